"""GraphRunner: warmup -> capture -> verify -> replay for one capturable piece.

One entry per shape key (tensor shapes and strides of the non-parameter inputs, plus the
type and value of every scalar input: a changed bool or int is captured anew under its own
key, never replayed stale). Per entry:

1. warming: `warmup` eager calls, each recording every tensor input's layout identity.
2. capture: scalars are constants (in the key); tensors whose identity never changed are
   pinned (read in place, checked on every replay); the rest are moving (copied into
   shared static buffers). Parameters and buffers must be pinned: if one moves, decline.
3. captured: replay and compare with eager, bit for bit, on `verify_inputs` distinct live
   input sets (the capture call's own inputs count as the first). Eager answers meanwhile.
4. verified: check identities, copy in, replay, return clones of the outputs.

A refusal is a CudaGraphUnavailable with a typed Decline: the entry goes eager for good
(its artifacts stay active), counted and logged once. A pinned *input* that moves (a new
prompt's embeddings) is re-captured as moving, at most twice per entry.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.errors import CudaGraphUnavailable, Decline
from graphdispatch_backend.runtime.contract import LayoutIdentity, layout_identity
from graphdispatch_backend.runtime.engine import CapturedGraph
from graphdispatch_backend.runtime.parity import bitwise_equal, compare
from graphdispatch_backend.runtime.scope import RuntimeScope

MAX_RECAPTURES = 2
NOT_DISTINCT_LIMIT = 8
_CONSTANT_OUTPUTS = (type(None), bool, int, float)
_tls = threading.local()


def begin_call() -> None:
    _tls.reason = None


def mark_eager(reason: str) -> None:
    """Record (once per graph call) why some piece ran eager."""
    if getattr(_tls, "reason", None) is None:
        _tls.reason = reason


def end_call() -> str | None:
    reason, _tls.reason = getattr(_tls, "reason", None), None
    return reason


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides as the static output (a chunk of a wider tensor keeps
    its row stride), so replayed outputs match eager's layout, not only its values."""
    if t.is_contiguous() or torch._debug_has_internal_overlap(t) != 0:
        return t.clone()
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)


class State(str, enum.Enum):
    EAGER = "eager"
    WARMING = "warming"
    CAPTURED = "captured"
    VERIFIED = "verified"


