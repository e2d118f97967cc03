"""ReplayEngine: the small protocol every CUDA-graph decision goes through.

An engine owns, per device, one memory pool shared by every capture of the session, the
streams (cudagraph/streams.py) and a device guard. `capture(fn, args, device)` records
`fn(*args)` against exactly those tensors, into the device's pool, and returns a
CapturedGraph whose `replay()` (launched on the current stream) re-runs it, writing into
the same static `outputs`. One warmup run comes first; `rewind` puts back what it wrote
into the arguments, so the capture starts from the caller's state (a cache position the
warmup advanced would otherwise index past a sliding window while the host model
records). `like` names the same graph captured at other addresses (a relocation): the host
model rebinds its tape to the new ones; CUDA records anew (torch has no update of a
captured graph's kernel arguments). Static outputs are not owned beyond the clone that follows each replay: later
captures reuse their memory, so replays that share a pool must be serialized per device
and every output cloned before the next replay (the runner does both).

Engines: CudaGraphEngine (cudagraph/cuda.py) wraps torch.cuda.CUDAGraph; HostReplayEngine
(cudagraph/host.py) is its CPU model for tests and `cuda_graphs="emulate"`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from graphdispatch_backend.runtime.cudagraph.streams import Streams

Fn = Callable[..., Sequence[Any]]
# (a graph of the engine, the arguments it was captured with): the graph a capture makes
# again at other addresses (a relocation); an engine may rebind it instead of recording
Like = tuple[Any, Sequence[Any]]


class CapturedGraph(Protocol):
    outputs: tuple[Any, ...]  # static outputs (tensors view pool memory), or constants

    def replay(self) -> None: ...

    def reset(self) -> None: ...


class ReplayEngine(Protocol):
    name: str

    def streams(self, device: torch.device) -> Streams: ...

    def guard(self, device: torch.device) -> contextlib.AbstractContextManager[Any]: ...

    def capture(self, fn: Fn, args: Sequence[Any], device: torch.device, warmup: bool = True,
                rewind: Callable[[], None] | None = None, like: Like | None = None) -> CapturedGraph: ...

    def pool_bytes(self) -> int: ...


class _Recording(threading.local):
    # a class default, not getattr(..., 0): a thread that never set it reads it without the
    # AttributeError getattr raises and swallows inside (0.5 us against 0.06, on hot paths)
    depth = 0


# read as `RECORDING.depth` where every call passes (runtime/program/fused_views.py): in_recording() is a frame more
RECORDING = _Recording()


def in_recording() -> bool:
    """True while an engine records a computation (CUDA capture, host capture, the warmup
    run before either), replays one, or the runtime runs a graph for its own checks (a
    derived verification set, a second eager run). The Python that runs inside stands for
    kernels that a replay runs without calling Python, and a capture forbids host syncs:
    artifact gates neither count these runs as calls nor re-check parity in them."""
    return RECORDING.depth > 0


@contextlib.contextmanager
def recording() -> Iterator[None]:
    RECORDING.depth += 1
    try:
        yield
    finally:
        RECORDING.depth -= 1


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failed (CUDA's caching allocator, or a host allocation): a transient
    condition, never a verdict on the graph."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError))


def storage_group(t: torch.Tensor, index: int) -> Any:
    """The key that groups outputs sharing memory: their storage's address. Storages of
    no bytes all sit at one address (or none) and view nothing: each is its own (`index`,
    the output's position; batch norm's saved statistics in eval mode are empty)."""
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else ("empty", index)


NEG, CONJ = 1, 2  # a tensor's lazy view bits: `x.conj().imag` is a negative view, `ihfft` a conjugate one


def view_bits(t: torch.Tensor) -> int:
    return (NEG if t.is_neg() else 0) | (CONJ if t.is_conj() else 0)


def with_view_bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    """`t` with its lazy negative and conjugate bits flipped where `bits` says (each view
    flips one): a tensor built over another's memory with `set_` (which drops them) reads
    it as the other does with `with_view_bits(t, view_bits(other))`, and
    `with_view_bits(t, view_bits(t))` is t's memory as stored."""
    if bits & NEG:
        t = t._neg_view()
    if bits & CONJ:
        t = t.conj()
    return t
