"""The session's report as a whole: its graphs' records (report.py), the registry, the
authoring failures, the rank, the totals over every graph; `to_dict()` is what
`latest_report()` returns, `write` puts it in `dispatch.json` (compact: report_file.py),
atomically. Importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.diagnostics.report_file import SCHEMA_VERSION, compact, write_json_atomic


@dataclasses.dataclass
class SessionReport:
    """One compile session (one Options value): its graphs, registry and timing."""

    options: dict[str, Any]
    registry: dict[str, Any] = dataclasses.field(default_factory=dict)
    graphs: list[GraphRecord] = dataclasses.field(default_factory=list)
    environment: dict[str, Any] = dataclasses.field(default_factory=dict)
    # runtime-wide figures (static buffers shared by all graphs), supplied by the session
    runtime: Callable[[], dict[str, Any]] | None = None
    # authoring failures found while compiling (unmatched, signature), once per key
    authoring: list[dict[str, str]] = dataclasses.field(default_factory=list)
    # {rank, world_size, backend} where torch.distributed is initialized (session.py); None: one process
    distributed: dict[str, Any] | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add_authoring(self, failure: str, artifact: str, key: str, message: str) -> bool:
        """Record one authoring failure per (failure, key); True the first time."""
        with self.lock:
            if any(a["failure"] == failure and a["key"] == key for a in self.authoring):
                return False
            self.authoring.append({"failure": failure, "artifact": artifact, "key": key, "message": message})
            return True

    def new_graph(self, compile_id: str = "") -> GraphRecord:
        with self.lock:
            record = GraphRecord(index=len(self.graphs), compile_id=compile_id)
            self.graphs.append(record)
            return record

    def to_dict(self) -> dict[str, Any]:
        from graphdispatch_backend.diagnostics.attribution import attribute

        graphs = [g.to_dict() for g in list(self.graphs)]
        with self.lock:
            authoring = [dict(a) for a in self.authoring]
        distributed = {"distributed": dict(self.distributed)} if self.distributed is not None else {}
        return {
            "schema_version": SCHEMA_VERSION,
            "environment": self.environment,
            **distributed,  # absent for one process: its report is as it always was
            "options": self.options,
            "registry": self.registry,
            "totals": {**_totals(graphs), **(self.runtime() if self.runtime else {})},
            "artifacts": attribute(graphs, self.registry),
            "authoring": authoring,
            "graphs": graphs,
        }

    def write(self, report_dir: str | os.PathLike[str], name: str = "dispatch.json") -> Path:
        """`name` (dispatch.json; a rank's own: report_file.rank_file_names), compact (module
        docstring): `expand` of it equals `to_dict()`."""
        path = Path(report_dir) / name
        write_json_atomic(path, compact(self.to_dict()))
        return path


def _totals(graphs: list[dict[str, Any]]) -> dict[str, Any]:
    backwards = [g["backward"] for g in graphs if g.get("backward")]
    eager_by_reason: Counter[str] = Counter()
    for g in graphs:
        eager_by_reason.update(g["cuda_graph"]["eager_by_reason"])
    return {
        "graphs": len(graphs),
        "calls": sum(g["calls"] for g in graphs),
        "replays": sum(g["cuda_graph"]["replays"] for g in graphs),
        "eager_calls": sum(g["cuda_graph"]["eager_calls"] for g in graphs),
        "eager_by_reason": dict(eager_by_reason),
        "substitutions": sum(len(g["substitutions"]) for g in graphs),
        "demotions": sum(1 for g in graphs for s in g["substitutions"] if s["demoted"]),
        # region calls artifacts served since their last check, and the most one region's
        # artifact served unchecked in a row (the artifact_recheck schedule's gaps)
        "artifact_unchecked_calls": sum(s.get("served_since_check", 0) for g in graphs for s in g["substitutions"]),
        "artifact_served_unchecked": sum(s.get("served_unchecked", 0) for g in graphs for s in g["substitutions"]),
        "artifact_largest_gap": max((s.get("largest_gap", 0) for g in graphs for s in g["substitutions"]), default=0),
        # the backwards of autograd graphs, accounted apart: a backward is no call of the model
        "backward_calls": sum(b["calls"] for b in backwards),
        "backward_replays": sum(b["cuda_graph"]["replays"] for b in backwards),
        "backward_eager_calls": sum(b["cuda_graph"]["eager_calls"] for b in backwards),
    }
