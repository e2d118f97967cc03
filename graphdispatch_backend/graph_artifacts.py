"""The artifacts of one graph being compiled: each region matched against the registry
(counted per artifact), the gate that answers a substituted region, each region's report
entry, and the authoring failures (an artifact that names a region and does not fit it, by
signature or by a pinned fingerprint, or names nothing) said once, or raised together under
`strict`.

A pinned `region.fingerprint` says which graph is the artifact's (a fingerprint covers
shapes): one kind of a wide pattern (`*.mlp` over two widths), or a decode step's graph
beside the prefill's, whose regions have the same names. So a fingerprint rejection is a
failure only where the rest of the manifest describes the region (its signature fits, or
would with `null` where the region's dims are symbolic: the recompile with dynamic shapes
that the docs say `null` is for) and the pin fits none of the regions the pattern names in
the graph, nor one of another kind in an earlier graph. A pin that contradicts its own
signature is said; a pin doing its job is not.

backend.py wires one per Dynamo graph into the pass pipeline (`PassContext.matcher` and
`make_call`); matching itself is pure (artifacts/match.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.artifacts.authoring import fingerprint_failure, signature_failure, unmatched
from graphdispatch_backend.artifacts.match import (
    MatchOutcome,
    match_for_autograd,
    match_region,
    pin_fits,
    signature_miss,
    symbolic_only_miss,
)
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
from graphdispatch_backend.runtime.gates.kin import Kin
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
        # artifact -> region kind -> (key, message) of its first region a pinned fingerprint refused
        self.pinned_out: dict[str, dict[str, tuple[str, str]]] = {}

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
                            novelty=Arrival.NEXT_CALL if session.options.cuda_graphs == "emulate" else Arrival.NOW,
                            kin=session.kin.setdefault(artifact.id, Kin()).kind(region.fingerprint))
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
                elif rejection.reason is Rejection.FINGERPRINT:
                    self._pinned_out(rejection.artifact, region)
        return entry

    def _pinned_out(self, artifact_id: str, region: Region) -> None:
        """Keep what to say of a region a pinned fingerprint refused (the first of its kind)
        where the rest of the manifest describes it (module docstring); whether it is said
        waits for every region of the graph (check_authoring)."""
        artifact = self.session.registry.artifacts.get(artifact_id)
        kind = generalize(region.module)
        if artifact is None or kind in self.pinned_out.get(artifact_id, {}):
            return
        m = artifact.manifest
        miss = signature_miss(m, region)
        if miss is not None and not symbolic_only_miss(m, region):
            return  # the signature refuses it too: not the region the manifest is for
        shapes = [s.shape for s in [*region.kernel_specs, *region.output_specs] if s is not None]
        shapes += [e.shape for e in [*m.inputs, *m.outputs]]
        self.pinned_out.setdefault(artifact_id, {})[kind] = fingerprint_failure(
            artifact_id, region.name, region.module, region.cls, m.fingerprint or "", region.fingerprint, miss,
            dynamic=any(d is None for shape in shapes for d in shape))

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
        self._check_pins()
        if self.failures and session.options.strict:
            raise StrictModeError(f"{record.name}: {len(self.failures)} authoring failure(s): "
                                  + "; ".join(self.failures))

    def _check_pins(self) -> None:
        """The fingerprint rejections that are an author's mistake (module docstring): the pin
        fit no region of this graph, nor one of another kind in an earlier graph."""
        if not self.pinned_out:
            return
        here = self.record.region_detail()[0]
        earlier = [e for g in list(self.session.report.graphs) if g is not self.record for e in g.region_detail()[0]]
        for artifact, kinds in sorted(self.pinned_out.items()):
            if any(pin_fits(e, artifact) for e in here):
                continue
            if any(generalize(e["module"]) not in kinds and pin_fits(e, artifact) for e in earlier):
                continue
            for kind in sorted(kinds):
                key, message = kinds[kind]
                self._authoring_failure(AuthoringFailure.FINGERPRINT, artifact, key, message)
