"""Phase timing (`timing` option) and bounded notes.

Modes: "off" (the hot path pays one boolean check), "host" (host clock around each
phase), "sync" (also synchronize the device around each phase, so device time lands in
the phase that caused it), "shadow" (sync, and the native forward also runs on every call
and is timed: it doubles the cost and can change a stateful forward, so never use it for
a parity run). Notes are always on: at most 128 distinct, overflow counted. A note is kept
whole up to NOTE_CHARS; a longer one keeps its head (what happened, to what: the runner, the
reason, the input by name) and its tail (an exception's last words), the cut counted between.

Phases recorded today: `validate` (the placeholder contract) and `execute` (the graph,
eager or through its pieces) per graph call; `copy_in`, `replay` and `unflatten` (clone
out) per served replay; `artifact_gate` per parity gate; `shadow.native_forward` per call
in shadow mode. A Timing belongs to one session: a new Options value or
`graphdispatch_backend.reset()` starts from zero.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

MAX_NOTES = 128
NOTE_HEAD, NOTE_TAIL = 700, 300
NOTE_CHARS = NOTE_HEAD + NOTE_TAIL  # a note up to this long is kept whole


def bounded(message: str) -> str:
    """`message` whole when it fits NOTE_CHARS; else its head and tail around the count of
    characters cut (128 notes of at most about 1 KB: timing.json stays small)."""
    if len(message) <= NOTE_CHARS:
        return message
    return f"{message[:NOTE_HEAD]} [... {len(message) - NOTE_CHARS} characters cut ...] {message[-NOTE_TAIL:]}"


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timing:
    def __init__(self, mode: str = "off") -> None:
        self.mode = mode
        self.enabled = mode != "off"
        self.synchronized = mode in ("sync", "shadow")
        self.shadow = mode == "shadow"
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._phases: dict[str, list[float]] = {}
            self._notes: dict[str, int] = {}
            self._dropped = 0

    def now(self) -> float:
        if self.synchronized:
            _sync()
        return time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            slot = self._phases.setdefault(phase, [0.0, 0])
            slot[0] += seconds
            slot[1] += 1

    def timed(self, phase: str, fn: Callable[[], Any]) -> Any:
        start = self.now()
        try:
            return fn()
        finally:
            self.add(phase, self.now() - start)

    def note(self, message: str) -> None:
        key = bounded(message)
        with self._lock:
            if key in self._notes or len(self._notes) < MAX_NOTES:
                self._notes[key] = self._notes.get(key, 0) + 1
            else:
                self._dropped += 1

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            phases = {
                name: {"total_seconds": total, "calls": calls, "mean_ms": 1e3 * total / calls if calls else 0.0}
                for name, (total, calls) in sorted(self._phases.items())
            }
            return {
                "timing_schema_version": 1,
                "mode": self.mode,
                "synchronized": self.synchronized,
                "phases": phases,
                "notes": dict(self._notes),
                "notes_dropped": self._dropped,
            }
