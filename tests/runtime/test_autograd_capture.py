"""Autograd graphs captured: forward and backward go warmup -> capture -> verify -> replay
like inference graphs (emulate mode), bitwise with eager and with the lowered graph run
without capture, every call and every backward run accounted for.

Each rule has its mutation: the generation rule (a tensor saved for backward is copied out
of pool memory, so a second forward never overwrites it before its backward ran), the
identity of outputs (a saved output is the output: autograd sees it modified in place),
and grad mode inside the graph (a replay records no history: the lowered graph runs)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import graphdispatch_backend
from graphdispatch_backend import backend as backend_mod
from graphdispatch_backend.errors import StrictModeError
from graphdispatch_backend.runtime.checks import eager_check as eager_check_mod
from graphdispatch_backend.runtime.runner.outputs import OutputPlan
from graphdispatch_backend.testing import (
    MLP_SOURCE,
    Stack,
    accounted_graphs,
    manifest_from_region,
    region_entry,
    serve_patches,
    write_bundle,
)

FAST = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1}


def report_graphs() -> list[dict[str, Any]]:
    """The latest report's graphs; every graph and every backward adds up."""
    return accounted_graphs()


def mlp(dropout: float = 0.1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Dropout(dropout), nn.Linear(16, 4)).train()


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)


