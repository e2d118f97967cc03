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


class Posted(threading.local):
    """The statistics a unit's last run posted, per thread (`stats`: a tensor, in the order of
    `positions`, the graph's input positions the unit watches; None since taken or cleared).
    The unit posts and the check clears by plain attribute writes: on every call of a fused
    graph, a method call each would add a Python frame, which inside a model's call (its
    kernels evict the frame's code) costs a few microseconds."""

    stats: torch.Tensor | None = None  # this thread's, until it posts

    def __init__(self, positions: Sequence[int]) -> None:  # run again in each thread, with the same positions
        self.positions = tuple(positions)

    def take(self) -> list[float] | None:
        """The values the last run on this thread posted (None: none since cleared)."""
        stats = self.stats
        if stats is None:
            return None
        self.stats = None
        return stats.tolist()
