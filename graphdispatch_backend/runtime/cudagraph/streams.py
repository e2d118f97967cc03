"""Streams: the verbs that order copy-in, replay and clone, and their CPU model.

The runner orders a replay with four verbs, written once for every engine:
`current()` (the caller's stream), `on(stream)` (work launched inside goes to that
stream), `launch(fn, *args)` (a kernel launch) and `wait(waiter, stream)` (later work on
`waiter` runs after everything launched on `stream` so far). Two attributes serve the
replay (runner/serve.py): `immediate` (a launch is made at once on the current stream,
so the runner may call the work directly)
and `replayed_on` (the stream the device's last replay went to, kept by the runner under
the device lock: a replay from another stream waits for it first).

- CudaStreams maps them onto torch.cuda streams: `launch` just calls `fn`, whose kernels go
  to the current stream, and `wait` is `waiter.wait_stream(stream)`.
- ImmediateStreams: one synchronous queue (engines whose replay runs at once).
- HostStreams is the CPU model, made to fail when an order is missing. Work launched on a
  stream is queued and runs only at a synchronization point: a launch on, or a wait by, a
  *synchronous* stream (each thread's host stream, which stands for the CPU reading the
  result), or `synchronize(stream)`. At a synchronization point the ready streams take
  turns, one op each, the stream that ran least recently first; in a round, the other
  streams before the synced one, latest-launched first: a GPU runs streams concurrently,
  so any interleaving the waits allow can happen, and this one is the worst for a missing
  wait (a copy-in that runs before the caller's write, two replays from two streams whose
  copy-ins and replays interleave, a replay that overwrites static outputs before an
  earlier clone read them, a caller that reads outputs before the clone ran).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class Streams(Protocol):
    immediate: bool  # launch(fn, *args) calls fn at once, its work going to the current stream
    replayed_on: Any  # the stream the device's last replay was launched on (None: none yet)

    def current(self) -> Any: ...

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...

    def launch(self, fn: Callable[..., Any], *args: Any) -> None: ...

    def wait(self, waiter: Any, stream: Any) -> None: ...


class ImmediateStreams:
    """One queue that runs everything at once: the verbs cost (nearly) nothing."""

    immediate = True
    replayed_on: Any = None
    _null = contextlib.nullcontext()

    def current(self) -> None:
        return None

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._null

    def launch(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    def wait(self, waiter: Any, stream: Any) -> None:
        pass


class CudaStreams:
    """torch.cuda streams of one device. Replays and copies run on the caller's stream
    (`current()`); captures run on the engine's own capture stream (cudagraph/cuda.py)."""

    immediate = True  # a launch enqueues its kernels on the current stream as the host calls it

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self._index = torch.device(device).index
        self._current: tuple[Any, Any] | None = None  # (raw stream triple, its Stream object)
        self.replayed_on: Any = None

    def current(self) -> Any:
        # torch.cuda.current_stream builds a new Stream object on every call (microseconds on
        # the replay path); the raw (id, device, type) triple is cheap, and the same stream
        # gives back the same object, so a replay sees an unchanged caller by identity
        index = self._index if self._index is not None else self._torch.cuda.current_device()
        data = self._torch._C._cuda_getCurrentStream(index)
        cached = self._current
        if cached is not None and cached[0] == data:
            return cached[1]
        stream = self._torch.cuda.Stream(stream_id=data[0], device_index=data[1], device_type=data[2])
        self._current = (data, stream)
        return stream

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._torch.cuda.stream(stream)

    def launch(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    def wait(self, waiter: Any, stream: Any) -> None:
        if waiter is not stream:
            waiter.wait_stream(stream)


class HostStream:
    """One stream of the CPU model: a FIFO of launched work and waits."""

    def __init__(self, name: str, synchronous: bool) -> None:
        self.name = name
        self.synchronous = synchronous
        self.queue: deque[tuple[int, Callable[..., Any] | None, Any]] = deque()
        self.launched = 0  # sequence number of the last op launched here
        self.done = 0  # sequence number of the last op run here
        self.turn = 0  # the scheduler's step at which this stream last ran an op

    def __repr__(self) -> str:
        return f"HostStream({self.name})"


class HostStreams:
    """The CPU model of a device's streams (see module docstring)."""

    immediate = False  # work is queued, and runs only at a synchronization point

    def __init__(self, device: str = "host") -> None:
        self.replayed_on: HostStream | None = None
        self._device = device
        self._lock = threading.RLock()
        self._seq = itertools.count(1)
        self._turns = itertools.count(1)
        self._streams: list[HostStream] = []
        self._local = threading.local()
        self.launches = 0

    # -- the verbs ------------------------------------------------------------------
    def current(self) -> HostStream:
        stream = getattr(self._local, "current", None)
        if stream is None:
            stream = self._local.current = self._new(f"{self._device}:host:{threading.get_ident()}", True)
        return stream

    @contextlib.contextmanager
    def on(self, stream: HostStream) -> Iterator[HostStream]:
        stack = self._targets()
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()

    def launch(self, fn: Callable[..., Any], *args: Any) -> None:
        stack = self._targets()
        stream = stack[-1] if stack else self.current()
        with self._lock:
            seq = next(self._seq)
            stream.queue.append((seq, fn, args))
            stream.launched = seq
            self.launches += 1
            if stream.synchronous:
                self._sync(stream)

    def wait(self, waiter: HostStream, stream: HostStream) -> None:
        with self._lock:
            if waiter is stream or stream.launched <= stream.done:
                return
            seq = next(self._seq)
            waiter.queue.append((seq, None, (stream, stream.launched)))
            waiter.launched = seq
            if waiter.synchronous:
                self._sync(waiter)

    # -- for tests: streams a caller uses, and synchronization --------------------------
    def stream(self, name: str) -> HostStream:
        """A new asynchronous stream (a server's per-request stream)."""
        return self._new(f"{self._device}:{name}", False)

    @contextlib.contextmanager
    def use(self, stream: HostStream) -> Iterator[HostStream]:
        """Make `stream` the calling thread's current stream (torch.cuda.stream's model)."""
        previous = getattr(self._local, "current", None)
        self._local.current = stream
        try:
            yield stream
        finally:
            self._local.current = previous

    def synchronize(self, stream: HostStream | None = None) -> None:
        """Run `stream`'s queued work (every stream's, by default)."""
        with self._lock:
            for s in [stream] if stream is not None else list(self._streams):
                self._sync(s)

    def pending(self) -> int:
        with self._lock:
            return sum(len(s.queue) for s in self._streams)

    # -- the scheduler --------------------------------------------------------------
    def _targets(self) -> list[HostStream]:
        stack = getattr(self._local, "targets", None)
        if stack is None:
            stack = self._local.targets = []
        return stack

    def _new(self, name: str, synchronous: bool) -> HostStream:
        stream = HostStream(name, synchronous)
        with self._lock:
            self._streams.append(stream)
        return stream

    def _ready(self, stream: HostStream) -> bool:
        if not stream.queue:
            return False
        _, fn, payload = stream.queue[0]
        return fn is not None or payload[0].done >= payload[1]

    def _step(self, stream: HostStream) -> None:
        seq, fn, payload = stream.queue.popleft()
        stream.done = seq
        stream.turn = next(self._turns)
        if fn is not None:
            fn(*payload)

    def _sync(self, target: HostStream) -> None:
        """Run until `target`'s queue is empty, the ready streams taking turns (see module
        docstring): least recently run first, then others before `target`, then the
        latest-launched."""
        while target.queue:
            ready = [s for s in self._streams if self._ready(s)]
            if not ready:
                raise RuntimeError(f"host stream model: {target.name} waits for work that can never run")
            self._step(min(ready, key=lambda s: (s.turn, s is target, -s.queue[0][0])))
