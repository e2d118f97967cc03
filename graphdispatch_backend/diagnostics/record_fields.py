"""The writers of the report's fields that are not counters. A graph's record: what the
compile plan decided (plan.py), what the passes found, a graph or backward that fell back, a
lowering that serves nothing or was declined by its check, a call left unchecked, an input
contract broken. An artifact's record (SubstitutionRecord): its parity mode and verdict, its
speed, its demotion, the check that caught it, its run of unchecked calls. A piece's stats
(CudaGraphStats): its state, shape keys, live captures, static bytes, parked captures. Every
such field is written here or in fusion_report.py; the rest of the package only increments
counters (`called`, the stats'). Statuses are the enums of errors.py, reported by their
value. A writer that says "under the lock" is called with the record's lock held (it is one
step of a larger locked block); the others take it themselves where the runtime did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from graphdispatch_backend.diagnostics.report import CudaGraphStats, GraphRecord, SubstitutionRecord
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


def answered_natively(record: GraphRecord) -> None:
    """The Dynamo graph answered a call (a declined lowering, a broken contract, a snapshot
    short of memory): each region an artifact was substituted into ran its own code once,
    natively, so that calls + replays + native_calls stays every call of the region."""
    for sub in record.substitutions:
        with sub.lock:
            sub.native_calls += 1


def piece_added(record: GraphRecord, stats: CudaGraphStats) -> CudaGraphStats:
    """A capturable piece's counters, owned by the graph's record (assemble.py)."""
    record.piece_stats.append(stats)
    return stats


def hot_counters(record: GraphRecord, stats: CudaGraphStats) -> None:
    """The counters a runner writes its hot replays into: plain data the record owns."""
    record.hot_stats.append(stats)


def substitution_added(record: GraphRecord, sub: SubstitutionRecord) -> None:
    """An artifact substituted into one of the graph's regions (graph_artifacts.py)."""
    record.substitutions.append(sub)


def region_graph(record: GraphRecord, fingerprint: str, graph: dict[str, Any]) -> None:
    """A region's graph, once per kind (its fingerprint), for `artifacts scaffold`."""
    record.region_graphs.setdefault(fingerprint, graph)


def exported(record: GraphRecord, outcomes: Sequence[dict[str, Any]]) -> None:
    """What exporting one of the graph's shape keys made (export.py)."""
    record.export.extend(outcomes)


def pattern_matches(record: GraphRecord, hits: Mapping[str, int]) -> None:
    """How many regions each artifact's pattern matched in the graph (graph_artifacts.py)."""
    record.pattern_matches = dict(hits)


# --- the lowering's check against eager (runtime/checks/) ---------------------------------

def lowering_declined(record: GraphRecord, reason: Decline, detail: str, gradients: Sequence[str] = ()) -> None:
    """The check declined the lowering: why, and the inputs whose gradients differ from eager's."""
    with record.lock:
        record.lowering = {"status": reason.value, "detail": detail}
        if gradients:
            record.lowering["gradients"] = list(gradients)


def unchecked(record: GraphRecord, detail: str) -> None:
    """One call not checked against eager, counted, and why (the last reason is kept)."""
    with record.lock:
        record.unchecked += 1
        record.unchecked_detail = detail


# --- an artifact's record (runtime/gates/, runtime/checks/isolate.py) ---------------------

def unused(sub: SubstitutionRecord, reason: Decline) -> None:
    """The artifact serves no call from now on (its graph runs as the Dynamo graph): a
    verdict still pending says so."""
    with sub.lock:
        if sub.parity == "pending":
            sub.parity = "unused"
            sub.detail = f"the graph runs as the Dynamo graph ({reason.value})"


def parity_mode(sub: SubstitutionRecord, mode: str) -> None:
    sub.parity_mode = mode


