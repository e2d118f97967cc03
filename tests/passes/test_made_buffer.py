"""split_pieces' made-buffer rule: a run of nodes that would return a buffer the graph makes
(a factory and row writes into it, MADE_BUFFER_BYTES or more: a new KV cache) stays
eager, counted `made_buffer`; a smaller one, a computed output, or a cache passed in is
captured, and so is a buffer assembled from values that cover it (tiles), and an autograd
graph's made gradient; `made_buffer` tells a made buffer from a computed value."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import expecttest
import pytest
import torch
import torch.fx as fx

from graphdispatch_backend.errors import SplitReason
from graphdispatch_backend.passes.context import PassContext, PieceSpec
from graphdispatch_backend.passes.functional_writes import made_buffer
from graphdispatch_backend.passes.reinplace_buffers import reinplace_buffers
from graphdispatch_backend.passes.split_pieces import MADE_BUFFER_BYTES
from graphdispatch_backend.testing import (
    Mlp,
    accounted_graphs,
    aten_graph,
    cut_pieces,
    generates_like_eager,
    manifest_from_region,
    normalize,
    op_counts,
    region_entry,
    write_bundle,
)

ROWS = MADE_BUFFER_BYTES // (4 * 64 * 4)  # a float32 cache of (4, ROWS, 64): MADE_BUFFER_BYTES


def prefill(pos: torch.Tensor, k: torch.Tensor, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    cache = torch.zeros(4, rows, 64)  # made at the first forward, as transformers' StaticCache
    cache.index_copy_(1, pos, k)
    return cache, (cache.sum(1) * 2).relu()  # attention stands here: it reads the new cache


def small_prefill(pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return prefill(pos, k, ROWS // 2)


def computed(pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    big = torch.zeros(4, ROWS, 64) + k.sum()  # as large, but a value computed from an input
    return big, k * 2


def read_after_write(pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cache = torch.zeros(4, ROWS, 64)
    new = cache.index_copy(1, pos, k)
    return new, cache.sum(1)  # the old value read after the write: it stays functional


def tiles(pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros(4, ROWS, 64)  # a decoded video, tile by tile: every element written
    half = ROWS // 2
    out[:, :half] = k.sum(1, keepdim=True).expand(4, half, 64).cos()
    out[:, half:] = k.mean(1, keepdim=True).expand(4, ROWS - half, 64).sin()
    return out, k * 2


def with_item(pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = (k * 3).cos()
    n = pos.sum().item()  # splits the graph: the run after it makes the cache
    cache = torch.zeros(4, ROWS, 64)
    cache.index_copy_(1, pos, k * n)
    return cache, y


def _args() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(3), torch.randn(4, 3, 64)


def _cut(fn: Callable[..., Any]) -> tuple[fx.GraphModule, PassContext, list[fx.GraphModule]]:
    """`fn`'s lowered graph cut into pieces after reinplace_buffers (the pipeline's order: a
    new cache's rows are written in place)."""
    with torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        gm = aten_graph(fn, *_args()).gm
    ctx, made = cut_pieces(gm, "cpu", before=(reinplace_buffers,))
    return gm, ctx, made


