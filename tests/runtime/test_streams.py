"""Replays that stay right under streams, threads, devices, nondeterministic kernels and
changing sizes (docs/design.md section 6), on CPU: HostStreams runs queued work only at
synchronization points, in the order that exposes a missing wait; HostReplayEngine with
named devices requires the capture to run under the graph's device. Each rule has a test
that fails when the rule is removed."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.checks import eager_check as eager_check_mod
from graphdispatch_backend.runtime.checks.suspects import Suspects
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine
from graphdispatch_backend.runtime.runner import GraphRunner, RuntimeScope
from graphdispatch_backend.runtime.runner import inputs as inputs_mod
from graphdispatch_backend.runtime.runner import serve as serve_mod
from graphdispatch_backend.runtime.runner.book import EntryBook
from graphdispatch_backend.runtime.runner.scope import DeviceRuntime
from graphdispatch_backend.runtime.runner.verify import Verifier
from graphdispatch_backend.testing import serve_patches


def affine(x: torch.Tensor) -> tuple[torch.Tensor]:
    return (x * 3 + 1,)


def verified(fn: Callable[..., Sequence[Any]] = affine, engine: Any = None, device: str = "cpu",
             **kw: Any) -> tuple[GraphRunner, CudaGraphStats]:
    """A runner taken to its verified state (warmup 2, one verification set)."""
    scope = RuntimeScope(engine or HostReplayEngine(), Timing(), Events(), make_contain(False))
    stats = CudaGraphStats()
    runner = GraphRunner(fn, "piece", scope, stats, warmup=2, max_captures=8, verify_inputs=1, state_names={},
                         device=device, **kw)
    for _ in range(3):
        runner(torch.randn(16))
    assert stats.state == "verified", stats.to_dict()
    return runner, stats


# -- streams --------------------------------------------------------------------------------------


def _serve_without(skip: str) -> Callable[..., list[Any]]:
    """serve() with one of its orders removed."""
    def serve(entry: Any, args: Sequence[Any], streams: Any) -> list[Any]:
        dsts = entry.outputs.allocate()
        caller = streams.current()
        if skip != "after the last replay" and streams.replayed_on not in (None, caller):
            streams.wait(caller, streams.replayed_on)
        streams.replayed_on = caller
        with streams.on(streams.stream("side") if skip == "on the caller's stream" else caller):
            streams.launch(entry.inputs.copy_in, args)
            streams.launch(entry.graph.replay)
            streams.launch(serve_mod.copy_out, entry, dsts, args)
        return entry.outputs.assemble(dsts, args)

    return serve


def input_written_on_the_callers_stream(runner: GraphRunner) -> bool:
    """The caller writes the input on its own stream, then calls: the copy-in must wait."""
    streams = runner._streams
    request = streams.stream("request")
    x, new = torch.zeros(16), torch.randn(16)
    with streams.on(request):
        streams.launch(x.copy_, new)  # the caller's kernel that produces the input
    with streams.use(request):
        (out,) = runner(x)
    streams.synchronize(request)
    return torch.equal(out, affine(new)[0])


def output_read_on_the_host(runner: GraphRunner) -> bool:
    x = torch.randn(16)
    return torch.equal(runner(x)[0], affine(x)[0])


def two_request_streams(runner: GraphRunner) -> bool:
    """Two callers on their own streams replay one graph before either synchronizes."""
    streams = runner._streams
    a, b = streams.stream("a"), streams.stream("b")
    xa, xb = torch.randn(16), torch.randn(16)
    with streams.use(a):
        (out_a,) = runner(xa)
    with streams.use(b):
        (out_b,) = runner(xb)
    streams.synchronize(a)
    streams.synchronize(b)
    return torch.equal(out_a, affine(xa)[0]) and torch.equal(out_b, affine(xb)[0])


# each order of serve(), and a caller that gets a wrong value without it
ORDERS = {
    "on the caller's stream": input_written_on_the_callers_stream,  # the copy-in reads the old input
    "on the caller's stream, read on the host": output_read_on_the_host,  # the output is read unwritten
    "after the last replay": two_request_streams,  # two streams' copy-ins and replays interleave
}


@pytest.mark.parametrize("order", ORDERS)
def test_with_the_order_the_replay_is_right(order):
    runner, _ = verified()
    assert ORDERS[order](runner)


@pytest.mark.parametrize("order", ORDERS)
def test_without_the_order_the_replay_is_wrong(order, monkeypatch):
    runner, _ = verified()
    for module, name, fn in serve_patches(_serve_without(order.split(",")[0])):
        monkeypatch.setattr(module, name, fn)
    assert not ORDERS[order](runner)


def capture_while_another_stream_replays() -> bool:
    """Graph A replays on stream b (queued, nothing run yet); graph B, sharing A's static
    buffer (one signature, one session), is captured from the host: the capture's first
    copy-in must wait for A's replay, which still reads that buffer."""
    scope = RuntimeScope(HostReplayEngine(), Timing(), Events(), make_contain(False))
    first = GraphRunner(affine, "first", scope, CudaGraphStats(), warmup=1, max_captures=8, verify_inputs=1,
                        state_names={})
    second = GraphRunner(lambda x: (x - 5,), "second", scope, CudaGraphStats(), warmup=1, max_captures=8,
                         verify_inputs=1, state_names={})
    keep = [torch.randn(16) for _ in range(3)]
    for x in keep:
        first(x)
    second(keep[0])  # warmup: the next call captures
    streams = first._streams
    b = streams.stream("b")
    xb, xa = torch.randn(16), torch.randn(16)
    with streams.use(b):
        (out_b,) = first(xb)
    (out_a,) = second(xa)  # captures and verifies
    streams.synchronize(b)
    return torch.equal(out_b, affine(xb)[0]) and torch.equal(out_a, xa - 5)


