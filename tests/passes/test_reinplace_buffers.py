"""reinplace_buffers: a functional write into a tensor the graph made itself becomes the
write (a prefill's new cache: its rows, not a copy of the cache); a buffer read after its
write, a pointwise write, or a write across a piece boundary stays functional."""

from __future__ import annotations

import sys
from typing import Any

import expecttest
import pytest
import torch
import torch.fx as fx

import graphdispatch_backend
from graphdispatch_backend.passes import functional_writes
from graphdispatch_backend.passes.context import PassContext, PieceSpec
from graphdispatch_backend.passes.reinplace_buffers import reinplace_buffers
from graphdispatch_backend.testing import accounted_graphs, aten_graph, generates_like_eager, normalize, op_counts


def _lowered(fn: Any, *args: Any) -> fx.GraphModule:
    with torch.no_grad():
        return aten_graph(fn, *args).gm


def _run(gm: fx.GraphModule, pieces: bool = False, fused: bool = False) -> int:
    spec = PieceSpec("cpu", lambda piece, info: piece) if pieces else None
    ctx = PassContext(pieces_spec=spec, fused=fused)
    reinplace_buffers(gm, ctx)
    return ctx.buffer_writes


def _same(gm: fx.GraphModule, fn: Any, *args: Any) -> bool:
    """The rewritten graph gives what the function gives, bit for bit."""
    with torch.no_grad():
        got, want = gm(*args), fn(*args)
    want = want if isinstance(want, tuple) else (want,)
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def prefill(pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cache = torch.zeros(2, 16, 4)  # made at the first forward, as transformers' StaticCache
    cache.index_copy_(1, pos, k)
    return cache, k * 2


def _prefill_args() -> tuple[torch.Tensor, ...]:
    return torch.arange(3), torch.randn(2, 3, 4)


class TestReinplaceBuffers(expecttest.TestCase):
    def test_a_new_cache_gets_its_rows_written_not_a_copy_of_it(self):
        gm = _lowered(prefill, *_prefill_args())
        self.assertEqual(op_counts(gm), {"aten::index_copy.default": 1, "aten::mul.Tensor": 1,
                                         "aten::zeros.default": 1})
        self.assertEqual(_run(gm), 1)
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1):
    zeros = torch.ops.aten.zeros.default([2, 16, 4], device = device(type='cpu'), pin_memory = False)
    index_copy__default = torch.ops.aten.index_copy_.default(zeros, 1, arg0_1, arg1_1)
    mul = torch.ops.aten.mul.Tensor(arg1_1, 2)
    return (zeros, mul)""")
        self.assertEqual(op_counts(gm), {"aten::index_copy_.default": 1, "aten::mul.Tensor": 1,
                                         "aten::zeros.default": 1})
        assert _same(gm, prefill, *_prefill_args())

    def test_a_chain_of_writes_into_one_buffer_goes_in_place_whole(self):
        def fill(pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            buf = torch.zeros(2, 16, 4)
            buf.index_copy_(1, pos, k)
            buf[:, 0] = 7.0
            return buf

        gm = _lowered(fill, *_prefill_args())
        self.assertEqual(_run(gm), 2)
        self.assertNotIn("aten::index_copy.default", op_counts(gm))
        self.assertNotIn("aten::select_scatter.default", op_counts(gm))
        assert _same(gm, fill, *_prefill_args())

    def test_a_buffer_read_after_its_write_stays_functional(self):
        def reread(pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            buf = torch.ones(2, 16, 4)
            new = buf.index_copy(1, pos, k)
            return new, buf.sum()  # the old value: in place, the sum would read the rows

        gm = _lowered(reread, *_prefill_args())
        self.assertEqual(_run(gm), 0)
        self.assertEqual(op_counts(gm)["aten::index_copy.default"], 1)
        assert _same(gm, reread, *_prefill_args())

    def test_a_buffer_returned_beside_its_written_value_stays_functional(self):
        def both(pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            buf = torch.zeros(2, 16, 4)
            return buf, buf.index_copy(1, pos, k)

        gm = _lowered(both, *_prefill_args())
        self.assertEqual(_run(gm), 0)
        assert _same(gm, both, *_prefill_args())

    def test_a_pointwise_write_stays_functional_for_fusion(self):
        def counter(x: torch.Tensor) -> torch.Tensor:
            buf = x * 2
            buf.add_(1)
            buf.masked_fill_(buf > 2, 0.0)
            return buf

        gm = _lowered(counter, torch.randn(8))
        self.assertEqual(_run(gm), 0)
        self.assertEqual(op_counts(gm)["aten::masked_fill.Scalar"], 1)

    def test_a_buffer_sized_by_a_symbolic_size_goes_in_place(self):
        def rows(pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            buf = torch.zeros(k.shape[0], 16, k.shape[2])
            return buf.index_copy(1, pos, k)

        with torch.no_grad():
            gm = aten_graph(rows, *_prefill_args(), dynamic=True).gm
        self.assertEqual(_run(gm), 1)
        graphdispatch_backend.reset()
        args = (torch.arange(3), torch.randn(5, 3, 6))
        compiled = torch.compile(rows, backend="graphdispatch", options={"cuda_graphs": False}, dynamic=True)
        with torch.no_grad():
            for a in (_prefill_args(), args):
                assert torch.equal(compiled(*a), rows(*a))
        graph = graphdispatch_backend.latest_report()["graphs"][-1]
        assert graph["buffer_writes_in_place"] == 1 and graph["lowering_check"]["status"] == "bitwise"

    def test_a_buffer_that_views_a_matmul_s_memory_is_not_the_graph_s_own(self):
        def rows(a: torch.Tensor, b: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            y = a @ b  # a batch of rows: aot's mm, then an _unsafe_view of its memory
            return y.index_copy(1, pos, torch.ones(2, 3, 4))

        args = (torch.randn(2, 16, 8), torch.randn(8, 4), torch.arange(3))
        gm = _lowered(rows, *args)
        self.assertIn("aten::_unsafe_view.default", op_counts(gm))
        self.assertEqual(_run(gm), 0)
        assert _same(gm, rows, *args)

    def test_a_write_into_an_input_is_not_this_pass_s(self):
        def decode(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            cache.index_copy_(1, pos, k)
            return k * 2

        gm = _lowered(decode, torch.zeros(2, 16, 4), *_prefill_args())
        self.assertEqual(_run(gm), 0)  # passes/reinplace.py's (the epilogue copy back)

    def test_a_write_across_a_piece_boundary_stays_functional(self):
        def split(pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            buf = torch.zeros(2, 16, 4)
            noise = torch.rand(2, 3, 4)  # a random draw stays out of captured pieces: a piece ends here
            return buf.index_copy(1, pos, k + noise)

        gm = _lowered(split, *_prefill_args())
        self.assertEqual(_run(gm, pieces=True), 0)  # the later piece would write into its input
        gm = _lowered(split, *_prefill_args())
        self.assertEqual(_run(gm, pieces=False), 1)  # no pieces (cuda_graphs=False): one graph


    def test_a_view_write_stays_functional_in_a_fused_graph_a_row_write_goes_in_place(self):
        def mask_and_rows(pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            mask = torch.zeros(1, 1, 6)  # HunyuanVideo's attention mask: a select write into zeros
            mask[:, :, 0] = pos.sum()
            cache = torch.zeros(2, 16, 4)
            return mask * 2, cache.index_copy(1, pos, k)

        gm = _lowered(mask_and_rows, *_prefill_args())
        self.assertEqual(_run(gm, fused=True), 1)  # the cache's rows only: Inductor stores the mask's write
        counts = op_counts(gm)
        self.assertEqual((counts.get("aten::select_scatter.default"), counts.get("aten::index_copy_.default")),
                         (1, 1))
        assert _same(gm, mask_and_rows, *_prefill_args())
        gm = _lowered(mask_and_rows, *_prefill_args())
        self.assertEqual(_run(gm, fused=False), 2)  # unfused: both in place
        self.assertNotIn("aten::select_scatter.default", op_counts(gm))

    def test_a_write_that_would_change_the_layout_stays_functional(self):
        gm = _lowered(prefill, *_prefill_args())
        (write,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.index_copy.default)
        val = write.meta["val"]  # as if the functional write returned another layout than its buffer's
        write.meta["val"] = val.new_empty_strided(val.shape, tuple(reversed(val.stride())))
        self.assertEqual(_run(gm), 0)


_MODULE = "graphdispatch_backend.passes.reinplace_buffers"


@pytest.mark.parametrize(("rule", "name", "broken", "test"), [
    ("nothing reads an overwritten value", "blocked", lambda *a: None,
     "test_a_buffer_read_after_its_write_stays_functional"),
    ("one piece", "inline_nodes", lambda gm, device: {}, "test_a_write_across_a_piece_boundary_stays_functional"),
    ("row writes only", "ROW_WRITES", frozenset(functional_writes.IN_PLACE),
     "test_a_pointwise_write_stays_functional_for_fusion"),
    ("the layout kept", "_same_layout", lambda node, root: True,
     "test_a_write_that_would_change_the_layout_stays_functional"),
    ("view writes left to a fused graph", "FUSED_VIEW_WRITES", frozenset(),
     "test_a_view_write_stays_functional_in_a_fused_graph_a_row_write_goes_in_place"),
])
def test_mutation_each_rule_is_what_its_test_checks(rule: str, name: str, broken: Any, test: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rule of the pass, removed: the test that states it fails (a wrong value, or a
    write made in place that must not be)."""
    monkeypatch.setattr(sys.modules[_MODULE], name, broken)
    with pytest.raises(AssertionError):
        getattr(TestReinplaceBuffers(test), test)()