def _emulated(fn: Callable[..., Any], calls: int = 6) -> dict[str, Any]:
    """`fn` compiled (emulate), called with a new `k` each time, every output equal to
    eager's; the report's only graph, every call accounted for."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    with torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        for _ in range(calls):
            args = _args()
            for got, want in zip(compiled(*args), fn(*args)):
                assert torch.equal(got, want)
    (graph,) = accounted_graphs()
    return graph


class TestMadeBuffer(expecttest.TestCase):
    def test_a_graph_that_returns_a_new_cache_is_left_whole_and_eager(self):
        gm, ctx, made = _cut(prefill)
        self.assertEqual(ctx.split_reasons, {SplitReason.MADE_BUFFER: 1})
        self.assertEqual([(p.capturable, p.reasons) for p in ctx.pieces], [(False, {"made_buffer": 1})])
        self.assertEqual(made, [])
        self.assertEqual(op_counts(gm), {"aten::index_copy_.default": 1, "aten::mul.Tensor": 1,
                                         "aten::relu.default": 1, "aten::sum.dim_IntList": 1,
                                         "aten::zeros.default": 1})
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1):
    zeros = torch.ops.aten.zeros.default([4, 1024, 64], device = device(type='cpu'), pin_memory = False)
    index_copy__default = torch.ops.aten.index_copy_.default(zeros, 1, arg0_1, arg1_1)
    sum_1 = torch.ops.aten.sum.dim_IntList(zeros, [1])
    mul = torch.ops.aten.mul.Tensor(sum_1, 2)
    relu = torch.ops.aten.relu.default(mul)
    return (zeros, relu)""")

    def test_through_compile_it_runs_eager_every_call_and_says_why(self):
        graph = _emulated(prefill)
        self.assertEqual(graph["split_reasons"], {"made_buffer": 1})
        self.assertEqual(graph["cuda_graph"]["reason"], "no_capturable_piece")
        detail = graph["cuda_graph"]["decline_details"]["no_capturable_piece"]
        self.assertIn("made_buffer: 1", detail)
        self.assertIn("pass one in", detail)
        self.assertEqual(graph["cuda_graph"]["replays"], 0)
        self.assertEqual(graph["cuda_graph"]["eager_by_reason"], {"no_capturable_piece": 6})
        # nothing to serve: the Dynamo graph answers, no lowering to check (backend.py)
        self.assertEqual((graph["lowering_check"]["status"], graph["lowering_check"]["checked"]), ("not_lowered", 0))

    def test_a_made_buffer_below_the_limit_is_captured_and_replays(self):
        gm, ctx, _ = _cut(small_prefill)
        self.assertEqual(ctx.split_reasons, {})
        self.assertEqual([p.capturable for p in ctx.pieces], [True])
        graph = _emulated(small_prefill)
        self.assertEqual(graph["cuda_graph"]["reason"], None)
        self.assertGreaterEqual(graph["cuda_graph"]["replays"], 3)

    def test_a_computed_output_as_large_is_captured(self):
        _, ctx, _ = _cut(computed)
        self.assertEqual(ctx.split_reasons, {})
        self.assertEqual([p.capturable for p in ctx.pieces], [True])

    def test_a_buffer_assembled_from_tiles_that_cover_it_is_captured(self):
        _, ctx, _ = _cut(tiles)
        self.assertEqual(ctx.split_reasons, {})
        self.assertEqual([p.capturable for p in ctx.pieces], [True])

    def test_a_buffer_whose_write_stays_functional_is_made_too(self):
        gm, ctx, _ = _cut(read_after_write)
        self.assertIn("aten::index_copy.default", op_counts(gm))  # functional: a copy of the zeros
        self.assertEqual(ctx.split_reasons, {SplitReason.MADE_BUFFER: 1})

    def test_only_the_run_that_makes_the_buffer_stays_eager(self):
        _, ctx, made = _cut(with_item)
        self.assertEqual(ctx.split_reasons, {SplitReason.SCALAR_READ: 1, SplitReason.MADE_BUFFER: 1})
        self.assertEqual([(p.capturable, p.reasons) for p in ctx.pieces],
                         [(True, {}), (False, {"scalar_read": 1}), (False, {"made_buffer": 1})])
        self.assertEqual(len(made), 1)  # the run before the .item() (mul, cos, sum) is captured
        graph = _emulated(with_item)
        self.assertEqual(graph["pieces"][0]["cuda_graph"]["replays"], 4)  # warmup, capture, 4 replays
        self.assertEqual(graph["split_reasons"], {"scalar_read": 1, "made_buffer": 1})