def test_a_capture_fills_the_shared_buffers_after_the_last_replay():
    assert capture_while_another_stream_replays()


def test_without_that_order_the_other_streams_replay_is_wrong(monkeypatch):
    from graphdispatch_backend.runtime.runner import record as record_mod

    def fill_on_the_callers_stream_only(inputs: Any, args: Any, device: Any) -> None:
        streams = device.streams
        streams.launch(inputs.fill, args)  # the caller's stream, no wait for the last replay

    monkeypatch.setattr(record_mod, "_fill", fill_on_the_callers_stream_only)
    assert not capture_while_another_stream_replays()


def test_four_threads_on_four_streams_replay_one_graph():
    runner, stats = verified()
    streams = runner._streams
    errors: list[str] = []
    start = threading.Barrier(4)

    def worker(i: int) -> None:
        mine = streams.stream(f"t{i}")
        start.wait()
        for _ in range(25):
            x = torch.randn(16)
            with streams.use(mine):
                (out,) = runner(x)
            streams.synchronize(mine)
            if not torch.equal(out, affine(x)[0]):
                errors.append(f"thread {i}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and stats.replays >= 100 - 4


# -- threads: a replay waits behind a capture of its device ----------------------------------------


def replay_while_another_graph_captures() -> tuple[bool, bool]:
    """Runner R is verified; runner C (same session and device, sharing R's static buffer)
    is capturing on another thread, slowly. Does R's replay return before the capture
    ends, and is it right? A capture holds the device lock (runner/record.py): it fills
    and may compute on the shared buffers, so R waits for it, then replays right."""
    engine = HostReplayEngine()
    scope = RuntimeScope(engine, Timing(), Events(), make_contain(False))
    r = GraphRunner(affine, "r", scope, CudaGraphStats(), warmup=2, max_captures=8, verify_inputs=1, state_names={})
    for _ in range(3):
        r(torch.randn(16))
    capturing, release = threading.Event(), threading.Event()
    real = HostReplayEngine.capture

    def slow(self: HostReplayEngine, fn: Any, args: Any, device: Any = "cpu", **engine_kwargs: Any) -> Any:
        capturing.set()
        release.wait(10)
        return real(self, fn, args, device, **engine_kwargs)

    c = GraphRunner(lambda x: (x - 1,), "c", scope, CudaGraphStats(), warmup=1, max_captures=8, verify_inputs=1,
                    state_names={})
    c(torch.randn(16))
    xc = torch.randn(16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HostReplayEngine, "capture", slow)
        out_c: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out_c.update(c=c(xc)[0]))
        t.start()
        assert capturing.wait(10)
        done, result = threading.Event(), {}

        def replay() -> None:
            x = torch.randn(16)
            result["ok"] = torch.equal(r(x)[0], affine(x)[0])
            done.set()

        threading.Thread(target=replay, daemon=True).start()
        early = done.wait(0.5)
        release.set()
        t.join(10)
        done.wait(10)
    return early, result.get("ok", False) and torch.equal(out_c["c"], xc - 1)


