"""CudaGraphEngine: torch.cuda.CUDAGraph behind the ReplayEngine protocol.

Mechanics follow torch/_inductor/cudagraph_trees.py (torch 2.13) and vLLM's CUDA-graph
wrapper (vllm/compilation/cuda_graph.py); every decision lives in the runner and is
tested on CPU through HostReplayEngine.

- One `torch.cuda.MemPool` per device per session, shared by every capture (vLLM's global
  graph pool; trees keep one pool per device alive with an empty "keeps memory pool alive"
  capture, a MemPool object holds the same use count). A private pool per capture would
  keep one peak working set per capture: for 40 per-block captures of a 14B video model,
  hundreds of GB.
- The pool lives as long as a graph uses it, no longer. Each captured graph holds the
  MemPool; the engine only finds it (a weak reference). This follows the lifetime trees
  give their pool (cudagraph_trees.py, `TreeManagerContainer`): the tree manager, whose
  empty capture keeps the pool alive, is kept while any of its compiled functions lives
  and dropped by a `weakref.finalize` when the last one dies. So a capture made while any
  graph of the device lives joins that graph's pool (one working set for all), and once
  the last graph is reset or gone the MemPool is dropped: its destructor releases the
  pool's use count and empties its cached segments. Dropping it while a graph still used
  it would be memory-safe (a captured CUDAGraph holds its own use count until reset) but
  the next capture would start a second pool beside it. No cyclic garbage collection
  runs on the capturing thread during a capture: it could drop another session's pool
  there, and a cudaFree is forbidden on a capturing thread.
- Static outputs are not owned: after capture only non-owning tensors over the output
  addresses are kept (trees' `_construct_storage_from_data_pointer`), so the pool hands
  that memory to later captures. The runner clones every output right after each replay
  and serializes replays per device.
- One capture at a time in the process (trees' module-level `graph_capture_lock`,
  cudagraph_trees.py): two runners capturing in two threads would share a capture stream
  (one's warmup kernels recorded into the other's graph), and a synchronize or an
  `empty_cache` while a capture is underway is invalid.
- Capture under the graph's device (`torch.cuda.device`, as trees record), on the device's
  capture stream, `capture_error_mode="thread_local"` (a stream-capture-unsafe API called
  by another thread's eager work does not invalidate it). Not the stream replays run on
  (the caller's): work launched on a capturing stream would be captured with it. One
  warmup run on that stream comes first, outside the pool (lazy cuBLAS and
  cuDNN initialization stays out of the capture; torch.cuda.make_graphed_callables does the
  same), not counted as an artifact call (recording()).
- `capture_begin`/`capture_end` are called directly, not through `torch.cuda.graph`, whose
  `__enter__` empties the caching allocator (and the host cache) before every capture:
  with 40 per-block captures that is 40 flushes, and eager allocations afterwards go back
  to cudaMalloc. vLLM patches those calls out during capture for the same reason; the
  device synchronize that precedes them is kept.
- cuBLAS workspaces are cleared before and after warmup and capture (trees'
  `clear_cublas_manager`): a persistent workspace allocated in the pool would otherwise be
  in use in two places once another graph reuses that memory.
- A failed capture resets its graph after the aborted frames' tensors are freed (the
  frames of every exception in its chain), then synchronizes; what it reports is the
  operation that failed, not the error CUDA's end of an invalidated capture raises after it
  (that one becomes a note: tests/runtime/test_cuda_engine_on_host.py runs this code on
  the host); the pool survives while
  another graph uses it. A warmup that raises still joins the capture stream back into the
  caller's, so nothing after it (the eager answer, the restore of the inputs the graph
  writes) races a warmup kernel.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from graphdispatch_backend.runtime.cudagraph.engine import Fn, Like, recording, view_bits, with_view_bits
from graphdispatch_backend.runtime.cudagraph.streams import CudaStreams

_CAPTURE_LOCK = threading.Lock()  # one capture underway in the process (trees' graph_capture_lock)


def _clear_frames(exc: BaseException) -> None:
    """Free what the frames of `exc` and of the exceptions it was raised during hold."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        traceback.clear_frames(cur.__traceback__)
        cur = cur.__context__


def _end_failed(graph: Any, exc: BaseException) -> None:
    """End a capture that `exc` interrupted. CUDA ends a capture that an operation
    invalidated (a host sync, a forbidden allocation) with an error of its own, which says
    only that the capture failed: raised from a `finally`, it would hide `exc`, the
    operation and the code that ran it, from the report. It becomes a note on `exc`."""
    try:
        graph.capture_end()
    except RuntimeError as end:
        exc.add_note(f"capture_end: {end}")


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No cyclic garbage collection on the capturing thread while it captures: a collection
    there may finish a graph whose runner went with its model, and the reset and the
    MemPool's cudaFree it then makes would be calls a capture forbids on its thread (one
    capture at a time runs, so re-enabling cannot race another capture's)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _clear_cublas() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _unowned(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory that does not own it (freeing it frees nothing)."""
    storage = torch._C._construct_storage_from_data_pointer(
        t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes())
    made = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())
    return with_view_bits(made, view_bits(t))


class _Pool:
    """A device's MemPool, held by every graph captured into it and found weakly by the
    engine (module docstring); a plain holder, so the weak reference never depends on
    what the binding's type supports."""

    __slots__ = ("__weakref__", "mem")

    def __init__(self, mem: Any) -> None:
        self.mem = mem


