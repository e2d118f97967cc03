"""plan.py: what serves a graph, decided from the graph and the options alone (no runtime)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphdispatch_backend
from graphdispatch_backend.errors import Decline, Engine, FusionOff, GraphKind, SplitReason
from graphdispatch_backend.options import Options
from graphdispatch_backend.passes.context import PieceInfo
from graphdispatch_backend.plan import Role, Serve, plan_graph
from graphdispatch_backend.testing import accounted_graphs


def _graph():
    return make_fx(lambda x: (x * 2).relu())(torch.randn(3, 4))


def _plan(role=Role.INFERENCE, writes_known=True, ranked=False, **options):
    return plan_graph(_graph(), role, Options.resolve(options, None), writes_known, ranked)


@pytest.mark.parametrize(("mode", "engine", "decline"), [
    (False, Engine.OFF, Decline.DISABLED), ("auto", Engine.OFF, Decline.NOT_CUDA), ("emulate", Engine.HOST, None)])
def test_the_engine_or_the_decline_that_says_why_none(mode, engine, decline):
    plan = _plan(cuda_graphs=mode)
    assert (plan.engine, plan.decline, plan.device, plan.nodes, plan.inputs) == (engine, decline, "cpu", 4, 1)
    assert plan.role.kind is GraphKind.INFERENCE and Role.FORWARD.kind is GraphKind.AUTOGRAD


@pytest.mark.parametrize(("role", "writes_known", "ranked", "off"), [
    (Role.INFERENCE, True, False, None), (Role.FORWARD, True, False, FusionOff.AUTOGRAD),
    (Role.INFERENCE, False, False, FusionOff.UNCHECKABLE), (Role.INFERENCE, True, True, FusionOff.COLLECTIVES)])
def test_fusion_eligible_or_off_with_its_reason(role, writes_known, ranked, off):
    plan = _plan(role, writes_known, ranked, fuse=True)
    assert plan.fusion is not None and plan.fusion.off is off and plan.fused == (off is None)
    assert (plan.fusion.detail is None) == (off is None)
    assert _plan(fuse=False).fusion is None


def test_serving_from_the_pieces():
    plan = _plan(cuda_graphs="emulate", fuse=True)
    whole = plan.serving([PieceInfo(0, True, 3)], {})
    assert (whole.how, whole.decline, whole.fused, whole.without_history) == (Serve.WHOLE, None, False, False)
    split = {SplitReason.RANDOM_OP: 1}
    pieces = plan.serving([PieceInfo(0, True, 2), PieceInfo(1, False, 1)], split)
    assert (pieces.how, pieces.decline, pieces.fused) == (Serve.PIECES, None, True)
    none = plan.serving([PieceInfo(0, False, 3)], split)
    assert (none.how, none.decline) == (Serve.UNCAPTURED, Decline.NO_CAPTURABLE_PIECE)
    assert none.detail == "every node of the graph must stay outside a CUDA graph (random_op: 1)"
    assert none.warning == f"{none.detail}; it runs eager" and not plan.serves_nothing(none, substituted=False)
    unfused = _plan(cuda_graphs="emulate")
    assert unfused.serves_nothing(unfused.serving([PieceInfo(0, False, 3)], split), substituted=False)
    assert not unfused.serves_nothing(unfused.serving([PieceInfo(0, False, 3)], split), substituted=True)


def test_a_decline_is_told_where_graphs_were_asked_for():
    quiet = _plan(cuda_graphs="auto").serving([], {})
    assert quiet.decline is Decline.NOT_CUDA and quiet.warning is None
    off = _plan(Role.FORWARD, cuda_graphs=False).serving([], {})
    assert off.detail == "cuda_graphs=False; the lowered forward and backward run, not captured" and off.warning is None
    told = _plan(Role.FORWARD, cuda_graphs=True).serving([], {})  # CPU inputs: no device, or not on it
    assert told.decline in (Decline.NO_CUDA_DEVICE, Decline.NOT_CUDA) and told.warning == told.detail
    assert told.detail.endswith("; the lowered forward and backward run, not captured")


def test_a_tolerance_is_checked_densely():
    assert _plan(fuse={"rtol": 1e-3, "atol": 1e-5}).recheck(Options.resolve({}, None)) == "dense"
    assert _plan(fuse=True).recheck(Options.resolve({}, None)) == "doubling"


def test_a_graph_dynamic_only_in_its_strides_is_told_how_to_fuse():
    """Dynamo recompiles for an input of the same shape laid out otherwise (a slice of a
    wider tensor: Flux's single blocks under `compile_repeated_blocks`) and makes its
    strides symbolic: unfused as dynamic shapes are, but the detail says it is the strides
    and names the fix; with that fix (`dynamic=False`) every graph fuses. A size that
    changes is still `dynamic shapes`."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    def run(xs: list[torch.Tensor], **kwargs: Any) -> list[dict[str, Any]]:
        torch._dynamo.reset()
        graphdispatch_backend.reset()
        compiled = torch.compile(f, backend="graphdispatch", options={"fuse": True, "cache_dir": False}, **kwargs)
        for x in xs:
            assert torch.equal(compiled(x), f(x))
        return [g["fusion"] for g in accounted_graphs()]

    contiguous, sliced = torch.randn(2, 16), torch.randn(2, 22)[:, :16]
    first, strided = run([contiguous, sliced, torch.randn(2, 30)[:, 3:19]])
    assert first["status"] == "fused" and strided["status"] == "off"
    assert strided["detail"].startswith("dynamic strides: Dynamo fixed every input size but left strides symbolic")
    assert "dynamic=False" in strided["detail"] and "torch._dynamo.mark_static(tensor)" in strided["detail"]
    assert [g["status"] for g in run([contiguous, sliced], dynamic=False)] == ["fused", "fused"]
    _, sized = run([contiguous, torch.randn(2, 20)])
    assert sized == {"status": "off", "detail": "dynamic shapes: only graphs whose input shapes Dynamo fixed are fused"}


def test_a_graph_dynamic_only_in_a_python_number_says_so():
    """A sliding-window cache counts its tokens in a Python int: after its second value
    Dynamo makes it symbolic while every tensor shape stays fixed. Not fused (as any
    symbolic graph), but the detail says it is a number, not a shape."""
    def f(x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n + 1

    torch._dynamo.reset()
    graphdispatch_backend.reset()
    compiled = torch.compile(f, backend="graphdispatch", options={"fuse": True, "cache_dir": False})
    for n in (1, 2, 3):
        x = torch.randn(2, 16)
        assert torch.equal(compiled(x, n), f(x, n))
    first, symbolic = (g["fusion"] for g in accounted_graphs())
    assert first["status"] == "fused" and symbolic["status"] == "off", (first, symbolic)
    assert symbolic["detail"].startswith("dynamic Python numbers: every tensor shape is fixed"), symbolic
