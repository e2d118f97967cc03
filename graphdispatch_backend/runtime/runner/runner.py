"""GraphRunner: warmup -> capture -> verify -> replay for one capturable piece.

The runner composes its parts and reads a call's way through them, top to bottom, in
`__call__` and `_dispatch` below; each part owns its state and answers its runner without
calling back into it:

    Lookup (runner/lookup.py)            the shape key and parameter set: the entry
    EntryBook (runner/book.py)           the entries, and the bounds on them
    Replayer (runner/hot.py)             every replay, and the hot entry
    Capturer (runner/record.py)          warmup and capture (input and output plans)
    Publisher (runner/publish.py)        verification (a Trial per call, runner/verify.py)
    Relocator (runner/relocate.py)       a verified graph whose held inputs moved
    Transitions (runner/transitions.py)  every change of an entry's phase: captured,
                                         verified, declines, re-captures and back-offs, reported
    Timed, Lockstep (runner/policy.py)   the call's first step under timing, or collectives

An entry's phase is a typed record (runner/phase.py): `Warming` (its observations, no
graph), `Captured` (a capture and its verification's progress), `Verified` (a capture,
replayed), `Eager` (its reason). `_dispatch` reads the phase once and hands it to the part
that serves it; only Transitions assigns one.

A step returns the call's outputs, or the Decline the call is answered eagerly with, in
one place (`__call__`), which counts it; None from a replay means the entry changed phase
under it, and the call looks again.

One entry per shape key (shapes and strides of the non-parameter inputs, plus the type and
value of every scalar input, a float by its bits; a graph without dynamic shapes has one
key, which Dynamo's guards ensure) and parameter set (the addresses of the parameters and
buffers: with `inline_inbuilt_nn_modules`, the blocks of a stack share one compiled graph
and each gets its own capture). Per entry:

1. warming: `warmup` eager calls, each recording every tensor input's layout identity.
2. capture (runner/record.py, `Capturer`): pinned inputs are read in place, moving ones copied into
   shared static buffers; the least recently used shape key is evicted past max_captures.
3. captured: replay and compare with eager, bit for bit (values, strides, views, and the
   inputs the piece writes into), on `verify_inputs` distinct input sets (the capture
   call's own inputs count as the first; a caller repeating the verified values gets a
   derived set; runner/publish.py). Eager answers meanwhile.
4. verified: one check per call (the pinned inputs' addresses, in C on CUDA builds), then
   copy-in, replay and copy-out on the caller's stream (runner/serve.py). A runner that
   serves a whole graph compiled through Dynamo is called at `replay_hot` first
   (runtime/program/program.py, runner/hot.py): the replay, or None having done nothing.

A refusal is a typed Decline: the entry goes eager for good (its artifacts stay active),
counted and logged once. A pinned input that moves is re-captured as moving; an
out-of-memory retries after 2, 4, 8, ... calls; nothing here raises into the call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.call.calls import answer_eagerly
from graphdispatch_backend.runtime.checks.agree import Agreement
from graphdispatch_backend.runtime.checks.isolate import Isolation, isolating_here
from graphdispatch_backend.runtime.checks.modes import natively
from graphdispatch_backend.runtime.checks.suspects import Suspects
from graphdispatch_backend.runtime.checks.world import Writes
from graphdispatch_backend.runtime.runner.book import MAX_PARAMETER_SETS, EntryBook
from graphdispatch_backend.runtime.runner.entry import Entry
from graphdispatch_backend.runtime.runner.hints import input_label
from graphdispatch_backend.runtime.runner.hot import Replayer
from graphdispatch_backend.runtime.runner.lookup import Lookup
from graphdispatch_backend.runtime.runner.phase import Captured, Eager, State, Verified, Warming
from graphdispatch_backend.runtime.runner.policy import Answer, Lockstep, Timed
from graphdispatch_backend.runtime.runner.publish import NOT_DISTINCT_LIMIT, Publisher
from graphdispatch_backend.runtime.runner.record import Capturer
from graphdispatch_backend.runtime.runner.relocate import Relocator
from graphdispatch_backend.runtime.runner.scope import RuntimeScope
from graphdispatch_backend.runtime.runner.transitions import Transitions
from graphdispatch_backend.runtime.runner.verify import Verifier

__all__ = ["MAX_PARAMETER_SETS", "NOT_DISTINCT_LIMIT", "GraphRunner", "State"]

_data_ptr = torch.Tensor.data_ptr


class GraphRunner:
    def __init__(
        self,
        fn: Callable[..., Sequence[Any]],
        name: str,
        scope: RuntimeScope,
        stats: CudaGraphStats,
        *,
        warmup: int,
        max_captures: int,
        verify_inputs: int,
        state_names: dict[int, str],
        input_names: Sequence[str] = (),
        gates: Sequence[Any] = (),
        suspects: Suspects | None = None,
        device: Any = "cpu",
        mutated: Sequence[int] = (),
        writes: Writes | None = None,
        wide: Sequence[int] = (),
        guarded: bool = False,
        static_shapes: bool = False,
        agreement: Agreement | None = None,
        unwritten: Sequence[int] = (),
    ) -> None:
        self._fn = fn
        self.name = name
        self._scope = scope  # the session's (bench/memory.py finds a session's runners by it)
        self._stats = stats
        self._names = tuple(input_names)  # position -> where the input comes from ("" if unknown)
        self._gates = tuple(gates)
        # where the piece writes its inputs (positions, and the regions of a call: world.py)
        writes = writes if writes is not None else Writes(mutated)
        self._device = scope.device(device)
        self._streams = self._device.streams  # read by the stream tests
        self._lock = threading.Lock()  # held while an entry warms, captures or verifies
        # the piece holds collectives (NCCL, captured inside): every rank keeps one schedule
        self._agreement = agreement
        timing = scope.timing if scope.timing.enabled else None
        # the parts (module docstring); the book reports its limits and evicts through the transitions
        self._book = book = EntryBook(max_captures, self._device.lock, lambda *a: transitions.report(*a),
                                      lambda entry: transitions.evicted(entry))
        self._lookup = lookup = Lookup(book, stats, state_names, static_shapes)
        transitions = self._transitions = Transitions(name, scope, stats, book, self._device, lookup, writes,
                                                      self._names, lockstep=agreement is not None)
        self._replayer = replayer = Replayer(fn, self._device, stats, gates, lookup, transitions, timing)
        self._capturer = capturer = Capturer(
            fn, scope, self._device, stats, book, lookup, transitions, warmup=warmup, gates=gates,
            writes=writes, wide=wide, guarded=guarded, agreement=agreement, names=self._names)
        verifier = Verifier(fn, scope.contain, writes, suspects, wide, unwritten)
        self._publisher = Publisher(fn, verifier, verify_inputs, scope, self._device, stats, gates, transitions,
                                    agreement)
        self._relocator = Relocator(self._device, stats, book, lookup, capturer, transitions, writes, gates)
        # a piece holding an allclose artifact: its captures hold the kernel, so the graph's
        # checks against eager, bit for bit, run it eagerly instead (__call__)
        self._tolerant = any(g.tolerant for g in self._gates)
        # the hot path (runtime/program/program.py): none where every call counts toward an agreement
        self.replay_hot = None if agreement is not None else replayer.replay_hot
        # the call's first step (runner/policy.py): a plain runner's pays for no policy
        self._first: Callable[[Sequence[Any]], Answer] = replayer.replay_in_place
        if agreement is not None:
            self._first = Lockstep(agreement, replayer, transitions).first
        elif timing is not None:
            self._first = Timed(timing, replayer, lookup, self._dispatch).first

    @property
    def stats(self) -> CudaGraphStats:
        """The piece's counters, owned by its graph's record: the runner writes into them
        (hot replays included), the report reads them, and they outlive the runner."""
        return self._stats

    @property
    def hot_replays(self) -> int:
        """Calls `replay_hot` answered with a replay (counted under the device lock)."""
        return self._stats.hot_replays

    @property
    def last_replayed(self) -> Entry | None:
        """What a checked call blames (runtime/checks/isolate.py)."""
        return self._replayer.last_replayed

    def _still_tolerant(self) -> bool:
        """Whether an allclose artifact of the piece still serves: once every one is demoted,
        the graph's checks replay it again (a trial's demoted kernel kept 9 of 20 calls off
        their replays). Read on a check's call only."""
        self._tolerant = self._replayer.tolerant = any(g.tolerant for g in self._gates)
        return self._tolerant

    # -- the call -------------------------------------------------------------------
    def __call__(self, *args: Any) -> Sequence[Any]:
        if Isolation.active and isolating_here():  # runtime/checks/isolate.py: the piece, eagerly, uncounted
            return self._fn(*args)
        if self._tolerant and natively() and self._still_tolerant():
            # the graph's check against eager (runtime/checks/eager_check.py): the lowering is
            # judged bit for bit, so an allclose artifact answers natively, which no capture
            # of this piece does (each holds the kernel, recorded on a call served): eagerly
            # then, its gate judging the kernel beside its region (runtime/gates/gate.py)
            return answer_eagerly(self._fn, self._stats, args, Decline.CHECKED_NATIVELY)
        out = self._first(args)  # the hot entry's replay, or (a policy's) the full path
        while out is None:  # no entry served the call, or its entry changed phase meanwhile
            out = self._dispatch(args)
        if type(out) is Decline:
            return answer_eagerly(self._fn, self._stats, args, out)
        return out

    def _dispatch(self, args: Sequence[Any], key: tuple[Any, ...] | None = None) -> Answer:
        lookup = self._lookup
        key = lookup.key(args) if key is None else key
        slot = lookup.slot(key)
        entry = None
        if slot is not None:
            if slot.declined is not None:
                return Decline.PARAMETER_MOVED
            entry = lookup.find(slot, args)
            if entry is not None and type(entry.phase) is Verified:
                verified = entry.phase
                problem = self._check(entry, args)
                if problem is None:
                    self._book.touch(slot)
                    return self._replayer.replay(entry, verified, args)
                return self._moved(entry, verified, args, problem)
        if entry is None:
            entry, refusal = lookup.add(key, args)
            if entry is None:
                return refusal
            self._transitions.states_changed()
        phase = entry.phase
        if type(phase) is Eager:
            return phase.reason
        waiting = entry.waiting()  # backing off (an out-of-memory, a fixed-address input that moves quickly)
        if waiting is not None:
            return waiting
        if not self._lock.acquire(blocking=False):
            return Decline.BUSY
        try:
            phase = entry.phase
            if type(phase) is Warming:
                warmed = self._capturer.warm(entry, phase, key, args)
                if type(warmed) is not Captured:
                    return warmed
                return self._publisher.verify(entry, warmed, args, first=True)  # the call that captured it
            if type(phase) is Captured:  # verifying: checked as a replay is
                problem = self._check(entry, args)
                if problem is not None:
                    self._transitions.transition(entry, phase.capture, args, *problem)
                    return problem[0]
                return self._publisher.verify(entry, phase, args, first=False)
            return phase.reason if type(phase) is Eager else Decline.BUSY  # another thread moved it on meanwhile
        finally:
            self._lock.release()

    def _check(self, entry: Entry, args: Sequence[Any]) -> tuple[Decline, str, int] | None:
        """Is the call's input where the entry's capture reads it? The one check per call:
        the pinned inputs' addresses (and layouts, where no Dynamo guard ensures them).
        None also where the entry holds no capture now (another thread moved it on): the
        replay, which serves only the phase it was given, finds that."""
        capture = entry.capture
        if capture is None:
            return None
        if capture.gates_changed(self._gates):
            return Decline.ARTIFACT_DEMOTED, "an artifact in this piece was demoted after capture", -1
        pos = None
        if capture.ptrs != list(map(_data_ptr, capture.pick_pinned(args))):
            pos = next(p for p, ptr in zip(capture.pinned, capture.ptrs) if _data_ptr(args[p]) != ptr)
        elif capture.identity is not None:
            pos = capture.identity.mismatch(args)
        if pos is None:
            return None
        state = self._lookup.state
        if pos in state:
            return Decline.PARAMETER_MOVED, f"{state[pos]} moved under the captured graph", pos
        return (Decline.PINNED_INPUT_MOVED,
                f"{input_label(pos, self._names)} is not the tensor the graph was captured with", pos)

    def _moved(self, entry: Entry, verified: Verified, args: Sequence[Any],
               problem: tuple[Decline, str, int]) -> Answer:
        """A verified entry's input is not where its capture reads it: relocated (only held
        inputs moved, or only inputs it reads: runner/relocate.py) and replayed, or its
        transition."""
        if self._agreement is not None:  # eager runs the same collectives: decide with the other ranks
            self._transitions.hold(problem[0], problem[1])
            return problem[0]
        # Never block here: another thread may hold the lock for a whole capture.
        if not self._lock.acquire(blocking=False):
            return problem[0]
        try:
            if entry.phase is not verified:  # another thread already handled it
                return problem[0]
            relocated = problem[0] is Decline.PINNED_INPUT_MOVED and self._relocator.relocate(entry, args)
            if relocated:
                return self._replayer.replay(entry, relocated, args)
            self._transitions.transition(entry, verified.capture, args, *problem)
            return problem[0]
        finally:
            self._lock.release()

    # -- verdicts from outside the call ----------------------------------------------
    def distrust(self, reason: Decline, detail: str) -> None:
        """A checked call's replay of this piece differed from eager (runtime/checks/isolate.py):
        the entry that served it declines."""
        entry = self._replayer.last_replayed
        if entry is None or type(entry.phase) is not Verified:
            return
        with self._lock:
            self._replayer.forget()
            self._transitions.decline(entry, reason, detail)

    def recompiled(self, detail: str) -> None:
        """The piece's code changed (a fused piece recompiled after a check, runtime/program/fused.py):
        every captured entry records again; none replays the old code meanwhile."""
        with self._lock:
            self._replayer.forget()
            self._transitions.recapture_all("fusion_changed", detail)
