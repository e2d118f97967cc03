"""CheckBook: which eager calls of an artifact are checked, and what it served unchecked.

Each shape key has its own `artifact_recheck` schedule over its eager calls (the gate's
first call included: runtime/checks/schedule.py). Every call the artifact serves is counted
in its region's record, checked or not: `served_since_check` (the run of calls served since
its last check) and `largest_gap` (the longest such run); a re-check that demotes it says
the call that caught it and the calls served unchecked before (`caught_at_call`,
`unchecked_calls`).
"""

from __future__ import annotations

from typing import Any

from graphdispatch_backend.diagnostics.report import SubstitutionRecord
from graphdispatch_backend.runtime.checks.schedule import KeyedDue


class CheckBook:
    def __init__(self, recheck: str | int, record: SubstitutionRecord) -> None:
        self._record = record
        # the artifact_recheck option, per shape key, over its eager calls (the gate's included)
        self._schedules = KeyedDue(recheck, f"{record.artifact}:{record.region}")
        self._closed = 0  # the unchecked run a check inside a whole-graph check closed (put back if it fails)

    def due(self, key: tuple[Any, ...]) -> bool:
        """Whether this eager call of shape key `key` is checked (the `artifact_recheck` schedule)."""
        return self._schedules(key)()

    def served(self, checked: bool, replayed: bool = False) -> None:
        """Count one call the artifact served, and the run of calls it served unchecked."""
        record = self._record
        with record.lock:
            if replayed:
                record.replays += 1
            else:
                record.calls += 1
            if checked:
                self._closed, record.served_since_check = record.served_since_check, 0
            else:
                record.served_since_check += 1
                record.largest_gap = max(record.largest_gap, record.served_since_check)

    def reopen(self) -> None:
        """The whole-graph check that counted the last call as checked failed: its run of
        unchecked calls stands."""
        with self._record.lock:
            self._record.served_since_check = self._closed

    def caught(self, key: tuple[Any, ...]) -> str:
        """A re-check failed: the call of its shape key that caught it, and the calls the
        artifact served unchecked since the check before, said and recorded."""
        due = self._schedules.get(key)
        record = self._record
        with record.lock:
            unchecked = record.served_since_check
            record.caught_at_call, record.unchecked_calls = (due.n if due else None), unchecked
        if due is None:
            return ""
        return (f"; caught at call {due.n} of its shape key by the artifact_recheck schedule (the check before: "
                f"call {due.previous}); {unchecked} call(s) served unchecked since its last check")
