"""Recheck: on which calls a graph is checked against eager, for as long as it lives.

A check runs the Dynamo graph eagerly beside the served call and compares, bit for bit
(runtime/eager_check.py): it judges the capture, the lowering and every artifact inside at
once. Checks never stop: an artifact or a lowering wrong for some values only is met when
such values come, not only in the first calls. The `recheck` option picks the calls, per
shape key:

- "doubling" (the default): the 1st, 2nd, 4th, 8th, ... call; the interval doubles up to
  CAP calls and stays there. From JITTER_FROM on, each position moves by up to a quarter of
  its interval, drawn from a generator seeded by the graph and the key (the same on every
  rank, so ranks check the same calls): inputs that repeat with a period cannot hide from
  it. A check costs one eager run, so this costs 1/CAP of an eager run per call for good.
- an integer N: the first call and every Nth after it;
- "every": every call (artifact authors' CI; what `timing="shadow"` implies).
"""

from __future__ import annotations

import random

CAP = 1024  # the longest interval between two checks, in calls
JITTER_FROM = 16  # intervals from this long on are jittered


class Due:
    """One shape key's schedule: called once per call, true on a checked call."""

    __slots__ = ("_every", "_gap", "_next", "_rng", "last", "n", "previous")

    def __init__(self, mode: str | int, seed: str) -> None:
        self.n = 0
        self.last = self.previous = 0  # the last checked call, and the one before it
        self._next = 1
        self._every = 1 if mode == "every" else mode if isinstance(mode, int) else 0
        self._gap = 1
        self._rng: random.Random | None = random.Random(seed) if self._every == 0 else None

    def __call__(self) -> bool:
        n = self.n = self.n + 1
        if n < self._next:
            return False
        self.previous, self.last = self.last, n
        if self._every:
            self._next = n + self._every
            return True
        gap = self._gap = min(max(self._gap, n), CAP)  # 1, 2, 4, ... then CAP
        if gap >= JITTER_FROM:
            assert self._rng is not None
            gap += self._rng.randint(-(gap // 4), gap // 4)
        self._next = n + gap
        return True
