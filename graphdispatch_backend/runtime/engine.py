"""ReplayEngine: the small protocol every CUDA-graph decision goes through.

`capture(fn, args)` records `fn(*args)` against exactly those tensors and returns a
CapturedGraph whose `replay()` re-runs it, writing into the same static `outputs`.

- CudaGraphEngine wraps torch.cuda.CUDAGraph: a side-stream warmup, then capture on that
  stream in a private memory pool per capture (a shared pool handle tripped the
  allocator's `use_count > 0` assert); any abort frees what the aborted capture allocated
  and resets the graph, releasing its pool.
- HostReplayEngine is its exact CPU model for tests and for `cuda_graphs="emulate"`:
  capture pins the storage of every argument (as a graph pins addresses), poisons the
  static outputs (a graph's capture computes nothing), and replay re-runs the computation
  against those same storages into the same outputs. A runner that forgets a check gets a
  stale or poisoned result on CPU, just as it would on a GPU.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

Fn = Callable[..., Sequence[Any]]


class CapturedGraph(Protocol):
    outputs: tuple[Any, ...]

    def replay(self) -> None: ...

    def reset(self) -> None: ...


class ReplayEngine(Protocol):
    name: str

    def capture(self, fn: Fn, args: Sequence[Any]) -> CapturedGraph: ...


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


_recording = threading.local()


def in_recording() -> bool:
    """True while an engine records a computation (CUDA capture, host capture) or re-runs a
    recorded one (host replay). The Python inside stands for kernels that a replay runs
    without calling Python, and a CUDA capture forbids host syncs: artifact gates neither
    count these runs as calls nor re-check parity in them (the runner counts replays)."""
    return getattr(_recording, "depth", 0) > 0


@contextlib.contextmanager
def recording() -> Iterator[None]:
    _recording.depth = getattr(_recording, "depth", 0) + 1
    try:
        yield
    finally:
        _recording.depth -= 1


class _HostGraph:
    def __init__(self, fn: Fn, args: tuple[Any, ...], outputs: tuple[Any, ...]) -> None:
        self._fn: Fn | None = fn
        self._args = args
        self.outputs = outputs

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("replay of a graph that was reset")
        with recording(), torch.no_grad():
            fresh = self._fn(*self._args)
        for static, value in zip(self.outputs, fresh):
            if isinstance(static, torch.Tensor):
                static.copy_(value)

    def reset(self) -> None:
        self._fn, self._args, self.outputs = None, (), ()


class HostReplayEngine:
    """The CPU model of a CUDA graph (see module docstring)."""

    name = "host"

    def capture(self, fn: Fn, args: Sequence[Any]) -> _HostGraph:
        # detach() aliases the storage live now; a later `param.data = new` or a new
        # tensor in the caller leaves this alias on the old storage, like an address.
        pinned = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        with recording(), torch.no_grad():
            outputs = tuple(fn(*pinned))
        held = {a.untyped_storage().data_ptr() for a in pinned if isinstance(a, torch.Tensor)}
        for out in outputs:
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in held:
                _poison(out)
        return _HostGraph(fn, pinned, outputs)


class _CudaGraph:
    def __init__(self, graph: Any, outputs: tuple[Any, ...], stream: Any) -> None:
        self._graph = graph
        self._stream = stream
        self.outputs = outputs

    def replay(self) -> None:
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)  # copy-in happened on the caller's stream
        with torch.cuda.stream(self._stream):
            self._graph.replay()
        current.wait_stream(self._stream)  # clones happen on the caller's stream

    def reset(self) -> None:
        if self._graph is not None:
            self._graph.reset()
        self._graph, self.outputs = None, ()


class CudaGraphEngine:
    """torch.cuda.CUDAGraph behind the ReplayEngine protocol. Kept thin: every decision
    lives in the runner and is tested on CPU through HostReplayEngine."""

    name = "cuda"

    def __init__(self, warmup_iters: int = 1) -> None:
        # One side-stream run lets lazy initialisation (cuBLAS handles, workspaces) happen
        # outside the capture; the runner's eager warmups already ran on the main stream.
        self.warmup_iters = warmup_iters
        # One side stream per device for every capture and replay, as torch.cuda.graph's
        # own default: PyTorch keeps a cuBLAS workspace per (handle, stream) for the life of
        # the process, so a new stream per capture would pin one workspace per capture.
        self._streams: dict[int, Any] = {}

    def _stream(self) -> Any:
        device = torch.cuda.current_device()
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream()
        return stream

    def capture(self, fn: Fn, args: Sequence[Any]) -> _CudaGraph:
        stream = self._stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(self.warmup_iters):
                fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # The outer stream context restores the caller's stream even when capture_end
        # raises inside torch.cuda.graph's __exit__ (which then skips its own restore).
        with torch.cuda.stream(stream):
            try:
                # thread_local: eager calls other threads make meanwhile (the runner lets
                # them run) neither fail nor invalidate this capture.
                with recording(), torch.no_grad(), torch.cuda.graph(
                        graph, pool=torch.cuda.graph_pool_handle(), stream=stream, capture_error_mode="thread_local"):
                    outputs = tuple(fn(*args))
            except BaseException as exc:
                # The frames of the aborted fn still hold tensors from the private pool;
                # free them, then the graph (and so its pool).
                traceback.clear_frames(exc.__traceback__)
                graph.reset()
                torch.cuda.synchronize()
                raise
        return _CudaGraph(graph, outputs, stream)
