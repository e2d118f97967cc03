"""Tolerance: how a graph fused under a declared tolerance (`fuse={"rtol": r, "atol": a}`)
is judged by the eager check, and the largest error its served calls showed.

A check compares the served call with eager as every check does (runtime/checks/eager_check.py),
but a value passes where `|served - eager| <= atol + rtol * |eager|`, as an artifact's
`allclose` parity: dtype, shape, strides, aliasing, and the places of NaN and inf stay
exact (runtime/checks/parity.py `compare`). The written inputs (a cache's rows) are judged
the same way. Every call judged within the tolerance adds its errors to the graph's
`fusion.largest_error`: the largest absolute error (and where), the largest relative error
(over elements eager did not make 0; and where), and `budget`, the largest share of the
tolerance one element used (`|served - eager| / (atol + rtol * |eager|)`, at most 1 on a
call that passed). Nothing here grows with an output beyond a bounded chunk of float64.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection, Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics.fusion_report import FusionReport
from graphdispatch_backend.runtime.checks.parity import Mismatch, compare, unravel

_CHUNK = 1 << 20  # elements per float64 copy


class Tolerance:
    """One graph's declared tolerance, and the errors its checks saw (into `report`, the
    graph's `fusion` report entry)."""

    def __init__(self, rtol: float, atol: float, report: FusionReport) -> None:
        self.rtol, self.atol = rtol, atol
        self._report = report
        self._lock = threading.Lock()
        report.tolerance(rtol, atol)

    def compare(self, expected: Sequence[Any], actual: Sequence[Any], check_strides: bool = True,
                skip: Collection[int] = ()) -> Mismatch | None:
        """Within the tolerance (parity.compare's allclose); `skip`: outputs whose values are
        nobody's (compared but for their values)."""
        return compare(expected, actual, "allclose", self.rtol, self.atol, check_strides, skip)

    def judged(self, within: bool) -> None:
        """Count one check of the fused graph: within the tolerance, or beyond it."""
        with self._lock:
            self._report.fields["checks"] += 1
            if not within:
                self._report.fields["beyond"] += 1

    def observe(self, call: int, expected: Sequence[Any], actual: Sequence[Any], what: str = "output") -> None:
        """Add one served call's errors (outputs, or written inputs: `what`)."""
        for i, (e, a) in enumerate(zip(expected, actual)):
            if not (isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor)) or e.shape != a.shape \
                    or not e.is_floating_point() or e.numel() == 0:
                continue
            peaks = self._peaks(e, a)
            with self._lock:
                largest = self._report.fields.get("largest_error") or {
                    "abs": 0.0, "abs_at": None, "rel": 0.0, "rel_at": None, "budget": 0.0, "budget_at": None}
                kept = False
                for kind, value, index in peaks:  # where: said only for a value kept
                    if value > largest[kind] or largest[f"{kind}_at"] is None:
                        where = f"{what} {i} {list(unravel(index, e.shape))}, call {call}"
                        largest[kind], largest[f"{kind}_at"], kept = value, where, True
                if kept:
                    self._report.largest_error(largest)

    def _peaks(self, e: torch.Tensor, a: torch.Tensor) -> list[tuple[str, float, int]]:
        """(kind, largest value, its flat index) for abs, rel and budget over finite elements:
        the three maxima taken in one reduction and read back in one call (a check measures
        every output: in a small graph its cost is the number of operations, not the size);
        an output served with eager's exact values has none to measure (all three 0, at 0)."""
        if e.dtype == a.dtype and not (e.is_conj() or e.is_neg() or a.is_conj() or a.is_neg()) and torch.equal(e, a):
            return [("abs", 0.0, 0), ("rel", 0.0, 0), ("budget", 0.0, 0)]
        flat_e, flat_a = e.detach().reshape(-1), a.detach().reshape(-1)
        best: dict[str, tuple[float, int]] = {}
        tiny = torch.finfo(torch.float64).tiny
        for start in range(0, flat_e.numel(), _CHUNK):
            de = flat_e[start:start + _CHUNK].to(torch.float64)
            da = flat_a[start:start + _CHUNK].to(torch.float64)
            finite = torch.isfinite(de).logical_and_(torch.isfinite(da))
            gap = torch.where(finite, (da - de).abs(), 0.0)
            scale = de.abs()
            rel = torch.where(finite.logical_and_(scale > 0), gap / scale.clamp_min(tiny), 0.0)
            room = scale.mul_(self.rtol).add_(self.atol)  # atol + rtol * |e| (scale is not read again)
            budget = torch.where(room > 0, gap / room.clamp_min(tiny), torch.where(gap > 0, math.inf, 0.0))
            values, indices = torch.stack((gap, rel, budget)).max(1)
            for kind, value, index in zip(("abs", "rel", "budget"), values.tolist(), indices.tolist()):
                if kind not in best or value > best[kind][0]:
                    best[kind] = (value, start + index)
        return [(kind, value, index) for kind, (value, index) in best.items()]
