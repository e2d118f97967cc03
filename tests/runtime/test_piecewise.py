"""Piecewise capture: a graph is cut around the nodes a CUDA graph cannot hold.

`.item()` (aten._local_scalar_dense), runtime asserts, ops tagged cudagraph_unsafe, random
ops, tensors on another device and artifacts declared `"capturable": false` stay eager,
inline and in order; the runs between them are captured and replay. Outputs are bitwise
equal to eager, the report lists the pieces and why each split happened, and a graph made
only of such nodes runs eager as no_capturable_piece.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import SplitReason
from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.ops import draws_random
from graphdispatch_backend.passes.split_pieces import split_pieces, split_reason
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine
from graphdispatch_backend.runtime.runner import GraphRunner, RuntimeScope
from graphdispatch_backend.testing import (
    LinearBlock,
    accounted_graphs,
    aten_graph,
    cut_pieces,
    manifest_from_region,
    only_graph,
    region_entry,
    uninitialized_memory,
    write_bundle,
)


@torch.library.custom_op("gdtest_piecewise::host_sync", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def host_sync(x: torch.Tensor) -> torch.Tensor:
    """Stands for an op that syncs with the host, so its author tagged it cudagraph_unsafe."""
    return x * 3


@host_sync.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def emulate(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    return torch.compile(fn, backend="graphdispatch", options={"cuda_graphs": "emulate", "warmup": 2, **options})


def run_checked(compiled: Callable[..., Any], fn: Callable[..., Any], inputs: Sequence[tuple[Any, ...]],
                seed: int | None = None) -> None:
    with torch.no_grad():
        for i, args in enumerate(inputs):
            if seed is not None:
                torch.manual_seed(seed + i)
            got = compiled(*args)
            if seed is not None:
                torch.manual_seed(seed + i)
            want = fn(*args)
            assert got.dtype == want.dtype and torch.equal(got, want), f"call {i}"


def summary(graph: dict[str, Any]) -> list[tuple[bool, dict[str, int], list[str]]]:
    return [(p["capturable"], p["split_reasons"], p["ops"]) for p in graph["pieces"]]


# -- through torch.compile ----------------------------------------------------------------


def scalar_read(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    y = (x * 2).relu()
    n = s.sum().item()
    return y * n + 1


def test_item_splits_around_local_scalar_dense_and_pieces_replay():
    torch.manual_seed(0)  # values whose derived set tells (else verification waits a call: order-dependent)
    s = torch.arange(3)
    inputs = [(torch.randn(4), s) for _ in range(6)]  # kept alive: x moves every call
    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # else .item() is a graph break
        run_checked(emulate(scalar_read), scalar_read, inputs)
    graph = only_graph()
    assert graph["split_reasons"] == {"scalar_read": 1}
    assert summary(graph) == [
        (True, {}, ["aten::mul.Tensor", "aten::relu.default", "aten::sum.default"]),
        (False, {"scalar_read": 1}, ["aten::_local_scalar_dense.default"]),
        (True, {}, ["aten::mul.Tensor", "aten::add.Tensor"]),
    ]
    for piece in (graph["pieces"][0], graph["pieces"][2]):
        stats = piece["cuda_graph"]
        # 2 warmups, the capture call verifies (its live inputs and a derived set), 3 replays
        assert stats["captures"] == 1 and stats["replays"] == 3 and stats["declines"] == {}
    assert "cuda_graph" not in graph["pieces"][1]
    assert graph["cuda_graph"]["replays"] == 3  # a call replays when every captured piece did


def test_a_changed_scalar_read_is_a_new_key_of_the_piece_after_it():
    # same shape (no recompile), another sum
    first, second = torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3])
    inputs = [(torch.randn(4), first) for _ in range(5)] + [(torch.randn(4), second) for _ in range(4)]
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        run_checked(emulate(scalar_read), scalar_read, inputs)
    after = only_graph()["pieces"][2]["cuda_graph"]
    assert after["shape_keys"] == 2  # n == 3, then n == 6: never replayed with the old constant


def test_runtime_asserts_split_as_assert_scalar():
    def slice_by(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        n = s.max().item()
        return (x * 2).relu()[:n].sum(0) + x.cos()[:1]

    s = torch.tensor([1, 2])
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        run_checked(emulate(slice_by), slice_by, [(torch.randn(4), s) for _ in range(6)])
    graph = only_graph()
    assert graph["split_reasons"] == {"scalar_read": 1, "assert_scalar": 2}
    # the size arithmetic between the asserts launches no kernel: left inline, not made a piece
    assert all(any(not op.startswith("_operator") for op in p["ops"]) for p in graph["pieces"] if p["capturable"])
    assert graph["cuda_graph"]["replays"] == 2


def noisy(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    return y * torch.rand_like(y) + x


def test_random_op_splits_and_matches_eager_under_the_same_seed():
    run_checked(emulate(noisy), noisy, [(torch.randn(4),) for _ in range(6)], seed=100)
    graph = only_graph()
    assert graph["split_reasons"] == {"random_op": 1}
    assert summary(graph) == [
        (True, {}, ["aten::sin.default"]),
        (False, {"random_op": 1}, ["aten::rand_like.default"]),
        (True, {}, ["aten::mul.Tensor", "aten::add.Tensor"]),
    ]
    assert graph["cuda_graph"]["replays"] == 3  # 2 warmups, the capture call verifies, 3 replays


def test_dropout_counts_once_though_it_has_two_outputs():
    def dropped(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x.sin(), 0.5, training=True) + 1

    run_checked(emulate(dropped), dropped, [(torch.randn(8),) for _ in range(6)], seed=7)
    graph = only_graph()
    assert graph["split_reasons"] == {"random_op": 1}
    assert [p["split_reasons"] for p in graph["pieces"] if not p["capturable"]] == [{"random_op": 1}]


def test_feature_dropout_keeps_its_uninitialized_mask_inline_and_replays():
    """dropout2d lowers to `new_empty` + `bernoulli(new_empty)`: the allocation goes inline
    with the random op, so no piece hands out uninitialized memory (its verification would
    see two runs disagree, `eager_nondeterministic`)."""
    def dropped(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout2d(x.sin(), 0.5, training=True) * 2

    run_checked(emulate(dropped), dropped, [(torch.randn(2, 3, 4, 4),) for _ in range(6)], seed=11)
    graph = only_graph()
    assert graph["split_reasons"] == {"random_op": 1}  # the allocation is not counted
    assert summary(graph) == [
        (True, {}, ["aten::sin.default"]),
        (False, {"random_op": 1}, ["aten::new_empty.default", "aten::bernoulli.p"]),
        (True, {}, ["aten::div.Scalar", "aten::mul.Tensor", "aten::mul.Tensor"]),
    ]
    assert graph["cuda_graph"]["declines"] == {} and graph["cuda_graph"]["replays"] == 3


def test_without_the_move_the_uninitialized_mask_fails_verification(monkeypatch):
    """Both rules removed: the allocation stays in the piece before the random op, which
    returns it, and the piece's checks compare its values (the mask's memory, unwritten)."""
    # the module, not the function passes/__init__ hands out under its name
    module = sys.modules[split_pieces.__module__]
    monkeypatch.setattr(module, "_place_allocations", lambda gm, reasons: set())
    monkeypatch.setattr(module, "unwritten_outputs", lambda gm: ())

    def dropped(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout2d(x.sin(), 0.5, training=True) * 2

    torch.manual_seed(0)  # the inputs below: the same whatever ran before (the suite's order)
    with uninitialized_memory():  # memory nobody wrote differs run to run (not by the allocator's chance)
        run_checked(emulate(dropped), dropped, [(torch.randn(2, 3, 4, 4),) for _ in range(6)], seed=11)
    assert any("eager_nondeterministic" in g["cuda_graph"]["declines"] for g in accounted_graphs())


def returns_a_buffer_to_fill(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a graph ends with before `dist.all_to_all_single(out, x, async_op=True)` breaks
    it: the buffer the collective fills, between this graph and the next."""
    return x.sin() * 2, torch.empty_like(x)


