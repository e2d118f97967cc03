"""GraphRunner: warmup -> capture -> verify -> replay for one capturable piece.

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

import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.errors import CudaGraphUnavailable, Decline
from graphdispatch_backend.runtime.call.calls import mark_eager
from graphdispatch_backend.runtime.call.contract import layout_identity
from graphdispatch_backend.runtime.call.keys import layout_key
from graphdispatch_backend.runtime.checks.agree import Agreement
from graphdispatch_backend.runtime.checks.isolate import Isolation, isolating_here
from graphdispatch_backend.runtime.checks.world import Writes
from graphdispatch_backend.runtime.cudagraph.engine import Like, is_out_of_memory
from graphdispatch_backend.runtime.runner import transitions
from graphdispatch_backend.runtime.runner.book import MAX_PARAMETER_SETS, EntryBook
from graphdispatch_backend.runtime.runner.entry import Entry, State
from graphdispatch_backend.runtime.runner.hints import CHURN_CALLS, churn_detail, input_label
from graphdispatch_backend.runtime.runner.hot import Hot, HotPath, hot_of, in_place
from graphdispatch_backend.runtime.runner.publish import NOT_DISTINCT_LIMIT, Publish
from graphdispatch_backend.runtime.runner.record import record
from graphdispatch_backend.runtime.runner.relocate import (
    alignment,
    held_key,
    keep,
    observe,
    only_held_moved,
    park,
    take,
    unpark,
)
from graphdispatch_backend.runtime.runner.scope import RuntimeScope
from graphdispatch_backend.runtime.runner.serve import serve, serve_timed
from graphdispatch_backend.runtime.runner.transitions import Transitions
from graphdispatch_backend.runtime.runner.verify import Verifier

__all__ = ["MAX_PARAMETER_SETS", "NOT_DISTINCT_LIMIT", "GraphRunner", "State"]

_data_ptr = torch.Tensor.data_ptr
_NO_KEY: tuple[Any, ...] = ()


class GraphRunner(HotPath, Publish, Transitions):
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
        suspects: Sequence[str] = (),
        device: Any = "cpu",
        mutated: Sequence[int] = (),
        writes: Writes | None = None,
        wide: Sequence[int] = (),
        guarded: bool = False,
        static_shapes: bool = False,
        agreement: Agreement | None = None,
    ) -> None:
        self._fn = fn
        self.name = name
        self._scope = scope
        self._stats = stats
        self._warmup = warmup
        self._verify_inputs = verify_inputs
        self._state = state_names  # position -> parameter/buffer name
        self._names = tuple(input_names)  # position -> where the input comes from ("" if unknown)
        self._gates = tuple(gates)
        # where the piece writes its inputs (positions, and the regions of a call: world.py)
        self._writes = writes if writes is not None else Writes(mutated)
        self._mutated = self._writes.positions
        self._wide = tuple(wide)  # positions the piece reads with as_strided
        self._guarded = guarded  # inputs come through Dynamo's guards (sizes, strides)
        self._static_shapes = static_shapes
        self._device = scope.device(device)
        self._align = alignment(torch.device(device) if not isinstance(device, torch.device) else device)
        self._streams = self._device.streams
        self._acquire, self._release = self._device.lock.acquire, self._device.lock.release
        self._book = EntryBook(max_captures, self._device.lock, self._report)
        self._slots = self._book.slots  # shape key -> its entries (read on every call)
        self._verifier = Verifier(fn, scope.contain, self._writes, suspects, self._wide)
        self._lock = threading.Lock()  # held while an entry warms, captures or verifies
        self._timing = scope.timing if scope.timing.enabled else None
        self._key_positions: tuple[int, ...] | None = None
        self._keyless = False  # one shape key for good: no key is computed per call
        self._hot: Hot | None = None  # the entry the last replay served (keyless runners), see hot.py
        self._buffers_used: dict[int, int] = {}  # id(static buffer) -> bytes, for the report
        self._param_positions: tuple[int, ...] = ()
        self._pick_params: Callable[[Sequence[Any]], Sequence[Any]] = lambda args: ()
        # the piece holds collectives (NCCL, captured inside): every rank keeps one schedule
        self._agreement = agreement
        self._pending: tuple[Decline, str] | None = None  # a verdict waiting for the next agreement
        self.last_replayed: Entry | None = None  # what a checked call blames (runtime/checks/isolate.py)
        self._calls = 0
        self._fresh = 0  # calls in a row that brought a new shape key
        if agreement is not None:
            self.__class__ = LockstepGraphRunner
        elif self._timing is not None:  # only then: the untimed hot path pays nothing for timing
            self.__class__ = TimedGraphRunner

    @property
    def stats(self) -> CudaGraphStats:
        """The piece's counters, owned by its graph's record: the runner writes into them
        (hot replays included), the report reads them, and they outlive the runner."""
        return self._stats

    @property
    def hot_replays(self) -> int:
        """Calls `replay_hot` answered with a replay (counted under the device lock)."""
        return self._stats.hot_replays

    # -- the call -------------------------------------------------------------------
    def __call__(self, *args: Any) -> Sequence[Any]:
        if Isolation.active and isolating_here():  # runtime/checks/isolate.py: the piece, eagerly, uncounted
            return self._fn(*args)
        hot = self._hot
        if hot is not None and in_place(hot, args):
            return self._replay(hot[0], args)
        return self._dispatch(args)

    def distrust(self, reason: Decline, detail: str) -> None:
        """A checked call's replay of this piece differed from eager (runtime/checks/isolate.py):
        the entry that served it declines."""
        entry = self.last_replayed
        if entry is None or entry.state is not State.VERIFIED:
            return
        with self._lock:
            self._hot = None
            self._decline(entry, reason, detail)

    def recompiled(self, detail: str) -> None:
        """The piece's code changed (a fused piece recompiled after a check, runtime/program/fused.py):
        every captured entry records it again; none replays the old code meanwhile."""
        with self._lock:
            self._hot = None
            for entry in list(self._book.entries.values()):
                if entry.state in (State.CAPTURED, State.VERIFIED):
                    self._recapture(entry, "fusion_changed", detail, set())

    def _dispatch(self, args: Sequence[Any], key: tuple[Any, ...] | None = None) -> Sequence[Any]:
        key = self._key(args) if key is None else key
        slot = self._slots.get(key)
        self._fresh = self._fresh + 1 if slot is None else 0
        if slot is None:
            entry = None
        elif slot.declined is not None:
            return self._eager(args, Decline.PARAMETER_MOVED)
        elif self._param_positions:
            entry = slot.find(self._state_key(args))
        else:  # one entry per shape key
            entry = slot.last[1]
        if entry is not None and entry.state is State.VERIFIED:
            problem = self._check(entry, args)
            if problem is None:
                self._book.touch(slot)  # type: ignore[arg-type]  # found through it
                return self._replay(entry, args)
            return self._moved(entry, args, problem)
        if entry is None:
            entry, refusal = self._new_entry(key, args)
            if entry is None:
                return self._eager(args, refusal)
        if entry.state is State.EAGER:
            return self._eager(args, entry.reason or Decline.BUSY)
        if entry.skip > 0:  # backing off (an out-of-memory, a fixed-address input that moves quickly)
            entry.skip -= 1
            return self._eager(args, entry.skip_reason)
        if not self._lock.acquire(blocking=False):
            return self._eager(args, Decline.BUSY)
        try:
            return self._advance(entry, key, args)
        finally:
            self._lock.release()

    def _key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        if self._keyless:
            return _NO_KEY
        positions = self._key_positions
        if positions is None:
            positions = self._positions(args)
            if self._keyless:
                return _NO_KEY
        return layout_key(map(args.__getitem__, positions))

    def _state_key(self, args: Sequence[Any]) -> Sequence[int]:
        """Parameters and buffers are told apart by address: each block that shares this
        graph gets its own entry."""
        return list(map(_data_ptr, self._pick_params(args)))

    def _positions(self, args: Sequence[Any]) -> tuple[int, ...]:
        self._state = {p: n for p, n in self._state.items() if p < len(args) and isinstance(args[p], torch.Tensor)}
        params = self._param_positions = tuple(sorted(self._state))
        self._pick_params = operator.itemgetter(*params) if len(params) > 1 else lambda a: [a[i] for i in params]
        positions = self._key_positions = tuple(i for i in range(len(args)) if i not in self._state)
        # shapes Dynamo guards, and no scalar among the inputs: one shape key, never computed
        self._keyless = self._static_shapes and all(isinstance(args[i], torch.Tensor) for i in positions)
        return positions

    def _new_entry(self, key: tuple[Any, ...], args: Sequence[Any]) -> tuple[Entry | None, Decline]:
        params = self._pick_params(args) if self._param_positions else ()
        entry, why = self._book.add(key, self._state_key(args), params, list(self._state.values()))
        self._stats.shape_keys = len(self._book.slots)
        if entry is not None:
            self._set_state()
        return entry, why

    def _eager(self, args: Sequence[Any], reason: Decline) -> Sequence[Any]:
        mark_eager(reason.value)
        self._stats.eager(reason.value)
        return self._fn(*args)

    # -- warming and capture ----------------------------------------------------------
    def _advance(self, entry: Entry, key: tuple[Any, ...], args: Sequence[Any]) -> Sequence[Any]:
        if entry.state is State.CAPTURED:
            return self._verify(entry, args, first=False)
        if entry.state is not State.WARMING:  # another thread moved it on meanwhile
            return self._eager(args, entry.reason or Decline.BUSY)
        if not entry.observations:
            entry.first_storages = [StorageWeakRef(a.untyped_storage()) if isinstance(a, torch.Tensor) else None
                                    for a in args]
        entry.observations.append(tuple(layout_identity(a) if isinstance(a, torch.Tensor) else None for a in args))
        if len(entry.observations) <= self._warmup:
            return self._eager(args, self._warming())
        # not in a piece holding collectives: a rank declining alone would leave the others
        # waiting in the capture's agreement below
        if self._agreement is None and self._book.thrashing(key):
            return self._thrashing(entry, args)
        if self._book.make_room(key) is not None:
            with self._stats.lock:
                self._stats.evictions += 1
        refusal: CudaGraphUnavailable | None = None
        try:
            self._capture(entry, args)
        except CudaGraphUnavailable as exc:
            refusal = exc
        if self._agree(int(refusal is not None)) and refusal is None:  # another rank failed to capture
            return self._refuse(entry, args, Decline.RANK_DISAGREEMENT, "another rank's capture failed")
        if refusal is None:
            return self._verify(entry, args, first=True)
        if refusal.reason is Decline.OUT_OF_MEMORY and self._agreement is None:
            return self._out_of_memory(entry, args, refusal.detail)
        self._decline(entry, refusal.reason, refusal.detail)
        return self._eager(args, refusal.reason)

    def _warming(self) -> Decline:
        """`warmup`, or `shape_churn` while every call brings a new shape key (runner/hints.py)."""
        if self._fresh < CHURN_CALLS:
            return Decline.WARMUP
        detail = churn_detail(list(self._slots), self._key_positions or (), self._names)
        self._book.limit(Decline.SHAPE_CHURN, detail, then="calls with new shape keys run eager meanwhile")
        return Decline.SHAPE_CHURN

    def _capture(self, entry: Entry, args: Sequence[Any], like: Like | None = None) -> None:
        buffers = record(entry, args, self._fn, self._scope, self._device, self._state, self._gates,
                         self._writes, self._wide, self._guarded, lockstep=self._agreement is not None, like=like)
        entry.replays_at_capture = self._stats.replays  # hot replays included (runner/hot.py counts both)
        with self._stats.lock:
            self._stats.captures += 1
            self._buffers_used.update((id(buf), buf.untyped_storage().nbytes()) for _, buf in buffers)
            # what this piece holds; the buffers are shared across pieces (session total in the report)
            self._stats.static_bytes = sum(self._buffers_used.values())
        self._set_state()

    # -- replay ---------------------------------------------------------------------
    def _replay(self, entry: Entry, args: Sequence[Any]) -> Sequence[Any]:
        failed: BaseException | None = None
        with self._device.lock:
            if entry.state is State.VERIFIED and not (self._gates and self._gates_changed(entry)):
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
                        self._gates_replayed(entry)
                    if self._keyless:
                        hot = self._hot
                        if hot is None or hot[0] is not entry or hot[1] is not entry.ptrs:
                            self._hot = hot_of(entry)
                    return out
        self._hot = None
        if failed is not None:
            return self._replay_failed(entry, args, failed)
        return self._dispatch(args)  # raced with a state change: the slow path decides

    def _moved(self, entry: Entry, args: Sequence[Any], problem: tuple[Decline, str, int]) -> Sequence[Any]:
        if self._agreement is not None:  # eager runs the same collectives: decide with the other ranks
            self._pending = problem[0], problem[1]
            return self._eager(args, problem[0])
        # Never block here: another thread may hold the lock for a whole capture.
        if not self._lock.acquire(blocking=False):
            return self._eager(args, problem[0])
        try:
            if entry.state is not State.VERIFIED:  # another thread already handled it
                return self._eager(args, problem[0])
            if problem[0] is Decline.PINNED_INPUT_MOVED:
                out = self._relocate(entry, args)
                if out is not None:
                    return out
            return self._mismatch(entry, args, *problem)
        finally:
            self._lock.release()

    def _relocate(self, entry: Entry, args: Sequence[Any]) -> Sequence[Any] | None:
        """Only held inputs moved (runner/relocate.py): the capture parked for their new
        addresses, or one made now as the verified one was; a replay answers. None: not a
        relocation, or its capture failed (the usual paths decide)."""
        moved = {p for p, ptr in zip(entry.pinned, entry.ptrs) if p not in self._state and _data_ptr(args[p]) != ptr}
        held = transitions.never_moving(moved, args, self._writes.positions)
        if not moved or held != moved or self._gates_changed(entry):
            return None
        entry.held |= held
        if not only_held_moved(entry, args, list(self._state), self._align):
            return None
        key = held_key(entry, args)
        with self._device.lock:  # no replay of it may be running while it is taken off
            old_key, pinned, moving = held_key(entry, entry.static_args), entry.pinned, [p for p, _ in entry.moving]
            # aliases, not the caller's tensors: a cache the caller dropped dies at park (relocate.keep)
            old_args = [a.detach() if isinstance(a, torch.Tensor) else a for a in entry.static_args]
            old = park(entry)
            found = take(entry.parked, key)
            if found is not None:
                unpark(entry, found, args)
        if found is None:
            observe(entry, args, moving)
            try:
                self._capture(entry, args, like=(old.graph, old_args))  # the same graph, other addresses
            except CudaGraphUnavailable:
                entry.state = State.WARMING  # the usual paths re-capture it, or decline
                old.release()
                return None
            if entry.pinned != pinned:  # not the verified classification: verify it as any capture
                old.release()
                return None
            entry.state, entry.verified, entry.last_inputs = State.VERIFIED, self._verify_inputs, None
            with self._stats.lock:
                self._stats.relocations += 1
        with self._device.lock:
            keep(entry.parked, old_key, old, self._book.max_captures - 1)
            self._stats.parked = sum(len(e.parked) for e in list(self._book.entries.values()))
        self._set_state()
        return self._replay(entry, args)

    def _replay_failed(self, entry: Entry, args: Sequence[Any], exc: BaseException) -> Sequence[Any]:
        """A verified graph raised on replay: an allocation failure is transient (this call
        answers eagerly); anything else goes through the session's contain() (under strict
        it raises), the entry declines and this call is answered eagerly."""
        if is_out_of_memory(exc):
            return self._eager(args, Decline.OUT_OF_MEMORY)
        if self._agreement is not None:
            self._pending = Decline.REPLAY_FAILED, f"{type(exc).__name__}: {exc}"
            return self._eager(args, Decline.REPLAY_FAILED)

        def reraise() -> None:
            raise exc

        _, contained = self._scope.contain(reraise)
        self._decline(entry, Decline.REPLAY_FAILED, f"{type(contained).__name__}: {contained}")
        return self._eager(args, Decline.REPLAY_FAILED)

    def _check(self, entry: Entry, args: Sequence[Any]) -> tuple[Decline, str, int] | None:
        if self._gates_changed(entry):
            return Decline.ARTIFACT_DEMOTED, "an artifact in this piece was demoted after capture", -1
        pos = None
        if entry.ptrs != list(map(_data_ptr, entry.pick_pinned(args))):
            pos = next(p for p, ptr in zip(entry.pinned, entry.ptrs) if _data_ptr(args[p]) != ptr)
        elif entry.identity is not None:
            pos = entry.identity.mismatch(args)
        if pos is None:
            return None
        if pos in self._state:
            return Decline.PARAMETER_MOVED, f"{self._state[pos]} moved under the captured graph", pos
        return (Decline.PINNED_INPUT_MOVED,
                f"{input_label(pos, self._names)} is not the tensor the graph was captured with", pos)

    def _agree(self, code: int) -> int:
        """The worst of this rank's `code` and every other rank's (the code itself when the
        piece holds no collectives: no other rank's schedule depends on this one's)."""
        return code if self._agreement is None else self._agreement.agree(code)

    def _gates_replayed(self, entry: Entry) -> None:
        for gate, demoted in zip(self._gates, entry.gate_state):
            gate.replayed(native=demoted)  # captured with the artifact's kernels in it, or the native region's

    def _gates_changed(self, entry: Entry) -> bool:
        return bool(self._gates) and tuple(g.demoted for g in self._gates) != entry.gate_state

    def _set_state(self) -> None:
        order = (State.EAGER, State.WARMING, State.CAPTURED, State.VERIFIED)
        states = self._book.states()
        self._stats.state = max(states, key=order.index).value if states else State.EAGER.value
        self._stats.live_captures = sum(1 for slot in list(self._slots.values()) if slot.captured)



class TimedGraphRunner(GraphRunner):
    """A GraphRunner under `timing`: the lookup (pointer check, shape key) is the
    `shape_key` phase."""

    def __call__(self, *args: Any) -> Sequence[Any]:
        if Isolation.active and isolating_here():
            return self._fn(*args)
        timing = self._timing
        assert timing is not None
        start = timing.now()
        hot = self._hot
        if hot is not None and in_place(hot, args):
            timing.add("shape_key", timing.now() - start)
            return self._replay(hot[0], args)
        key = self._key(args)
        timing.add("shape_key", timing.now() - start)
        return self._dispatch(args, key)


class LockstepGraphRunner(GraphRunner):
    """A runner of a piece that holds collectives (NCCL, captured inside, as vLLM does):
    every rank must capture, verify and replay it on the same calls, or the collectives go
    out of step. Every decision that would change the schedule is agreed (runner.py's
    `_agree`); a rank that finds a problem in steady state (a moved input, a failed replay)
    answers eagerly, which runs the same collectives, and raises it at the next agreement
    point, the runner's 1st, 2nd, 4th, 8th, ... call: then every rank declines the piece
    (the rank at fault with its reason, the others `rank_disagreement`)."""

    replay_hot = None  # no hot path: every call counts toward the agreement schedule

    def __call__(self, *args: Any) -> Sequence[Any]:
        n = self._calls = self._calls + 1
        if n & (n - 1) == 0:
            self._settle_pending()
        return GraphRunner.__call__(self, *args)

    def _settle_pending(self) -> None:
        pending, self._pending = self._pending, None
        if not self._agree(int(pending is not None)):
            return
        self._hot = None
        reason, detail = pending or (Decline.RANK_DISAGREEMENT, "another rank could not replay")
        for entry in list(self._book.entries.values()):
            if entry.state is not State.EAGER:
                self._decline(entry, reason, detail)