def parity_passed(sub: SubstitutionRecord, gap: float | None = None) -> None:
    """A check passed; `gap`: the largest difference it saw (allclose), kept if the largest yet."""
    with sub.lock:
        sub.parity = "passed"
        if gap is not None and (sub.largest_diff_passed is None or gap > sub.largest_diff_passed):
            sub.largest_diff_passed = gap


def speed(sub: SubstitutionRecord, figures: dict[str, float]) -> None:
    """The speed gate's median times of both."""
    sub.speed = figures


def shadow_timed(sub: SubstitutionRecord, artifact_s: float, native_s: float) -> None:
    """`timing="shadow"`: one call more, and the seconds of both added."""
    with sub.lock:
        shadow = sub.shadow
        shadow["calls"] = shadow.get("calls", 0) + 1
        shadow["artifact_s"] = shadow.get("artifact_s", 0.0) + artifact_s
        shadow["native_s"] = shadow.get("native_s", 0.0) + native_s


def caught_by(sub: SubstitutionRecord, by: str) -> None:
    """The check that caught the artifact (a shadow check), before its demotion."""
    with sub.lock:
        sub.caught_by = by


def substitution_caught(sub: SubstitutionRecord, at_call: int | None, unchecked_calls: int, by: str,
                        stale_state: Sequence[str] = ()) -> None:
    """Under the lock: the call of its shape key that caught the artifact, the calls it
    served unchecked since the check before, by which check, and the state those calls
    wrote from the kernel's values (a cache), which stays."""
    sub.caught_at_call, sub.unchecked_calls, sub.caught_by = at_call, unchecked_calls, by
    sub.stale_state = list(stale_state)
    sub.served_since_check = 0  # the catch was a check: nothing is served unchecked since (it serves no more)


def caught_on_another_rank(record: GraphRecord, at_call: int, unchecked_calls: int) -> None:
    """Under the record's lock: a check where another rank of the graph's process groups
    found its kernel off, and the calls served unchecked before it here."""
    record.caught_on_other_ranks.append({"at_call": at_call, "unchecked_calls": unchecked_calls})


def served_unchecked(sub: SubstitutionRecord, since_check: int) -> None:
    """Under the lock: the run of calls served since the last check, the longest run, and
    the session's count of calls served unchecked (one more)."""
    sub.served_since_check = since_check
    sub.largest_gap = max(sub.largest_gap, since_check)
    sub.served_unchecked += 1


def checked_run(sub: SubstitutionRecord, since_check: int) -> None:
    """Under the lock: the run of calls served since the last check ends (0), or stands again."""
    sub.served_since_check = since_check


def demotion(sub: SubstitutionRecord, reason: str, detail: str, parity_failed: bool,
             difference: tuple[float | None, Sequence[int] | None] | None = None) -> None:
    """Under the lock: the artifact demoted, why; its parity failed (`parity_failed`, or a
    verdict still pending); a mismatch's `difference`: its largest absolute difference and
    first index."""
    sub.demoted, sub.reason, sub.detail = True, reason, detail
    if parity_failed or sub.parity == "pending":
        sub.parity = "failed"
    if difference is not None:
        sub.max_abs_diff, first_index = difference
        # `is not None`: a 0-d output's first mismatch index is [] (falsy), not unknown
        sub.first_mismatch_index = list(first_index) if first_index is not None else None


# --- a piece's stats (runtime/runner/) -------------------------------------------------

def shape_keys(stats: CudaGraphStats, n: int) -> None:
    stats.shape_keys = n


def static_bytes(stats: CudaGraphStats, n: int) -> None:
    """Under the lock: the bytes of the buffers this piece's captures hold."""
    stats.static_bytes = n


def parked(stats: CudaGraphStats, n: int) -> None:
    """The captures parked for moved inputs, across the piece's entries."""
    stats.parked = n


def piece_state(stats: CudaGraphStats, state: str, live_captures: int) -> None:
    """The piece's most advanced state, and its live captures."""
    stats.state, stats.live_captures = state, live_captures
