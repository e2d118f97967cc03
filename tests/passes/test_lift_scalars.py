"""lift_scalars: tensors made from Python-number inputs, and host arithmetic on them that is
returned, move ahead of the captured piece, so one capture serves every value (a timestep
passed as an int replays, a cache layer's int counter does not key the decode step); a
scalar with any other use keeps keying the piece."""

from __future__ import annotations

import sys
from typing import Any

import expecttest
import pytest
import torch
import torch.fx as fx

from graphdispatch_backend.errors import SplitReason
from graphdispatch_backend.passes.context import PassContext, PieceSpec
from graphdispatch_backend.passes.lift_scalars import SCALAR_INPUT_META, lift_scalars
from graphdispatch_backend.passes.split_pieces import split_pieces
from graphdispatch_backend.testing import accounted_graphs, aten_graph, normalize, op_counts


def _spec() -> PieceSpec:
    return PieceSpec("cpu", lambda piece, info: piece.forward)


def _timestep_graph() -> fx.GraphModule:
    def f(x: torch.Tensor, w: torch.Tensor, t: int) -> torch.Tensor:
        return (x @ w) * torch.tensor([t], dtype=x.dtype) + torch.full((2,), t, dtype=x.dtype)

    return aten_graph(f, torch.randn(2, 2), torch.randn(2, 2), 3, dynamic=True).gm


def _lifted(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.meta.get(SCALAR_INPUT_META)]