def train(model: nn.Module, options: dict[str, Any] | None, n: int) -> list[list[torch.Tensor]]:
    """`n` SGD steps (seeded per step: dropout draws the same masks); per step the loss and
    every gradient, cloned. `options` None: eager."""
    model = copy.deepcopy(model)
    run = model if options is None else torch.compile(model, backend="graphdispatch", options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(n):
        x, target = data(step)
        torch.manual_seed(step)
        loss = nn.functional.mse_loss(run(x), target)
        loss.backward()
        seen.append([loss.detach().clone()] + [p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return seen


def same(a: Sequence[Sequence[torch.Tensor]], b: Sequence[Sequence[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


# -- capture ------------------------------------------------------------------------------------


def test_a_training_loop_replays_forward_and_backward_bitwise():
    model, n = mlp(), 8
    captured = train(model, {"cuda_graphs": "emulate"}, n)
    (g,) = report_graphs()
    assert same(captured, train(model, None, n))
    assert same(captured, train(model, {"cuda_graphs": False}, n))  # the lowered graph, not captured
    assert g["kind"] == "autograd" and g["calls"] == n and g["lowering_check"] == {"checked": 4, "status": "bitwise"}
    assert g["split_reasons"] == {"random_op": 1}  # dropout runs between two captured pieces
    # warmup 1, the capture call verifies its inputs and a set derived from them, then replays
    assert g["cuda_graph"]["eager_by_reason"] == {"warmup": 1, "verifying": 1} and g["cuda_graph"]["replays"] == 6
    backward = g["backward"]
    assert backward["calls"] == n + 4 and backward["checks"] == 4  # the user's 8, the check's 4
    # 2 eager: warmup 1 and the capture call (the first call's check backward and the user's
    # own, which held one input at one address: pinned); that input moving at the next call,
    # with its layout, the graph only moved: relocated at once, copied in from then on
    # (runner/relocate.py; it warmed up and captured again before: 5 eager)
    cg = backward["cuda_graph"]
    assert cg["replays"] == backward["calls"] - 2 and cg["relocations"] == 1 and cg["declines"] == {}


def test_dropouts_backward_uses_the_mask_its_forward_drew():
    """The mask is drawn between captured pieces and saved for backward: with p=0.5 any
    other mask would give other gradients."""
    model = mlp(dropout=0.5)
    assert same(train(model, FAST, 6), train(model, None, 6))
    (g,) = report_graphs()
    assert g["cuda_graph"]["replays"] == 4 and g["backward"]["cuda_graph"]["replays"] > 0


class Checkpointed(nn.Module):
    """Attention under torch.utils.checkpoint: CPU attention is a seeded op (its dropout
    argument), so aot's backward recomputes it from its saved RNG state (the higher-order
    operator `run_with_rng_state`), dropout or not."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 4)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(1, 4, 2, 4).transpose(1, 2) for t in self.qkv(x).split(8, dim=-1))
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.utils.checkpoint.checkpoint(self.attend, x, use_reentrant=False))


def test_a_checkpointed_attention_is_refused_by_name_and_runs_bitwise(gd_log):
    """The capture refuses the recomputation from a saved RNG state and says what it is
    (torch's own refusal told the user to change graphdispatch's dispatch mode); every
    step stays eager's bits."""
    torch.manual_seed(0)
    model = Checkpointed().train()
    assert same(train(model, FAST, 4), train(model, None, 4))
    declines = [g["cuda_graph"]["decline_details"] for g in report_graphs()]
    said = " ".join(str(d) for d in declines) + gd_log.text
    assert "run_and_save_rng_state (torch.utils.checkpoint's random op" in said, said
    assert "run_with_rng_state (torch.utils.checkpoint's recomputation" in said, said
    assert "supports_higher_order_operators" not in said


def test_dynamic_shapes_save_sizes_for_backward_and_replay():
    """Under dynamic shapes aot compiles the backward at once (it saves sizes for it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="graphdispatch", options=FAST, dynamic=True)
    for step in range(8):
        x = torch.randn(3 + step % 2, 8)
        out, want = compiled(x), reference(x)
        out.square().sum().backward()
        want.square().sum().backward()
        assert torch.equal(out, want)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    (g,) = report_graphs()
    assert g["cuda_graph"]["replays"] > 0 and g["backward"]["cuda_graph"]["replays"] > 0


# -- the generation rule ------------------------------------------------------------------------


def _serve_pool_memory(entry: Any, args: Sequence[Any], streams: Any) -> list[Any]:
    """A replay that hands out its outputs in pool memory (new tensors over the static
    outputs' memory) instead of copies; views of inputs are rebuilt as shipped."""
    entry.inputs.copy_in(args)
    entry.graph.replay()
    entry.inputs.copy_back(args)
    pool = {src.untyped_storage().data_ptr() for src in entry.outputs._srcs}
    return [torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in pool else t
            for t in entry.outputs.assemble(list(entry.outputs._srcs), args)]


def two_forwards_before_their_backwards() -> int:
    """Forward A, forward B, then A's backward and B's: how many gradients are not eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="graphdispatch", options=FAST)
    wrong = 0
    for step in range(6):
        xa, xb = data(2 * step)[0], data(2 * step + 1)[0]
        got = [compiled(xa), compiled(xb)]
        want = [reference(xa), reference(xb)]
        for out, ref in zip(got, want):
            out.sum().backward()
            ref.sum().backward()
            wrong += not torch.equal(out, ref)
            for p, q in zip(model.parameters(), reference.parameters()):
                wrong += not torch.equal(p.grad, q.grad)
                p.grad = q.grad = None
    (g,) = report_graphs()
    assert g["cuda_graph"]["replays"] > 0 and g["backward"]["cuda_graph"]["replays"] > 0
    return wrong


def test_a_second_forward_never_overwrites_what_the_first_saved_for_backward():
    assert two_forwards_before_their_backwards() == 0


def test_without_the_copy_out_a_saved_tensor_goes_stale(monkeypatch):
    """Mutation: replays hand out pool memory; B's forward replay (and the backward's,
    sharing the pool) overwrite the activations A saved, and A's gradients are B's."""
    for module, name, fn in serve_patches(_serve_pool_memory):
        monkeypatch.setattr(module, name, fn)
    monkeypatch.setattr(eager_check_mod, "MAX_KEYS", 0)  # the runner's own rule, alone
    assert two_forwards_before_their_backwards() > 0


# -- outputs keep their identity ----------------------------------------------------------------


def modify_an_output_saved_for_backward() -> int:
    """tanh saves its output for backward (aot saves `detach(tanh)`, a view of the output):
    writing into the output before backward raises in eager; on a replay it must raise too,
    or the gradient is computed from the written values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    compiled = torch.compile(model, backend="graphdispatch", options=FAST)
    silent = 0
    for step in range(5):
        out = compiled(data(step)[0])
        out.mul_(2)
        try:
            out.sum().backward()
        except RuntimeError as exc:
            assert "modified by an inplace operation" in str(exc)
        else:
            silent += 1
    (g,) = report_graphs()
    assert g["cuda_graph"]["replays"] > 0
    return silent


def test_a_saved_output_is_the_output_so_writing_into_it_raises_as_in_eager():
    assert modify_an_output_saved_for_backward() == 0


def test_without_views_in_a_group_the_write_goes_unnoticed(monkeypatch):
    """Mutation: the outputs of a group rebuilt as unrelated tensors over the copy (same
    memory, a version counter each): the saved `detach(y)` never sees `y` written."""
    real = OutputPlan.assemble

    def unrelated(self: OutputPlan, dsts: list[torch.Tensor], args: Sequence[Any]) -> list[Any]:
        return [torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
                if isinstance(t, torch.Tensor) and t._base is not None else t for t in real(self, dsts, args)]

    monkeypatch.setattr(OutputPlan, "assemble", unrelated)
    assert modify_an_output_saved_for_backward() > 0


def test_saved_parameters_reach_the_backward_as_they_are():
    """aot's forward returns the parameters it saves: a replay hands out the parameter
    itself, so the backward's inputs look the same on every step and it keeps replaying."""
    model = mlp(dropout=0.0)
    train(model, FAST, 6)
    (g,) = report_graphs()
    assert g["backward"]["contract_mismatches"] == 0 and g["backward"]["cuda_graph"]["replays"] > 0


# -- grad mode inside the graph -------------------------------------------------------------------


def call_forward_with_grad_mode_on(monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """aot never calls the lowered forward with grad mode on; a caller that did would need
    the autograd history a replay cannot record."""
    kept: list[Callable[..., Any]] = []
    real = backend_mod._Builder.forward

    def keep(self: Any, gm: Any, example: Any) -> Any:
        kept.append(real(self, gm, example))
        return kept[-1]

    monkeypatch.setattr(backend_mod._Builder, "forward", keep)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    compiled = torch.compile(model, backend="graphdispatch", options=FAST)
    for step in range(4):
        compiled(data(step)[0]).sum().backward()
    assert report_graphs()[0]["cuda_graph"]["state"] == "verified"
    return kept[0]([*model.parameters(), data(9)[0]])[0]


def test_grad_mode_on_inside_the_graph_runs_the_lowered_graph(monkeypatch):
    out = call_forward_with_grad_mode_on(monkeypatch)
    assert out.requires_grad and out.grad_fn is not None
    (g,) = report_graphs()
    assert g["cuda_graph"]["eager_by_reason"]["autograd"] == 1


def test_without_the_grad_mode_rule_a_replay_drops_the_history(monkeypatch):
    monkeypatch.setattr(backend_mod, "without_history", lambda run, lowered, events, record: run)
    assert not call_forward_with_grad_mode_on(monkeypatch).requires_grad


# -- a backward graphdispatch cannot build ------------------------------------------------------


def _exploding(gm: Any, ctx: Any) -> None:
    raise RuntimeError("a backward pass exploded")


def test_a_backward_that_fails_to_build_runs_as_aot_lowered_it(monkeypatch):
    monkeypatch.setattr(backend_mod, "BACKWARD_PIPELINE", (_exploding,))
    model = mlp()
    assert same(train(model, FAST, 4), train(model, None, 4))
    (g,) = report_graphs()
    backward = g["backward"]
    assert backward["kind"] == "fallback" and "a backward pass exploded" in backward["error"]
    assert backward["cuda_graph"]["eager_by_reason"] == {"backend_error": backward["calls"]}
    assert g["cuda_graph"]["replays"] > 0  # the forward is captured all the same


def test_under_strict_a_backward_that_fails_to_build_raises(monkeypatch):
    monkeypatch.setattr(backend_mod, "BACKWARD_PIPELINE", (_exploding,))
    compiled = torch.compile(mlp(), backend="graphdispatch", options={**FAST, "strict": True})
    with pytest.raises(StrictModeError, match="a backward pass exploded"):
        compiled(data(0)[0]).sum().backward()


# -- artifacts --------------------------------------------------------------------------------------


def test_an_artifact_serves_inference_graphs_and_autograd_graphs_run_the_region_native(tmp_path):
    torch.manual_seed(0)
    model = Stack(depth=2)
    x = torch.randn(4, 8)
    region = region_entry(model, x, name="blocks.0.mlp")
    write_bundle(tmp_path / "mlp", "mlp-relu", "blocks.*.mlp", **manifest_from_region(region), source=MLP_SOURCE)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="graphdispatch", options={**FAST, "artifacts": str(tmp_path)})
    out, want = compiled(x), reference(x)
    out.sum().backward()
    want.sum().backward()
    assert torch.equal(out, want)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    with torch.no_grad():  # an inference graph: the artifact serves
        assert torch.equal(compiled(x), reference(x))
    report = graphdispatch_backend.latest_report()
    training, inference = report["graphs"]
    assert training["kind"] == "autograd" and training["substitutions"] == []
    refused = [r for r in training["regions"] if r["module"].endswith(".mlp")]
    assert [rej["reason"] for r in refused for rej in r["rejections"]] == ["autograd", "autograd"]
    assert "the region runs native" in refused[0]["rejections"][0]["detail"]
    assert inference["kind"] == "inference" and len(inference["substitutions"]) == 2
    entry = report["artifacts"]["mlp-relu"]
    assert entry["rejections"] == {"autograd": 2, "module": entry["rejections"]["module"]}
    assert entry["status"] == "partly_rejected"


def test_without_capture_the_decline_says_what_runs():
    """Not the Dynamo graph eagerly: aot's lowered forward and backward, not captured."""
    model = mlp()
    assert same(train(model, {"cuda_graphs": False}, 2), train(model, None, 2))
    (g,) = report_graphs()
    for record in (g, g["backward"]):
        assert record["cuda_graph"]["eager_by_reason"] == {"disabled": record["calls"]}
        detail = record["cuda_graph"]["decline_details"]["disabled"]
        assert detail == "cuda_graphs=False; the lowered forward and backward run, not captured"


def test_a_backward_called_inside_a_compiled_step_is_not_traced_by_dynamo():
    """`loss.backward()` inside the compiled function: the autograd engine runs the lowered
    backward from a frame Dynamo is compiling. Dynamo traced graphdispatch's runtime as user
    code: the backward's capture raised inside Dynamo (`capture_failed`) and each of its
    frames came back as one more graph. Now one graph, its backward replayed, the
    gradients eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)

    def step(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        return loss

    compiled = torch.compile(step, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        assert torch.equal(compiled(model, x, y), step(reference, x, y))
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad)
            p.grad = q.grad = None
    graphs = graphdispatch_backend.latest_report()["graphs"]
    assert [g["name"] for g in graphs] == ["graph_0"]
    backward = graphs[0]["backward"]["cuda_graph"]
    assert backward["replays"] > 0 and backward["declines"] == {}