def test_a_replay_waits_behind_another_graphs_capture_and_both_are_right():
    early, ok = replay_while_another_graph_captures()
    assert not early and ok


# -- devices ----------------------------------------------------------------------------------------


def test_a_graph_on_a_device_other_than_the_current_one_captures_under_its_device():
    engine = HostReplayEngine(devices=("cuda:0", "cuda:1"))  # cuda:0 is current
    runner, stats = verified(engine=engine, device="cuda:1")
    x = torch.randn(16)
    assert torch.equal(runner(x)[0], affine(x)[0]) and stats.replays == 1


def test_without_the_device_guard_the_capture_fails(monkeypatch):
    monkeypatch.setattr(DeviceRuntime, "guard", lambda self: contextlib.nullcontext())
    engine = HostReplayEngine(devices=("cuda:0", "cuda:1"))
    scope = RuntimeScope(engine, Timing(), Events(), make_contain(False))
    stats = CudaGraphStats()
    runner = GraphRunner(affine, "piece", scope, stats, warmup=2, max_captures=8, verify_inputs=1, state_names={},
                         device="cuda:1")
    for _ in range(5):
        runner(torch.randn(16))
    assert stats.replays == 0 and set(stats.declines) == {"capture_failed"}
    assert "current device is cuda:0" in stats.decline_details["capture_failed"]


# -- nondeterministic eager ---------------------------------------------------------------------------


def _noise() -> float:
    return float(int.from_bytes(os.urandom(2), "little") + 1)


def noisy_index_add(x: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor]:
    """index_add_ under a forced-nondeterministic eager: other bits on every run."""
    return (x.clone().index_add_(0, index, src) + _noise(),)


def test_a_verification_mismatch_from_eager_itself_is_eager_nondeterministic():
    scope = RuntimeScope(HostReplayEngine(), Timing(), Events(), make_contain(False))
    stats = CudaGraphStats()
    runner = GraphRunner(noisy_index_add, "piece", scope, stats, warmup=2, max_captures=8, verify_inputs=2,
                         state_names={}, suspects=Suspects(listed=["aten::index_add"]))
    index = torch.tensor([0, 2])
    for _ in range(5):
        runner(torch.randn(4, 3), index, torch.randn(2, 3))
    assert set(stats.declines) == {"eager_nondeterministic"}, stats.decline_details
    assert "aten::index_add" in stats.decline_details["eager_nondeterministic"]


def test_without_the_second_eager_run_it_would_be_blamed_on_the_capture(monkeypatch):
    real = Verifier.judge

    def judge(self: Verifier, *args: Any) -> Any:
        verdict = real(self, *args)
        return (Decline.VERIFY_MISMATCH, "") if verdict is not None else None

    monkeypatch.setattr(Verifier, "judge", judge)
    scope = RuntimeScope(HostReplayEngine(), Timing(), Events(), make_contain(False))
    stats = CudaGraphStats()
    runner = GraphRunner(noisy_index_add, "piece", scope, stats, warmup=2, max_captures=8, verify_inputs=2,
                         state_names={})
    for _ in range(5):
        runner(torch.randn(4, 3), torch.tensor([0, 2]), torch.randn(2, 3))
    assert set(stats.declines) == {"verify_mismatch"}


