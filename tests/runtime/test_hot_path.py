"""The replay hot path (runtime/program/program.py, GraphRunner.replay_hot, runner/serve.py), on CPU.

A graph Dynamo compiled and one runner serves whole is asked for a replay before anything
else: one address check, no contract, no thread-local, counted by the runner. These tests
pin what that path must keep: every output right, the report balanced (a hot replay is a
call and a replay; a hot replay that fails is an eager call, `replay_failed`), the
contract still checked wherever a decision is made (and on every call of a graph compiled
without Dynamo), nothing of the slow path paid on a hot call; and the serve path for
streams that launch at once (CUDA's, modelled on CPU by ImmediateStreams over the host
engine), where each output base is cloned after the replay: remove the clone or the
copy-in and some output is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

import graphdispatch_backend
from graphdispatch_backend.backend import graphdispatch_backend as backend_fn
from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.runtime.call.contract import PlaceholderContract
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine
from graphdispatch_backend.runtime.cudagraph.streams import ImmediateStreams
from graphdispatch_backend.runtime.runner import GraphRunner, RuntimeScope
from graphdispatch_backend.runtime.runner.inputs import InputPlan
from graphdispatch_backend.runtime.runner.outputs import OutputPlan


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * 2


class _TupleNet(_Net):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:  # type: ignore[override]
        return (super().forward(x),)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net().eval()


def _report() -> dict[str, Any]:
    report = graphdispatch_backend.latest_report()
    assert report is not None
    for graph in report["graphs"]:
        cg = graph["cuda_graph"]
        assert graph["calls"] == cg["replays"] + cg["eager_calls"], graph
        assert sum(cg["eager_by_reason"].values()) == cg["eager_calls"], graph
    return report


def _emulate(model: nn.Module, **options: Any) -> Callable[..., Any]:
    return torch.compile(model, backend="graphdispatch",
                         options={"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1, **options})


def _drive(calls: int) -> dict[str, Any]:
    """`calls` calls of the emulated model, each bitwise with eager; its graph's report."""
    model = _model()
    compiled = _emulate(model)
    keep = [torch.randn(2, 8) for _ in range(calls)]  # kept alive: no address is reused
    with torch.no_grad():
        for x in keep:
            assert torch.equal(compiled(x), model(x))
    (graph,) = _report()["graphs"]
    return graph


def test_hot_replays_are_counted_as_calls_and_replays():
    graph = _drive(10)
    assert graph["calls"] == 10
    # warmup, capture + verification, the first replay (slow path), then hot replays
    assert graph["cuda_graph"]["replays"] == 8
    assert graph["cuda_graph"]["eager_by_reason"] == {"warmup": 1, "verifying": 1}


def test_a_hot_replay_pays_no_contract_check(monkeypatch):
    checks = []
    real = PlaceholderContract.check

    def counted(self: PlaceholderContract, args: Sequence[Any]) -> bool:
        checks.append(1)
        return real(self, args)

    monkeypatch.setattr(PlaceholderContract, "check", counted)
    model = _model()
    compiled = _emulate(model)
    keep = [torch.randn(2, 8) for _ in range(8)]
    with torch.no_grad():
        for x in keep[:3]:  # warmup, capture + verification, the first replay
            compiled(x)
        before = len(checks)
        for x in keep[3:]:
            assert torch.equal(compiled(x), model(x))
    assert before == 3 and len(checks) == 3


@pytest.mark.parametrize("cuda_graphs", [False, "auto"])
def test_a_graph_dynamo_compiled_without_a_capture_pays_no_contract_check(monkeypatch, cuda_graphs):
    # cuda_graphs off, or "auto" on a CPU graph: no runner decides anything, and Dynamo's
    # guards stand in front of every call, so the call is the pipeline graph and a count
    checks = []
    real = PlaceholderContract.check
    monkeypatch.setattr(PlaceholderContract, "check", lambda self, args: checks.append(1) or real(self, args))
    model = _model()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": cuda_graphs})
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 8)
            assert torch.equal(compiled(x), model(x))
        x = torch.randn(5, 8)  # a new shape: Dynamo recompiles, nothing reaches the old graph
        assert torch.equal(compiled(x), model(x))
    assert checks == []
    graphs = _report()["graphs"]
    assert sum(g["calls"] for g in graphs) == 5
    reason = "disabled" if cuda_graphs is False else "not_cuda"
    assert all(set(g["cuda_graph"]["eager_by_reason"]) == {reason} for g in graphs)