@dataclasses.dataclass
class _Entry:
    key: tuple[Any, ...]
    state: State = State.WARMING
    observations: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    forced_moving: set[int] = dataclasses.field(default_factory=set)
    graph: CapturedGraph | None = None
    static_args: list[Any] = dataclasses.field(default_factory=list)
    moving: tuple[tuple[int, torch.Tensor], ...] = ()
    identity: LayoutIdentity | None = None
    template: tuple[Any, ...] = ()  # None for a tensor output, the value for a constant one
    gate_state: tuple[bool, ...] = ()
    verified: int = 0
    last_inputs: list[torch.Tensor] | None = None
    waits: int = 0
    recaptures: int = 0
    reason: Decline | None = None

    def release(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.static_args, self.moving, self.identity, self.last_inputs = None, [], (), None, None


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
    ) -> None:
        self._fn = fn
        self.name = name
        self._scope = scope
        self._stats = stats
        self._warmup = warmup
        self._max_captures = max_captures
        self._verify_inputs = verify_inputs
        self._state = state_names  # position -> parameter/buffer name
        self._gates = tuple(gates)
        self._entries: dict[tuple[Any, ...], _Entry] = {}
        self._lock = threading.Lock()
        self._timing = scope.timing if scope.timing.enabled else None
        self._key_positions: tuple[int, ...] | None = None

    # -- the call -------------------------------------------------------------------
    def __call__(self, *args: Any) -> Sequence[Any]:
        key = self._key(args)
        entry = self._entries.get(key)
        if entry is not None and entry.state is State.VERIFIED:
            return self._replay(entry, args)
        if entry is None:
            if len(self._entries) >= self._max_captures:
                if not self._stats.declines.get(Decline.MAX_CAPTURES.value):
                    self._report(Decline.MAX_CAPTURES, f"more than {self._max_captures} shape keys")
                return self._eager(args, Decline.MAX_CAPTURES)
            entry = self._entries.setdefault(key, _Entry(key))
            self._stats.shape_keys = len(self._entries)
        if entry.state is State.EAGER:
            return self._eager(args, entry.reason or Decline.BUSY)
        if not self._lock.acquire(blocking=False):
            return self._eager(args, Decline.BUSY)
        try:
            return self._advance(entry, args)
        finally:
            self._lock.release()

    def _key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        positions = self._key_positions
        if positions is None:  # parameters are checked by identity, not keyed
            positions = self._key_positions = tuple(i for i in range(len(args)) if i not in self._state)
        return tuple(
            (a.shape, a.stride()) if isinstance(a, torch.Tensor) else (type(a), a)
            for a in map(args.__getitem__, positions)
        )

    def _eager(self, args: Sequence[Any], reason: Decline) -> Sequence[Any]:
        mark_eager(reason.value)
        self._stats.eager(reason.value)
        return self._fn(*args)

    # -- warming and capture ----------------------------------------------------------
    def _advance(self, entry: _Entry, args: Sequence[Any]) -> Sequence[Any]:
        if entry.state is State.CAPTURED:
            return self._verify(entry, args, first=False)
        if entry.state is not State.WARMING:  # another thread moved it on meanwhile
            return self._eager(args, entry.reason or Decline.BUSY)
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

    def _capture(self, entry: _Entry, args: Sequence[Any]) -> None:
        first = entry.observations[0]
        stable = {
            i for i, ident in enumerate(first)
            if ident is not None and all(o[i] == ident for o in entry.observations)
        }
        for pos, name in self._state.items():
            if pos not in stable:
                raise CudaGraphUnavailable(Decline.PARAMETER_MOVED, f"{name} changed address or layout during warmup")
        tensors = [i for i, ident in enumerate(first) if ident is not None]
        moving = [i for i in tensors if (i not in stable or i in entry.forced_moving) and i not in self._state]
        pinned = [i for i in tensors if i not in moving]
        static_args = list(args)
        buffers = []
        for pos in moving:
            buf = self._scope.buffers.get(pos, args[pos])
            buf.copy_(args[pos])
            static_args[pos] = buf
            buffers.append((pos, buf))
        with self._scope.replay_lock:
            graph, exc = self._scope.contain(lambda: self._scope.engine.capture(self._fn, static_args))
        if exc is not None:
            raise CudaGraphUnavailable(Decline.CAPTURE_FAILED, f"{type(exc).__name__}: {exc}")
        template = []
        for i, out in enumerate(graph.outputs):
            if isinstance(out, torch.Tensor):
                template.append(None)
            elif isinstance(out, _CONSTANT_OUTPUTS):
                template.append(out)
            else:
                graph.reset()
                raise CudaGraphUnavailable(Decline.NON_TENSOR_OUTPUT, f"output {i} is a {type(out).__name__}")
        entry.graph, entry.static_args, entry.moving = graph, static_args, tuple(buffers)
        entry.identity = LayoutIdentity(pinned, args)
        entry.template = tuple(template)
        entry.gate_state = tuple(g.demoted for g in self._gates)
        entry.state, entry.verified, entry.waits = State.CAPTURED, 0, 0
        with self._stats.lock:
            self._stats.captures += 1
            self._stats.static_bytes = self._scope.buffers.nbytes
        self._set_state()

    # -- verification ---------------------------------------------------------------
    def _verify(self, entry: _Entry, args: Sequence[Any], first: bool) -> Sequence[Any]:
        if not first:
            problem = self._check(entry, args)
            if problem is not None:
                return self._mismatch(entry, args, *problem)
            if entry.moving and entry.last_inputs is not None and all(
                bitwise_equal(args[pos], prev) for (pos, _), prev in zip(entry.moving, entry.last_inputs)
            ):
                entry.waits += 1
                if entry.waits > NOT_DISTINCT_LIMIT:
                    self._decline(entry, Decline.VERIFY_NOT_DISTINCT,
                                  f"{entry.waits} calls in a row repeated the verified inputs' values")
                return self._eager(args, Decline.VERIFYING)
        with self._scope.replay_lock:
            replayed, exc = self._scope.contain(lambda: self._serve(entry, args))
        expected = self._eager(args, Decline.VERIFYING)
        if exc is not None:
            self._decline(entry, Decline.REPLAY_FAILED, f"{type(exc).__name__}: {exc}")
            return expected
        mismatch = self._compare(expected, replayed)
        if mismatch is not None:
            self._decline(entry, Decline.VERIFY_MISMATCH, str(mismatch))
            return expected
        entry.verified += 1
        if entry.verified >= self._verify_inputs:
            entry.state, entry.last_inputs = State.VERIFIED, None
            self._set_state()
        else:
            entry.last_inputs = [args[pos].clone() for pos, _ in entry.moving]
        return expected

    def _compare(self, expected: Sequence[Any], replayed: Sequence[Any]) -> Any:
        return compare(list(expected), list(replayed), "bitwise")

    # -- replay ---------------------------------------------------------------------
    def _replay(self, entry: _Entry, args: Sequence[Any]) -> Sequence[Any]:
        with self._scope.replay_lock:
            problem = self._check(entry, args)
            if problem is None and entry.state is State.VERIFIED:
                out = self._serve(entry, args)
                self._stats.replayed()
                return out
        with self._lock:
            if problem is None:  # raced with a state change: answer eagerly this once
                return self._eager(args, entry.reason or Decline.BUSY)
            return self._mismatch(entry, args, *problem)

    def _check(self, entry: _Entry, args: Sequence[Any]) -> tuple[Decline, str, int] | None:
        if self._gates and tuple(g.demoted for g in self._gates) != entry.gate_state:
            return Decline.ARTIFACT_DEMOTED, "an artifact in this piece was demoted after capture", -1
        pos = entry.identity.mismatch(args) if entry.identity is not None else None
        if pos is None:
            return None
        if pos in self._state:
            return Decline.PARAMETER_MOVED, f"{self._state[pos]} moved under the captured graph", pos
        return Decline.PINNED_INPUT_MOVED, f"input {pos} is not the tensor the graph was captured with", pos

    def _serve(self, entry: _Entry, args: Sequence[Any]) -> list[Any]:
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

    def _copy_in(self, entry: _Entry, args: Sequence[Any]) -> None:
        for pos, buf in entry.moving:
            buf.copy_(args[pos])

    def _clone_outputs(self, entry: _Entry) -> list[Any]:
        assert entry.graph is not None
        return [_copy(o) if t is None else t for o, t in zip(entry.graph.outputs, entry.template)]

    # -- refusals -------------------------------------------------------------------
    def _mismatch(self, entry: _Entry, args: Sequence[Any], reason: Decline, detail: str, pos: int) -> Sequence[Any]:
        if reason in (Decline.PINNED_INPUT_MOVED, Decline.ARTIFACT_DEMOTED):
            entry.recaptures += 1
            if entry.recaptures > MAX_RECAPTURES:
                self._decline(entry, Decline.PINNED_INPUT_CHURN if pos >= 0 else reason,
                              f"{detail}; re-captured {MAX_RECAPTURES} times already")
            else:
                entry.release()
                if pos >= 0:
                    entry.forced_moving.add(pos)
                entry.state, entry.observations = State.WARMING, []
                with self._stats.lock:
                    self._stats.recaptures += 1
                self._scope.timing.note(f"recapture {self.name}: {reason.value}: {detail}")
                self._set_state()
        else:
            self._decline(entry, reason, detail)
        return self._eager(args, reason)

    def _decline(self, entry: _Entry, reason: Decline, detail: str) -> None:
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
        states = [e.state for e in list(self._entries.values())]
        self._stats.state = max(states, key=order.index).value if states else State.EAGER.value
