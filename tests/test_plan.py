"""plan.py: what serves a graph, decided from the graph and the options alone (no runtime)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphdispatch_backend.errors import Decline, Engine, FusionOff, GraphKind, SplitReason
from graphdispatch_backend.options import Options
from graphdispatch_backend.passes.context import PieceInfo
from graphdispatch_backend.plan import Role, Serve, plan_graph


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
