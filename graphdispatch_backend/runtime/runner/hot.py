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

`Replayer` owns the hot entry and serves every replay of its runner, hot or not: each
takes a `Verified` phase (runner/phase.py) and serves its capture while the entry is still
in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.call.calls import Answered, answer_eagerly
from graphdispatch_backend.runtime.checks.isolate import Isolation
from graphdispatch_backend.runtime.checks.modes import natively
from graphdispatch_backend.runtime.runner.entry import Entry
from graphdispatch_backend.runtime.runner.lookup import Lookup
from graphdispatch_backend.runtime.runner.phase import Capture, Verified
from graphdispatch_backend.runtime.runner.serve import serve, serve_timed
from graphdispatch_backend.runtime.runner.transitions import Transitions

_data_ptr = torch.Tensor.data_ptr
# CUDA builds: the pinned addresses compared in one C++ loop, as cudagraph trees' hot path
# does (torch/_inductor/cudagraph_trees.py, check_invariants); absent from CPU wheels
PTRS_EQUAL: Callable[[list[Any], list[Any], list[int]], bool] | None = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", None)

# (entry, its capture's pinned addresses, its picker, on CUDA builds the addresses by
# position and the positions, the bytes one replay copies). Not the capture itself: what
# an entry releases must not stay alive here; its `ptrs` list, one per capture, says
# whether the entry still serves the capture these were read from.
Hot = tuple[Entry, list[int], Callable[[Sequence[Any]], Any], "list[int | None] | None", "list[int] | None", int]


def hot_of(entry: Entry, capture: Capture) -> Hot:
    """What the hot path reads of an entry's capture, in one reference (a thread never sees
    half of it), in the form `_tensors_data_ptrs_at_indices_equal` takes where torch has it."""
    if PTRS_EQUAL is None:
        return entry, capture.ptrs, capture.pick_pinned, None, None, capture.copy_bytes
    positions = [p for p, _ in zip(capture.pinned, capture.ptrs)]
    at: list[int | None] = [None] * (max(positions, default=-1) + 1)
    for pos, ptr in zip(positions, capture.ptrs):
        at[pos] = ptr
    return entry, capture.ptrs, capture.pick_pinned, at, positions, capture.copy_bytes




class Replayer:
    """Serves a runner's verified entries: `replay` for an entry the caller found and
    checked, `replay_in_place` and `replay_hot` for the one the last replay served (keyless
    runners keep it hot). It owns the hot entry; it counts replays in the stats under the
    device lock."""

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
        self._hot: Hot | None = None
        self.last_replayed: Entry | None = None  # what a checked call blames (runtime/checks/isolate.py)
        # a piece holding an allclose artifact that serves: the graph's checks take the slow
        # path (runner.py, which clears it once every such artifact is demoted)
        self.tolerant = any(g.tolerant for g in self._gates)

    def forget(self) -> None:
        """No hot entry: the next call takes the full path (a verdict came from outside the call)."""
        self._hot = None

    def hot_in_place(self, args: Sequence[Any]) -> tuple[Entry, Verified] | None:
        """The hot entry and its phase, where it is still verified and the call's pinned
        inputs are where it read them (the one check per call); else None."""
        hot = self._hot
        if hot is None:
            return None
        entry, ptrs, pick, at, positions, _ = hot
        if at is None:
            if ptrs != list(map(_data_ptr, pick(args))):
                return None
        elif not PTRS_EQUAL(args if type(args) is list else list(args), at, positions):  # type: ignore[misc,arg-type]
            return None
        phase = entry.phase
        return (entry, phase) if type(phase) is Verified and phase.capture.ptrs is ptrs else None

    def replay_in_place(self, args: Sequence[Any]) -> Sequence[Any] | Decline | None:
        """The hot entry's replay where the call's pinned inputs are where it read them (a
        runner's `__call__` asks first); None, having done nothing, otherwise."""
        found = self.hot_in_place(args)
        return None if found is None else self.replay(found[0], found[1], args)

    def replay(self, entry: Entry, verified: Verified, args: Sequence[Any]) -> Sequence[Any] | Decline | None:
        """The replay of `verified`, the entry's phase when the caller checked the call's
        inputs against it: its outputs; the Decline to answer the call eagerly with, when
        the replay raised; or None, having done nothing, when the entry left that phase
        meanwhile (the caller looks again)."""
        failed: BaseException | None = None
        capture = verified.capture
        with self._device.lock:
            if entry.phase is verified and not (self._gates and capture.gates_changed(self._gates)):
                try:  # free unless it raises; what a replay raises (CUDA errors included) is a RuntimeError
                    if self._timing is None:
                        out = serve(capture, args, self._streams)
                    else:
                        out = serve_timed(capture, args, self._streams, self._timing)
                except (RuntimeError, MemoryError) as exc:
                    failed = exc
                else:
                    stats = self._stats
                    stats.replays += 1  # under the device lock: no other replay counts meanwhile
                    self.last_replayed = entry
                    stats.copy_bytes += capture.copy_bytes
                    if self._gates:
                        capture.gates_replayed(self._gates)
                    if self._lookup.keyless:
                        hot = self._hot
                        if hot is None or hot[0] is not entry or hot[1] is not capture.ptrs:
                            self._hot = hot_of(entry, capture)
                    return out
        self._hot = None
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
        hot = self._hot
        if hot is None or Isolation.active:  # an isolation runs somewhere: the slow path decides
            return None
        if self.tolerant and natively():  # a check of the graph: run eagerly (runner.py `__call__`)
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
            gates = self._gates
            # `ptrs is`: the entry serves the capture whose addresses were read
            verified = entry.phase
            if (type(verified) is Verified and verified.capture.ptrs is ptrs
                    and not (gates and verified.capture.gates_changed(gates))):
                try:
                    out = serve(verified.capture, args, self._streams)
                except (RuntimeError, MemoryError) as exc:
                    failed = exc
                else:
                    stats = self._stats
                    stats.replays += 1
                    stats.copy_bytes += nbytes
                    stats.hot_replays += 1
                    self.last_replayed = entry
                    if self._gates:
                        verified.capture.gates_replayed(self._gates)
                    return out
        finally:
            self._release()
        self._hot = None
        if failed is None:
            return None  # raced with a state change: the slow path decides
        reason = self._transitions.replay_failed(entry, failed)
        raise Answered(answer_eagerly(self._fn, self._stats, args, reason), reason.value)
