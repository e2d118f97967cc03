"""A report field other than a counter has one writer: diagnostics/ (record_fields.py,
fusion_report.py), from what plan.py decided. Read from the source (`ast`): in every module
of the package outside diagnostics/ and plan.py, an assignment to a field of GraphRecord,
CudaGraphStats or SubstitutionRecord (or into FusionReport's `fields`, a graph's `fusion`
entry) is an increment (`+=`, `-=`) or it is a defect. The reading goes by field name: the
few objects that are no report but share a field's name are named in NOT_REPORTS."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from graphdispatch_backend.diagnostics.report import CudaGraphStats, GraphRecord, SubstitutionRecord

PACKAGE = Path(__file__).resolve().parents[2] / "graphdispatch_backend"
OUTSIDE = ("diagnostics", "plan.py")  # the writers: diagnostics/, and the planner
# objects that are no report but have a field named as one of a report's, by the modules
# under a folder (or one module) where they appear: the passes' PassContext (`ctx`), Region
# (`region`) and PieceInfo (`info`); the thread-local state of one call (calls.py); the
# catalog's kinds of region (`kind`); a shape key's Entry (`entry`)
NOT_REPORTS = {"passes": {"ctx", "region", "info"}, "runtime/call/calls.py": {"_calls"},
               "artifacts/catalog.py": {"kind"}, "runtime/runner": {"entry"}}
# a field's list or dict written through its methods: `record.substitutions.append(sub)`
MUTATORS = {"update", "append", "extend", "insert", "setdefault", "clear", "pop", "remove", "add"}
FIELDS = {f.name for cls in (GraphRecord, CudaGraphStats, SubstitutionRecord) for f in dataclasses.fields(cls)} - {
    "lock"} | {"fields"}


def _assignments(source: str, name: str) -> list[str]:
    """`file:line target` for each plain assignment to a report field (through any object
    but `self` and the module's NOT_REPORTS, and into a field's list or dict:
    `record.fusion["status"] = ...`, `.update(...)`, `.append(...)`)."""
    found = []
    exempt = {"self"} | {o for where, objects in NOT_REPORTS.items() if name == where or name.startswith(where + "/")
                         for o in objects}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in (t for x in targets for t in (x.elts if isinstance(x, ast.Tuple) else [x])):
                base = target
                while isinstance(base, ast.Subscript):
                    base = base.value
                if isinstance(base, ast.Attribute) and base.attr in FIELDS and ast.unparse(base.value) not in exempt:
                    found.append(f"{name}:{node.lineno} {ast.unparse(target)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr in FIELDS and ast.unparse(owner.value) not in exempt:
                found.append(f"{name}:{node.lineno} {ast.unparse(owner)}.{node.func.attr}")
    return found


def test_only_diagnostics_writes_a_report_field_that_is_not_a_counter():
    paths = [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] not in OUTSIDE]
    assert len(paths) > 100 and PACKAGE / "runtime" / "runner" / "serve.py" in paths  # the package, read
    found = [a for path in paths for a in _assignments(path.read_text("utf-8"), path.relative_to(PACKAGE).as_posix())]
    assert not found, "report fields assigned outside diagnostics/:\n" + "\n".join(found)


def test_the_reading_finds_an_assignment():
    """The test above can fail: an assignment of the kind it looks for is found."""
    source = ("def f(record, stats):\n    record.kind = 'x'\n    stats.replays += 1\n    record.fusion['a'] = 1\n"
              "    record.fusion.update(status='off')\n")
    found = [a.split(" ", 1)[1] for a in _assignments(source, "probe")]
    assert found == ["record.kind", "record.fusion['a']", "record.fusion.update"]
