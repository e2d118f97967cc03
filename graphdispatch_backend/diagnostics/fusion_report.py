"""FusionReport: the one writer of a graph record's `fusion` entry (with `fuse`).

Its status (errors.FusionStatus, reported by its value) and detail, the verdict key and
recipe, and the figures of the last compile: kernels, ops fused and kept (errors.KeptWhy),
rounds, compile time. runtime/program/fused.py says what happened; a tolerance's checks are
counted into `fields` by runtime/checks/tolerance.py, which reports its largest error here.
"""

from __future__ import annotations

from typing import Any

from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.errors import FusionStatus
from graphdispatch_backend.inductor_options import reported


class FusionReport:
    """A graph's `fusion` entry (the dict `record.fusion`), written through its methods."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    @staticmethod
    def off(record: GraphRecord, detail: str) -> None:
        """Not fused, by a rule (plan.py FusionOff): the rule's words."""
        record.fusion = {"status": FusionStatus.OFF.value, "detail": detail}

    @classmethod
    def planned(cls, record: GraphRecord, inductor_keys: dict[str, Any] | None) -> FusionReport:
        """Fused, not compiled yet; what became of the Inductor keys given in `options`."""
        record.fusion = {"status": FusionStatus.PENDING.value}
        if inductor_keys is not None:
            record.fusion["inductor_keys"] = {
                "applied": {k: reported(v) for k, v in inductor_keys["applied"].items()},
                "overridden": {k: {w: reported(v) for w, v in both.items()}
                               for k, both in inductor_keys["overridden"].items()}}
        return cls(record.fusion)

    def nothing_to_fuse(self) -> None:
        self.fields.update(status=FusionStatus.OFF.value, detail="no run of the graph holds an op the recipe fuses")

    def compiling(self, key: str, recipe: str) -> None:
        self.fields.update(status=FusionStatus.FUSED.value, key=key, recipe=recipe)

    def compiled(self, kernels: int) -> None:
        """A compile made `kernels` kernels: fused, or (none) the ATen kernels run as the graph."""
        if kernels:
            self.fields.update(status=FusionStatus.FUSED.value, detail=None)
        else:
            self.fields.update(status=FusionStatus.NOTHING_FUSED.value,
                               detail="Inductor generated no kernel (the ops it was given are views, or it left "
                                      "them to ATen): the graph runs its ATen kernels")

    def gave_up(self, detail: str, key: str) -> None:
        self.fields.update(status=FusionStatus.FUSION_MISMATCH.value, detail=detail, key=key)

    def failed(self, detail: str) -> None:
        self.fields.update(status=FusionStatus.FAILED.value, detail=detail)

    def figures(self, seconds: float, **figures: Any) -> None:
        """What the graph serves and keeps (rounds, kernels, aten_calls, fused_ops, segments,
        kept); `seconds` of compiling added to the graph's total."""
        self.fields.update(figures, compile_seconds=round(self.fields.get("compile_seconds", 0.0) + seconds, 3))

    def tolerance(self, rtol: float, atol: float) -> None:
        """Fused under a declared tolerance: its checks and the largest error start at none."""
        self.fields.update(tolerance={"rtol": rtol, "atol": atol}, checks=0, beyond=0, largest_error=None)

    def largest_error(self, largest: dict[str, Any]) -> None:
        """The largest errors the checks within the tolerance saw (runtime/checks/tolerance.py)."""
        self.fields["largest_error"] = largest
