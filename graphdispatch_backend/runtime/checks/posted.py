"""Posted: the statistics a fused graph took of its watched inputs inside its own kernels.

A fused graph may compute its novelty statistics itself (fusion/statistics.py: one more
output). Its unit strips that output and posts it here (runtime/program/fused_unit.py); the
eager check takes it after the call, and judges the call by it as a separate reduction
would have (runtime/checks/novelty.py `Novelty.judge`). One slot per thread: each thread's
call takes what its own run posted. A call that ran no unit (it raised first) finds
nothing, and is judged by a reduction of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch


class Posted:
    """The statistics of a unit's last run on each thread, in the order of `positions` (the
    graph's input positions the unit watches)."""

    def __init__(self, positions: Sequence[int]) -> None:
        self.positions = tuple(positions)
        self._local = threading.local()

    def put(self, stats: torch.Tensor) -> None:
        self._local.stats = stats

    def clear(self) -> None:
        self._local.stats = None

    def take(self) -> list[float] | None:
        """The values the last run on this thread posted (None: none since `clear`)."""
        stats = getattr(self._local, "stats", None)
        if stats is None:
            return None
        self._local.stats = None
        return stats.tolist()
