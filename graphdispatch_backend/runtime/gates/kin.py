"""Kin: the gates one kernel serves its regions through, so that a fault of the kernel met
at one of them keeps it from the others.

A model compiled whole puts a gate at each region an artifact serves (`blocks.0.mlp`,
`blocks.1.mlp`): each judges its own calls on its own schedule. A kernel's fault is the
kernel's, not the region's: a kernel one ulp off above a magnitude, caught at block 1's
second call, kept serving block 0 and served it a wrong value at an unchecked call (a trial,
2026-12-07), where the same model compiled block by block shares one gate and one catch
demotes it everywhere. Kin are the gates of one artifact; a kind is the regions of one
fingerprint (one graph of ATen ops over the same shapes). One gate demoted for a fault of
the kernel's demotes the others, said as `demoted_elsewhere` naming the region and what was
found there:

- its values (`parity`), a write it does not declare, a draw, a process-wide setting
  changed: at every region it serves, of every kind. No shape explains such a fault away:
  a kernel one ulp off above a magnitude, demoted at an LLM's decode graph, kept serving
  the prefill graph's replays (another kind: other shapes, the same module) and gave a
  request wrong logits at a call no schedule checked (a trial, 2026-12-07);
- a raise, an output of the wrong count, shape, dtype or strides: at the regions of the
  same kind. These follow the shapes and never serve a wrong value: a gate meets them at
  the first call of each of its shape keys, which it checks.

A demotion stands for the session: a gate made later (a graph compiled after the catch: a
new prompt length's prefill) joins demoted, where the fault reaches its kind (a trial's
kernel, caught in one prefill graph on a rank, came back in the next prompt length's
graph and served 3 more wrong decode steps before it was caught there again).

Being slower than native (`slower`) is the region's, and stays there. The gates are held
weakly: a dropped graph's gates leave.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from graphdispatch_backend.errors import Demotion

# faults that follow the shapes a kernel is given (module docstring): kept to the kind
_OF_THE_KIND = frozenset({Demotion.RAISED, Demotion.BAD_OUTPUT})


class Kin:
    """The gates of one artifact, each with the kind of its region (module docstring)."""

    def __init__(self) -> None:
        self._gates: list[tuple[weakref.ref[Any], str]] = []
        self._standing: list[tuple[str, str, Demotion, str]] = []  # (fingerprint, region, reason, detail)
        self._lock = threading.Lock()

    def kind(self, fingerprint: str) -> KindOf:
        """What a gate at a region of this `fingerprint` joins and reports to."""
        return KindOf(self, fingerprint)

    def join(self, gate: Any, fingerprint: str) -> None:
        """`gate` serves a region of the kind `fingerprint`: demoted now where a fault of the
        kernel's met before reaches it (module docstring)."""
        with self._lock:
            self._gates = [(g, f) for g, f in self._gates if g() is not None]
            self._gates.append((weakref.ref(gate), fingerprint))
            standing = next(((region, reason, detail) for f, region, reason, detail in self._standing
                             if _reaches(reason, f, fingerprint)), None)
        if standing is not None:
            gate.kin_demoted(*standing)

    def demoted(self, gate: Any, fingerprint: str, region: str, reason: Demotion, detail: str) -> None:
        """`gate` (at `region`, of the kind `fingerprint`) was demoted for `reason`: its kin are
        too, of every kind or of its own (module docstring), unless the reason is the region's own."""
        if reason is Demotion.SLOWER:
            return
        with self._lock:
            self._standing.append((fingerprint, region, reason, detail))
            others = [g for g, f in ((r(), f) for r, f in self._gates) if g is not None and g is not gate
                      and _reaches(reason, fingerprint, f)]
        for other in others:  # outside the lock: each takes none of ours
            other.kin_demoted(region, reason, detail)


def _reaches(reason: Demotion, where: str, kind: str) -> bool:
    """A demotion for `reason` at a region of the kind `where` demotes the kernel at the
    regions of the kind `kind` (module docstring)."""
    return kind == where or reason not in _OF_THE_KIND


class KindOf:
    """A gate's handle on its kin, naming its region's kind."""

    __slots__ = ("_fingerprint", "_kin")

    def __init__(self, kin: Kin, fingerprint: str) -> None:
        self._kin, self._fingerprint = kin, fingerprint

    def join(self, gate: Any) -> None:
        self._kin.join(gate, self._fingerprint)

    def demoted(self, gate: Any, region: str, reason: Demotion, detail: str) -> None:
        self._kin.demoted(gate, self._fingerprint, region, reason, detail)