@torch.library.custom_op("gd_test::noisy_index_add", mutates_args=())
def _noisy_op(x: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return x.clone().index_add_(0, index, src) + _noise()


@_noisy_op.register_fake
def _(x: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def noisy_model_through_compile() -> dict[str, Any]:
    def f(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return torch.ops.gd_test.noisy_index_add(x * 2, torch.tensor([0, 2]), src).relu()

    compiled = torch.compile(f, backend="graphdispatch", options={"cuda_graphs": "emulate", "warmup": 2})
    for _ in range(4):
        compiled(torch.randn(4, 3), torch.randn(2, 3))
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    return graph


def test_a_nondeterministic_model_reports_eager_nondeterministic_not_lowering_mismatch():
    graph = noisy_model_through_compile()
    assert graph["lowering_check"]["status"] == "eager_nondeterministic"
    assert "gd_test::noisy_index_add" in graph["lowering_check"]["detail"]


def test_without_the_second_eager_run_the_lowering_would_be_blamed(monkeypatch):
    monkeypatch.setattr(eager_check_mod.EagerCheck, "_blame",
                        lambda self, args, side, expected, detail: (Decline.LOWERING_MISMATCH, detail))
    assert noisy_model_through_compile()["lowering_check"]["status"] == "lowering_mismatch"


# -- alignment ------------------------------------------------------------------------------------


def alignment_sensitive(x: torch.Tensor) -> tuple[torch.Tensor]:
    """A kernel that picks its path by alignment (cuBLASLt, cuDNN and memory-efficient
    attention do), with a different rounding on each path."""
    return (x * 3 + 1 if x.data_ptr() % 16 == 0 else (x + 1 / 3) * 3,)


def misaligned_caller(**kw: Any) -> CudaGraphStats:
    scope = RuntimeScope(HostReplayEngine(), Timing(), Events(), make_contain(False))
    stats = CudaGraphStats()
    runner = GraphRunner(alignment_sensitive, "piece", scope, stats, warmup=2, max_captures=8, verify_inputs=2,
                         state_names={})
    keep = []
    for _ in range(6):
        base = torch.randn(17)
        x = base[1:]  # 4 bytes past a 16-byte boundary
        keep.append(base)
        assert torch.equal(runner(x)[0], alignment_sensitive(x)[0])
    return stats


def test_static_buffers_keep_the_callers_alignment():
    stats = misaligned_caller()
    assert stats.replays == 3 and stats.declines == {}


def test_without_the_alignment_the_replay_takes_another_path(monkeypatch):
    monkeypatch.setattr(inputs_mod, "aligned_empty", lambda shape, stride, like, align: torch.empty_strided(
        shape, stride, dtype=like.dtype, device=like.device))
    stats = misaligned_caller()
    assert stats.replays == 0 and set(stats.declines) == {"verify_mismatch"}


# -- sizes: least recently used eviction ------------------------------------------------------------


def cycle_sizes() -> tuple[dict[str, Any], list[int]]:
    """12 sizes cycled 5 times, a burst of 6 calls per size, dynamic=True, max_captures=4."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    compiled = torch.compile(model, backend="graphdispatch", dynamic=True,
                             options={"cuda_graphs": "emulate", "warmup": 2, "verify_inputs": 2, "max_captures": 4})
    live, last_cycle = [], []
    with torch.no_grad():
        for cycle in range(5):
            for size in range(2, 14):
                for _ in range(6):
                    x = torch.randn(size, 8)
                    before = _replays()
                    assert torch.equal(compiled(x), model(x))
                    if cycle == 4:
                        last_cycle.append(_replays() - before)
                    live.append(_piece()["live_captures"])
    return _piece(), [max(live), sum(last_cycle)]


def _piece() -> dict[str, Any]:
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    (piece,) = [p["cuda_graph"] for p in graph["pieces"] if "cuda_graph" in p]
    return piece


def _replays() -> int:
    report = graphdispatch_backend.latest_report()
    return sum(g["cuda_graph"]["replays"] for g in report["graphs"]) if report else 0


def test_sizes_cycled_past_max_captures_keep_replaying_their_hot_sizes():
    piece, (most_live, last_cycle_replays) = cycle_sizes()
    assert most_live <= 4
    # every size's burst of 6 replays 3 times after its 2 warmups and the capture call, which
    # verifies its inputs and a set derived from them
    assert last_cycle_replays == 12 * 3
    assert piece["evictions"] >= 12 * 4 and piece["declines"] == {}


def test_without_eviction_captures_pile_up(monkeypatch):
    monkeypatch.setattr(EntryBook, "make_room", lambda self, key: None)
    _, (most_live, _) = cycle_sizes()
    assert most_live > 4
