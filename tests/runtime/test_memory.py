"""Memory and data rules of the runtime (docs/design.md section 6), each shown on CPU with
the host model of a CUDA graph, and each shown to matter: with the rule removed, a test
fails (more pool memory, a wrong value, or no replay).

- one pool per device per session, shared by every capture;
- static outputs not owned beyond the copy after each replay (two graphs share the pool);
- replays sharing a pool serialized per device;
- inputs the graph writes into written in place (a KV cache), moving ones copied back;
- grad modes: a graph captured under inference_mode and one under no_grad both replay;
- out-of-memory is its own decline, retried, never a verdict on the lowering;
- ops with dynamic output shapes are split out of captured pieces.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import graphdispatch_backend
from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.capture import lower as lower_mod
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.runtime.cudagraph import engine as engine_mod
from graphdispatch_backend.runtime.cudagraph.host import HostPool, HostReplayEngine
from graphdispatch_backend.runtime.runner import GraphRunner, RuntimeScope
from graphdispatch_backend.runtime.runner import record as record_mod
from graphdispatch_backend.runtime.runner import serve as serve_mod
from graphdispatch_backend.runtime.runner.inputs import InputPlan
from graphdispatch_backend.testing import serve_patches

EMULATE = {"cuda_graphs": "emulate", "warmup": 2, "verify_inputs": 2}


def graphs() -> list[dict[str, Any]]:
    report = graphdispatch_backend.latest_report()
    assert report is not None
    for graph in report["graphs"]:
        cg = graph["cuda_graph"]
        assert graph["calls"] == cg["replays"] + cg["eager_calls"]
    return report["graphs"]


# -- one pool per device ----------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def pool_bytes(n: int) -> int:
    """n blocks compiled one by one (one compiled graph, n parameter sets): n captures.
    Returns the session's host pool bytes."""
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(n)).eval()
    for block in blocks:
        block.compile(backend="graphdispatch", options={"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1})
    with torch.no_grad():
        for _ in range(3):
            x = ref = torch.randn(8, 32)
            for block in blocks:
                x, ref = block(x), Block.forward(block, ref)  # compiled, and the module's own forward
            assert torch.equal(x, ref)
    (graph,) = graphs()
    assert graph["cuda_graph"]["captures"] == n and graph["cuda_graph"]["replays"] == n
    return sum(p["pool_bytes"] for p in graphdispatch_backend.latest_report()["totals"]["pools"].values())


def test_forty_captures_of_one_block_share_one_pool():
    one = pool_bytes(1)
    # the working set of one capture: its output (8 x 32) and the peak of live
    # intermediates (up's and relu's 8 x 128), float32
    assert 2 * 8 * 128 * 4 <= one <= 8 * 32 * 4 + 2 * 8 * 128 * 4
    assert pool_bytes(40) == one


def test_a_pool_per_capture_would_hold_forty_working_sets(monkeypatch):
    one = pool_bytes(1)
    monkeypatch.setattr(HostReplayEngine, "pool",
                        lambda self, device: self._pools.setdefault(f"{device}#{len(self._pools)}", HostPool()))
    assert pool_bytes(40) >= 40 * one


# -- outputs are copied out of the shared pool ----------------------------------------------------


def _runner(fn: Callable[..., Sequence[Any]], scope: RuntimeScope, **kw: Any) -> GraphRunner:
    options = {"warmup": 2, "max_captures": 8, "verify_inputs": 1, "state_names": {}, **kw}
    return GraphRunner(fn, "piece", scope, CudaGraphStats(), **options)


def two_graphs_one_pool() -> int:
    """Two graphs of one session replay in turn; every output is held until the end."""
    scope = RuntimeScope(HostReplayEngine(), Timing(), Events(), make_contain(False))
    f = lambda x: (x * 2 + 1,)
    g = lambda x: (x - 3,)
    a, b = _runner(f, scope), _runner(g, scope)
    keep, got, want = [], [], []
    with torch.no_grad():
        for _ in range(6):
            x, y = torch.randn(16), torch.randn(16)
            keep += [x, y]
            got += [a(x)[0], b(y)[0]]
            want += [f(x)[0], g(y)[0]]
    return sum(not torch.equal(o, w) for o, w in zip(got, want))


def _static_outputs(entry: Any, args: Sequence[Any], streams: Any) -> list[Any]:
    entry.inputs.copy_in(args)
    entry.graph.replay()
    return list(entry.graph.outputs)


def test_outputs_are_copied_out_before_another_graph_reuses_the_pool(monkeypatch):
    assert two_graphs_one_pool() == 0
    for module, name, fn in serve_patches(_static_outputs):
        monkeypatch.setattr(module, name, fn)
    assert two_graphs_one_pool() > 0  # the other graph's replay overwrote the held outputs


def interleaved_launches(lock: bool) -> list[bool]:
    """Thread A is paused between its copy-in and its replay while thread B serves a whole
    call of another graph sharing the pool and the buffers; A's output must be A's."""
    scope = RuntimeScope(HostReplayEngine(), Timing(), Events(), make_contain(False))
    f = lambda x: (x * 2,)
    a, b = _runner(f, scope), _runner(lambda x: (x + 100,), scope)
    keep = [torch.randn(8) for _ in range(8)]
    for i in range(3):
        a(keep[i]), b(keep[i + 3])
    if not lock:
        scope.device("cpu").lock = _NoLock()
        a._device.lock = b._device.lock = scope.device("cpu").lock
    paused, go = threading.Event(), threading.Event()
    real = InputPlan.copy_in

    def copy_in(self: InputPlan, args: Sequence[Any]) -> None:
        real(self, args)
        if threading.current_thread().name == "A":
            paused.set()
            go.wait(5)

    x, y = torch.randn(8), torch.randn(8)
    result: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InputPlan, "copy_in", copy_in)
        mp.setattr(serve_mod, "serve", _immediate_serve)
        for module, name, fn in serve_patches(_immediate_serve):
            mp.setattr(module, name, fn)
        ta = threading.Thread(target=lambda: result.update(a=a(x)[0]), name="A")
        ta.start()
        paused.wait(5)
        tb = threading.Thread(target=lambda: result.update(b=b(y)[0]), name="B")
        tb.start()
        tb.join(0.5)
        go.set()
        ta.join(5)
        tb.join(5)
    return [torch.equal(result["a"], f(x)[0]), torch.equal(result["b"], y + 100)]


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _immediate_serve(entry: Any, args: Sequence[Any], streams: Any) -> list[Any]:
    """serve, launching at once (the host thread is the device), so that the launches of
    two threads interleave as the device lock allows."""
    dsts = entry.outputs.allocate()
    entry.inputs.copy_in(args)
    entry.graph.replay()
    serve_mod.copy_out(entry, dsts, args)
    return entry.outputs.assemble(dsts, args)


def test_replays_sharing_a_pool_are_serialized_per_device():
    assert interleaved_launches(lock=True) == [True, True]
    assert interleaved_launches(lock=False) != [True, True]


# -- mutation in place ------------------------------------------------------------------------------


class Decode(nn.Module):
    """One decode step with a static KV cache: the new row is written in place."""

    def __init__(self, rows: int = 4096, dim: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("cache", torch.zeros(rows, dim))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, self.proj(x))
        return (self.cache[:64] * 2).sum(0, keepdim=True)


def decode_loop() -> dict[str, Any]:
    torch.manual_seed(0)
    model, ref = Decode().eval(), Decode().eval()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="graphdispatch", options=EMULATE)
    with torch.no_grad():
        for step in range(16):
            x, pos = torch.randn(1, 64), torch.tensor([step])
            assert torch.equal(compiled(x, pos), ref(x, pos)), step
            assert torch.equal(model.cache, ref.cache), step
    (graph,) = graphs()
    return graph