def _returned_buffer_run() -> dict[str, Any]:
    compiled = emulate(returns_a_buffer_to_fill)
    with torch.no_grad(), uninitialized_memory():  # the buffer holds new values every call
        for i in range(6):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(i))
            (got, buf), (want, ref) = compiled(x), returns_a_buffer_to_fill(x)
            assert torch.equal(got, want), f"call {i}"
            assert (buf.shape, buf.stride(), buf.dtype) == (ref.shape, ref.stride(), ref.dtype)
    return only_graph()


def test_a_buffer_returned_unwritten_is_made_at_each_call_and_never_compared():
    graph = _returned_buffer_run()
    assert graph["split_reasons"] == {"unwritten_buffer": 1}
    assert summary(graph) == [(True, {}, ["aten::sin.default", "aten::mul.Tensor"]),
                              (False, {"unwritten_buffer": 1}, ["aten::empty_like.default"])]
    assert graph["lowering_check"]["status"] == "bitwise"
    assert graph["cuda_graph"]["declines"] == {} and graph["cuda_graph"]["replays"] == 3


def test_without_the_rule_the_eager_check_judges_the_buffer_nondeterministic(monkeypatch):
    import graphdispatch_backend.backend as backend

    monkeypatch.setattr(backend, "unwritten_outputs", lambda gm: ())
    graph = _returned_buffer_run()
    assert graph["lowering_check"]["status"] == "eager_nondeterministic"
    assert "torch.empty_like (memory made uninitialized)" in graph["lowering_check"]["detail"]


