"""Direct: a tolerance segment runs Inductor's code past aot's runtime wrapper once its
first call showed the same outputs (count, layouts, bits, aliasing); a first call that
differs, aliases otherwise or raises keeps every call on the wrapper."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphdispatch_backend.fusion import inductor
from graphdispatch_backend.fusion.recipe import recipe_for
from graphdispatch_backend.options import FuseTolerance
from graphdispatch_backend.runtime.program.direct import Direct
from graphdispatch_backend.testing import aten_graph

TOLERANCE = recipe_for("cpu", FuseTolerance(rtol=1e-3, atol=1e-5))


def block(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = F.layer_norm(x, (x.shape[-1],))
    y = F.gelu(h @ w)
    return y + x, y.sum(-1)


def test_a_tolerance_segment_goes_past_the_wrapper_after_its_first_call():
    args = (torch.randn(4, 16), torch.randn(16, 16))
    gm = aten_graph(block, *args).gm
    segment = inductor.compile_segment(gm, TOLERANCE, frozenset())
    assert segment.alone is not None
    run = Direct(segment.run, segment.alone)
    assert run.direct is None
    first = run(*args)
    assert run.direct is True
    for i in range(3):
        fresh = (torch.randn(4, 16, generator=torch.Generator().manual_seed(i)), args[1])
        want, got = gm(*fresh), run(*fresh)
        assert len(got) == 2 and all(torch.allclose(w, g, rtol=1e-3, atol=1e-5) and w.stride() == g.stride()
                                     for w, g in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(first, run(*args)))  # the same code: the same bits


def test_a_first_call_that_differs_keeps_every_call_on_the_wrapper():
    x = torch.randn(8)
    run = Direct(lambda t: (t * 2,), lambda boxed: (boxed[0] * 2 + 1e-6,))
    assert torch.equal(run(x)[0], x * 2) and run.direct is False
    assert torch.equal(run(x)[0], x * 2)


def test_an_output_aliased_otherwise_keeps_the_wrapper():
    """The wrapper returns the input itself (an alias aot regenerates); the graph alone a copy
    with the same bits: the sharing differs."""
    x = torch.randn(8)
    run = Direct(lambda t: (t,), lambda boxed: (boxed[0].clone(),))
    assert run(x)[0] is x and run.direct is False


def test_nan_in_the_same_places_is_the_same_and_a_raising_graph_keeps_the_wrapper():
    x = torch.tensor([1.0, float("nan")])
    same = Direct(lambda t: (t + 1,), lambda boxed: (boxed[0] + 1,))
    same(x)
    assert same.direct is True

    def refuses(boxed: list[torch.Tensor]) -> tuple[torch.Tensor]:
        raise RuntimeError("expected 2 inputs")

    raising = Direct(lambda t: (t + 1,), refuses)
    assert torch.equal(raising(x)[0].nan_to_num(), (x + 1).nan_to_num()) and raising.direct is False


def test_a_fused_graph_binds_its_tolerance_segments_direct_and_its_exact_ones_not():
    """Bound in a fused unit (runtime/program/fused_unit.py): a tolerance segment's run is a
    Direct, and goes direct after the graph's first call; the exact recipe's segments are
    compiled past aot already (no `alone`)."""
    import graphdispatch_backend
    from graphdispatch_backend.runtime.program import fused_unit as fused

    made: list[Direct] = []
    real = fused.Direct

    def spy(*a):
        made.append(real(*a))
        return made[-1]

    x, w = torch.randn(4, 16), torch.randn(16, 16)
    for fuse, expect in ((True, 0), ({"rtol": 1e-3, "atol": 1e-5}, 1)):
        made.clear()
        graphdispatch_backend.reset()
        torch._dynamo.reset()
        fused.Direct = spy
        try:
            compiled = torch.compile(block, backend="graphdispatch",
                                     options={"cuda_graphs": False, "cache_dir": False, "fuse": fuse})
            with torch.no_grad():
                for _ in range(2):
                    got = compiled(x, w)
        finally:
            fused.Direct = real
        assert len(made) == expect and all(d.direct for d in made)
        want = block(x, w)
        assert all(torch.allclose(g, e, rtol=1e-3, atol=1e-5) for g, e in zip(got, want))