class TestLiftScalars(expecttest.TestCase):
    def _assert_unmoved(self, fn: Any, *args: Any) -> None:
        gm = aten_graph(fn, *args, dynamic=True).gm
        code = normalize(gm)
        lift_scalars(gm, PassContext(pieces_spec=_spec()))
        self.assertEqual(normalize(gm), code)
        self.assertEqual(_lifted(gm), [])

    def test_factories_of_a_scalar_input_move_to_the_top_marked(self):
        gm = _timestep_graph()
        before = op_counts(gm)
        lift_scalars(gm, PassContext(pieces_spec=_spec()))
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1, arg2_1):
    scalar_tensor = torch.ops.aten.scalar_tensor.default(arg2_1, dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
    full = torch.ops.aten.full.default([2], arg2_1, dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
    mm = torch.ops.aten.mm.default(arg0_1, arg1_1)
    stack = torch.ops.aten.stack.default([scalar_tensor])
    mul = torch.ops.aten.mul.Tensor(mm, stack)
    add = torch.ops.aten.add.Tensor(mul, full)
    return (add,)""")  # noqa: E501
        self.assertEqual(op_counts(gm), before)  # moved, nothing added or removed
        self.assertEqual(_lifted(gm), ["scalar_tensor", "full"])

    def test_the_piece_takes_their_tensors_and_no_scalar(self):
        gm = _timestep_graph()
        ctx = PassContext(pieces_spec=_spec())
        lift_scalars(gm, ctx)
        split_pieces(gm, ctx)
        self.assertEqual(ctx.split_reasons, {SplitReason.SCALAR_INPUT: 2})
        self.assertEqual([(p.capturable, p.reasons) for p in ctx.pieces],
                         [(False, {"scalar_input": 2}), (True, {})])
        (call,) = [n for n in gm.graph.nodes if n.meta.get("gd_piece") is not None]
        piece_inputs = [a for a in call.args if isinstance(a, fx.Node)]
        assert all(isinstance(a.meta.get("val"), torch.Tensor) for a in piece_inputs)

    def test_a_scalar_with_another_use_stays_in_the_piece(self):
        def g(x: torch.Tensor, t: int) -> torch.Tensor:
            return x * t + torch.tensor([t])

        self._assert_unmoved(g, torch.randn(2), 3)

    def test_host_arithmetic_that_is_returned_moves_to_the_top_marked(self):
        def counted(x: torch.Tensor, w: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
            return x @ w, n + 1  # a cache layer's counter: no kernel reads it

        gm = aten_graph(counted, torch.randn(2, 2), torch.randn(2, 2), 3, dynamic=True).gm
        before = op_counts(gm)
        ctx = PassContext(pieces_spec=_spec())
        lift_scalars(gm, ctx)
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1):
    add_3 = arg3_1 + 1
    mm = torch.ops.aten.mm.default(arg1_1, arg2_1)
    return (mm, add_3)""")
        self.assertEqual(op_counts(gm), before)
        self.assertEqual(_lifted(gm), ["add_3"])
        split_pieces(gm, ctx)
        (call,) = [n for n in gm.graph.nodes if n.meta.get("gd_piece") is not None]
        assert all(isinstance(a.meta.get("val"), torch.Tensor) for a in call.args if isinstance(a, fx.Node))

    def test_arithmetic_that_reaches_a_kernel_keeps_its_scalar(self):
        def scaled(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
            return x * (n + 1), n + 1

        self._assert_unmoved(scaled, torch.randn(2), 3)

    def test_arithmetic_on_a_kept_scalar_keeps_the_other_one_too(self):
        # n + m runs in the piece (m keys it), so the piece reads n: lifting n's factory
        # would split the graph for nothing
        def mixed(x: torch.Tensor, n: int, m: int) -> tuple[torch.Tensor, int]:
            return x * m + torch.tensor([n]), n + m

        self._assert_unmoved(mixed, torch.randn(2), 3, 4)

    def test_nothing_moves_when_nothing_is_captured(self):
        gm = _timestep_graph()
        code = normalize(gm)
        lift_scalars(gm, PassContext())
        self.assertEqual(normalize(gm), code)


# -- end to end: a timestep passed as a Python int ------------------------------------------


class TimestepNet(torch.nn.Module):
    """Diffusers' Timesteps in small: `torch.tensor([t])` when t is not a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, t: Any) -> torch.Tensor:
        if not torch.is_tensor(t):
            t = torch.tensor([t], dtype=torch.int64)
        freqs = torch.exp(-torch.arange(8, dtype=torch.float32) / 8)
        emb = torch.sin(t[:, None].float() * freqs[None])
        return self.proj(x + emb)


def _denoise(options: dict[str, Any], steps: list[int], rounds: int) -> dict[str, Any]:
    model = TimestepNet().eval()
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 2, **options})
    x = torch.randn(1, 8)
    with torch.no_grad():
        for _ in range(rounds):
            for t in steps:
                got, want = compiled(x, t), model(x, t)
                assert torch.equal(got, want), t
    graphs = accounted_graphs()
    assert len(graphs) == 2  # Dynamo specializes the first value, then makes t a symbol
    return graphs[-1]


STEPS = list(range(999, 0, -83))  # 13 distinct timesteps, more than max_captures


def test_a_denoising_loop_over_int_timesteps_replays_one_capture():
    graph = _denoise({"max_captures": 4}, STEPS, rounds=2)
    cg = graph["cuda_graph"]
    assert graph["split_reasons"] == {"scalar_input": 1}
    (piece,) = [p["cuda_graph"] for p in graph["pieces"] if p["capturable"]]
    assert piece["shape_keys"] == 1 and cg["captures"] == 1 and cg["declines"] == {}
    # the first value is Dynamo's specialized graph; of the dynamic graph's calls, warmup,
    # capture and a second verification answer eagerly, every other call replays
    assert cg["replays"] == graph["calls"] - 3, cg


def test_without_the_lift_every_value_is_a_capture_of_its_own(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sys.modules[lift_scalars.__module__], "_is_factory", lambda node: False)
    graph = _denoise({"max_captures": 4}, STEPS, rounds=2)
    (piece,) = [p["cuda_graph"] for p in graph["pieces"] if p["capturable"]]
    assert graph["split_reasons"] == {} and piece["shape_keys"] > 4
    assert graph["cuda_graph"]["replays"] == 0



def test_the_piece_after_the_lift_computes_no_shape_key(monkeypatch: pytest.MonkeyPatch):
    """The graph has a symbol (t), but its piece's tensors have fixed shapes that Dynamo's
    guards ensure: the piece's runner is keyless, as a static graph's is."""
    runner_mod = sys.modules["graphdispatch_backend.runtime.runner.lookup"]
    keys = []
    real = runner_mod.layout_key
    monkeypatch.setattr(runner_mod, "layout_key", lambda values: keys.append(1) or real(values))
    graph = _denoise({}, STEPS, rounds=1)
    assert graph["cuda_graph"]["replays"] > 0
    assert keys == []  # none: the piece is keyless

class Layer:
    """transformers' sliding-window cache layer in small: a plain object whose Python int
    counter each decode step adds one to (Dynamo makes it a symbol after one recompile)."""

    def __init__(self) -> None:
        self.length = 0


def _step(x: torch.Tensor, w: torch.Tensor, layer: Layer) -> torch.Tensor:
    layer.length += 1
    return (x @ w).sin()


def _count(steps: int) -> dict[str, Any]:
    compiled = torch.compile(_step, backend="graphdispatch", options={"cuda_graphs": "emulate", "max_captures": 4})
    ours, theirs = Layer(), Layer()
    x, w = torch.randn(1, 8), torch.randn(8, 8)
    with torch.no_grad():
        for i in range(steps):
            assert torch.equal(compiled(x + i, w, ours), _step(x + i, w, theirs))
            assert ours.length == theirs.length
    graphs = accounted_graphs()
    assert len(graphs) == 2  # Dynamo specializes the first value, then makes the counter a symbol
    return graphs[-1]


def test_a_counter_returned_plus_one_does_not_key_the_capture():
    graph = _count(20)
    cg = graph["cuda_graph"]
    assert graph["split_reasons"] == {"scalar_input": 1} and cg["captures"] == 1 and cg["declines"] == {}
    assert cg["replays"] == graph["calls"] - 2 and cg["eager_by_reason"] == {"warmup": 1, "verifying": 1}


def test_without_the_arithmetic_lift_every_count_is_a_shape_key(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sys.modules[lift_scalars.__module__], "_is_arithmetic", lambda node: False)
    graph = _count(20)
    assert graph["split_reasons"] == {} and graph["cuda_graph"]["replays"] == 0
    assert "shape_churn" in graph["cuda_graph"]["eager_by_reason"]


def test_a_transformers_sliding_window_decode_relocates_across_requests():
    """What a new user hit: Gemma 3 (sliding-window layers, a new StaticCache per generate).
    Each decode step passed the layers' int counter in and got it back plus one: every
    position was a shape key of its own, warmed and verified again in each request."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, pad_token_id=0, sliding_window=4, attn_implementation="eager")
    model = transformers.Gemma3ForCausalLM(config).eval()
    prompt = torch.randint(1, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    kw = {"max_new_tokens": 8, "do_sample": False, "cache_implementation": "static", "disable_compile": True,
          "return_dict_in_generate": True, "output_logits": True}
    with torch.no_grad():
        ref = model.generate(prompt, **kw)
        model.forward = torch.compile(model.forward, backend="graphdispatch", options={"cuda_graphs": "emulate"})
        for _ in range(3):
            out = model.generate(prompt, **kw)
            assert torch.equal(out.sequences, ref.sequences)
            assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    decode = max(accounted_graphs(), key=lambda g: g["calls"])
    cg = decode["cuda_graph"]
    assert decode["split_reasons"] == {"scalar_input": 2}  # one counter per layer
    # warmup, the capture call and a second verification, in the first request; then one
    # relocation per request, each replaying
    assert cg["relocations"] == 2 and cg["eager_by_reason"] == {"warmup": 1, "verifying": 2}, cg
    assert cg["replays"] == decode["calls"] - 3


def test_a_diffusers_unet_called_with_int_timesteps_replays():
    """What a new user hit: diffusers' UNet2DConditionModel with `t` an int, as samplers that
    loop over `range` pass it. Before the lift, every timestep was a shape key of its own
    and no call replayed."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8).eval()
    compiled = torch.compile(unet, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    x, text = torch.randn(1, 4, 8, 8), torch.randn(1, 5, 32)
    steps = list(range(999, 0, -125))  # 8 timesteps, twice
    with torch.no_grad():
        for t in steps * 2:
            assert torch.equal(compiled(x, t, text).sample, unet(x, t, text).sample), t
    graph = accounted_graphs()[-1]
    assert graph["split_reasons"] == {"scalar_input": 1}
    assert graph["cuda_graph"]["captures"] == 1 and graph["cuda_graph"]["declines"] == {}
    # warmup 1, the capture call and a second verification: the only moving input, the
    # timestep, holds one repeated integer, so no derived set verifies it at the capture call
    assert graph["cuda_graph"]["replays"] == graph["calls"] - 3
    assert graph["cuda_graph"]["eager_by_reason"] == {"warmup": 1, "verifying": 2}