def test_a_hot_replay_that_raises_is_answered_eagerly_and_counted(monkeypatch):
    replays = [0]
    real = HostReplayEngine.capture

    def capture(self: HostReplayEngine, fn: Any, args: Any, device: Any = "cpu", **engine_kwargs: Any) -> Any:
        graph = real(self, fn, args, device, **engine_kwargs)
        inner = graph.replay

        def replay() -> None:
            replays[0] += 1
            if replays[0] == 4:  # 1 verifies, 2 is the first served (slow path), 3 and 4 are hot
                raise RuntimeError("injected: device fault")
            inner()

        graph.replay = replay
        return graph

    monkeypatch.setattr(HostReplayEngine, "capture", capture)
    cg = _drive(7)["cuda_graph"]
    assert cg["declines"] == {"replay_failed": 1}
    assert cg["replays"] == 2 and cg["eager_by_reason"]["replay_failed"] == 3  # the failing call and later ones
    assert "injected: device fault" in cg["decline_details"]["replay_failed"]


def test_a_graph_compiled_without_dynamo_checks_its_contract_while_it_replays():
    # The backend called directly: no guards stand in front of its callable, so a batch of
    # 3 reaching a graph traced (and replaying) for 2 must still be stopped by the contract.
    torch.manual_seed(0)
    model = _TupleNet().eval()  # aot's direct path wants tuple outputs
    with torch.no_grad():
        fn = backend_fn(fx.symbolic_trace(model), [torch.randn(2, 8)],
                        options={"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1})
        for batch in (2, 2, 2, 2, 2, 3, 2):
            x = torch.randn(batch, 8)
            assert torch.equal(fn(x)[0], model(x)[0])
    (graph,) = _report()["graphs"]
    assert graph["contract_mismatches"] == 1 and graph["cuda_graph"]["replays"] == 4


# -- the serve path for streams that launch at once ---------------------------------------------


class _ImmediateHost(HostReplayEngine):
    """The host engine with streams that run every launch at once (as CUDA's host calls
    are made at once): the runner's direct serve path, outputs cloned after the replay."""

    def __init__(self) -> None:
        super().__init__()
        self._immediate: dict[str, ImmediateStreams] = {}

    def streams(self, device: Any) -> ImmediateStreams:  # type: ignore[override]
        return self._immediate.setdefault(self._key(device), ImmediateStreams())


def _runner(fn: Callable[..., Sequence[Any]], **kw: Any) -> tuple[GraphRunner, CudaGraphStats]:
    scope = RuntimeScope(_ImmediateHost(), Timing(), Events(), make_contain(False))
    stats = CudaGraphStats()
    kw = {"warmup": 2, "max_captures": 8, "verify_inputs": 1, "state_names": {}, **kw}
    return GraphRunner(fn, "piece", scope, stats, **kw), stats


def _affine(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    return (x @ w + 1.0,)


def _split(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = x @ w
    return (*y.chunk(2, dim=1), y.t())  # outputs that share a base, one of them restrided


def _wrong(fn: Callable[..., Sequence[Any]], calls: int = 7) -> tuple[int, CudaGraphStats]:
    """Outputs held across replays, compared with eager at the end (a later replay that
    overwrote an earlier output counts)."""
    runner, stats = _runner(fn)
    w = torch.randn(4, 4)
    got, want = [], []
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(3, 4)
            got.append(runner(x, w))
            want.append(fn(x, w))
    wrong = sum(not all(a.stride() == b.stride() and torch.equal(a, b) for a, b in zip(g, e))
                for g, e in zip(got, want))
    return wrong, stats


@pytest.mark.parametrize("fn", [_affine, _split], ids=["one output", "outputs sharing a base"])
def test_immediate_streams_serve_right(fn):
    wrong, stats = _wrong(fn)
    assert wrong == 0 and stats.replays >= 3 and not stats.declines


def test_immediate_streams_without_the_clone_some_output_is_wrong(monkeypatch):
    monkeypatch.setattr(OutputPlan, "clones", lambda self: list(self._srcs))
    wrong, _ = _wrong(_affine)
    assert wrong > 0


def test_immediate_streams_without_the_copy_in_some_output_is_wrong(monkeypatch):
    monkeypatch.setattr(InputPlan, "fill", InputPlan.copy_in)  # the capture still gets its values
    monkeypatch.setattr(InputPlan, "copy_in", lambda self, args: None)
    wrong, _ = _wrong(_affine)
    assert wrong > 0


def test_a_graph_writing_a_pinned_input_allocates_before_it_replays(monkeypatch):
    """An allocation that fails after the replay would leave the write done, and the eager
    answer would do it again: such a graph allocates its outputs first."""
    def accumulate(acc: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor]:
        acc.add_(x)
        return (acc * 2,)

    runner, stats = _runner(accumulate, mutated=(0,))
    acc, ref = torch.zeros(4), torch.zeros(4)
    order: list[str] = []
    real_allocate, real_clones = OutputPlan.allocate, OutputPlan.clones
    monkeypatch.setattr(OutputPlan, "allocate", lambda self: order.append("allocate") or real_allocate(self))
    monkeypatch.setattr(OutputPlan, "clones", lambda self: order.append("clones") or real_clones(self))
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4)
            (out,) = runner(acc, x)
            (expected,) = accumulate(ref, x)
            assert torch.equal(out, expected) and torch.equal(acc, ref)
    assert stats.replays >= 2 and "clones" not in order and "allocate" in order
