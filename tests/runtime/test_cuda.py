"""CudaGraphEngine and the runner on a real GPU (skipped without CUDA; bench/gpu_check.sh runs them).

Every decision is tested on CPU through HostReplayEngine; these tests pin what only a
device can show: a real capture replays right, also when the caller works on a
non-default stream; an aborted capture gives its memory back and leaves the caller's
stream as it was; eager work on another thread neither fails nor spoils a capture, and
two threads capturing at once take turns; the
shared pool keeps reserved memory flat across captures, and goes with its last graph (a
compiled model that is gone leaves no graph memory); outputs keep eager's aliasing;
a KV cache is written in place; per-request streams in threads, a non-current device,
misaligned inputs; and the whole runner replays bit for bit through torch.compile.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from graphdispatch_backend.runtime.cudagraph.cuda import CudaGraphEngine
from graphdispatch_backend.testing import linear_stack, only_graph

pytestmark = pytest.mark.cuda


def mlp(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.relu(x @ w) + x,)


def operands(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return (torch.randn(n, n, device="cuda", generator=gen), torch.randn(n, n, device="cuda", generator=gen))


# -- the engine ------------------------------------------------------------------------------


def test_capture_then_replay_matches_eager_on_new_values():
    x, w = operands()
    graph = CudaGraphEngine().capture(mlp, (x, w), x.device)
    try:
        for _ in range(3):
            x.copy_(torch.randn_like(x))  # what the runner's copy-in does
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(graph.outputs[0], mlp(x, w)[0])
    finally:
        graph.reset()


def test_replay_from_a_non_default_stream_is_ordered_with_it():
    x, w = operands(1024)  # big enough that an unordered copy or clone would race visibly
    graph = CudaGraphEngine().capture(mlp, (x, w), x.device)
    side = torch.cuda.Stream()
    inputs = [torch.randn_like(x) for _ in range(8)]
    got = []
    side.wait_stream(torch.cuda.current_stream())  # the inputs were made on the default stream
    try:
        with torch.cuda.stream(side):
            for new in inputs:
                x.copy_(new)  # on `side`: the replay must wait for it
                graph.replay()
                got.append(graph.outputs[0].clone())  # on `side`: must wait for the replay
        torch.cuda.synchronize()
        for new, out in zip(inputs, got):
            assert torch.equal(out, mlp(new, w)[0])
    finally:
        graph.reset()


def test_capture_leaves_the_callers_stream_current():
    x, w = operands()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph = CudaGraphEngine().capture(mlp, (x, w), x.device)
        assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    graph.reset()


def _raises_in_capture(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    hidden = torch.relu(x @ w)
    if torch.cuda.is_current_stream_capturing():  # the side-stream warmup before it passes
        big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB from the capture's pool
        big.fill_(1)
        raise RuntimeError(f"kernel author's bug after {hidden.numel() + big.numel()} elements")
    return (hidden,)


def _syncs_in_capture(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    hidden = torch.relu(x @ w)
    if torch.cuda.is_current_stream_capturing():
        hidden = hidden * float(hidden.sum().item() > 0)  # a host sync: not permitted while capturing
    return (hidden,)


def test_repeated_captures_do_not_grow_memory():
    x, w = operands()
    engine = CudaGraphEngine()
    engine.capture(mlp, (x, w), x.device).reset()  # the first capture initialises the side stream's cuBLAS workspace
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for _ in range(4):
        engine.capture(mlp, (x, w), x.device).reset()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline


@pytest.mark.parametrize("fn", [_raises_in_capture, _syncs_in_capture], ids=["raises", "syncs"])
def test_aborted_capture_releases_its_pool_and_the_stream(fn: Callable[..., Any]):
    x, w = operands()
    engine = CudaGraphEngine()
    engine.capture(mlp, (x, w), x.device).reset()  # workspaces and handles exist before the baseline
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    with pytest.raises(Exception):  # noqa: B017 - whatever CUDA or the fn raised
        engine.capture(fn, (x, w), x.device)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline  # the aborted capture's tensors and pool are gone
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    graph = engine.capture(mlp, (x, w), x.device)  # the device is fit for the next capture
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph.outputs[0], mlp(x, w)[0])
    graph.reset()


def test_eager_work_on_another_thread_during_a_capture():
    """The runner lets other threads run eager while one captures; with the default
    "global" capture mode their host syncs would fail or invalidate the capture."""
    x, w = operands()
    in_capture, done = threading.Event(), threading.Event()
    calls = [0]

    def slow(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        calls[0] += 1
        if calls[0] == 2:  # the capture, after the side-stream warmup
            in_capture.set()
            assert done.wait(30)
        return mlp(x, w)

    errors: list[BaseException] = []

    def other() -> None:
        try:
            assert in_capture.wait(30)
            a, b = operands(128)
            for _ in range(3):
                float((a @ b).sum().item())  # launches and a host sync, meanwhile
        except BaseException as exc:  # re-raised below
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=other)
    thread.start()
    graph = CudaGraphEngine().capture(slow, (x, w), x.device)
    thread.join(30)
    assert not errors, errors
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph.outputs[0], mlp(x, w)[0])
    graph.reset()


def test_two_threads_capturing_at_once_take_turns():
    """Two engines (two sessions) capture in two threads at the same moment: one capture at
    a time in the process (trees' graph_capture_lock), or one's warmup kernels would land in
    the other's capture stream and its synchronize would break the capture underway."""
    x1, w = operands()
    x2 = torch.randn_like(x1)
    start = threading.Barrier(2)
    graphs: dict[int, Any] = {}
    errors: list[BaseException] = []

    def capture(i: int, x: torch.Tensor) -> None:
        try:
            start.wait(30)
            graphs[i] = CudaGraphEngine().capture(lambda a, b: (mlp(a, b)[0] * (i + 1),), (x, w), x.device)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=capture, args=(i, x)) for i, x in ((0, x1), (1, x2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i, x in ((0, x1), (1, x2)):
        x.copy_(torch.randn_like(x))
        graphs[i].replay()
        torch.cuda.synchronize()
        assert torch.equal(graphs[i].outputs[0], mlp(x, w)[0] * (i + 1))
        graphs[i].reset()


# -- the runner through torch.compile ----------------------------------------------------------


def stack(depth: int = 4, dim: int = 64) -> nn.Module:
    return linear_stack(depth, dim).cuda()


def run_checked(compiled: Callable[..., Any], model: Callable[..., Any], inputs: list[tuple[Any, ...]]) -> list[Any]:
    outs = []
    with torch.no_grad():
        for i, args in enumerate(inputs):
            got, want = compiled(*args), model(*args)
            assert torch.equal(got, want), f"call {i}"
            outs.append(got)
    return outs


@pytest.mark.parametrize("cuda_graphs", [True, "auto"])
def test_runner_replays_bitwise_through_compile(cuda_graphs):
    model = stack()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": cuda_graphs})
    inputs = [(torch.randn(8, 64, device="cuda"),) for _ in range(9)]
    outs = run_checked(compiled, model, inputs)
    snapshots = [o.clone() for o in outs]
    run_checked(compiled, model, [(torch.randn(8, 64, device="cuda"),) for _ in range(2)])
    assert all(torch.equal(o, s) for o, s in zip(outs, snapshots))  # later replays never touch them
    cg = only_graph()["cuda_graph"]
    assert cg["mode"] == "cuda" and cg["state"] == "verified"
    assert cg["captures"] == 1 and cg["declines"] == {}
    assert cg["replays"] == 11 - 5  # 3 warmups, 2 verifying calls


def test_blocks_sharing_one_graph_each_capture_and_share_buffers():
    model = stack(depth=8)
    for block in model:  # regional compilation: one compiled graph for all eight blocks
        block.compile(backend="graphdispatch", options={"cuda_graphs": True})
    keep = []  # intermediates kept alive: every block input is at a new address, deterministically

    def forward(x: torch.Tensor) -> torch.Tensor:
        for block in model:
            x = block(x)
            keep.append(x)
        return x

    def reference(x: torch.Tensor) -> torch.Tensor:
        for block in model:
            x = block.forward(x)
        return x

    run_checked(forward, reference, [(torch.randn(8, 64, device="cuda"),) for _ in range(7)])
    graph = only_graph()
    cg = graph["cuda_graph"]
    assert cg["captures"] == 8 and cg["declines"] == {}
    assert cg["replays"] == 8 * 2  # 3 warmups and 2 verifying calls per block, then replays
    assert cg["static_bytes"] == 8 * 64 * 4  # one buffer set for all eight


def test_moved_parameter_on_cuda_is_never_replayed_stale():
    model = stack(depth=1)
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": True})
    run_checked(compiled, model, [(torch.randn(8, 64, device="cuda"),) for _ in range(6)])
    model[0].lin.weight.data = torch.randn(64, 64, device="cuda")  # a reshard: new storage
    run_checked(compiled, model, [(torch.randn(8, 64, device="cuda"),) for _ in range(6)])
    cg = only_graph()["cuda_graph"]
    assert cg["captures"] == 2 and cg["replays"] == 2


def test_piecewise_capture_on_cuda():
    def f(x: torch.Tensor, s: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        y = (x * 2).relu()
        n = s.sum().item()  # scalar_read
        return y * n * scale + 1  # scale is a 0-dim CPU tensor: foreign_device

    scale = torch.tensor(0.5)
    s = torch.arange(3, device="cuda")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(f, backend="graphdispatch", options={"cuda_graphs": True})
        run_checked(compiled, f, [(torch.randn(16, device="cuda"), s, scale) for _ in range(7)])
        scale.fill_(2.0)  # a CPU value read live, never baked into a capture
        run_checked(compiled, f, [(torch.randn(16, device="cuda"), s, scale)])
    graph = only_graph()
    assert graph["split_reasons"].get("scalar_read") == 1
    assert graph["split_reasons"].get("foreign_device", 0) >= 1
    assert any(p["capturable"] and p["cuda_graph"]["replays"] > 0 for p in graph["pieces"])


# -- memory: one pool per device -------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, dim: int = 1024) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _reserved_after(n: int) -> int:
    """Reserved memory after n blocks (one compiled graph, n parameter sets) captured."""
    import graphdispatch_backend

    torch._dynamo.reset()
    graphdispatch_backend.reset()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block() for _ in range(n)).cuda().eval()
    for block in blocks:
        block.compile(backend="graphdispatch", options={"cuda_graphs": True, "warmup": 1, "verify_inputs": 1})
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(256, 1024, device="cuda")
            for block in blocks:
                x = block(x)
    torch.cuda.synchronize()
    cg = only_graph()["cuda_graph"]
    assert cg["captures"] == n and cg["replays"] == n, cg
    weights = sum(p.numel() * 4 for p in blocks.parameters())
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved() - weights


def test_the_pool_keeps_reserved_memory_flat_across_captures():
    one = _reserved_after(1)
    eight = _reserved_after(8)
    working_set = 256 * 4096 * 4 * 2  # up's and relu's outputs: the peak of one capture
    assert eight - one < working_set, (one, eight)


def test_the_pool_goes_with_its_last_graph():
    x, w = operands()
    engine = CudaGraphEngine()
    first = engine.capture(mlp, (x, w), x.device)
    second = engine.capture(mlp, (x, w), x.device)
    (pool,) = engine._pools.values()  # one pool while a graph uses it
    pool_id = pool.mem.id
    del pool
    first.reset()
    assert [p.mem.id for p in engine._pools.values()] == [pool_id] and engine.pool_bytes() > 0
    del second  # gone unreset, as when its runner goes with the model
    gc.collect()
    torch.cuda.synchronize()
    assert not list(engine._pools.values()) and engine.pool_bytes() == 0
    third = engine.capture(mlp, (x, w), x.device)  # a new pool for the next capture
    assert [p.mem.id for p in engine._pools.values()] != [pool_id]
    third.reset()


def test_a_compiled_model_that_is_gone_leaves_no_graph_memory():
    import graphdispatch_backend

    held = []
    for _ in range(3):
        torch._dynamo.reset()
        graphdispatch_backend.reset()
        model = _Block().cuda().eval()
        compiled = torch.compile(model, backend="graphdispatch",
                                 options={"cuda_graphs": True, "warmup": 1, "verify_inputs": 1})
        with torch.no_grad():
            for _ in range(4):
                compiled(torch.randn(256, 1024, device="cuda"))
        assert only_graph()["cuda_graph"]["replays"] >= 2
        del model, compiled
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        held.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
    # the first round leaves what stays for the process (cuBLAS handles, workspaces); none after grows
    assert held[2][0] <= held[1][0] <= held[0][0] and held[2][1] <= held[1][1], held


@pytest.mark.parametrize("fn", [_raises_in_capture, _syncs_in_capture], ids=["raises", "syncs"])
def test_failed_captures_do_not_grow_reserved_memory(fn: Callable[..., Any]):
    x, w = operands()
    engine = CudaGraphEngine()
    engine.capture(mlp, (x, w), x.device).reset()
    with pytest.raises(Exception):  # noqa: B017 - the first failure may grow the shared pool once
        engine.capture(fn, (x, w), x.device)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved()
    for _ in range(4):
        with pytest.raises(Exception):  # noqa: B017
            engine.capture(fn, (x, w), x.device)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= baseline


# -- outputs and mutation ----------------------------------------------------------------------------


class _Chunked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.lin(x)
        return y, y.chunk(2)[1], (y * 2).expand(3, 8, 64), (y + 1).unfold(0, 2, 1)


def test_outputs_keep_eagers_aliasing_on_cuda():
    model = _Chunked().cuda().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": True})
    with torch.no_grad():
        for _ in range(8):
            x = torch.randn(8, 64, device="cuda")
            got, want = compiled(x), model(x)
            assert all(g.stride() == w.stride() and torch.equal(g, w) for g, w in zip(got, want))
            assert got[1].untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()
    cg = only_graph()["cuda_graph"]
    assert cg["replays"] == 3 and cg["declines"] == {}


class _Decode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.register_buffer("cache", torch.zeros(4096, 64))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, self.proj(x))
        return (self.cache[:64] * 2).sum(0, keepdim=True)


def test_a_static_kv_cache_is_written_in_place_on_cuda():
    torch.manual_seed(0)
    model, ref = _Decode().cuda().eval(), _Decode().cuda().eval()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": True})
    with torch.no_grad():
        for step in range(12):
            x, pos = torch.randn(1, 64, device="cuda"), torch.tensor([step], device="cuda")
            assert torch.equal(compiled(x, pos), ref(x, pos))
            assert torch.equal(model.cache, ref.cache)
    graph = only_graph()
    (piece,) = [p["cuda_graph"] for p in graph["pieces"] if "cuda_graph" in p]
    assert piece["replays"] > 0 and piece["copy_bytes"] / piece["replays"] == 520


# -- streams, threads, devices, alignment ------------------------------------------------------------


def test_per_request_streams_in_four_threads():
    model = stack(depth=2)
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": True})
    run_checked(compiled, model, [(torch.randn(64, 64, device="cuda"),) for _ in range(6)])  # verified
    errors: list[str] = []
    start = threading.Barrier(4)

    def worker(i: int) -> None:
        stream = torch.cuda.Stream()
        start.wait()
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(50):
                x = torch.randn(64, 64, device="cuda")
                got = compiled(x)
                want = model(x)
                stream.synchronize()
                if not torch.equal(got, want):
                    errors.append(f"thread {i}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and only_graph()["cuda_graph"]["replays"] > 100


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_model_on_a_non_current_device_replays():
    model = linear_stack(2, 64).to("cuda:1")
    assert torch.cuda.current_device() == 0
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": True})
    run_checked(compiled, model, [(torch.randn(8, 64, device="cuda:1"),) for _ in range(8)])
    cg = only_graph()["cuda_graph"]
    assert cg["replays"] == 3 and cg["declines"] == {}


def test_misaligned_inputs_replay_bitwise():
    model = stack(depth=2)
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": True})
    keep = []

    def misaligned() -> torch.Tensor:
        base = torch.randn(8 * 64 + 1, device="cuda")
        keep.append(base)
        return base[1:].view(8, 64)  # 4 bytes past a 16-byte boundary

    run_checked(compiled, model, [(misaligned(),) for _ in range(8)])
    cg = only_graph()["cuda_graph"]
    assert cg["replays"] > 0 and cg["declines"] == {}


def test_the_engines_warmup_is_not_an_artifact_call(tmp_path):
    """The side-stream warmup before a capture runs the artifact's Python: not a call."""
    from graphdispatch_backend import testing

    model = testing.Stack(depth=1).cuda().eval()
    testing.write_bundle(tmp_path / "mlp", "mlp-exact", "blocks.0.mlp", testing.mlp_inputs(), testing.MLP_OUTPUTS,
                         testing.MLP_SOURCE, devices=["cuda"])
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"cuda_graphs": True, "artifacts": str(tmp_path)})
    run_checked(compiled, model, [(torch.randn(4, 8, device="cuda"),) for _ in range(8)])
    graph = only_graph()
    (sub,) = graph["substitutions"]
    assert sub["parity"] == "passed"
    # eager calls it served (warmups, verifying) + calls served from a replay == the graph's calls
    assert sub["calls"] + sub["replays"] == graph["calls"], sub