def _release(graph: Any, pool: _Pool) -> None:
    """The graph's use of its pool ends first (`reset`), then the graph's hold on the
    MemPool (dropped when this returns): the MemPool's destructor, run by the last such
    drop, finds the pool unused and empties its segments."""
    graph.reset()


class _CudaGraph:
    def __init__(self, graph: Any, outputs: tuple[Any, ...], pool: _Pool) -> None:
        self._graph = graph
        self.outputs = outputs
        # Released in that order by reset(), or when the graph is gone unreset (its runner
        # went with the compiled model), whatever order its attributes would be freed in;
        # not at exit (the process frees it all).
        self._release = weakref.finalize(self, _release, graph, pool)
        self._release.atexit = False

    def replay(self) -> None:
        # cudaGraphLaunch on the current stream: the caller's, ordered after the device's
        # last replay by the runner (runner/serve.py)
        self._graph.replay()

    def reset(self) -> None:
        # the outputs view pool memory: dropped before the pool may be
        self._graph, self.outputs = None, ()
        self._release()  # once: a finalizer called or fired does nothing again


class CudaGraphEngine:
    name = "cuda"

    def __init__(self, warmup_iters: int = 1) -> None:
        self.warmup_iters = warmup_iters
        # weak: the graphs captured into a pool hold it (module docstring)
        self._pools: weakref.WeakValueDictionary[int, _Pool] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._streams: dict[int, CudaStreams] = {}
        self._capture_streams: dict[int, Any] = {}

    def _index(self, device: Any) -> int:
        if isinstance(device, int):  # already an index (pool() and guard() get one)
            return device
        device = torch.device(device)
        return device.index if device.index is not None else torch.cuda.current_device()

    def streams(self, device: Any) -> CudaStreams:
        index = self._index(device)
        streams = self._streams.get(index)
        if streams is None:
            streams = self._streams[index] = CudaStreams(torch.device("cuda", index))
        return streams

    def pool(self, device: Any) -> _Pool:
        """The device's pool: the one its live graphs share, or a new one when none lives."""
        index = self._index(device)
        with self._lock:
            pool = self._pools.get(index)
            if pool is None:
                with torch.cuda.device(index):
                    pool = self._pools[index] = _Pool(torch.cuda.MemPool())
            return pool

    def guard(self, device: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(self._index(device))

    def pool_bytes(self) -> int:
        """Bytes the device pools hold (their segments), from the allocator's snapshot."""
        total = 0
        for pool in list(self._pools.values()):
            # the segments only: MemPool.snapshot() would gather every block's stack trace
            total += sum(seg.get("total_size", 0)
                         for seg in pool.mem.snapshot(include_traces=False))
        return total

    def capture(self, fn: Fn, args: Sequence[Any], device: Any, warmup: bool = True,
                rewind: Callable[[], None] | None = None, like: Like | None = None) -> _CudaGraph:
        """`warmup=False` for a piece that holds collectives: its warmup run would run them
        on this rank alone (the runner's eager warmup calls, on every rank, did that work).
        `like` (a relocation) changes nothing here: torch exposes no update of a captured
        graph's kernel arguments (cudaGraphExecKernelNodeSetParams), so the graph is
        recorded at the new addresses, as cudagraph trees record a new node."""
        index = self._index(device)
        with _CAPTURE_LOCK, torch.cuda.device(index):
            side = self._capture_streams.get(index)
            if side is None:
                side = self._capture_streams[index] = torch.cuda.Stream(index)
            pool = self.pool(index)
            caller = torch.cuda.current_stream()
            side.wait_stream(caller)
            _clear_cublas()
            try:
                with recording(), torch.no_grad(), torch.cuda.stream(side):
                    for _ in range(self.warmup_iters if warmup else 0):
                        fn(*args)
            finally:  # a warmup that raised still joins back: nothing after it races its kernels
                _clear_cublas()
                caller.wait_stream(side)
            if warmup and rewind is not None:  # on the caller's stream, after the warmup's kernels
                rewind()
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(index)  # as torch.cuda.graph's __enter__, without its cache flushes
            # The stream context restores the caller's stream even when capture_end raises.
            with torch.cuda.stream(side), _no_collection():
                try:
                    graph.capture_begin(pool=pool.mem.id, capture_error_mode="thread_local")
                    try:
                        with recording(), torch.no_grad():
                            owned = tuple(fn(*args))
                    except BaseException as exc:
                        _end_failed(graph, exc)
                        raise
                    graph.capture_end()
                except BaseException as exc:
                    # The aborted frames still hold tensors from the pool: free them, then
                    # the graph (releasing its hold on the pool), then let the GPU settle.
                    _clear_frames(exc)
                    graph.reset()
                    torch.cuda.synchronize(index)
                    raise
                finally:
                    _clear_cublas()
            held = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            # outputs that view an argument stay as they are (the argument owns the memory);
            # the rest become non-owning views of pool memory, a tensor returned twice once
            made: dict[int, Any] = {}
            outputs = tuple(made.setdefault(id(o), _unowned(o)) if isinstance(o, torch.Tensor)
                            and o.untyped_storage().data_ptr() not in held else o for o in owned)
            del owned
        return _CudaGraph(graph, outputs, pool)
