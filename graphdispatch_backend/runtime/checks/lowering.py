"""Lowering: what a verdict of the eager check (runtime/checks/eager_check.py) does to its graph.

The check's policy over its side-by-side comparison (runtime/checks/side_by_side.py): who is
declined and who answers the call. A verdict on the lowering holds for the rest of the
session: the graph then runs as the Dynamo graph, eagerly, counted, recorded
(`lowering`), said once (or raised, under strict), and its artifacts marked unused. A call
that could not be checked (its snapshot refused or short of memory), and a compiled graph
that raises on a call that was not checked, are answered here too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.errors import Contain, Decline, SnapshotRefused, StrictModeError
from graphdispatch_backend.runtime.cudagraph.engine import is_out_of_memory


class Lowering:
    """One graph's lowering: trusted until a verdict declines it (`declined`)."""

    def __init__(self, eager: Callable[..., Any], compiled: Callable[..., Any], record: GraphRecord,
                 events: Events, contain: Contain, strict: bool) -> None:
        self._eager, self._compiled = eager, compiled
        self._record = record
        self._events = events
        self._contain = contain
        self._strict = strict
        self.declined: Decline | None = None

    def declined_call(self, args: Sequence[Any]) -> Any:
        """A call after the verdict: the Dynamo graph answers it, counted with the reason."""
        assert self.declined is not None
        return self._answer(args, self.declined)

    def _answer(self, args: Sequence[Any], reason: Decline) -> Any:
        """The Dynamo graph answers the call, counted with `reason` (where it raises, the
        caller's error, the call is counted `raised` as it leaves the check: eager_check.py)."""
        out = self._eager(*args)
        self._record.called(False, reason.value)
        record_fields.answered_natively(self._record)
        return out

    def verdict(self, reason: Decline, detail: str, answer: Any, gradients: Sequence[str] = ()) -> Any:
        """Answer with eager's result and world (`answer`), and run the Dynamo graph from now on."""
        with self._record.lock:
            self._record.eager_checks += 1
        self.give_up(reason, detail, gradients)
        return answer

    def unsnapshotted(self, args: Sequence[Any], exc: Exception) -> Any:
        """What this call writes could not be snapshotted, so it is not checked. Too large
        for max_snapshot_bytes (it always will be): the compiled graph answers, unchecked,
        and the report says why. Memory short this once: the Dynamo graph answers (eager's
        values), and the next due call tries again. Anything else: check_failed, once the
        Dynamo graph answered the call; where it raises too, the inputs are the caller's error
        (a position past a static cache's end, which locating the rows to snapshot reads
        first): it is raised as eager raises it, and no verdict falls on the lowering."""
        if isinstance(exc, SnapshotRefused):
            record_fields.unchecked(self._record, exc.detail)
            self._events.warn_once(f"unchecked:{self._record.name}", "graphdispatch: %s is not checked against "
                                   "eager: %s", self._record.name, exc.detail)
            return self._compiled(*args)
        if is_out_of_memory(exc):
            record_fields.unchecked(self._record, f"snapshotting what the call writes ran out of memory: {exc}")
            return self._answer(args, Decline.OUT_OF_MEMORY)
        out = self._answer(args, Decline.CHECK_FAILED)  # raises the caller's own error, if that is what it was
        self.give_up(Decline.CHECK_FAILED, f"snapshot of the written inputs raised {type(exc).__name__}: {exc}")
        return out

    def own(self, step: Callable[[], Any]) -> None:
        """One of graphdispatch's own steps around a check (putting the world back): a raise declines."""
        _, exc = self._contain(step)
        if exc is not None:
            self.give_up(Decline.CHECK_FAILED, f"restoring the mutated inputs raised {type(exc).__name__}: {exc}")

    def give_up(self, reason: Decline, detail: str, gradients: Sequence[str] = ()) -> None:
        """From now on the Dynamo graph runs: record why, mark the artifacts unused, say it
        once (or raise, under strict)."""
        self.declined = reason
        record_fields.lowering_declined(self._record, reason, detail, gradients)
        self._unused(reason)
        message = f"{self._record.name} runs as the Dynamo graph, eagerly ({reason.value}): {detail}"
        self._events.decision("decline", {"graph": self._record.name, "reason": reason.value, "detail": detail})
        if self._strict:
            raise StrictModeError(message)
        self._events.warn_once(f"lowering:{reason.value}", "graphdispatch: %s", message)

    def _unused(self, reason: Decline) -> None:
        """The graph's artifacts serve no call from now on (the Dynamo graph runs): say so
        where their verdicts are read, instead of leaving them `pending`."""
        for sub in self._record.substitutions:
            record_fields.unused(sub, reason)

    def failed_later(self, args: Sequence[Any], exc: RuntimeError) -> Any:
        """The compiled graph raised on a call that was not checked: if eager answers the
        same inputs, the lowering is at fault; else the error is the user's own."""
        out = self._eager(*args)  # raises the user's own error if there is one
        record_fields.answered_natively(self._record)
        if is_out_of_memory(exc):  # memory was short this once: no verdict on the lowering
            self._record.called(False, Decline.OUT_OF_MEMORY.value)
            return out
        self._record.called(False, Decline.LOWERING_FAILED.value)
        self.give_up(Decline.LOWERING_FAILED, f"the compiled graph raised {type(exc).__name__}: {exc}")
        return out