@pytest.mark.parametrize("fuse", [True, {"rtol": 1e-3, "atol": 1e-5}], ids=["exact", "tolerance"])
def test_a_view_write_into_a_made_buffer_leaves_a_fused_graph_one_segment(fuse: Any) -> None:
    """A mask built by a select write into zeros between two pointwise runs: fused, the
    graph is one segment (in place, the write cut it in two), and eager's bits."""
    def masked(x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x * 3 + 1)
        mask = torch.zeros(1, x.shape[1])
        mask[:, 0] = 1.0
        return (h * mask + h).neg()

    graphdispatch_backend.reset()
    compiled = torch.compile(masked, backend="graphdispatch",
                             options={"cuda_graphs": False, "cache_dir": False, "fuse": fuse})
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            assert torch.equal(compiled(x), masked(x))
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    assert graph["buffer_writes_in_place"] == 0
    assert graph["fusion"]["status"] == "fused" and graph["fusion"]["segments"] == 1, graph["fusion"]


def test_a_transformers_prefill_writes_its_new_cache_rows_in_place_bitwise():
    """A Llama's prefill with a new StaticCache (transformers' default per generate): the
    cache's zeros are written in place (2 layers x keys and values), every generate equal
    to eager, bit for bit."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="eager", bos_token_id=None, eos_token_id=None,
                                      pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=3, do_sample=False, cache_implementation="static", max_cache_len=64, pad_token_id=0,
              disable_compile=True, return_dict_in_generate=True, output_logits=True)
    generates_like_eager(model, prompt, kw, 4)
    prefill_graph = min(accounted_graphs(), key=lambda g: g["calls"])
    assert prefill_graph["buffer_writes_in_place"] == 4
    assert prefill_graph["lowering_check"]["status"] == "bitwise"
    assert prefill_graph["cuda_graph"]["replays"] >= 1
