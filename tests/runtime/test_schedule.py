"""The recheck schedule (runtime/schedule.py): which calls are checked against eager, for as
long as a graph lives: doubling up to an interval of CAP calls, jittered so that periodic
inputs cannot hide, the same on every rank; every Nth; every."""

from __future__ import annotations

from graphdispatch_backend.runtime import schedule
from graphdispatch_backend.runtime.schedule import CAP, Due


def _checked(mode: str | int, calls: int, seed: str = "graph_0") -> list[int]:
    due = Due(mode, seed)
    return [n for n in range(1, calls + 1) if due()]


def test_doubling_then_capped_and_never_stopping():
    checked = _checked("doubling", 20000)
    assert checked[:5] == [1, 2, 4, 8, 16]
    gaps = [b - a for a, b in zip(checked, checked[1:])]
    assert max(gaps) <= CAP + CAP // 4  # capped (jitter included)
    assert len([n for n in checked if n > 10000]) >= 7  # checks go on for the graph's whole life
    assert checked[-1] > 20000 - CAP - CAP // 4


def test_positions_are_jittered_so_a_period_cannot_hide():
    checked = _checked("doubling", 50000)
    late = [n for n in checked if n > 5000]
    assert len({n % 10 for n in late}) > 3  # a bad input every 10th call meets a check
    assert _checked("doubling", 50000, "graph_0") == checked  # the same on every rank
    assert _checked("doubling", 50000, "graph_1") != checked


def test_every_nth_and_every_call():
    assert _checked(3, 10) == [1, 4, 7, 10]
    assert _checked("every", 5) == [1, 2, 3, 4, 5]


def test_without_jitter_a_periodic_bad_input_is_never_met(monkeypatch):
    """The rule removed: checks at multiples of the capped interval only ever see the same
    phase of a period that divides it."""
    monkeypatch.setattr(schedule, "JITTER_FROM", 10**9)
    late = [n for n in _checked("doubling", 50000) if n > 5000]
    assert len({n % 8 for n in late}) == 1