def _garbage_piece() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A piece returning memory it made and never wrote, holding new values every run."""
    fills = itertools.count(1)
    return lambda x: (x * 2, torch.empty(3).fill_(next(fills)))


@pytest.mark.parametrize(("unwritten", "declines"), [((1,), set()), ((), {"eager_nondeterministic"})])
def test_a_pieces_unwritten_output_is_compared_but_for_its_values(unwritten, declines):
    """Verification (runtime/runner/verify.py) compares such an output's metadata only;
    without the rule, two eager runs disagree on it."""
    scope = RuntimeScope(HostReplayEngine(), Timing(), Events(), make_contain(False))
    stats = CudaGraphStats()
    runner = GraphRunner(_garbage_piece(), "piece", scope, stats, warmup=1, max_captures=8, verify_inputs=2,
                         state_names={}, unwritten=unwritten)
    for i in range(5):
        x = torch.randn(3, generator=torch.Generator().manual_seed(i))
        got, buf = runner(x)
        assert torch.equal(got, x * 2) and buf.shape == (3,)
    assert set(stats.declines) == declines, stats.decline_details
    assert (stats.replays > 0) == (not declines)


def test_cudagraph_unsafe_tag_splits():
    def f(x: torch.Tensor) -> torch.Tensor:
        return host_sync(x.sin()) + 1

    run_checked(emulate(f), f, [(torch.randn(4),) for _ in range(6)])
    graph = only_graph()
    assert graph["split_reasons"] == {"cudagraph_unsafe_tag": 1}
    assert [p["capturable"] for p in graph["pieces"]] == [True, False, True]
    assert graph["cuda_graph"]["replays"] == 3


def test_graph_of_only_unsafe_nodes_is_no_capturable_piece():
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.rand_like(x)

    run_checked(emulate(f), f, [(torch.randn(4),) for _ in range(3)], seed=3)
    cg = only_graph()["cuda_graph"]
    assert cg["reason"] == "no_capturable_piece"
    assert cg["eager_by_reason"] == {"no_capturable_piece": 3}
    assert cg["declines"] == {"no_capturable_piece": 1}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ff = LinearBlock(residual=False)  # region `ff`: relu(lin(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x.sin()) * 2


def test_artifact_declared_not_capturable_splits_around_its_call(tmp_path):
    model = Model().eval()
    region = region_entry(model, torch.randn(2, 8), name="ff", cuda_graphs="emulate", warmup=2)
    names = [i["name"] for i in region["inputs"]]
    source = (
        "import torch\n\n\n"
        "def forward(*args):\n"
        f"    b, w, x = args[{names.index('lin.bias')}], args[{names.index('lin.weight')}], "
        f"args[{names.index('input0')}]\n"
        "    return torch.relu(torch.addmm(b, x, w.t()))\n"
    )
    write_bundle(tmp_path / "ff", "ff-host", "ff", **manifest_from_region(region), source=source, capturable=False)
    run_checked(emulate(model, artifacts=str(tmp_path)), model, [(torch.randn(2, 8),) for _ in range(6)])
    graph = only_graph()
    (sub,) = graph["substitutions"]
    assert sub["artifact"] == "ff-host" and not sub["capturable"] and not sub["demoted"] and sub["calls"] == 6
    assert graph["split_reasons"] == {"artifact_not_capturable": 1}
    assert [(p["capturable"], p["split_reasons"]) for p in graph["pieces"]] == [
        (True, {}), (False, {"artifact_not_capturable": 1}), (True, {}),
    ]
    assert graph["cuda_graph"]["replays"] == 3


# -- split_pieces, directly ----------------------------------------------------------------------


def cut(gm: fx.GraphModule, device: str) -> tuple[PassContext, list[fx.GraphModule]]:
    return cut_pieces(gm, device)


def chain(x: torch.Tensor) -> torch.Tensor:
    return x.sin().cos() + x


def test_cpu_graph_under_a_cuda_spec_splits_everything_as_foreign_device():
    lowered = aten_graph(chain, torch.randn(4))
    ctx, made = cut(lowered.gm, "cuda")
    assert ctx.split_reasons == {SplitReason.FOREIGN_DEVICE: 3}
    assert [(p.capturable, p.reasons) for p in ctx.pieces] == [(False, {"foreign_device": 3})]
    assert made == []
    x = torch.randn(4)
    assert torch.equal(lowered.gm(x)[0], chain(x))


def test_same_device_graph_is_one_whole_piece_and_left_alone():
    lowered = aten_graph(chain, torch.randn(4))
    before = lowered.gm.code
    ctx, made = cut(lowered.gm, "cpu")
    assert ctx.split_reasons == {}
    assert [(p.capturable, p.nodes) for p in ctx.pieces] == [(True, 3)]
    assert made == [] and lowered.gm.code == before  # captured whole by the caller, not rewritten


def test_a_tensor_on_another_device_splits_where_it_is_made_and_read():
    lowered = aten_graph(chain, torch.randn(4))
    gm = lowered.gm
    cos = next(n for n in gm.graph.nodes if n.op == "call_function" and "cos" in str(n.target))
    cos.meta["val"] = torch.empty(4, device="meta")  # as if cos ran on another device
    ctx, made = cut(gm, "cpu")
    assert ctx.split_reasons == {SplitReason.FOREIGN_DEVICE: 2}  # cos makes it, add reads it
    assert [(p.capturable, p.reasons) for p in ctx.pieces] == [(True, {}), (False, {"foreign_device": 2})]
    assert len(made) == 1
    x = torch.randn(4)
    assert torch.equal(gm(x)[0], chain(x))  # the cut graph still computes the same


def test_split_reason_of_each_kind():
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4)

    def call(target: Any, *args: Any, **meta: Any) -> fx.Node:
        node = graph.call_function(target, args)
        node.meta.update({"val": torch.empty(4), **meta})
        return node

    aten = torch.ops.aten
    assert split_reason(call(aten.sin.default, x), "cpu") is None
    assert split_reason(call(aten._local_scalar_dense.default, x), "cpu") is SplitReason.SCALAR_READ
    assert split_reason(call(aten._assert_async.default, x), "cpu") is SplitReason.ASSERT_SCALAR
    unsafe = torch.ops.gdtest_piecewise.host_sync.default
    assert split_reason(call(unsafe, x), "cpu") is SplitReason.CUDAGRAPH_UNSAFE_TAG
    assert split_reason(call(aten.rand_like.default, x), "cpu") is SplitReason.RANDOM_OP
    assert split_reason(call(aten.sin.default, x, gd_capturable=False), "cpu") is SplitReason.ARTIFACT_NOT_CAPTURABLE
    assert split_reason(call(aten.sin.default, x), "cuda") is SplitReason.FOREIGN_DEVICE
    # sized by what they are given: an MoE's weights[expert_ids] stays in a piece; a mask does not
    ids, mask = graph.placeholder("ids"), graph.placeholder("mask")
    ids.meta["val"], mask.meta["val"] = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.bool)
    assert split_reason(call(aten.index.Tensor, x, [ids]), "cpu") is None
    assert split_reason(call(aten.index.Tensor, x, [mask]), "cpu") is SplitReason.DYNAMIC_OUTPUT_SHAPE
    assert split_reason(call(aten.nonzero.default, x), "cpu") is SplitReason.DYNAMIC_OUTPUT_SHAPE
    repeat = graph.call_function(aten.repeat_interleave.Tensor, (ids,), {"output_size": 8})
    repeat.meta["val"] = torch.zeros(8, dtype=torch.long)
    assert split_reason(repeat, "cpu") is None


def test_draws_random_reads_dropout_arguments():
    graph = fx.Graph()
    x = graph.placeholder("x")
    aten = torch.ops.aten

    def node(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return graph.call_function(target, args, kwargs)

    assert draws_random(node(aten.rand_like.default, x))
    assert draws_random(node(aten.native_dropout.default, x, 0.5, True))
    assert draws_random(node(aten.native_dropout.default, x, 0.5, None))  # ATen: train=None means training
    assert not draws_random(node(aten.native_dropout.default, x, 0.5, False))
    assert not draws_random(node(aten.native_dropout.default, x, 0.0, True))
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert not draws_random(node(sdpa, x, x, x))  # dropout_p defaults to 0
    assert not draws_random(node(sdpa, x, x, x, 0.0))
    assert draws_random(node(sdpa, x, x, x, dropout_p=0.1))
    assert not draws_random(node(aten.sin.default, x))


def _masked_embedding(value: str) -> Callable[..., torch.Tensor]:
    """transformers' vocab-parallel embedding (`tp_plan="auto"`): ids outside a rank's rows
    masked to 0, by a constant or by a value the graph computes."""

    def embed(ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        mask = (ids < 2) | (ids >= 5)
        ids = ids - 2
        ids[mask] = 0 if value == "constant" else ids.max()
        return nn.functional.embedding(ids, w) * 2

    return embed


@pytest.mark.parametrize(("value", "fuse"), [("constant", False), ("computed", False), ("constant", True)])
def test_a_mask_fill_of_a_constant_is_split_as_on_a_gpu_and_the_rest_replays(value, fuse):
    """`x[mask] = 0` on a CUDA tensor reads a one-element CPU tensor, which CUDA's index_put_
    fills as masked_fill_ (no host sync): the node is split out (`foreign_device`) and the
    rest replays. The CPU model refused it as any index_put by a mask (a host sync), and the
    piece holding it ran eagerly on every call. A value the graph computes stays refused."""
    embed = _masked_embedding(value)
    w = torch.randn(8, 4)
    compiled = torch.compile(embed, backend="graphdispatch", options={"cuda_graphs": "emulate", "fuse": fuse})
    with torch.no_grad():
        for i in range(6):
            ids = torch.randint(0, 8, (1, 8), generator=torch.Generator().manual_seed(i))
            assert torch.equal(compiled(ids, w), embed(ids.clone(), w))
    graph = only_graph()
    cg = graph["cuda_graph"]
    if value == "constant":
        assert graph["split_reasons"] == {"foreign_device": 2}  # the constant's copy and the fill
        assert cg["replays"] == 4 and cg["declines"] == {}, cg
    else:
        assert graph["split_reasons"] == {} and cg["replays"] == 0, graph["split_reasons"]
        assert "indexing by a boolean mask" in cg["decline_details"]["capture_failed"], cg
