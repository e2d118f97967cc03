"""Direct: a tolerance segment runs Inductor's code past aot's runtime wrapper once its
first call showed the same outputs (count, layouts, bits, aliasing); a first call that
differs, aliases otherwise or raises keeps every call on the wrapper."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphdispatch_backend.fusion import inductor
from graphdispatch_backend.fusion.direct import Direct
from graphdispatch_backend.fusion.recipe import recipe_for
from graphdispatch_backend.options import FuseTolerance
from graphdispatch_backend.testing import aten_graph

TOLERANCE = recipe_for("cpu", FuseTolerance(rtol=1e-3, atol=1e-5))


def block(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = F.layer_norm(x, (x.shape[-1],))
    y = F.gelu(h @ w)
    return y + x, y.sum(-1)


def test_a_tolerance_segment_goes_past_the_wrapper_after_its_first_call():
    args = (torch.randn(4, 16), torch.randn(16, 16))
    gm = aten_graph(block, *args).gm
    run = inductor.compile_segment(gm, TOLERANCE, frozenset()).run
    assert isinstance(run, Direct) and run.direct is None
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
