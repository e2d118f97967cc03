"""inductor.py: one segment compiled by Inductor under the recipe, bitwise with its ATen
graph, and no process-wide table of Inductor's touched: a user's own `backend="inductor"`
compile lowers as it would without graphdispatch, before, during and after. Each rule of
the compile has a test that removes it and sees a difference from eager."""

from __future__ import annotations

import threading
from unittest import mock

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from graphdispatch_backend.fusion import canonical, inductor
from graphdispatch_backend.fusion.recipe import recipe_for
from graphdispatch_backend.options import FuseTolerance
from graphdispatch_backend.testing import aten_graph

CPU = recipe_for("cpu")


def _segment(fn, *args) -> tuple[fx.GraphModule, tuple[torch.Tensor, ...]]:
    lowered = aten_graph(fn, *args)
    return lowered.gm, args


def _same(gm: fx.GraphModule, args, keep=frozenset()) -> tuple[bool, inductor.CompiledSegment]:
    compiled = inductor.compile_segment(gm, CPU, keep)
    want, got = gm(*args), compiled.run(*args)
    return all(torch.equal(w, g) and w.stride() == g.stride() for w, g in zip(want, got)), compiled


def residual(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x + 0.5 * (x @ w)
    return h.float().pow(2).mean(-1, keepdim=True) * h.float()


def test_a_segment_fuses_its_exact_ops_and_matches_its_aten_graph():
    x, w = torch.randn(8, 32), torch.randn(32, 32)
    same, compiled = _same(*_segment(residual, x, w))
    assert same and compiled.kernels >= 1
    assert set(compiled.fused) >= {"aten.add.Tensor", "aten.mul.Tensor"}
    assert "aten.mm.default" not in compiled.fused and "torch.ops.aten.mm.default" in compiled.source


def test_a_kept_op_runs_as_its_aten_call():
    x, w = torch.randn(8, 32), torch.randn(32, 32)
    same, compiled = _same(*_segment(residual, x, w), keep=frozenset({"aten.add.Tensor"}))
    assert same and "aten.add.Tensor" not in compiled.fused
    assert "torch.ops.aten.add.Tensor" in compiled.source


def test_a_segment_is_called_past_inductors_own_call_after_its_first_but_not_while_profiled():
    """Inductor's `CompiledFxGraph.__call__` runs at a segment's first call (the autotune
    cache's writes end there) and while a profiler records (its trace names the call); the
    other calls go to `current_callable` directly, with the same bits."""
    from torch._inductor.output_code import CompiledFxGraph

    x, w = torch.randn(8, 32), torch.randn(32, 32)
    gm, args = _segment(residual, x, w)
    own = []
    real = CompiledFxGraph.__call__

    def counted(self, inputs):
        own.append(1)
        return real(self, inputs)

    for recipe in (CPU, recipe_for("cpu", FuseTolerance(rtol=1e-3, atol=1e-5))):
        with mock.patch.object(CompiledFxGraph, "__call__", counted):
            compiled = inductor.compile_segment(gm, recipe, frozenset())
            call = compiled.run if recipe.exact else lambda *a, alone=compiled.alone: tuple(alone(list(a)))
            own.clear()
            first = call(*args)
            assert len(own) == 1
            for _ in range(3):
                assert all(torch.equal(a, b) for a, b in zip(first, call(*args)))
            assert len(own) == 1  # past it
            with torch.profiler.profile() as prof:
                call(*args)
            assert len(own) == 2
            assert any("CompiledFxGraph" in e.name for e in prof.events())
            call(*args)
            assert len(own) == 2


def plus_one(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, x * 2  # the add fused or kept, the graph's code is the same: only its marks differ


def test_inductors_cache_never_serves_the_code_of_another_keep_set():
    """Inductor's FX graph cache keys a graph by its code, not by which nodes are marked:
    the marks enter the key through the no-op pass's uuid. Without it the second compile
    would get the first one's code, with the op fused that it was asked to keep."""
    gm, args = _segment(plus_one, torch.randn(8, 32))
    ADD = "torch.ops.aten.add.Tensor"
    assert ADD not in inductor.compile_segment(gm, CPU, frozenset()).source
    assert ADD in inductor.compile_segment(gm, CPU, frozenset({"aten.add.Tensor"})).source
    one_key = inductor._key_pass("one key for every graph")
    with mock.patch.object(inductor, "_key_pass", lambda digest: one_key):
        inductor.compile_segment(gm, CPU, frozenset())
        stale = inductor.compile_segment(gm, CPU, frozenset({"aten.add.Tensor"}))
    assert ADD not in stale.source  # the cached code of the other set


def bf16_residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x + y  # rounded to bf16 in eager before the cast below
    return h.float() * 3


def test_bf16_results_are_rounded_where_eager_rounds_them():
    x, y = torch.randn(4, 64).bfloat16(), torch.randn(4, 64).bfloat16()
    gm, args = _segment(bf16_residual, x, y)
    assert _same(gm, args)[0]
    with mock.patch.object(inductor, "_low_precision", lambda node: False):  # the rounding left out
        assert not _same(gm, args)[0]


def tail_view(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # the output is a view of a permuted buffer with dims of size 1: eager's `view` strides
    # them otherwise than a fake tensor's, which Inductor follows
    y = (x @ w) + 1
    return y.view(1, 8, 8, 1, 1, 4).permute(0, 5, 1, 3, 2, 4).reshape(1, 4, 8, 8)


def test_the_views_an_output_is_made_of_are_atens():
    gm, args = _segment(tail_view, torch.randn(64, 16), torch.randn(16, 4))
    assert _same(gm, args)[0]
    with mock.patch.object(inductor, "_view_tails", lambda gm: set()):
        assert not _same(gm, args)[0]


def layout(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # a fused sum, laid out as its transposed operand, handed to an ATen op
    return F.gelu(x.t() + b)


def test_an_aten_call_gets_its_inputs_laid_out_as_eager_laid_them_out():
    gm, args = _segment(layout, torch.randn(16, 8), torch.randn(8, 16))
    assert _same(gm, args)[0]
    with mock.patch.object(inductor, "_eager_layouts", lambda gm, chosen: set()):
        assert not _same(gm, args)[0]


def first_fill(x: torch.Tensor, w: torch.Tensor, empty: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = (x @ w).view(2, 8, 2, 8).transpose(1, 2) * 2 + 1  # transposed, as a rotary key is
    keys = torch.cat([empty, k], dim=-2)  # a cache's first fill (transformers): contiguous in eager
    return keys, F.scaled_dot_product_attention(k.contiguous(), keys, keys)


def test_a_cat_of_one_tensor_and_empty_ones_is_written_once_in_eagers_layout():
    # Inductor drops such a cat and hands attention the key's own (transposed) layout, so a
    # graph returning the cat with eager's strides wrote the key twice (fusion/canonical.py)
    tolerance = recipe_for("cpu", FuseTolerance(rtol=1e-3, atol=1e-5))
    gm, args = _segment(first_fill, torch.randn(16, 32), torch.randn(32, 16), torch.tensor([]))
    want = gm(*args)

    def keys_written(compiled: inductor.CompiledSegment) -> int:
        got = compiled.run(*args)
        assert torch.equal(got[0], want[0]) and got[0].stride() == want[0].stride() == (128, 64, 8, 1)
        assert torch.allclose(got[1], want[1], rtol=1e-3, atol=1e-5) and got[1].stride() == want[1].stride()
        return compiled.source.count("empty_strided_cpu((2, 2, 8, 8)")  # the keys, and the query's copy

    assert keys_written(inductor.compile_segment(gm, tolerance, frozenset())) == 2
    with mock.patch.object(canonical, "_copy_of_one", lambda tensors, val: None):
        assert keys_written(inductor.compile_segment(gm, tolerance, frozenset())) == 4


# -- no global state -----------------------------------------------------------------------

def _tables() -> dict[str, tuple[int, int, frozenset]]:
    from torch._inductor import decomposition, lowering

    tables = {"lowerings": lowering.lowerings, "fallbacks": lowering.fallbacks,
              "decompositions": decomposition.decompositions, "fast_random": decomposition.fast_random_decomps()}
    return {k: (id(v), len(v), frozenset(map(str, v))) for k, v in tables.items()}


def users_function(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x).sum(-1) * torch.softmax(x, -1).amax(-1) + x.mean(-1)


def _inductor_values(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.reset()
    out = torch.compile(users_function, backend="inductor")(x)
    torch._dynamo.reset()
    return out


def test_inductors_tables_are_untouched_and_a_users_inductor_compile_lowers_as_before():
    x = torch.randn(64, 33)
    before, tables = _inductor_values(x), _tables()
    gm, args = _segment(residual, torch.randn(8, 32), torch.randn(32, 32))

    def fused_compiles() -> None:
        for keep in (frozenset(), frozenset({"aten.mul.Tensor"})):
            inductor.compile_segment(gm, CPU, keep)

    thread = threading.Thread(target=fused_compiles)
    thread.start()  # a user's compile on this thread while graphdispatch compiles on that one
    torch._dynamo.reset()
    during = torch.compile(users_function, backend="inductor")(x)
    thread.join()
    assert _tables() == tables
    after = _inductor_values(x)
    assert torch.equal(before, after) and torch.equal(before, during)


def test_keeping_an_op_through_inductors_tables_would_be_seen():
    """Mutation: the way a recipe is usually applied (`make_fallback(op, override_decomp=True)`)
    changes Inductor's process-wide tables for every user; the comparison above sees it."""
    from torch._inductor import decomposition, lowering

    tables = _tables()
    saved = (dict(lowering.lowerings), set(lowering.fallbacks), dict(decomposition.decompositions))
    try:
        lowering.make_fallback(torch.ops.aten.tanh.default, override_decomp=True, warn=False)
        assert _tables() != tables
    finally:  # put Inductor back for the rest of this process
        lowering.lowerings.clear()
        lowering.lowerings.update(saved[0])
        lowering.fallbacks.clear()
        lowering.fallbacks.update(saved[1])
        decomposition.decompositions.clear()
        decomposition.decompositions.update(saved[2])
    assert _tables() == tables


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["host-recipe", "gpu-recipe"])
def test_each_device_has_its_recipe(device):
    patches = recipe_for(device).patches
    assert patches["fallback_by_default"] and patches["emulate_precision_casts"]
    assert not patches["use_post_grad_passes"]
    if device == "cuda":
        assert patches["eager_numerics.division_rounding"] and patches["eager_numerics.disable_ftz"]
    else:
        assert patches["cpp.enable_floating_point_contract_flag"] == "off"
    assert recipe_for("cpu").id != recipe_for("cuda").id


def test_a_segments_key_is_its_structure_not_its_node_names():
    """A bisection cuts the graph anew per keep set, naming the same nodes otherwise: the
    key (what a unit's compiled segments are kept by) is the nodes' structure, so such a
    segment is compiled once; another op, another layout, or a kept op it holds is another
    key (the exact recipe keeps ops inside its segments)."""
    x, w = torch.randn(8, 32), torch.randn(32, 32)
    gm, _ = _segment(residual, x, w)
    renamed, _ = _segment(residual, x, w)
    for i, node in enumerate(renamed.graph.nodes):
        node.name = f"other_{i}"
    renamed.recompile()
    assert renamed.code != gm.code
    key = inductor.segment_key(gm, CPU, frozenset())
    assert inductor.segment_key(renamed, CPU, frozenset()) == key
    assert inductor.segment_key(gm, CPU, frozenset({"aten.add.Tensor"})) != key
    assert inductor.segment_key(gm, CPU, frozenset({"aten.sin.default"})) == key  # not an op it holds
    assert inductor.segment_key(_segment(residual, torch.randn(4, 32), w)[0], CPU, frozenset()) != key
    other, _ = _segment(lambda x, w: x - 0.5 * (x @ w), x, w)
    assert inductor.segment_key(other, CPU, frozenset()) != key
