"""GraphRunner: warmup -> capture -> verify -> replay for one capturable piece.

The runner composes its parts and reads a call's way through them, top to bottom, in
`__call__` and `_dispatch` below; each part owns its state and answers its runner without
calling back into it:

    Lookup (runner/lookup.py)            the shape key and parameter set: the entry
    EntryBook (runner/book.py)           the entries, and the bounds on them
    Replayer (runner/hot.py)             every replay, and the hot entry
    Recorder (runner/record.py)          warmup and capture (input and output plans)
    Publisher (runner/publish.py)        verification (a Trial per call, runner/verify.py)
    Relocator (runner/relocate.py)       a verified graph whose held inputs moved
    Transitions (runner/transitions.py)  declines, re-captures and back-offs, reported

A step returns the call's outputs, or the Decline the call is answered eagerly with, in
one place (`__call__`), which counts it; None from a replay means the entry changed state
under it, and the call looks again.

One entry per shape key (shapes and strides of the non-parameter inputs, plus the type and
value of every scalar input, a float by its bits; a graph without dynamic shapes has one
key, which Dynamo's guards ensure) and parameter set (the addresses of the parameters and
buffers: with `inline_inbuilt_nn_modules`, the blocks of a stack share one compiled graph
and each gets its own capture). Per entry:

1. warming: `warmup` eager calls, each recording every tensor input's layout identity.
2. capture (runner/record.py): pinned inputs are read in place, moving ones copied into
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
from graphdispatch_backend.runtime.checks.agree import Agreement, agreed_verdict
from graphdispatch_backend.runtime.checks.isolate import Isolation, isolating_here
from graphdispatch_backend.runtime.checks.suspects import Suspects
from graphdispatch_backend.runtime.checks.world import Writes
from graphdispatch_backend.runtime.runner.book import MAX_PARAMETER_SETS, EntryBook
from graphdispatch_backend.runtime.runner.entry import Entry, State
from graphdispatch_backend.runtime.runner.hints import input_label
from graphdispatch_backend.runtime.runner.hot import Replayer, in_place
from graphdispatch_backend.runtime.runner.lookup import Lookup
from graphdispatch_backend.runtime.runner.publish import NOT_DISTINCT_LIMIT, Publisher
from graphdispatch_backend.runtime.runner.record import Recorder
from graphdispatch_backend.runtime.runner.relocate import Relocator
from graphdispatch_backend.runtime.runner.scope import RuntimeScope
from graphdispatch_backend.runtime.runner.transitions import Transitions
from graphdispatch_backend.runtime.runner.verify import Verifier

__all__ = ["MAX_PARAMETER_SETS", "NOT_DISTINCT_LIMIT", "GraphRunner", "State"]

_data_ptr = torch.Tensor.data_ptr
Answer = Sequence[Any] | Decline | None  # outputs; the eager answer's reason; look again


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
        # the parts (module docstring); the book reports its limits through the transitions
        self._book = book = EntryBook(max_captures, self._device.lock, lambda *a: transitions.report(*a))
        self._lookup = lookup = Lookup(book, stats, state_names, static_shapes)
        transitions = self._transitions = Transitions(name, scope, stats, book, self._device, lookup, writes,
                                                      self._names, lockstep=agreement is not None)
        self._replayer = Replayer(fn, self._device, stats, gates, lookup, transitions, timing)
        self._recorder = recorder = Recorder(
            fn, scope, self._device, stats, book, lookup, transitions, warmup=warmup, gates=gates,
            writes=writes, wide=wide, guarded=guarded, agreement=agreement, names=self._names)
        verifier = Verifier(fn, scope.contain, writes, suspects, wide, unwritten)
        self._publisher = Publisher(fn, verifier, verify_inputs, scope, self._device, stats, gates, transitions,
                                    agreement)
        self._relocator = Relocator(self._device, stats, book, lookup, recorder, transitions, writes, gates,
                                    verify_inputs)
        # the hot path (runtime/program/program.py): none where every call counts toward an agreement
        self.replay_hot = None if agreement is not None else self._replayer.replay_hot
        self._calls = 0
        if agreement is not None:
            self.__class__ = LockstepGraphRunner
        elif timing is not None:  # only then: the untimed hot path pays nothing for timing
            self.__class__ = TimedGraphRunner
            self._timing = timing

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

    # -- the call -------------------------------------------------------------------
    def __call__(self, *args: Any) -> Sequence[Any]:
        if Isolation.active and isolating_here():  # runtime/checks/isolate.py: the piece, eagerly, uncounted
            return self._fn(*args)
        hot = self._replayer.hot
        out = self._replayer.replay(hot[0], args) if hot is not None and in_place(hot, args) else None
        while out is None:  # no entry served the call, or its entry changed state meanwhile
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
        if entry is not None and entry.state is State.VERIFIED:
            problem = self._check(entry, args)
            if problem is None:
                self._book.touch(slot)  # type: ignore[arg-type]  # found through it
                return self._replayer.replay(entry, args)
            return self._moved(entry, args, problem)
        if entry is None:
            entry, refusal = lookup.add(key, args)
            if entry is None:
                return refusal
            self._transitions.states_changed()
        if entry.state is State.EAGER:
            return entry.reason or Decline.BUSY
        if entry.skip > 0:  # backing off (an out-of-memory, a fixed-address input that moves quickly)
            entry.skip -= 1
            return entry.skip_reason
        if not self._lock.acquire(blocking=False):
            return Decline.BUSY
        try:
            first = entry.state is State.WARMING
            if entry.state is State.CAPTURED:  # verifying: checked as a replay is
                problem = self._check(entry, args)
                if problem is not None:
                    self._transitions.transition(entry, args, *problem)
                    return problem[0]
            elif not first:  # another thread moved it on meanwhile
                return entry.reason or Decline.BUSY
            else:
                refusal = self._recorder.warm(entry, key, args)
                if refusal is not None:
                    return refusal
            return self._publisher.verify(entry, args, first)  # `first`: the call that captured it
        finally:
            self._lock.release()

    def _check(self, entry: Entry, args: Sequence[Any]) -> tuple[Decline, str, int] | None:
        """Is the call's input where the entry's capture reads it? The one check per call:
        the pinned inputs' addresses (and layouts, where no Dynamo guard ensures them)."""
        if entry.gates_changed(self._gates):
            return Decline.ARTIFACT_DEMOTED, "an artifact in this piece was demoted after capture", -1
        pos = None
        if entry.ptrs != list(map(_data_ptr, entry.pick_pinned(args))):
            pos = next(p for p, ptr in zip(entry.pinned, entry.ptrs) if _data_ptr(args[p]) != ptr)
        elif entry.identity is not None:
            pos = entry.identity.mismatch(args)
        if pos is None:
            return None
        state = self._lookup.state
        if pos in state:
            return Decline.PARAMETER_MOVED, f"{state[pos]} moved under the captured graph", pos
        return (Decline.PINNED_INPUT_MOVED,
                f"{input_label(pos, self._names)} is not the tensor the graph was captured with", pos)

    def _moved(self, entry: Entry, args: Sequence[Any], problem: tuple[Decline, str, int]) -> Answer:
        """A verified entry's input is not where its capture reads it: relocated (only held
        inputs moved, or only inputs it reads: runner/relocate.py) and replayed, or its
        transition."""
        if self._agreement is not None:  # eager runs the same collectives: decide with the other ranks
            self._transitions.pending = problem[0], problem[1]
            return problem[0]
        # Never block here: another thread may hold the lock for a whole capture.
        if not self._lock.acquire(blocking=False):
            return problem[0]
        try:
            if entry.state is not State.VERIFIED:  # another thread already handled it
                return problem[0]
            if problem[0] is Decline.PINNED_INPUT_MOVED and self._relocator.relocate(entry, args):
                return self._replayer.replay(entry, args)
            self._transitions.transition(entry, args, *problem)
            return problem[0]
        finally:
            self._lock.release()

    # -- verdicts from outside the call ----------------------------------------------
    def distrust(self, reason: Decline, detail: str) -> None:
        """A checked call's replay of this piece differed from eager (runtime/checks/isolate.py):
        the entry that served it declines."""
        entry = self._replayer.last_replayed
        if entry is None or entry.state is not State.VERIFIED:
            return
        with self._lock:
            self._replayer.hot = None
            self._transitions.decline(entry, reason, detail)

    def recompiled(self, detail: str) -> None:
        """The piece's code changed (a fused piece recompiled after a check, runtime/program/fused.py):
        every captured entry records it again; none replays the old code meanwhile."""
        with self._lock:
            self._replayer.hot = None
            for entry in list(self._book.entries.values()):
                if entry.state in (State.CAPTURED, State.VERIFIED):
                    self._transitions.recapture(entry, "fusion_changed", detail, set())


