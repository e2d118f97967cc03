"""The hot path: a replay of the entry the last replay served, for one address check.

    caller (runtime/program/program.py)  ->  replay_hot(args)
        pinned inputs where the entry read them?    (one check: in C on CUDA builds)
          no  -> None, nothing done: the caller takes the full path
          yes -> under the device lock: still verified, not re-captured, no artifact
                 demoted? -> serve (copy-in, replay, clone) and count; else None

This is what a correct replay must do and no more (cudagraph trees' fast path,
torch/_inductor/cudagraph_trees.py `check_invariants` then `run`, does the same: one C++
pointer check, the input copies, the replay). A runner keeps a hot entry only where one
shape key serves every call (Dynamo guards the shapes, no scalar input), so no key is
computed here; metadata Dynamo's guards ensure is not checked again.

`Replayer` owns the hot entry and serves every replay of its runner, hot or not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.call.calls import Answered, answer_eagerly
from graphdispatch_backend.runtime.checks.isolate import Isolation
from graphdispatch_backend.runtime.runner.entry import Entry, State
from graphdispatch_backend.runtime.runner.lookup import Lookup
from graphdispatch_backend.runtime.runner.serve import serve, serve_timed
from graphdispatch_backend.runtime.runner.transitions import Transitions

_data_ptr = torch.Tensor.data_ptr
# CUDA builds: the pinned addresses compared in one C++ loop, as cudagraph trees' hot path
# does (torch/_inductor/cudagraph_trees.py, check_invariants); absent from CPU wheels
PTRS_EQUAL: Callable[[list[Any], list[Any], list[int]], bool] | None = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", None)
_VERIFIED = State.VERIFIED

# (entry, its pinned addresses, its picker, on CUDA builds the addresses by position and
# the positions, the bytes one replay copies)
Hot = tuple[Entry, list[int], Callable[[Sequence[Any]], Any], "list[int | None] | None", "list[int] | None", int]


def hot_of(entry: Entry) -> Hot:
    """What the hot path reads of an entry, in one reference (a thread never sees half of
    it), in the form `_tensors_data_ptrs_at_indices_equal` takes where torch has it."""
    if PTRS_EQUAL is None:
        return entry, entry.ptrs, entry.pick_pinned, None, None, entry.copy_bytes
    positions = [p for p, _ in zip(entry.pinned, entry.ptrs)]
    at: list[int | None] = [None] * (max(positions, default=-1) + 1)
    for pos, ptr in zip(positions, entry.ptrs):
        at[pos] = ptr
    return entry, entry.ptrs, entry.pick_pinned, at, positions, entry.copy_bytes


def in_place(hot: Hot, args: Sequence[Any]) -> bool:
    """The pinned inputs are where the hot entry read them: the one check per call."""
    _, ptrs, pick, at, positions, _ = hot
    if at is None:
        return ptrs == list(map(_data_ptr, pick(args)))
    return PTRS_EQUAL(args if type(args) is list else list(args), at, positions)  # type: ignore[misc,arg-type]


class Replayer:
    """Serves a runner's verified entries: `replay` for an entry the caller found and
    checked, `replay_hot` for the one the last replay served (keyless runners keep it in
    `hot`). It owns the hot entry; it counts replays in the stats under the device lock."""

    def __init__(self, fn: Callable[..., Sequence[Any]], device: Any, stats: Any, gates: Sequence[Any],
                 lookup: Lookup, transitions: Transitions, timing: Timing | None) -> None:
        self._fn = fn
        self._device = device  # its lock read at each replay (a test may swap it)
        self._acquire, self._release = device.lock.acquire, device.lock.release  # cheaper than `with`
        self._streams = device.streams
        self._stats = stats
        self._gates = tuple(gates)
        self._transitions = transitions
        self._timing = timing
        self._lookup = lookup  # an entry is kept hot only where one shape key serves every call (`keyless`)
        self.hot: Hot | None = None
        self.last_replayed: Entry | None = None  # what a checked call blames (runtime/checks/isolate.py)

    def replay(self, entry: Entry, args: Sequence[Any]) -> Sequence[Any] | Decline | None:
        """The replay of a verified entry whose inputs the caller checked: its outputs; the
        Decline to answer the call eagerly with, when the replay raised; or None, having
        done nothing, when the entry changed state meanwhile (the caller looks again)."""
        failed: BaseException | None = None
        with self._device.lock:
            if entry.state is _VERIFIED and not (self._gates and entry.gates_changed(self._gates)):
                try:  # free unless it raises; what a replay raises (CUDA errors included) is a RuntimeError
                    if self._timing is None:
                        out = serve(entry, args, self._streams)
                    else:
                        out = serve_timed(entry, args, self._streams, self._timing)
                except (RuntimeError, MemoryError) as exc:
                    failed = exc
                else:
                    stats = self._stats
                    stats.replays += 1  # under the device lock: no other replay counts meanwhile
                    self.last_replayed = entry
                    stats.copy_bytes += entry.copy_bytes
                    if self._gates:
                        entry.gates_replayed(self._gates)
                    if self._lookup.keyless:
                        hot = self.hot
                        if hot is None or hot[0] is not entry or hot[1] is not entry.ptrs:
                            self.hot = hot_of(entry)
                    return out
        self.hot = None
        if failed is not None:
            return self._transitions.replay_failed(entry, failed)
        return None

    def replay_hot(self, args: list[Any]) -> Sequence[Any] | None:
        """The replay of the entry the last replay served, when the pinned inputs are where
        it read them: the call's outputs, counted in the stats' `hot_replays` (the graph's
        record adds them to its calls and replays); or None, having done nothing (the caller
        takes the slow path, the runner's `__call__`). A replay that raises is answered
        eagerly here, and said by raising Answered (counted eager in the stats, not in
        `hot_replays`)."""
        hot = self.hot
        if hot is None or Isolation.active:  # an isolation runs somewhere: the slow path decides
            return None
        entry, ptrs, pick, at, positions, nbytes = hot
        if at is None:  # CPU builds: the check inline, a call less (none at all without pinned inputs)
            if ptrs and ptrs != list(map(_data_ptr, pick(args))):
                return None
        elif not PTRS_EQUAL(args, at, positions):  # type: ignore[misc]
            return None
        failed: BaseException | None = None
        self._acquire()
        try:
            # `ptrs is`: the entry was not captured anew since the addresses were read
            gates = self._gates
            if entry.state is _VERIFIED and entry.ptrs is ptrs and not (gates and entry.gates_changed(gates)):
                try:
                    out = serve(entry, args, self._streams)
                except (RuntimeError, MemoryError) as exc:
                    failed = exc
                else:
                    stats = self._stats
                    stats.replays += 1
                    stats.copy_bytes += nbytes
                    stats.hot_replays += 1
                    self.last_replayed = entry
                    if self._gates:
                        entry.gates_replayed(self._gates)
                    return out
        finally:
            self._release()
        self.hot = None
        if failed is None:
            return None  # raced with a state change: the slow path decides
        reason = self._transitions.replay_failed(entry, failed)
        raise Answered(answer_eagerly(self._fn, self._stats, args, reason), reason.value)