class CacheOfMlp(torch.nn.Module):
    """A new cache whose rows an Mlp computes: the run that makes it holds the Mlp's region."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp(64)

    def forward(self, pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return prefill(pos, self.mlp(k))


def test_a_graph_with_no_capturable_piece_but_an_artifact_runs_lowered_and_checked(tmp_path: Path):
    """The lowering serves the artifact: it runs, checked against eager on its schedule;
    only a graph that serves nothing runs as Dynamo traced it."""
    torch.manual_seed(0)
    model = CacheOfMlp().eval()
    region = region_entry(model, *_args(), name="mlp", cuda_graphs=False)
    sig = manifest_from_region(region)
    names = [i["name"] for i in region["inputs"]]
    write_bundle(tmp_path / "mlp", "mlp-exact", "mlp", sig["inputs"], sig["outputs"],
                 f"import torch\nimport torch.nn.functional as F\n\nNAMES = {names!r}\n\n\ndef forward(*inputs):\n"
                 "    a = dict(zip(NAMES, inputs))\n    return F.linear(torch.relu(F.linear(a['input0'], "
                 "a['fc1.weight'], a['fc1.bias'])), a['fc2.weight'], a['fc2.bias'])\n")
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"cuda_graphs": "emulate", "artifacts": str(tmp_path)})
    with torch.no_grad():
        for _ in range(4):
            args = _args()
            for got, want in zip(compiled(*args), model(*args)):
                assert torch.equal(got, want)
    (graph,) = accounted_graphs()
    assert graph["cuda_graph"]["reason"] == "no_capturable_piece"
    assert [s["calls"] for s in graph["substitutions"]] == [4]
    assert graph["lowering_check"]["status"] == "bitwise" and graph["lowering_check"]["checked"] == 3


class Gather(torch.nn.Module):
    """`w[idx]`: its backward makes `w`'s gradient from `zeros` and the rows the index wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(ROWS * 4, 64, generator=torch.Generator().manual_seed(0)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return (self.w[idx] * 2).relu().sum()


def test_an_autograd_graph_s_made_gradient_is_captured():
    """A gradient made by `zeros` and the rows an index wrote (1 MiB, 16 of 4096 rows) is an
    output as any: the backward graph is captured and replays, every gradient eager's."""
    torch._dynamo.reset()
    model, twin = Gather(), Gather()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    for i in range(5):
        idx = torch.randint(0, ROWS * 4, (16,), generator=torch.Generator().manual_seed(i))
        model.zero_grad()
        twin.zero_grad()
        compiled(idx).backward()
        twin(idx).backward()
        assert torch.equal(model.w.grad, twin.w.grad)
    (graph,) = accounted_graphs()
    backward = graph["backward"]
    assert backward["split_reasons"] == {} and backward["cuda_graph"]["reason"] is None
    # every backward call but warmup and the capture call replays: the saved index, pinned
    # through warmup, moves with the next forward and relocates (runner/relocate.py)
    cg = backward["cuda_graph"]
    assert cg["replays"] == backward["calls"] - 2 and cg["relocations"] == 1, cg


