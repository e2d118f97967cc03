"""The writers of a graph record's fields that are not counters: what the compile plan
decided (plan.py), what the passes found, a graph or backward that fell back, a lowering
that serves nothing, an input contract broken. Every such field of GraphRecord is written
here or in fusion_report.py; the runtime only increments counters (`called`, the stats').
Statuses are the enums of errors.py, reported by their value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.errors import Decline, Engine, GraphKind, LoweringStatus, SplitReason


def planned(record: GraphRecord, kind: GraphKind, nodes: int, inputs: int, engine: Engine) -> None:
    """What the plan says of the graph before any pass ran."""
    record.kind, record.nodes, record.inputs, record.cuda_graph_mode = kind, nodes, inputs, engine.value


def backward_of(record: GraphRecord, fresh: bool = False) -> GraphRecord:
    """The record of an autograd graph's backward: made anew at its forward's compile
    (`fresh`), or when aot compiles a backward without a forward."""
    if fresh or record.backward is None:
        record.backward = GraphRecord(record.index, kind=GraphKind.BACKWARD, role="backward")
    return record.backward


def passes_found(record: GraphRecord, stripped_assertions: int, input_writes: list[dict[str, Any]], buffer_writes: int,
                 pieces: Sequence[dict[str, Any]], split_reasons: Mapping[SplitReason, int]) -> None:
    """What the pass pipeline made of the graph: assertions stripped, writes, pieces."""
    record.stripped_assertions = stripped_assertions
    record.input_writes = input_writes
    record.buffer_writes_in_place = buffer_writes
    record.pieces = list(pieces)
    record.split_reasons = {k.value: v for k, v in split_reasons.items()}


def regions_found(record: GraphRecord, regions: list[dict[str, Any]], module_rejections: Mapping[str, int]) -> None:
    record.regions = regions
    record.module_rejections = dict(module_rejections)


def served(record: GraphRecord, decline: Decline | None, detail: str | None) -> None:
    """The graph-level decline of a CUDA graph (None: the graph is captured, whole or in pieces)."""
    record.cuda_graph_reason = decline.value if decline is not None else None
    record.cuda_graph_detail = detail


def failed(record: GraphRecord, exc: Exception, whole: bool) -> str:
    """Compiling the graph (`whole`) or its backward failed: it runs as it was given, every
    call counted `backend_error`; nothing half-built is reported. Returns the error's words."""
    record.kind, record.cuda_graph_mode = GraphKind.FALLBACK, Engine.OFF.value
    if whole:
        record.substitutions.clear()
        record.backward = None
    record.pieces.clear()
    record.piece_stats.clear()
    record.error = f"{type(exc).__name__}: {exc}"
    record.cuda_graph_reason, record.cuda_graph_detail = Decline.BACKEND_ERROR.value, record.error
    return record.error


def not_lowered(record: GraphRecord, detail: str) -> None:
    """The lowering never runs: the Dynamo graph answers the calls."""
    record.lowering = {"status": LoweringStatus.NOT_LOWERED.value, "detail": detail}


def contract_broken(record: GraphRecord, detail: str) -> None:
    """A call whose inputs break the graph's placeholder contract (the first detail is kept)."""
    with record.lock:
        record.contract_mismatches += 1
        record.contract_detail = record.contract_detail or detail