def test_a_static_kv_cache_is_written_in_place_by_the_replay():
    graph = decode_loop()
    cg = graph["cuda_graph"]
    # 16 steps: 2 warmups, the capture call verifies its own inputs and a set derived from
    # them, then 13 replays
    assert cg["replays"] == 13 and cg["declines"] == {}
    (piece,) = [p["cuda_graph"] for p in graph["pieces"] if "cuda_graph" in p]
    per_replay = piece["copy_bytes"] / piece["replays"]
    # the new row in, the position, the output out: 256 + 8 + 256 bytes; the cache is 1 MiB
    assert per_replay == 520, per_replay


def test_without_in_graph_mutation_the_whole_cache_is_copied(monkeypatch):
    real = lower_mod.aot_module_simplified
    monkeypatch.setattr(lower_mod, "aot_module_simplified",
                        lambda *a, **kw: real(*a, **{**kw, "keep_inference_input_mutations": False}))
    graph = decode_loop()
    (piece,) = [p["cuda_graph"] for p in graph["pieces"] if "cuda_graph" in p]
    assert piece["copy_bytes"] / piece["replays"] > 4096 * 64 * 4  # the cache comes out on every replay


def accumulate_into_new_buffers() -> tuple[int, dict[str, Any]]:
    """The graph adds into a buffer the caller allocates anew each call (a moving input it writes)."""
    def f(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        acc.add_(x)
        return acc * 2

    compiled = torch.compile(f, backend="graphdispatch", options=EMULATE)
    wrong = 0
    for _ in range(8):
        x = torch.randn(8)
        acc, ref_acc = torch.ones(8) * torch.rand(()), None
        ref_acc = acc.clone()
        out, want = compiled(acc, x), f(ref_acc, x)
        wrong += int(not (torch.equal(out, want) and torch.equal(acc, ref_acc)))
    (graph,) = graphs()
    return wrong, graph["cuda_graph"]


def test_a_moving_input_the_graph_writes_is_copied_back(monkeypatch):
    wrong, cg = accumulate_into_new_buffers()
    assert wrong == 0 and cg["replays"] > 0 and cg["declines"] == {}
    monkeypatch.setattr(InputPlan, "copy_back", lambda self, args: None)
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    # the caller's buffer keeps its old value after a replay: verification compares the
    # inputs the graph writes, sees it, and refuses to serve
    wrong, cg = accumulate_into_new_buffers()
    assert wrong == 0 and cg["replays"] == 0 and set(cg["declines"]) == {"verify_mismatch"}


# -- grad modes -----------------------------------------------------------------------------------


def grad_modes() -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval()
    compiled = torch.compile(model, backend="graphdispatch", options=EMULATE)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            for _ in range(8):
                x = torch.randn(4, 8)
                assert torch.equal(compiled(x), model(x))
    return graphs()


def test_inference_mode_then_no_grad_both_replay():
    for graph in grad_modes():
        cg = graph["cuda_graph"]
        # 8 calls per mode: 2 warmups, the capture call verifies live and derived, 5 replays
        assert cg["replays"] == 5 and cg["declines"] == {}, cg
        assert graph["lowering_check"]["status"] == "bitwise"


def test_without_grad_mode_in_the_buffer_key_the_second_mode_loses_its_replays(monkeypatch):
    from graphdispatch_backend.runtime.runner import inputs as inputs_mod

    real = inputs_mod.StaticBuffers.key
    monkeypatch.setattr(inputs_mod.StaticBuffers, "key",
                        staticmethod(lambda p, like, wide: real(p, like, wide)[:6] + real(p, like, wide)[7:]))
    first, second = grad_modes()
    assert first["cuda_graph"]["replays"] == 5
    assert second["cuda_graph"]["replays"] == 0  # an inference tensor met a normal one


# -- out of memory --------------------------------------------------------------------------------


def test_out_of_memory_while_capturing_backs_off_and_retries(monkeypatch):
    real, failures = HostReplayEngine.capture, [2]

    def capture(self: HostReplayEngine, fn: Any, args: Any, device: Any = "cpu", **engine_kwargs: Any) -> Any:
        if failures[0] > 0:
            failures[0] -= 1
            raise torch.OutOfMemoryError("injected: out of memory while capturing")
        return real(self, fn, args, device, **engine_kwargs)

    monkeypatch.setattr(HostReplayEngine, "capture", capture)
    torch.manual_seed(0)
    model = nn.Linear(8, 8).eval()
    compiled = torch.compile(model, backend="graphdispatch", options=EMULATE)
    with torch.no_grad():
        for _ in range(24):
            x = torch.randn(4, 8)
            assert torch.equal(compiled(x), model(x))
    (graph,) = graphs()
    cg = graph["cuda_graph"]
    assert cg["declines"] == {"out_of_memory": 2} and cg["replays"] > 0, cg
    assert graph["lowering_check"]["status"] == "bitwise"
    assert "out of memory" in cg["decline_details"]["out_of_memory"]


def test_out_of_memory_classified_as_a_failure_would_lose_the_graph(monkeypatch):
    monkeypatch.setattr(record_mod, "is_out_of_memory", lambda exc: False)
    monkeypatch.setattr(engine_mod, "is_out_of_memory", lambda exc: False)
    real, failures = HostReplayEngine.capture, [1]

    def capture(self: HostReplayEngine, fn: Any, args: Any, device: Any = "cpu", **engine_kwargs: Any) -> Any:
        if failures[0] > 0:
            failures[0] -= 1
            raise torch.OutOfMemoryError("injected")
        return real(self, fn, args, device, **engine_kwargs)

    monkeypatch.setattr(HostReplayEngine, "capture", capture)
    model = nn.Linear(8, 8).eval()
    compiled = torch.compile(model, backend="graphdispatch", options=EMULATE)
    with torch.no_grad():
        for _ in range(24):
            compiled(torch.randn(4, 8))
    (graph,) = graphs()
    assert graph["cuda_graph"]["declines"] == {"capture_failed": 1} and graph["cuda_graph"]["replays"] == 0
    assert graph["cuda_graph"]["state"] == "eager" and graph["cuda_graph"]["reason"] == "capture_failed"


def test_out_of_memory_allocating_outputs_answers_that_call_eagerly(monkeypatch):
    from graphdispatch_backend.runtime.runner import outputs as outputs_mod

    model = nn.Linear(8, 8).eval()
    compiled = torch.compile(model, backend="graphdispatch", options=EMULATE)
    with torch.no_grad():
        for _ in range(6):
            compiled(torch.randn(4, 8))
        real = outputs_mod.OutputPlan.allocate
        monkeypatch.setattr(outputs_mod.OutputPlan, "allocate",
                            lambda self: (_ for _ in ()).throw(torch.OutOfMemoryError("injected")))
        x = torch.randn(4, 8)
        assert torch.equal(compiled(x), model(x))
        monkeypatch.setattr(outputs_mod.OutputPlan, "allocate", real)
        for _ in range(3):
            x = torch.randn(4, 8)
            assert torch.equal(compiled(x), model(x))
    (graph,) = graphs()
    cg = graph["cuda_graph"]
    # 10 calls: 2 warmups, the capture call (verified live and derived), 3 replays, the
    # out-of-memory call eager, 3 replays
    assert cg["eager_by_reason"]["out_of_memory"] == 1 and cg["declines"] == {} and cg["replays"] == 6
    assert graph["lowering_check"]["status"] == "bitwise"


def test_out_of_memory_in_the_compiled_graph_is_no_lowering_verdict(monkeypatch):
    from graphdispatch_backend.runtime.program import program as program_mod

    model = nn.Linear(8, 8).eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": False})
    with torch.no_grad():
        compiled(torch.randn(4, 8))
        real = program_mod.CompiledGraph.__call__
        monkeypatch.setattr(program_mod.CompiledGraph, "__call__",
                            lambda self, args: (_ for _ in ()).throw(torch.OutOfMemoryError("injected")))
        for _ in range(2):  # the 2nd call is a re-check, the 3rd is not
            x = torch.randn(4, 8)
            assert torch.equal(compiled(x), model(x))
        monkeypatch.setattr(program_mod.CompiledGraph, "__call__", real)
        x = torch.randn(4, 8)
        assert torch.equal(compiled(x), model(x))
    (graph,) = graphs()
    assert graph["lowering_check"]["status"] == "bitwise"
    assert graph["cuda_graph"]["eager_by_reason"]["out_of_memory"] == 2


# -- dynamic output shapes --------------------------------------------------------------------------


def test_ops_with_dynamic_output_shapes_are_split_out():
    def f(x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x) * 2
        return y.nonzero().float().sum() + y.sum()

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(f, backend="graphdispatch", options=EMULATE)
        for _ in range(8):
            x = torch.randn(6, 4)
            assert torch.equal(compiled(x), f(x))
    (graph,) = graphs()
    assert graph["split_reasons"].get("dynamic_output_shape") == 1, graph["split_reasons"]
