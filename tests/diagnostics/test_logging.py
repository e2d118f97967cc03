"""Logging through `logging.getLogger("graphdispatch_backend")`: a decline, a demotion or a
compile fallback is a WARNING the first time its reason is seen in a session and DEBUG
after; routine decisions are INFO or DEBUG, never WARNING."""

from __future__ import annotations

import logging

import torch

import graphdispatch_backend
import graphdispatch_backend.backend as backend_module
from graphdispatch_backend.passes import PIPELINE
from graphdispatch_backend.passes import run_pipeline as real_run_pipeline
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine

EMULATE = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1}


class TwoGraphs(torch.nn.Module):
    """A graph break in the middle: Dynamo hands the backend two graphs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return torch.relu(self.b(x))


def _run(model, options, calls=3):
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(4, 8)
            assert torch.equal(compiled(x), model(x))
    return graphdispatch_backend.latest_report()


def _ours(caplog, text):
    return [r for r in caplog.records if r.name == "graphdispatch_backend" and text in r.getMessage()]


def test_a_demotion_warns_once_per_region(net, make_bundle, gd_log):
    root = make_bundle("mlp-off", "off")  # fails parity on blocks.0.mlp, and so demoted on blocks.1.mlp
    report = _run(net, {**EMULATE, "artifacts": str(root)})
    assert [s["reason"] for s in report["graphs"][0]["substitutions"]] == ["parity", "demoted_elsewhere"]
    records = _ours(gd_log, "demoted to native")
    assert [r.levelno for r in records] == [logging.WARNING, logging.WARNING]  # every demoted region is named
    messages = sorted(r.getMessage() for r in records)
    assert "blocks.0.mlp (parity)" in messages[0], messages
    assert "blocks.1.mlp (demoted_elsewhere): its kernel was demoted at region blocks.0.mlp (parity)" in messages[1]


def test_each_demotion_reason_gets_its_own_warning(net, make_bundle, gd_log):
    make_bundle("mlp-raises", "flaky", module="blocks.0.mlp", fail_after=0)
    root = make_bundle("mlp-off", "off", module="blocks.1.mlp")
    _run(net, {**EMULATE, "artifacts": str(root)})
    warnings = [r.getMessage() for r in _ours(gd_log, "demoted to native") if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert any("mlp-raises" in m and "(raised)" in m and "kernel fault" in m for m in warnings)
    assert any("mlp-off" in m and "(parity)" in m for m in warnings)


def test_a_decline_warns_once_per_reason_then_debug(monkeypatch, gd_log):
    def refuse(self, fn, args, device="cpu", **engine_kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(HostReplayEngine, "capture", refuse)
    report = _run(TwoGraphs().eval(), EMULATE)
    assert [g["cuda_graph"]["declines"] for g in report["graphs"]] == [{"capture_failed": 1}] * 2
    records = _ours(gd_log, "CUDA graph declined")
    assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG]
    assert "capture_failed" in records[0].getMessage() and "stream is capturing" in records[0].getMessage()
    assert "graph_1" in records[1].getMessage()


def test_a_compile_fallback_warns_once_per_error_type(monkeypatch, gd_log):
    def broken_pass(gm, ctx):
        raise RuntimeError("injected pass failure")

    monkeypatch.setattr(backend_module, "run_pipeline",
                        lambda gm, ctx: real_run_pipeline(gm, ctx, (*PIPELINE, broken_pass)))
    report = _run(TwoGraphs().eval(), EMULATE, calls=1)
    assert [g["kind"] for g in report["graphs"]] == ["fallback", "fallback"]
    records = _ours(gd_log, "compiling it failed")
    assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG]
    assert "injected pass failure" in records[0].getMessage()


def test_routine_decisions_are_info_or_debug_never_warning(net, make_bundle, gd_log):
    root = make_bundle("mlp-exact", "exact")
    report = _run(net, {**EMULATE, "artifacts": str(root)}, calls=4)
    assert report["graphs"][0]["cuda_graph"]["replays"] == 2  # substituted, verified and replaying
    ours = [r for r in gd_log.records if r.name.startswith("graphdispatch_backend")]
    assert ours, "nothing was logged"
    assert all(r.levelno < logging.WARNING for r in ours), [r.getMessage() for r in ours if r.levelno >= 30]
    info = [r.getMessage() for r in ours if r.levelno == logging.INFO]
    assert any(m.startswith("graphdispatch compile:") and '"graph": "graph_0"' in m for m in info)
    assert sum(m.startswith("graphdispatch substitution:") for m in info) == 2
    assert sum(m.startswith("graphdispatch parity:") and '"verdict": "passed"' in m for m in info) == 2


def test_warnings_reach_a_default_logging_setup(net, make_bundle, caplog):
    caplog.set_level(logging.WARNING)  # what an application that never configured logging sees
    root = make_bundle("mlp-off", "off")
    _run(net, {**EMULATE, "artifacts": str(root)})
    assert [r.levelname for r in _ours(caplog, "demoted to native")] == ["WARNING", "WARNING"]  # one per region
    assert not [r for r in caplog.records if r.name == "graphdispatch_backend" and r.levelno < logging.WARNING]
