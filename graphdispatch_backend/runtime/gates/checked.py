"""CheckBook: which eager calls of an artifact are checked, and what it served unchecked.

Each shape key has its own `artifact_recheck` schedule over its eager calls (the gate's
first call included: runtime/checks/schedule.py); an eager call whose region inputs leave
what the checked calls saw is checked too (runtime/checks/novelty.py). Every call the artifact serves is counted
in its region's record, checked or not: `served_since_check` (the run of calls served since
its last check) and `largest_gap` (the longest such run); a re-check that demotes it says
the call that caught it and the calls served unchecked before (`caught_at_call`,
`unchecked_calls`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.diagnostics.report import SubstitutionRecord
from graphdispatch_backend.runtime.checks.novelty import Novelty, Observation
from graphdispatch_backend.runtime.checks.schedule import WRITTEN, Instances, KeyedDue

Check = tuple[bool, "Observation | None", "str | None"]  # due; what the call saw; why it is new (or None)


class CheckBook:
    def __init__(self, recheck: str | int, record: SubstitutionRecord, novelty: Novelty | None = None,
                 state: Sequence[int] = ()) -> None:
        self._record = record
        # the artifact_recheck option, per shape key and per state (`state`: the region's
        # parameters among its inputs; blocks compiled one by one share this gate, each with its
        # own weights: runtime/checks/schedule.py), over its eager calls (the gate's included)
        self._schedules = KeyedDue(recheck, f"{record.artifact}:{record.region}")
        self._instances = Instances(state, state)  # ... and writes into those weights (a new checkpoint)
        self._closed = 0  # the unchecked run a check inside a whole-graph check closed (put back if it fails)
        # eager calls whose region inputs leave what the checked calls saw are checked too
        self._novelty = novelty if novelty is not None and novelty.on else None

    def due(self, key: tuple[Any, ...], inputs: Sequence[Any]) -> bool:
        """Whether this eager call of shape key `key` is checked (the `artifact_recheck` schedule)."""
        return self._schedules(self._instances.key(key, inputs))()

    def take(self, key: tuple[Any, ...], inputs: Sequence[Any]) -> Check:
        """Whether this eager call of shape key `key` is checked: by the schedule, or for its
        new inputs (runtime/checks/novelty.py: then `why` says what is new); and what it
        saw, which counts as seen once the call was checked (`Observation.checked`)."""
        due = self._schedules(self._instances.key(key, inputs))
        scheduled = due()
        seen = self._novelty.observe(inputs) if self._novelty is not None else None
        why = None if scheduled or seen is None else seen.why
        if why is None and not scheduled and self._instances.written:
            why = WRITTEN
        if why is not None:
            due.checked_now()
        return scheduled or why is not None, seen, why

    def first(self, key: tuple[Any, ...], inputs: Sequence[Any]) -> Observation | None:
        """A shape key's first call, checked whatever the schedule: its schedule starts here;
        what it saw, to count as seen."""
        self._schedules(self._instances.key(key, inputs))()
        return self._novelty.observe(inputs) if self._novelty is not None else None

    def novel_check(self) -> None:
        """A check made for novel inputs, counted."""
        with self._record.lock:
            self._record.novelty_checks += 1

    def served(self, checked: bool, replayed: bool = False) -> None:
        """Count one call the artifact served, and the run of calls it served unchecked."""
        record = self._record
        with record.lock:
            if replayed:
                record.replays += 1
            else:
                record.calls += 1
            if checked:
                self._close()
            else:
                record_fields.served_unchecked(record, record.served_since_check + 1)

    def caught_in_graph_check(self) -> str:
        """A re-check at a check of its graph against eager failed (an allclose artifact's,
        runtime/gates/gate.py `_reference_call`): the region's call that caught it, and the
        calls it served unchecked since its last check (replays included), said and recorded."""
        record = self._record
        with record.lock:
            unchecked = record.served_since_check
            n = record.calls + record.replays + record.native_calls  # this one's native run counted
            record_fields.substitution_caught(record, n, unchecked, "recheck")
        return (f"; caught at the region's call {n} by a check of its graph against eager, where it answers "
                f"natively; {unchecked} call(s) served unchecked since its last check")

    def judged(self) -> None:
        """A check passed on a call it did not serve (native answered): the run of calls it
        served unchecked ends there."""
        with self._record.lock:
            self._close()

    def _close(self) -> None:
        """Under the record's lock: the run of calls served unchecked ends (kept for `reopen`)."""
        self._closed = self._record.served_since_check
        record_fields.checked_run(self._record, 0)

    def reopen(self) -> None:
        """The whole-graph check that counted the last call as checked failed: its run of
        unchecked calls stands."""
        with self._record.lock:
            record_fields.checked_run(self._record, self._closed)

    def caught(self, key: tuple[Any, ...], inputs: Sequence[Any], novel: str | None = None) -> str:
        """A re-check failed: the call of its shape key that caught it, by which check (the
        schedule, or `novel` inputs), and the calls the artifact served unchecked since the
        check before, said and recorded."""
        due = self._schedules.get(self._instances.key(key, inputs))
        record = self._record
        with record.lock:
            unchecked = record.served_since_check
            record_fields.substitution_caught(record, due.n if due else None, unchecked,
                                              "novelty" if novel is not None else "artifact_recheck")
        if due is None:
            return ""
        by = f"a check for novel inputs ({novel})" if novel is not None else "the artifact_recheck schedule"
        return (f"; caught at call {due.n} of its shape key by {by} (the check before: call {due.previous}); "
                f"{unchecked} call(s) served unchecked since its last check")
