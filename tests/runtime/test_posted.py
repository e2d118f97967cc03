"""posted.py, with fusion/statistics.py: a fused graph served eagerly takes its watched
inputs' statistics in its own kernels; its eager check judges the call by them after it
ran, and checks it then, with the outputs it made, when they are new (nothing ran since:
no input written, no draw). Everywhere else the check takes them itself, before the call;
each such path is forced here."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

from graphdispatch_backend.runtime.checks.novelty import Novelty
from graphdispatch_backend.testing import accounted_graphs, perturbed

MUL = "aten.mul.Tensor"
BIG = 6  # the 7th call: no schedule's (1, 2, 4, 8, ...)


class Counted:
    """Novelty._magnitude, counted: the reductions the check takes itself (`method`, patched
    onto the class)."""

    def __init__(self) -> None:
        self.calls = 0
        original = Novelty._magnitude

        def method(watch: Novelty, t: torch.Tensor) -> float:
            self.calls += 1
            return original(watch, t)

        self.method = method


def scaled(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * 3.0) + 1.0


def _calls(fn: Any, options: dict[str, Any], n: int = 10, big: tuple[int, ...] = (BIG,)) -> tuple[Counted, dict]:
    """`n` calls of `fn` compiled with `fuse=True` and `options`, the calls at `big` with an
    input 100x larger; each output eager's bits. (the check's own reductions, the graph)"""
    counted = Counted()
    compiled = torch.compile(fn, backend="graphdispatch", options={"fuse": True, "cache_dir": False, **options})
    with mock.patch.object(Novelty, "_magnitude", counted.method), torch.no_grad():
        for i in range(n):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) * (100.0 if i in big else 1.0)
            want = fn(x.clone())
            assert torch.equal(compiled(x), want), i
    (graph,) = accounted_graphs()
    return counted, graph


def test_a_fused_graph_takes_its_statistics_itself_and_a_fault_on_large_inputs_is_caught_at_once():
    """A fused mul 1 ulp off only above 50: the 7th call's input (100x) is the first to
    reach it, no schedule names the call, and its output is still eager's (checked after it
    ran, by the statistics the fused kernel took: the check took none itself); the mul is
    learned there, the 9th call (as large: seen) is not checked again."""
    with mock.patch.object(*perturbed(MUL, above=50.0)):
        counted, graph = _calls(scaled, {"cuda_graphs": False}, big=(BIG, 8))
    assert counted.calls == 0
    assert graph["lowering_check"]["novelty"] == 1
    kept = [(k["op"], k["why"], k["at_call"]) for k in graph["fusion"]["kept"] if k["why"] == "learned"]
    assert kept == [(MUL, "learned", BIG + 1)]
    assert graph["fusion"]["status"] == "fused"


def test_without_a_fault_a_new_input_is_checked_once_and_passes():
    counted, graph = _calls(scaled, {"cuda_graphs": False}, big=(BIG, 8))
    assert counted.calls == 0
    assert graph["lowering_check"]["novelty"] == 1 and graph["lowering_check"]["status"] == "bitwise"
    assert graph["fusion"]["kept"] == [] or all(k["why"] == "recipe" for k in graph["fusion"]["kept"])


COUNT = torch.zeros(())
W = torch.randn(8, 4)
W16 = torch.randn(16, 4)


def _writes(x: torch.Tensor) -> torch.Tensor:
    COUNT.add_(1.0)  # a buffer the graph writes (x, which it reads, is watched)
    return torch.relu(x * 3.0) + 1.0


def _draws(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * 3.0) + torch.rand_like(x) * 0.0


def _views_only(x: torch.Tensor) -> torch.Tensor:
    return x.t() @ W


def _matmul_only(x: torch.Tensor) -> torch.Tensor:
    return x @ W16


@pytest.mark.parametrize("fn, options", [
    pytest.param(scaled, {"cuda_graphs": "emulate"}, id="captured"),
    pytest.param(_writes, {"cuda_graphs": False}, id="writes_its_input"),
    pytest.param(_draws, {"cuda_graphs": False}, id="draws"),
    pytest.param(_views_only, {"cuda_graphs": False}, id="nothing_fused"),
    pytest.param(_matmul_only, {"cuda_graphs": False}, id="nothing_to_fuse"),
])
def test_where_a_call_must_be_judged_before_it_runs_the_check_reads_its_inputs_itself(fn, options):
    """Captured (a replay's outputs lie in its pool), a graph that writes a buffer (the
    check puts the world back from before the call) or draws (it replays the draws from
    before), a graph Inductor fuses nothing of or that holds nothing to fuse (statistics by
    ATen ops, or a compile for them alone, would cost more than the check's one reduction):
    the check takes the statistics itself, and a new input is still checked."""
    counted, graph = _calls(fn, options, big=(4,))  # (a replay's statistics decide the next call: the 6th)
    assert counted.calls > 0
    assert graph["lowering_check"]["novelty"] >= 1
    status = {_views_only: "nothing_fused", _matmul_only: "off"}.get(fn, "fused")
    assert graph["fusion"]["status"] == status
