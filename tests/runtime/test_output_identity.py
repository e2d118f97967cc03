"""Replayed outputs keep the identity eager gives them (runtime/runner/outputs.py): a tensor
returned twice is one object, an output that is a whole input is that input, and outputs
sharing memory are views of one tensor, the first that covers them when there is one, so
they share its version counter as eager's views do."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine
from graphdispatch_backend.runtime.runner import GraphRunner, RuntimeScope


def replayed(fn: Callable[..., Sequence[Any]], *args: Any) -> tuple[list[Any], list[Any]]:
    """(eager's outputs, a replay's outputs) of `fn` on `args` (read in place)."""
    scope = RuntimeScope(HostReplayEngine(), Timing(), Events(), make_contain(False))
    stats = CudaGraphStats()
    runner = GraphRunner(fn, "piece", scope, stats, warmup=1, max_captures=8, verify_inputs=1, state_names={})
    for _ in range(3):
        out = runner(*args)
    assert stats.replays == 1
    return list(fn(*args)), list(out)


def test_a_tensor_returned_twice_is_one_object():
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x.sin()
        return y, x.cos(), y

    eager, out = replayed(fn, torch.randn(4))
    assert eager[0] is eager[2] and out[0] is out[2] and out[1] is not out[0]


def test_an_output_that_is_a_whole_input_is_that_input():
    w = torch.nn.Parameter(torch.randn(3, 4))

    def fn(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return w, w.t(), w * 2

    with torch.no_grad():
        eager, out = replayed(fn, w)
    assert eager[0] is w and out[0] is w  # a Parameter, requires grad: as aot hands it to the backward
    assert out[1]._base is w and type(out[1]) is torch.Tensor and out[1].requires_grad == eager[1].requires_grad


def test_outputs_sharing_memory_are_views_of_the_first_that_covers_them():
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 2
        return y, y.detach(), y[1:]

    eager, out = replayed(fn, torch.randn(4, 3))
    assert out[0]._base is None and out[1]._base is out[0] and out[2]._base is out[0]
    assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(eager, out))
    version = out[1]._version
    out[0].add_(1)  # the saved view sees the write, as eager's `detach(y)` would
    assert out[1]._version == version + 1 and torch.equal(out[1], out[0])


def test_outputs_of_a_base_nobody_returned_are_views_of_a_copy_of_it():
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 2
        return y[:2], y[2:]

    eager, out = replayed(fn, torch.randn(4, 3))
    assert all(torch.equal(a, b) for a, b in zip(eager, out))
    assert out[0]._base is not None and out[0]._base is out[1]._base
