"""A graph's record in the session report: its counters and decisions as data (the
session's report as a whole, its totals and its file: session_report.py).

The runtime only increments counters; the compile side's fields (what plan.py decided, what
the passes found, fallbacks, fusion) are written by record_fields.py and fusion_report.py;
nothing here imports the runtime or the passes. Every call is
accounted for: per graph (and per captured piece) `calls == replays + eager_calls`, and
`eager_by_reason` sums to `eager_calls`. The file holds metadata only, never tensor values,
and is written atomically (temp file + replace).

The file's form (schema 2: brief regions, their kinds' detail once, region graphs
compressed) is report_file.py's. Importing this module imports no torch: the command line
reads reports with it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import zlib
from collections import Counter
from typing import Any

from graphdispatch_backend.errors import GraphKind, LoweringStatus

# lowering statuses under which the lowered graph still answers calls (any other: the Dynamo graph does)
_SERVED_STATUSES = frozenset({LoweringStatus.BITWISE.value, LoweringStatus.WITHIN_TOLERANCE.value,
                               LoweringStatus.UNCHECKED.value})


@dataclasses.dataclass
class CudaGraphStats:
    """Counters of one captured piece (or of a whole graph, aggregated)."""

    state: str = "eager"
    captures: int = 0
    recaptures: int = 0
    replays: int = 0
    eager_calls: int = 0
    eager_by_reason: Counter[str] = dataclasses.field(default_factory=Counter)
    declines: Counter[str] = dataclasses.field(default_factory=Counter)
    decline_details: dict[str, str] = dataclasses.field(default_factory=dict)
    shape_keys: int = 0
    static_bytes: int = 0
    evictions: int = 0  # shape keys whose captures were evicted (least recently used, past max_captures)
    live_captures: int = 0  # shape keys holding a capture now (at most max_captures)
    copy_bytes: int = 0  # bytes the replays copied: moving inputs in, mutated ones back, outputs out
    # replays the runner's hot path answered (runtime/runner/hot.py): each is also a call of
    # the graph, counted here rather than on the record (no record lock per replay)
    hot_replays: int = 0
    # captures made for held inputs that only moved (a new cache per request), and captures
    # parked for other addresses (a rotation of caches): runtime/runner/relocate.py
    relocations: int = 0
    parked: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def replayed(self) -> None:
        with self.lock:
            self.replays += 1

    def eager(self, reason: str) -> None:
        with self.lock:
            self.eager_calls += 1
            self.eager_by_reason[reason] += 1

    def decline(self, reason: str, detail: str) -> None:
        with self.lock:
            self.declines[reason] += 1
            self.decline_details.setdefault(reason, detail)

    def to_dict(self) -> dict[str, Any]:
        with self.lock:  # the runner updates these from the calling threads
            return {
                "state": self.state, "captures": self.captures, "recaptures": self.recaptures,
                "replays": self.replays, "eager_calls": self.eager_calls,
                "eager_by_reason": dict(self.eager_by_reason),
                "declines": dict(self.declines),
                "decline_details": dict(self.decline_details),
                "shape_keys": self.shape_keys,
                "static_bytes": self.static_bytes,
                "evictions": self.evictions,
                "live_captures": self.live_captures,
                "copy_bytes": self.copy_bytes,
                "relocations": self.relocations,
                "parked": self.parked,
            }


def _plain(value: Any) -> Any:
    """A copy of a record's field for its dict (containers copied under the record's lock)."""
    return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value


@dataclasses.dataclass
class SubstitutionRecord:
    """One region served by one artifact, behind its parity gate."""

    region: str
    artifact: str
    capturable: bool = True
    kind: str = ""  # the region's kind, its name generalized (`layers.*.mlp`): warnings are per kind
    parity: str = "pending"  # pending | passed | failed | unused (its graph runs as the Dynamo graph)
    parity_mode: str = "bitwise"
    gates: int = 0  # shape keys gated
    calls: int = 0  # eager calls the artifact served (its Python ran)
    replays: int = 0  # calls served from a captured graph that holds the artifact's kernels
    native_calls: int = 0  # calls the native region answered, eagerly or replayed (gate failures, demotion)
    demoted: bool = False
    reason: str | None = None
    detail: str | None = None
    max_abs_diff: float | None = None
    largest_diff_passed: float | None = None  # allclose: the largest |native - artifact| a passing check saw
    first_mismatch_index: list[int] | None = None
    speed: dict[str, float] | None = None  # speed_gate: median ms of both
    shadow: dict[str, float] = dataclasses.field(default_factory=dict)  # timing="shadow"
    mutates: list[str] = dataclasses.field(default_factory=list)  # inputs the kernel writes in place
    # demoted by a check (of the whole graph, runtime/checks/isolate.py, or a re-check at its gate,
    # runtime/gates/gate.py): the call of its shape key that caught it, the calls since the check
    # before it, served unchecked, and which check: "artifact_recheck" (its schedule), "recheck"
    # (the graph's), "novelty" (for new inputs: runtime/checks/novelty.py) or "shadow"
    caught_at_call: int | None = None
    unchecked_calls: int | None = None
    caught_by: str | None = None
    # ... and the state the graph writes (a cache: inputs it writes, tensors it makes and writes in
    # place) that those unchecked calls wrote, maybe from the kernel's values: it stays
    stale_state: list[str] = dataclasses.field(default_factory=list)
    novelty_checks: int = 0  # the gate's checks made for new inputs (beyond its schedule)
    # calls (eager or replayed) the artifact served since its last check, and the most it
    # served unchecked in a row: what its `artifact_recheck` schedule left unjudged
    served_since_check: int = 0
    largest_gap: int = 0
    served_unchecked: int = 0  # ... and all the calls it served unchecked, over the session
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def to_dict(self) -> dict[str, Any]:
        with self.lock:
            return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "lock"}


@dataclasses.dataclass
class GraphRecord:
    """Everything known about one compiled graph."""

    index: int
    compile_id: str = ""
    kind: GraphKind = GraphKind.INFERENCE  # a backward's own record: backward | fallback
    nodes: int = 0
    inputs: int = 0
    stripped_assertions: int = 0
    calls: int = 0
    replays: int = 0
    eager_calls: int = 0
    eager_by_reason: Counter[str] = dataclasses.field(default_factory=Counter)
    eager_checks: int = 0  # calls on which the lowered graph was compared with real eager
    novelty_checks: int = 0  # of those, the ones made for novel inputs (runtime/checks/novelty.py)
    # collectives: checks where another rank's kernel was found off (its values reach this rank's
    # outputs through them): the call, and the calls served unchecked before it (runtime/checks/isolate.py)
    caught_on_other_ranks: list[dict[str, int]] = dataclasses.field(default_factory=list)
    unchecked: int = 0  # due checks skipped: what the call writes could not be snapshotted
    unchecked_detail: str | None = None
    # set when the lowering was found wrong (its Decline) or never runs (errors.LoweringStatus.NOT_LOWERED)
    lowering: dict[str, Any] | None = None
    contract_mismatches: int = 0
    contract_detail: str | None = None
    cuda_graph_mode: str = "off"  # errors.Engine's value
    cuda_graph_reason: str | None = None
    cuda_graph_detail: str | None = None
    regions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    module_rejections: dict[str, int] = dataclasses.field(default_factory=dict)  # artifact -> regions
    pattern_matches: dict[str, int] = dataclasses.field(default_factory=dict)  # artifact -> regions its pattern named
    region_graphs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # fingerprint -> graph
    substitutions: list[SubstitutionRecord] = dataclasses.field(default_factory=list)
    pieces: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    piece_stats: list[CudaGraphStats] = dataclasses.field(default_factory=list)
    split_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    # inputs the graph writes into: each written in place, or copied back whole (and why)
    input_writes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    buffer_writes_in_place: int = 0  # writes into tensors the graph makes, made in place
    error: str | None = None
    export: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # an autograd graph's backward: its own calls, pieces and captures (None: inference)
    backward: GraphRecord | None = None
    role: str = ""  # "backward" for an autograd graph's backward record
    checks: int = 0  # a backward's runs made by the lowering check (counted in `calls` too)
    # the stats of the runner serving the whole graph on its hot path (runtime/program/program.py):
    # its hot replays, counted there under the device lock, are calls and replays of the graph
    hot_stats: list[CudaGraphStats] = dataclasses.field(default_factory=list, repr=False)
    # with `fuse`: status (errors.FusionStatus), kernels, ops fused and kept (errors.KeptWhy), rounds,
    # compile time (runtime/program/fused.py); a tolerance's checks and largest error (runtime/checks/tolerance.py)
    fusion: dict[str, Any] | None = None
    _frozen: bytes | None = dataclasses.field(default=None, repr=False)  # see retire()
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def name(self) -> str:
        return f"graph_{self.index}" + (f".{self.role}" if self.role else "")

    def retire(self) -> None:
        """The graph is gone (its compiled callable collected): its region detail (the
        regions and the region graphs the scaffold reads, most of a record) is kept as
        compressed JSON, about a tenth of its size as Python objects, so that a server that
        compiles and drops models all day holds a bounded report that still says all it
        said (`to_dict()` is unchanged; `report_dir` is written again at exit)."""
        with self.lock:
            if self._frozen is not None:
                return
            detail = {"regions": self.regions, "region_graphs": self.region_graphs}
            self._frozen = zlib.compress(json.dumps(detail, separators=(",", ":")).encode(), 6)
            self.regions, self.region_graphs = [], {}

    def region_detail(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(regions, region_graphs), of a live graph or of one retired."""
        with self.lock:
            if self._frozen is None:
                return self.regions, self.region_graphs
            detail = json.loads(zlib.decompress(self._frozen))
            return detail["regions"], detail["region_graphs"]

    def called(self, replayed: bool, reason: str | None) -> None:
        with self.lock:
            self.calls += 1
            if replayed:
                self.replays += 1
            else:
                self.eager_calls += 1
                self.eager_by_reason[reason or "eager"] += 1

    def _counts(self) -> tuple[int, int, int, dict[str, int]]:
        """calls, replays, eager_calls and eager_by_reason read together, under the lock
        `called` takes: a report written while another thread calls the graph still adds up."""
        with self.lock:
            hot = sum(s.hot_replays for s in self.hot_stats)
            return self.calls + hot, self.replays + hot, self.eager_calls, dict(self.eager_by_reason)

    def cuda_graph(self, counts: tuple[int, int, int, dict[str, int]] | None = None) -> dict[str, Any]:
        _, replays, eager_calls, eager_by_reason = counts if counts is not None else self._counts()
        declines: Counter[str] = Counter()
        details: dict[str, str] = {}
        pieces = [s.to_dict() for s in list(self.piece_stats)]
        for stats in pieces:
            declines.update(stats["declines"])
            for k, v in stats["decline_details"].items():
                details.setdefault(k, v)
        if self.cuda_graph_reason:  # the whole graph was declined once, at compile time
            declines[self.cuda_graph_reason] += 1
            details.setdefault(self.cuda_graph_reason, self.cuda_graph_detail or self.cuda_graph_reason)
        states = {s["state"] for s in pieces}
        state = "eager" if not pieces else states.pop() if len(states) == 1 else "mixed"
        reason = self.cuda_graph_reason
        declined = self._lowering_declined()
        if declined is not None:  # the Dynamo graph answers every call now: nothing captured serves
            state, reason = "eager", reason or declined
        if reason is None and state == "eager" and declines:  # every piece declined: the reason most of them gave
            reason = declines.most_common(1)[0][0]
        return {
            "mode": self.cuda_graph_mode,
            "state": state,
            "reason": reason,
            "captures": sum(s["captures"] for s in pieces),
            "recaptures": sum(s["recaptures"] for s in pieces),
            "relocations": sum(s["relocations"] for s in pieces),
            "replays": replays,
            "eager_calls": eager_calls,
            "eager_by_reason": eager_by_reason,
            "declines": dict(declines),
            "decline_details": details,
            "static_bytes": sum(s["static_bytes"] for s in pieces),
        }

    def _fusion(self) -> dict[str, Any] | None:
        """The fusion's record; where the lowering was declined since, `unused` says the fused
        code serves no call (the Dynamo graph answers)."""
        if self.fusion is None:
            return None
        fusion, declined = dict(self.fusion), self._lowering_declined()
        if declined is not None and fusion.get("status") == "fused":
            fusion["unused"] = declined
        return fusion

    def _lowering_declined(self) -> str | None:
        """The verdict that made the graph run as the Dynamo graph, if one did."""
        status = self.lowering.get("status") if self.lowering is not None else None
        return status if status is not None and status not in _SERVED_STATUSES else None

    def to_dict(self) -> dict[str, Any]:
        pieces = self._piece_dicts()
        counts = self._counts()
        regions, region_graphs = self.region_detail()
        return {
            "name": self.name,
            "compile_id": self.compile_id,
            "kind": GraphKind(self.kind).value,
            "nodes": self.nodes,
            "inputs": self.inputs,
            "calls": counts[0],
            "stripped_assertions": self.stripped_assertions,
            "lowering_check": self._lowering_check(),
            "contract_mismatches": self.contract_mismatches,
            "contract_detail": self.contract_detail,
            "error": self.error,
            "cuda_graph": self.cuda_graph(counts),
            "pieces": pieces,
            "split_reasons": dict(self.split_reasons),
            "input_writes": list(self.input_writes),
            "buffer_writes_in_place": self.buffer_writes_in_place,
            "substitutions": [s.to_dict() for s in self.substitutions],
            "regions": regions,
            "module_rejections": dict(self.module_rejections),
            "pattern_matches": dict(self.pattern_matches),
            "region_graphs": dict(region_graphs),
            "export": self.export,
            "backward": self.backward.backward_dict() if self.backward is not None else None,
            "fusion": self._fusion(),
        }

    def backward_dict(self) -> dict[str, Any]:
        """A backward's record: what it ran as, its calls (the lowering check's among
        them) and its capture, accounted as a graph's are."""
        counts = self._counts()
        pieces = self._piece_dicts()
        return {
            "name": self.name,
            "kind": GraphKind(self.kind).value,
            "nodes": self.nodes,
            "inputs": self.inputs,
            "calls": counts[0],
            "checks": self.checks,
            "error": self.error,
            "contract_mismatches": self.contract_mismatches,
            "contract_detail": self.contract_detail,
            "cuda_graph": self.cuda_graph(counts),
            "pieces": pieces,
            "split_reasons": dict(self.split_reasons),
        }

    def _lowering_check(self) -> dict[str, Any]:
        """How the lowered graph compared with real eager (runtime/checks/eager_check.py)."""
        skipped = {"skipped": self.unchecked, "skipped_detail": self.unchecked_detail} if self.unchecked else {}
        checked = {"checked": self.eager_checks, **({"novelty": self.novelty_checks} if self.novelty_checks else {}),
                   **({"caught_on_other_ranks": self.caught_on_other_ranks} if self.caught_on_other_ranks else {})}
        if self.lowering is not None:
            return {**checked, **self.lowering, **skipped}
        tolerant = (self.fusion or {}).get("checks") and self.fusion.get("tolerance")
        passed = LoweringStatus.WITHIN_TOLERANCE if tolerant else LoweringStatus.BITWISE
        return {**checked, "status": (passed if self.eager_checks else LoweringStatus.UNCHECKED).value, **skipped}

    def _piece_dicts(self) -> list[dict[str, Any]]:
        """Each piece, a captured one with its counters (piece_stats holds the capturable pieces')."""
        stats = iter(self.piece_stats)
        found = [next(stats, None) if p.get("capturable") else None for p in self.pieces]
        return [{**p, "cuda_graph": st.to_dict()} if st is not None else p for p, st in zip(self.pieces, found)]
