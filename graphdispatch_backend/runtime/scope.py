"""RuntimeScope: what all runners of one compile session share.

- Static input buffers, keyed by flat position and layout: the 48 pieces of a block stack
  (one graph break per block) share one buffer set instead of holding 48.
- One replay lock: copy-in, replay and clone-out of a shared buffer set must not
  interleave between threads.
- The replay engine, timing, events and the `contain` boundary from backend.py.
- Per-call accounting (thread-local): which piece of a graph call ran eager, and why.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Contain
from graphdispatch_backend.runtime.contract import writable_layout
from graphdispatch_backend.runtime.engine import ReplayEngine

_calls = threading.local()


def begin_call() -> None:
    """Per-call accounting: a graph call starts with no eager piece recorded."""
    _calls.reason = None


def mark_eager(reason: str) -> None:
    """Record (once per graph call, first reason wins) why some piece ran eager."""
    if getattr(_calls, "reason", None) is None:
        _calls.reason = reason


def end_call() -> str | None:
    reason, _calls.reason = getattr(_calls, "reason", None), None
    return reason


def mark_entry(when: float) -> None:
    """timing: when the backend's callable was entered, before aot flattens the inputs."""
    _calls.entered = when


def take_entry() -> float | None:
    when, _calls.entered = getattr(_calls, "entered", None), None
    return when


class StaticBuffers:
    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, position: int, like: torch.Tensor) -> torch.Tensor:
        key = (position, tuple(like.shape), like.stride(), like.dtype, like.device)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None:
                if writable_layout(like):  # the live layout, gaps and all: kernels see what eager saw
                    buf = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
                else:  # an expanded view cannot be written into; verification judges the copy
                    buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
                self._buffers[key] = buf
            return buf

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.untyped_storage().nbytes() for b in self._buffers.values())

    def __len__(self) -> int:
        return len(self._buffers)


class RuntimeScope:
    def __init__(self, engine: ReplayEngine, timing: Timing, events: Events, contain: Contain) -> None:
        self.engine = engine
        self.timing = timing
        self.events = events
        self.contain = contain
        self.buffers = StaticBuffers()
        self.replay_lock = threading.RLock()