class TimedGraphRunner(GraphRunner):
    """A GraphRunner under `timing`: the lookup (pointer check, shape key) is the
    `shape_key` phase."""

    _timing: Any

    def __call__(self, *args: Any) -> Sequence[Any]:
        if Isolation.active and isolating_here():
            return self._fn(*args)
        timing = self._timing
        start = timing.now()
        hot = self._replayer.hot
        if hot is not None and in_place(hot, args):
            timing.add("shape_key", timing.now() - start)
            out = self._replayer.replay(hot[0], args)
        else:
            key = self._lookup.key(args)
            timing.add("shape_key", timing.now() - start)
            out = self._dispatch(args, key)
        while out is None:
            out = self._dispatch(args)
        if type(out) is Decline:
            return answer_eagerly(self._fn, self._stats, args, out)
        return out


class LockstepGraphRunner(GraphRunner):
    """A runner of a piece that holds collectives (NCCL, captured inside, as vLLM does):
    every rank must capture, verify and replay it on the same calls, or the collectives go
    out of step. Every decision that would change the schedule is agreed (checks/agree.py's
    `agreed`); a rank that finds a problem in steady state (a moved input, a failed replay)
    answers eagerly, which runs the same collectives, and raises it at the next agreement
    point, the runner's 1st, 2nd, 4th, 8th, ... call: then every rank declines the piece
    (every rank with the reason the rank at fault found: checks/agree.py's `agreed_verdict`). No hot path:
    every call counts toward the agreement schedule."""

    def __call__(self, *args: Any) -> Sequence[Any]:
        n = self._calls = self._calls + 1
        if n & (n - 1) == 0:
            self._settle_pending()
        return GraphRunner.__call__(self, *args)

    def _settle_pending(self) -> None:
        transitions = self._transitions
        pending, transitions.pending = transitions.pending, None
        verdict = agreed_verdict(self._agreement, pending)  # every rank, one reason: the rank at fault's
        if verdict is None:
            return
        self._replayer.hot = None
        reason, detail = verdict
        for entry in list(self._book.entries.values()):
            if entry.state is not State.EAGER:
                transitions.decline(entry, reason, detail)
