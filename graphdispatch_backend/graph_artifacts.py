"""The artifacts of one graph being compiled: each region matched against the registry
(counted per artifact), the gate that answers a substituted region, each region's report
entry, and the authoring failures (an artifact that names a region and does not fit it, or
names nothing) said once, or raised together under `strict`.

backend.py wires one per Dynamo graph into the pass pipeline (`PassContext.matcher` and
`make_call`); matching itself is pure (artifacts/match.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.artifacts.authoring import signature_failure, unmatched
from graphdispatch_backend.artifacts.match import MatchOutcome, match_for_autograd, match_region
from graphdispatch_backend.artifacts.registry import ArtifactLoadError
from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.diagnostics.report import GraphRecord, SubstitutionRecord
from graphdispatch_backend.errors import AuthoringFailure, Rejection, StrictModeError
from graphdispatch_backend.passes.locate_writes import plan_writes
from graphdispatch_backend.patterns import generalize
from graphdispatch_backend.region import Region
from graphdispatch_backend.runtime.checks.novelty import Arrival
from graphdispatch_backend.runtime.checks.world import Writes
from graphdispatch_backend.runtime.gates.gate import ArtifactGate
from graphdispatch_backend.session import Session


def call_target(obj: Any, name: str) -> Any:
    """`obj` named for FX code generation, which names call targets by
    __name__/__qualname__/__module__."""
    obj.__name__ = obj.__qualname__ = "".join(c if c.isalnum() else "_" for c in name)
    obj.__module__ = "graphdispatch"
    return obj


class GraphArtifacts:
    def __init__(self, session: Session, record: GraphRecord, model_modules: Sequence[str] | None) -> None:
        self.session = session
        self.record = record
        self.model_modules = model_modules  # the compiled root's named_modules() (None: unknown)
        self.module_rejections: Counter[str] = Counter()
        self.pattern_hits: Counter[str] = Counter()  # artifact -> regions its pattern named
        self.failures: list[str] = []  # authoring failures of this graph, raised together under strict

    def match(self, region: Region) -> MatchOutcome:
        reg = self.session.registry
        return self._count(match_region(region, reg.artifacts.values(), reg.excluded.values(), torch.__version__))

    def match_autograd(self, region: Region) -> MatchOutcome:
        reg = self.session.registry
        return self._count(match_for_autograd(region, reg.artifacts.values(), reg.excluded.values()))

    def _count(self, outcome: MatchOutcome) -> MatchOutcome:
        reg = self.session.registry
        by_name = {r.artifact for r in outcome.rejections if r.reason is Rejection.MODULE}
        for artifact_id in by_name:
            self.module_rejections[artifact_id] += 1
        for artifact_id in reg.artifacts:
            if artifact_id not in by_name:
                self.pattern_hits[artifact_id] += 1
        return outcome

    def make_call(self, region: Region, outcome: MatchOutcome, native: fx.GraphModule) -> Callable[..., Any] | None:
        session, artifact = self.session, outcome.selected
        try:  # what its code raises comes back even under strict, to be said with its name
            fn = artifact.load(session.contain_artifact)
        except ArtifactLoadError as exc:
            if session.options.strict:
                raise StrictModeError(f"artifact {artifact.id} (bundle {artifact.bundle.folder}) did not "
                                      f"load for region {region.name}: {exc}") from exc
            outcome.reject(artifact.id, Rejection.LOAD_FAILED, str(exc))
            session.events.warn_once(f"load:{artifact.id}", "graphdispatch: artifact %s did not load: %s",
                                     artifact.id, exc)
            return None
        sub = SubstitutionRecord(region.name, artifact.id, capturable=artifact.manifest.capturable,
                                 kind=generalize(region.module), mutates=list(region.mutates))
        record_fields.substitution_added(self.record, sub)
        # the inputs the kernel writes in place (matching checked they are the region's), and where
        written = [region.input_names.index(name) for name in region.mutates]
        writes = Writes(written, plan_writes(native) if written else None, session.options.max_snapshot_bytes,
                        region.input_names)
        gate = ArtifactGate(artifact=fn, native=native, record=sub, parity=artifact.manifest.parity,
                            contain=session.contain, contain_artifact=session.contain_artifact,
                            events=session.events, timing=session.timing,
                            speed_gate=session.options.speed_gate, strict=session.options.strict,
                            kernel_inputs=region.kernel_positions, writes=writes,
                            snapshot_limit=session.options.max_snapshot_bytes, input_names=region.input_names,
                            recheck=session.options.artifact_recheck,
                            # under emulate, a region's statistics come a call late, as a GPU's would
                            novelty=Arrival.NEXT_CALL if session.options.cuda_graphs == "emulate" else Arrival.NOW)
        session.events.decision("substitution",
                                {"graph": self.record.name, "region": region.name, "artifact": artifact.id})
        return call_target(gate, f"gd_artifact_{artifact.id}")

    def region_entry(self, region: Region, outcome: MatchOutcome | None, inference: bool) -> dict[str, Any]:
        entry = region.to_dict()
        if outcome is not None:
            entry["artifact"] = outcome.selected.id if outcome.selected is not None else None
            entry["rejections"] = [r.to_dict() for r in outcome.rejections if r.reason is not Rejection.MODULE]
            # the region's graph once per kind, for `artifacts scaffold` to write a kernel from
            # (inference graphs only: a forward graph's regions also hand out saved tensors)
            if inference and region.graph_data is not None:
                record_fields.region_graph(self.record, region.fingerprint, region.graph_data)
            for rejection in outcome.rejections:
                if rejection.reason is Rejection.SIGNATURE:
                    key, message = signature_failure(rejection.artifact, region.name, region.module, region.cls,
                                                     rejection.detail)
                    self._authoring_failure(AuthoringFailure.SIGNATURE, rejection.artifact, key, message)
        return entry

    def _authoring_failure(self, failure: AuthoringFailure, artifact: str, key: str, message: str) -> None:
        """An author's mistake: one WARNING per key (artifact and region kind) and one report
        entry; under `strict` the graph's compile fails once every region was looked at."""
        self.session.report.add_authoring(failure.value, artifact, key, message)
        self.session.events.warn_once(f"authoring:{failure.value}:{key}", "graphdispatch: %s", message)
        self.failures.append(message)

    def check_authoring(self, training: bool) -> None:
        """Artifacts that matched nothing (see artifacts/authoring.py), then `strict`."""
        record, session = self.record, self.session
        record_fields.pattern_matches(record, self.pattern_hits)
        if not training:
            hits: Counter[str] = Counter()
            for graph in list(session.report.graphs):
                hits.update(graph.pattern_matches)
            names = [r["module"] for g in list(session.report.graphs) for r in g.region_detail()[0]]
            patterns = {a.id: a.manifest.module for a in session.registry.artifacts.values()}
            for miss in unmatched(patterns, hits, names, self.model_modules):
                self._authoring_failure(AuthoringFailure.UNMATCHED, miss.artifact, miss.artifact, miss.message())
        if self.failures and session.options.strict:
            raise StrictModeError(f"{record.name}: {len(self.failures)} authoring failure(s): "
                                  + "; ".join(self.failures))