def test_made_buffer_follows_views_and_row_writes_to_a_factory():
    def fn(pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        buf = torch.zeros(4, 8, 64)
        buf.index_copy_(1, pos, k)
        like = torch.zeros_like(k)
        like[:, 0] = 1.0  # a write into a view: select_scatter
        over = torch.zeros(4, 3, 64)
        over.copy_(k)  # a whole copy: k's value, not a buffer the graph made
        return buf.transpose(0, 1), like, over, k * 2

    with torch.no_grad():
        gm = aten_graph(fn, *_args()).gm
    outs = gm.graph.output_node().args[0]
    assert [made_buffer(o) is not None for o in outs] == [True, True, False, False]


def test_mutation_without_the_inference_only_rule_the_gradient_graph_runs_eager(monkeypatch: pytest.MonkeyPatch):
    """backend.py asks for made buffers to stay eager in inference graphs only: asked in
    every graph, the backward of `w[idx]` is not captured, and
    test_an_autograd_graph_s_made_gradient_is_captured fails."""
    backend = sys.modules["graphdispatch_backend.backend"]

    def everywhere(device: str, make_piece: Any, made_buffers_eager: bool = True) -> PieceSpec:
        return PieceSpec(device, make_piece, True)

    monkeypatch.setattr(backend, "PieceSpec", everywhere)
    with pytest.raises(AssertionError):
        test_an_autograd_graph_s_made_gradient_is_captured()


_MODULE = "graphdispatch_backend.passes.split_pieces"


@pytest.mark.parametrize(("rule", "name", "broken", "test"), [
    ("made buffers stay eager", "_made_buffers", lambda outputs: [],
     "test_through_compile_it_runs_eager_every_call_and_says_why"),
    ("the size limit", "MADE_BUFFER_BYTES", 0, "test_a_made_buffer_below_the_limit_is_captured_and_replays"),
    ("through functional writes", "made_buffer", lambda node: (node, []) if "zeros" in node.name else None,
     "test_a_buffer_whose_write_stays_functional_is_made_too"),
    ("less than half written", "made_buffer",
     lambda node: (found[0], []) if (found := made_buffer(node)) is not None else None,
     "test_a_buffer_assembled_from_tiles_that_cover_it_is_captured"),
])
def test_mutation_each_rule_is_what_its_test_checks(rule: str, name: str, broken: Any, test: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rule removed: the test that states it fails."""
    monkeypatch.setattr(sys.modules[_MODULE], name, broken)
    with pytest.raises(AssertionError):
        getattr(TestMadeBuffer(test), test)()


def test_a_transformers_server_with_a_new_cache_per_request_prefills_eager_and_decodes_replaying():
    """A Llama with a new 1 MiB StaticCache per generate (transformers' default): the
    prefill graph, which makes the caches, runs eager as `made_buffer` (2 layers x keys and
    values); the decode graph, which reads them as inputs, replays; every generate equal to
    eager, bit for bit. With one cache passed in and reset per request, the prefill writes
    into it and is captured (Dynamo compiles it once more for the cache made by the first
    request: it guards on the cache's `is_initialized`)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    length = MADE_BUFFER_BYTES // (2 * 2 * 2 * 16 * 4)  # layers x (keys, values) x heads x head_dim x 4 B
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=length, attn_implementation="eager",
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=5, do_sample=False, cache_implementation="static", max_cache_len=length,
              pad_token_id=0, disable_compile=True, return_dict_in_generate=True, output_logits=True)
    torch._dynamo.reset()
    generates_like_eager(model, prompt, kw, 3)
    prefill_graph, decode_graph = sorted(accounted_graphs(), key=lambda g: g["calls"])
    assert prefill_graph["split_reasons"] == {"made_buffer": 4}
    assert prefill_graph["cuda_graph"]["eager_by_reason"] == {"no_capturable_piece": 3}
    assert decode_graph["cuda_graph"]["replays"] >= 8
    with torch.no_grad():
        ref = {k: v for k, v in kw.items() if k not in ("cache_implementation", "max_cache_len")}
        cache = transformers.StaticCache(config=config, max_cache_len=length)
        eager = transformers.LlamaForCausalLM(config).eval()
        eager.load_state_dict(model.state_dict())
        want = eager.generate(prompt, cache=transformers.StaticCache(config=config, max_cache_len=length),
                              **ref)
        for _ in range(4):  # the first makes the cache's tensors (the made-buffer graph, once more)
            cache.reset()
            got = model.generate(prompt, cache=cache, **ref)
            assert torch.equal(got.sequences, want.sequences)
            assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    prefills = [g for g in accounted_graphs() if "made_buffer" not in g["split_reasons"] and g["calls"] == 3]
    assert prefills and prefills[0]["cuda_graph"]["replays"] >= 1
