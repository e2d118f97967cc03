"""EagerCheck: prove the lowering against real eager, bit for bit, before trusting it.

Everything downstream (artifact gates, CUDA-graph verification) compares against the
*lowered* ATen graph. The lowering itself (aot) is not always bitwise equal to eager on
torch 2.13: a Linear after a permuted conv under CPU bf16 autocast is lowered to another
matmul path, and eval BatchNorm on a transposed input gets fake strides that make a later
view invalid at run time. So the first inference call per shape key (up to MAX_KEYS) also
runs the Dynamo graph itself, eagerly, on the same inputs: the inputs the graph mutates
are snapshotted and restored, and the RNG state is replayed, so both runs see the same
world. If the compiled outputs (values, strides) or the mutated inputs differ, or the
compiled graph raises where eager does not, the graph runs as the Dynamo graph, eagerly,
for the rest of the session (`lowering_mismatch` / `lowering_failed`), counted and said.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Contain, Decline, StrictModeError
from graphdispatch_backend.runtime.entry import layout_key
from graphdispatch_backend.runtime.gate import native_regions
from graphdispatch_backend.runtime.parity import compare
from graphdispatch_backend.runtime.scope import mark_entry

MAX_KEYS = 4


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _flat(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


class EagerCheck:
    def __init__(
        self,
        eager: Callable[..., Any],
        compiled: Callable[..., Any],
        record: GraphRecord,
        events: Events,
        contain: Contain,
        strict: bool,
        keyed: Sequence[int],
        mutated: Callable[[Sequence[Any]], list[torch.Tensor]],
        dynamic: bool,
        timing: Timing,
    ) -> None:
        self._eager = eager  # the Dynamo graph: the user's code, as Dynamo traced it
        self._compiled = compiled
        self._record = record
        self._events = events
        self._contain = contain
        self._strict = strict
        self._keyed = tuple(keyed)  # positions of call inputs (parameters are not keyed)
        self._mutated = mutated  # the tensors among the inputs the graph writes into
        self._checked: set[tuple[Any, ...]] = set()
        # A static graph has one shape key (Dynamo guards the shapes): check its first call.
        self._budget = MAX_KEYS if dynamic else min(1, MAX_KEYS)
        self._pending = self._budget > 0  # the hot path's one check once the budget is spent
        self._declined: Decline | None = None
        self._timing = timing if timing.enabled else None

    def __call__(self, *args: Any) -> Any:
        if self._timing is not None:
            mark_entry(self._timing.now())
        if self._declined is not None:
            out = self._eager(*args)
            self._record.called(False, self._declined.value)
            return out
        if self._pending:
            key = layout_key(map(args.__getitem__, self._keyed))
            if key not in self._checked and not self._needs_grad(args):
                self._checked.add(key)
                self._pending = len(self._checked) < self._budget
                return self._check(args)
        try:
            return self._compiled(*args)
        except RuntimeError as exc:  # free unless raised; torch's errors (CUDA's too) are RuntimeErrors
            return self._failed_later(args, exc)

    def _needs_grad(self, args: Sequence[Any]) -> bool:
        return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)

    def _check(self, args: Sequence[Any]) -> Any:
        mutated = self._mutated(args)
        before = [t.clone() for t in mutated]
        rng = _rng_state()
        raw, exc = self._contain(lambda: self._eager(*args))
        if exc is not None:  # eager itself raises: the compiled run answers, as it would have
            for t, b in zip(mutated, before):
                t.copy_(b)
            _set_rng_state(rng)
            return self._compiled(*args)
        expected = _flat(raw)
        after = [t.clone() for t in mutated]
        rng_after = _rng_state()
        for t, b in zip(mutated, before):
            t.copy_(b)
        _set_rng_state(rng)
        with native_regions():  # judge the lowering; each artifact's gate judges the artifact
            out, exc = self._contain(lambda: self._compiled(*args))
        if exc is not None:
            return self._decline(Decline.LOWERING_FAILED, f"raised {type(exc).__name__}: {exc}",
                                 raw, mutated, after, rng_after, counted=False)
        mismatch = compare(expected, _flat(out), "bitwise") or compare(after, mutated, "bitwise")
        if mismatch is not None:
            return self._decline(Decline.LOWERING_MISMATCH, f"differs from eager: {mismatch}", raw, mutated, after,
                                 rng_after, counted=True)
        with self._record.lock:
            self._record.eager_checks += 1
        return out

    def _decline(self, reason: Decline, detail: str, eager_out: Any, mutated: list[torch.Tensor],
                 after: list[torch.Tensor], rng_after: Any, counted: bool) -> Any:
        """Answer with eager's result and state, and run the Dynamo graph from now on."""
        for t, a in zip(mutated, after):
            t.copy_(a)
        _set_rng_state(rng_after)
        with self._record.lock:
            self._record.eager_checks += 1
        if not counted:  # the compiled call raised before it was counted
            self._record.called(False, reason.value)
        self._give_up(reason, detail)
        return eager_out

    def _give_up(self, reason: Decline, detail: str) -> None:
        """From now on the Dynamo graph runs: record why, mark the artifacts unused, say it
        once (or raise, under strict)."""
        self._declined = reason
        with self._record.lock:
            self._record.lowering = {"status": reason.value, "detail": detail}
        self._unused(reason)
        message = f"{self._record.name} runs as the Dynamo graph, eagerly: the compiled graph {detail}"
        self._events.decision("decline", {"graph": self._record.name, "reason": reason.value, "detail": detail})
        if self._strict:
            raise StrictModeError(message)
        self._events.warn_once(f"lowering:{reason.value}", "graphdispatch: %s (%s)", message, reason.value)

    def _unused(self, reason: Decline) -> None:
        """The graph's artifacts serve no call from now on (the Dynamo graph runs): say so
        where their verdicts are read, instead of leaving them `pending`."""
        for sub in self._record.substitutions:
            with sub.lock:
                if sub.parity == "pending":
                    sub.parity = "unused"
                    sub.detail = f"the graph runs as the Dynamo graph ({reason.value})"

    def _failed_later(self, args: Sequence[Any], exc: RuntimeError) -> Any:
        """The compiled graph raised on a call that was not checked: if eager answers the
        same inputs, the lowering is at fault; else the error is the user's own."""
        out = self._eager(*args)  # raises the user's own error if there is one
        self._record.called(False, Decline.LOWERING_FAILED.value)
        self._give_up(Decline.LOWERING_FAILED, f"raised {type(exc).__name__}: {exc}")
        return out
