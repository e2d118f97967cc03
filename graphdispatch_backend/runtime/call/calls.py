"""Per-call accounting, thread-local: which piece of a graph call ran eager, and why.

A compiled graph call starts with `begin_call()`; any runner that answers eagerly calls
`mark_eager(reason)` (first reason wins); `end_call()` returns it, or None when every
piece replayed. `mark_entry` / `take_entry` carry the time the backend's callable was
entered to the timing of aot's flattening.

The hot path of a graph served whole by one runner (runtime/program/program.py) takes none of
these: its replays are counted by the runner, under the device lock the replay holds, in
its stats (`CudaGraphStats.hot_replays`, owned by the graph's record); a hot replay that
fails is answered eagerly by the runner, which raises `Answered` with the eager outputs
and the reason.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from graphdispatch_backend.errors import Decline


class _Calls(threading.local):
    # class defaults (runtime/cudagraph/engine.py `_Recording`: no swallowed AttributeError per read)
    reason: str | None = None
    entered: float | None = None


_calls = _Calls()


class Answered(Exception):
    """A runner answered the call eagerly on its hot path: these are the outputs, and why."""

    def __init__(self, outputs: Sequence[Any], reason: str) -> None:
        super().__init__(reason)
        self.outputs = outputs
        self.reason = reason


def begin_call() -> None:
    _calls.reason = None


def mark_eager(reason: str) -> None:
    if _calls.reason is None:
        _calls.reason = reason


def answer_eagerly(fn: Callable[..., Sequence[Any]], stats: Any, args: Sequence[Any],
                   reason: Decline) -> Sequence[Any]:
    """The call answered by the piece run eagerly: counted in the piece's `stats` with
    `reason`, and marked for the graph's call."""
    mark_eager(reason.value)
    stats.eager(reason.value)
    return fn(*args)


def end_call() -> str | None:
    reason, _calls.reason = _calls.reason, None
    return reason


def mark_entry(when: float) -> None:
    _calls.entered = when


def take_entry() -> float | None:
    when, _calls.entered = _calls.entered, None
    return when
