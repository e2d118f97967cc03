"""Kin: the gates one kernel serves one kind of region through, so that a fault of the
kernel met at one of them keeps it from all of them.

A model compiled whole puts a gate at each region an artifact serves (`blocks.0.mlp`,
`blocks.1.mlp`): each judges its own calls on its own schedule. A kernel's fault is the
kernel's, not the region's: a kernel one ulp off above a magnitude, caught at block 1's
second call, kept serving block 0 and served it a wrong value at an unchecked call (a trial,
2026-12-07), where the same model compiled block by block shares one gate and one catch
demotes it everywhere. Kin are the gates of one artifact over regions of one fingerprint
(one graph of ATen ops over the same shapes: the same kind): one demoted for a fault of the
kernel's (its values, its outputs, its writes, its raise, its draws, its settings) demotes
the others, said as `demoted_elsewhere` naming the region and what was found there. Being
slower than native (`slower`) is the region's, and stays there. The gates are held weakly:
a dropped graph's gates leave.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from graphdispatch_backend.errors import Demotion


class Kin:
    """The gates of one artifact over one kind of region (module docstring)."""

    def __init__(self) -> None:
        self._gates: list[weakref.ref[Any]] = []
        self._lock = threading.Lock()

    def join(self, gate: Any) -> None:
        with self._lock:
            self._gates = [g for g in self._gates if g() is not None]
            self._gates.append(weakref.ref(gate))

    def demoted(self, gate: Any, region: str, reason: Demotion, detail: str) -> None:
        """`gate` (at `region`) was demoted for `reason`: its kin are too, unless the reason is
        the region's own (slower)."""
        if reason is Demotion.SLOWER:
            return
        with self._lock:
            others = [g for g in (r() for r in self._gates) if g is not None and g is not gate]
        for other in others:  # outside the lock: each takes none of ours
            other.kin_demoted(region, reason, detail)
