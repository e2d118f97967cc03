"""Threads calling one compiled model (emulate mode): right outputs, every call counted.

State changes happen under the runner's lock; copy-in, replay and clone-out of the shared
static buffers under the session's replay lock. A call that finds the runner busy (another
thread warming, capturing or verifying) runs eager and is counted as `busy`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine
from graphdispatch_backend.testing import linear_stack, only_graph

CALLS_PER_THREAD = 12


def hammer(threads: int, call: Callable[[int, int], None]) -> None:
    """Run call(thread, i) CALLS_PER_THREAD times in each of `threads` threads, started
    together; re-raise the first failure."""
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            barrier.wait(10)
            for i in range(CALLS_PER_THREAD):
                call(t, i)
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not any(w.is_alive() for w in workers)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("threads", [2, 4])
def test_threads_get_their_own_right_outputs_and_counts_add_up(threads):
    model = linear_stack()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate", "warmup": 2})
    with torch.no_grad():  # compile once, before the threads start
        compiled(torch.randn(2, 8))

    def call(t: int, i: int) -> None:
        x = torch.full((2, 8), float(t)) + torch.randn(2, 8)  # each thread's own values
        with torch.no_grad():  # grad mode is per thread
            got, want = compiled(x), model(x)
        assert torch.equal(got, want), (t, i)

    hammer(threads, call)
    graph = only_graph()
    assert graph["calls"] == 1 + threads * CALLS_PER_THREAD
    cg = graph["cuda_graph"]
    assert cg["captures"] >= 1 and cg["replays"] > 0
    assert set(cg["eager_by_reason"]) <= {"warmup", "verifying", "busy", "pinned_input_moved"}


def test_threads_with_different_shapes_each_replay_their_own_capture():
    model = linear_stack(depth=1)
    compiled = torch.compile(model, backend="graphdispatch", dynamic=True,
                             options={"cuda_graphs": "emulate", "warmup": 2})
    with torch.no_grad():
        compiled(torch.randn(6, 8))  # not 1: Dynamo specializes sizes 0 and 1
    batches = [2, 3, 4, 5]

    def call(t: int, i: int) -> None:
        x = torch.randn(batches[t], 8)
        with torch.no_grad():
            got, want = compiled(x), model(x)
        assert torch.equal(got, want), (t, i)

    hammer(len(batches), call)
    graph = only_graph()
    stats = graph["pieces"][0]["cuda_graph"]
    assert stats["shape_keys"] == 1 + len(batches)
    assert graph["cuda_graph"]["replays"] > 0


def test_a_call_that_finds_the_runner_capturing_runs_eager_as_busy(monkeypatch):
    capturing, release = threading.Event(), threading.Event()
    real_capture = HostReplayEngine.capture

    def slow_capture(self, fn, args, device="cpu", **engine_kwargs):
        capturing.set()
        assert release.wait(10)
        return real_capture(self, fn, args, device, **engine_kwargs)

    monkeypatch.setattr(HostReplayEngine, "capture", slow_capture)
    model = linear_stack()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate", "warmup": 2})
    with torch.no_grad():
        for _ in range(2):  # the warmups
            x = torch.randn(2, 8)
            assert torch.equal(compiled(x), model(x))
    captured: dict[str, Any] = {}

    def capture_call() -> None:
        x = torch.randn(2, 8)
        with torch.no_grad():
            captured["out"], captured["want"] = compiled(x), model(x)

    capturer = threading.Thread(target=capture_call)
    capturer.start()
    try:
        assert capturing.wait(10)  # the capture is under way, holding the runner
        x = torch.randn(2, 8)
        with torch.no_grad():
            assert torch.equal(compiled(x), model(x))  # answered eagerly meanwhile
        assert only_graph()["cuda_graph"]["eager_by_reason"]["busy"] == 1
    finally:
        release.set()
        capturer.join(10)
    assert torch.equal(captured["out"], captured["want"])
    with torch.no_grad():
        for _ in range(3):  # replays: the capture call verified its inputs and a set derived from them
            x = torch.randn(2, 8)
            assert torch.equal(compiled(x), model(x))
    cg = only_graph()["cuda_graph"]
    assert cg["eager_by_reason"] == {"warmup": 2, "busy": 1, "verifying": 1}
    assert cg["replays"] == 3 and cg["declines"] == {}
