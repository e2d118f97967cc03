"""GraphRunner: warmup -> capture -> verify -> replay for one capturable piece.

One entry per shape key (tensor shapes and strides of the non-parameter inputs, plus the
type and value of every scalar input, a float by its bits: a changed bool, int or float,
-0.0 included, is captured anew under its own key, never replayed stale) and parameter set
(the addresses of the parameters and buffers). One compiled graph often serves many
modules: with Dynamo's default `inline_inbuilt_nn_modules`, a block stack with a graph
break per block, or `block.compile()` on each block, runs every block through one graph
with that block's parameters as inputs; each block then gets its own capture, and all of
them share one static buffer set. `max_captures` bounds the shape keys; at most
MAX_PARAMETER_SETS parameter sets are captured per shape key. Per entry:

1. warming: `warmup` eager calls, each recording every tensor input's layout identity.
2. capture: scalars are constants (in the key); tensors whose identity never changed are
   pinned (read in place, checked on every replay); the rest are moving (copied into
   shared static buffers). Parameters and buffers must be pinned: if one moves, decline.
3. captured: replay and compare with eager, bit for bit, on `verify_inputs` distinct live
   input sets (the capture call's own inputs count as the first). Eager answers meanwhile.
4. verified: check identities, copy in, replay, return clones of the outputs.

A refusal is a CudaGraphUnavailable with a typed Decline: the entry goes eager for good
(its artifacts stay active), counted and logged once. A pinned *input* that moves (a new
prompt's embeddings) is re-captured as moving (see _mismatch).
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.errors import CudaGraphUnavailable, Decline
from graphdispatch_backend.runtime.book import MAX_PARAMETER_SETS, EntryBook
from graphdispatch_backend.runtime.contract import layout_identity
from graphdispatch_backend.runtime.entry import (
    TENSOR,
    Entry,
    State,
    copy_like,
    layout_key,
)
from graphdispatch_backend.runtime.recording import record
from graphdispatch_backend.runtime.scope import RuntimeScope, mark_eager
from graphdispatch_backend.runtime.verify import NO_SET, Verdict, Verifier

__all__ = ["MAX_PARAMETER_SETS", "MAX_RECAPTURES", "NOT_DISTINCT_LIMIT", "GraphRunner", "State"]

MAX_RECAPTURES = 2
NOT_DISTINCT_LIMIT = 8
_data_ptr = torch.Tensor.data_ptr


def _reraise(exc: BaseException) -> None:
    raise exc


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
        gates: Sequence[Any] = (),
        suspects: Sequence[str] = (),
    ) -> None:
        self._fn = fn
        self.name = name
        self._scope = scope
        self._stats = stats
        self._warmup = warmup
        self._verify_inputs = verify_inputs
        self._state = state_names  # position -> parameter/buffer name
        self._gates = tuple(gates)
        self._verifier = Verifier(fn, scope.contain, suspects=suspects)
        self._book = EntryBook(max_captures, scope, self._report)
        self._slots = self._book.slots  # shape key -> its entries (read on every call)
        self._lock = threading.Lock()  # held while an entry warms, captures or verifies
        self._timing = scope.timing if scope.timing.enabled else None
        self._key_positions: tuple[int, ...] | None = None
        if self._timing is not None:  # only then: the untimed hot path pays nothing for it
            self._key = self._timed(self._key, "shape_key")  # type: ignore[method-assign]
        self._buffers_used: dict[int, int] = {}  # id(static buffer) -> bytes, for the report
        self._param_positions: tuple[int, ...] = ()
        self._pick_params: Callable[[Sequence[Any]], Sequence[Any]] = lambda args: ()

    # -- the call -------------------------------------------------------------------
    def __call__(self, *args: Any) -> Sequence[Any]:
        key = self._key(args)
        slot = self._slots.get(key)
        if slot is None:
            entry = None
        elif slot.declined is not None:
            return self._eager(args, Decline.PARAMETER_MOVED)
        elif self._param_positions:
            entry = slot.find(self._state_key(args))
        else:  # one entry per shape key
            entry = slot.last[1]
        if entry is not None and entry.state is State.VERIFIED:
            return self._replay(entry, args)
        if entry is None:
            entry, refusal = self._new_entry(key, args)
            if entry is None:
                return self._eager(args, refusal)
        if entry.state is State.EAGER:
            return self._eager(args, entry.reason or Decline.BUSY)
        if not self._lock.acquire(blocking=False):
            return self._eager(args, Decline.BUSY)
        try:
            return self._advance(entry, args)
        finally:
            self._lock.release()

    def _timed(self, fn: Callable[[Sequence[Any]], Any], phase: str) -> Callable[[Sequence[Any]], Any]:
        timing = self._timing
        assert timing is not None

        def timed(args: Sequence[Any]) -> Any:
            start = timing.now()
            try:
                return fn(args)
            finally:
                timing.add(phase, timing.now() - start)

        return timed

    def _key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        positions = self._key_positions
        if positions is None:
            positions = self._positions(args)
        return layout_key(map(args.__getitem__, positions))

    def _state_key(self, args: Sequence[Any]) -> Sequence[int]:
        """Parameters and buffers are told apart by address (the identity check then
        compares only their layout): each block that shares this graph gets its own entry."""
        return list(map(_data_ptr, self._pick_params(args)))

    def _positions(self, args: Sequence[Any]) -> tuple[int, ...]:
        self._state = {p: n for p, n in self._state.items() if p < len(args) and isinstance(args[p], torch.Tensor)}
        params = self._param_positions = tuple(sorted(self._state))
        self._pick_params = operator.itemgetter(*params) if len(params) > 1 else lambda a: [a[i] for i in params]
        positions = self._key_positions = tuple(i for i in range(len(args)) if i not in self._state)
        return positions

    def _new_entry(self, key: tuple[Any, ...], args: Sequence[Any]) -> tuple[Entry | None, Decline]:
        params = self._pick_params(args) if self._param_positions else ()
        entry, why = self._book.add(key, self._state_key(args), params, list(self._state.values()))
        self._stats.shape_keys = len(self._book.slots)
        if entry is not None:
            self._set_state()
        return entry, why

    @property
    def _entries(self) -> dict[tuple[Any, ...], Entry]:
        return self._book.entries

    def _eager(self, args: Sequence[Any], reason: Decline) -> Sequence[Any]:
        mark_eager(reason.value)
        self._stats.eager(reason.value)
        return self._fn(*args)

    # -- warming and capture ----------------------------------------------------------
    def _advance(self, entry: Entry, args: Sequence[Any]) -> Sequence[Any]:
        if entry.state is State.CAPTURED:
            return self._verify(entry, args, first=False)
        if entry.state is not State.WARMING:  # another thread moved it on meanwhile
            return self._eager(args, entry.reason or Decline.BUSY)
        if not entry.observations:
            entry.first_storages = [StorageWeakRef(a.untyped_storage()) if isinstance(a, torch.Tensor) else None
                                    for a in args]
        entry.observations.append(self._observe(args))
        if len(entry.observations) <= self._warmup:
            return self._eager(args, Decline.WARMUP)
        try:
            self._capture(entry, args)
        except CudaGraphUnavailable as refusal:
            self._decline(entry, refusal.reason, refusal.detail)
            return self._eager(args, refusal.reason)
        return self._verify(entry, args, first=True)

    def _observe(self, args: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(layout_identity(a) if isinstance(a, torch.Tensor) else None for a in args)

    def _capture(self, entry: Entry, args: Sequence[Any]) -> None:
        buffers = record(entry, args, self._fn, self._scope, self._state, self._gates)
        with self._stats.lock:
            self._stats.captures += 1
            self._buffers_used.update((id(buf), buf.untyped_storage().nbytes()) for _, buf in buffers)
            # what this piece holds; the buffers are shared across pieces (session total in the report)
            self._stats.static_bytes = sum(self._buffers_used.values())
        self._set_state()

    # -- verification ---------------------------------------------------------------
    def _verify(self, entry: Entry, args: Sequence[Any], first: bool) -> Sequence[Any]:
        if not first:
            problem = self._check(entry, args)
            if problem is not None:
                return self._mismatch(entry, args, *problem)
            repeats = self._verifier.repeats(entry.moving, args, entry.last_inputs)
            if repeats is None:
                return self._refuse(entry, args, Decline.CHECK_FAILED, "comparing with the verified inputs raised")
            if repeats:
                return self._verify_derived(entry, args)
        expected, verdict = self._verifier.live(args, lambda a: self._serve_locked(entry, a),
                                                lambda a: self._eager(a, Decline.VERIFYING))
        return self._conclude(entry, args, expected, verdict)

    def _verify_derived(self, entry: Entry, args: Sequence[Any]) -> Sequence[Any]:
        """The caller repeats the verified values: verify on a set derived from them."""
        expected = self._eager(args, Decline.VERIFYING)
        verdict = self._verifier.judge_derived(entry.moving, args, expected, lambda a: self._serve_locked(entry, a),
                                               salt=entry.verified)
        if verdict is NO_SET:
            entry.waits += 1
            if entry.waits > NOT_DISTINCT_LIMIT:
                self._decline(entry, Decline.VERIFY_NOT_DISTINCT, (
                    f"{entry.waits} calls in a row repeated the verified inputs' values, and no distinct set could be "
                    "derived from them (every moving input holds one repeated integer or bool value, or eager raised "
                    "on the derived values): call once with other values, or pass the same tensor object each call "
                    "(it is then read in place)"))
            return expected
        return self._conclude(entry, args, expected, verdict, live=False)

    def _conclude(self, entry: Entry, args: Sequence[Any], expected: Sequence[Any], verdict: Verdict,
                  live: bool = True) -> Sequence[Any]:
        if self._gates_changed(entry):
            # an artifact in this piece failed a parity re-check during this very call: the
            # capture holds it, so capture again without it rather than declining for good
            self._transition(entry, args, Decline.ARTIFACT_DEMOTED, "an artifact was demoted while verifying", -1)
            return expected
        if verdict is not None:
            self._decline(entry, *verdict)
            return expected
        entry.verified, entry.waits = entry.verified + 1, 0
        if entry.verified >= self._verify_inputs:
            entry.state, entry.last_inputs = State.VERIFIED, None
            self._set_state()
        elif live:
            last, exc = self._scope.contain(lambda: [args[pos].clone() for pos, _ in entry.moving])
            if exc is not None:
                self._decline(entry, Decline.CHECK_FAILED, f"keeping the verified inputs raised {type(exc).__name__}")
            entry.last_inputs = last
        return expected

    def _refuse(self, entry: Entry, args: Sequence[Any], reason: Decline, detail: str) -> Sequence[Any]:
        self._decline(entry, reason, detail)
        return self._eager(args, reason)

    def _serve_locked(self, entry: Entry, args: Sequence[Any]) -> list[Any]:
        with self._scope.replay_lock:
            return self._serve(entry, args)

    # -- replay ---------------------------------------------------------------------
    def _replay(self, entry: Entry, args: Sequence[Any]) -> Sequence[Any]:
        with self._scope.replay_lock:
            problem = self._check(entry, args)
            if problem is None and entry.state is State.VERIFIED:
                try:  # free unless it raises; what a replay raises (CUDA errors included) is a RuntimeError
                    out = self._serve(entry, args)
                except RuntimeError as exc:
                    return self._replay_failed(entry, args, exc)
                self._stats.replayed()
                for gate, demoted in zip(self._gates, entry.gate_state):
                    if not demoted:  # captured with the artifact's kernels in it
                        gate.replayed()
                return out
        # Never block here: another thread may hold the lock for a whole capture.
        if not self._lock.acquire(blocking=False):
            return self._eager(args, problem[0] if problem else Decline.BUSY)
        try:
            if problem is None or entry.state is not State.VERIFIED:
                # raced with a state change (another thread declined the entry, or already
                # handled the same mismatch): answer eagerly this once
                return self._eager(args, problem[0] if problem else entry.reason or Decline.BUSY)
            return self._mismatch(entry, args, *problem)
        finally:
            self._lock.release()

    def _replay_failed(self, entry: Entry, args: Sequence[Any], exc: Exception) -> Sequence[Any]:
        """A verified graph raised on replay: the session's contain() decides (under strict
        it raises), the entry declines and this call is answered eagerly."""
        _, exc = self._scope.contain(functools.partial(_reraise, exc))
        self._decline(entry, Decline.REPLAY_FAILED, f"{type(exc).__name__}: {exc}")
        return self._eager(args, Decline.REPLAY_FAILED)

    def _check(self, entry: Entry, args: Sequence[Any]) -> tuple[Decline, str, int] | None:
        if self._gates_changed(entry):
            return Decline.ARTIFACT_DEMOTED, "an artifact in this piece was demoted after capture", -1
        pos = entry.identity.mismatch(args) if entry.identity is not None else None
        if pos is None:
            return None
        if pos in self._state:
            return Decline.PARAMETER_MOVED, f"{self._state[pos]} moved under the captured graph", pos
        return Decline.PINNED_INPUT_MOVED, f"input {pos} is not the tensor the graph was captured with", pos

    def _serve(self, entry: Entry, args: Sequence[Any]) -> list[Any]:
        timing = self._timing
        start = timing.now() if timing else 0.0
        self._copy_in(entry, args)
        mid = timing.now() if timing else 0.0
        assert entry.graph is not None
        entry.graph.replay()
        end = timing.now() if timing else 0.0
        out = self._clone_outputs(entry)
        if timing:
            timing.add("copy_in", mid - start)
            timing.add("replay", end - mid)
            timing.add("unflatten", timing.now() - end)
        return out

    def _copy_in(self, entry: Entry, args: Sequence[Any]) -> None:
        for pos, buf in entry.moving:
            buf.copy_(args[pos])

    def _clone_outputs(self, entry: Entry) -> list[Any]:
        assert entry.graph is not None
        return [copy_like(o) if t is TENSOR else t for o, t in zip(entry.graph.outputs, entry.template)]

    # -- refusals -------------------------------------------------------------------
    def _gates_changed(self, entry: Entry) -> bool:
        return bool(self._gates) and tuple(g.demoted for g in self._gates) != entry.gate_state

    def _mismatch(self, entry: Entry, args: Sequence[Any], reason: Decline, detail: str, pos: int) -> Sequence[Any]:
        self._transition(entry, args, reason, detail, pos)
        return self._eager(args, reason)

    def _transition(self, entry: Entry, args: Sequence[Any], reason: Decline, detail: str, pos: int) -> None:
        """Re-capture after a pinned input moved or an artifact was demoted; decline else.

        A pinned input that moves (a new prompt's embeddings; an activation the allocator
        happened to put at the same address during warmup) becomes moving for good, with
        every other pinned input that moved too: each such re-capture makes progress, so
        they are bounded by the number of inputs and never end in a decline. Re-captures
        for demotions are bounded by MAX_RECAPTURES."""
        if reason is Decline.PINNED_INPUT_MOVED:
            assert entry.identity is not None
            moved = {p for p, ident in zip(entry.identity.positions, entry.identity.identities)
                     if p not in self._state and layout_identity(args[p]) != ident}
            self._recapture(entry, reason, detail, moved | {pos})
        elif reason is Decline.ARTIFACT_DEMOTED and entry.recaptures < MAX_RECAPTURES:
            entry.recaptures += 1
            self._recapture(entry, reason, detail, set())
        else:
            self._decline(entry, reason, detail)

    def _recapture(self, entry: Entry, reason: Decline, detail: str, now_moving: set[int]) -> None:
        with self._scope.replay_lock:  # no thread may be replaying what is released
            entry.release()
            entry.forced_moving |= now_moving
            entry.state, entry.observations = State.WARMING, []
        with self._stats.lock:
            self._stats.recaptures += 1
        self._scope.timing.note(f"recapture {self.name}: {reason.value}: {detail}")
        self._set_state()

    def _decline(self, entry: Entry, reason: Decline, detail: str) -> None:
        with self._scope.replay_lock:  # no thread may be replaying what is released
            entry.release()
            entry.state, entry.reason = State.EAGER, reason
        self._report(reason, detail)
        self._set_state()

    def _report(self, reason: Decline, detail: str) -> None:
        self._stats.decline(reason.value, detail)
        self._scope.timing.note(f"cuda_graph_declined {self.name}: {reason.value}: {detail}")
        self._scope.events.warn_once(
            f"decline:{reason.value}",
            "graphdispatch: CUDA graph declined for %s (%s): %s; that shape key runs eager from now on",
            self.name, reason.value, detail,
        )
        self._scope.events.decision("decline", {"runner": self.name, "reason": reason.value, "detail": detail})

    def _set_state(self) -> None:
        order = (State.EAGER, State.WARMING, State.CAPTURED, State.VERIFIED)
        states = self._book.states()
        self._stats.state = max(states, key=order.index).value if states else State.EAGER.value
