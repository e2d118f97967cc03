"""Match regions against manifests: a selected artifact, or typed rejections (pure).

Checks run cheapest first: module pattern, enable filter, device, torch version,
fingerprint, signature, then the region's own shape (convex, deterministic). Every miss
is a RejectionRecord with a detail a human can act on ("input 1 'net.0.proj.weight':
dtype bfloat16, region has float32").

A manifest's fingerprint fits the region's, or the fingerprint the same graph has on
another device the manifest lists: a fingerprint covers the boundary's device type, and a
bundle scaffolded in CPU CI (`devices: ["cpu", "cuda"]`) must still serve its region on a
GPU, where it is the same graph of the same ops (`devices` is what says where it runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from graphdispatch_backend.artifacts.fingerprint import fingerprint
from graphdispatch_backend.artifacts.manifest import Manifest, version_tuple
from graphdispatch_backend.artifacts.signature import fits_but_for_symbolic_dims, manifest_miss
from graphdispatch_backend.errors import Rejection
from graphdispatch_backend.patterns import matches
from graphdispatch_backend.region import Region, TensorSpec


@dataclasses.dataclass(frozen=True)
class RejectionRecord:
    artifact: str
    reason: Rejection
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"artifact": self.artifact, "reason": self.reason.value, "detail": self.detail}


@dataclasses.dataclass
class MatchOutcome:
    region: str
    selected: Any = None  # the registry's Artifact (kept opaque here)
    rejections: list[RejectionRecord] = dataclasses.field(default_factory=list)

    def reject(self, artifact: str, reason: Rejection, detail: str = "") -> None:
        self.rejections.append(RejectionRecord(artifact, reason, detail))


def signature_miss(manifest: Manifest, region: Region) -> str | None:
    """Why the manifest's signature does not fit the region, or None if it does. The
    region's size inputs (dynamic shapes) are not part of it: a kernel never gets them."""
    return manifest_miss(manifest, region.kernel_names, region.kernel_specs, region.output_specs, region.mutates)


def symbolic_only_miss(manifest: Manifest, region: Region) -> bool:
    """Whether the manifest's signature would fit the region with null where the region's
    dims are symbolic: only a recompile with dynamic shapes stands between them."""
    return fits_but_for_symbolic_dims(manifest, region.kernel_names, region.kernel_specs, region.output_specs,
                                      region.mutates)


def torch_miss(manifest: Manifest, torch_version: str) -> str | None:
    have = version_tuple(torch_version)
    if manifest.torch_min and have < version_tuple(manifest.torch_min):
        return f"needs torch >= {manifest.torch_min}, have {torch_version}"
    if manifest.torch_max_exclusive and have >= version_tuple(manifest.torch_max_exclusive):
        return f"needs torch < {manifest.torch_max_exclusive}, have {torch_version}"
    return None


def match_region(
    region: Region,
    artifacts: Iterable[Any],
    excluded: Iterable[Any],
    torch_version: str,
) -> MatchOutcome:
    """`artifacts`/`excluded` are registry Artifacts (anything with `.id` and `.manifest`)."""
    outcome = MatchOutcome(region.name)
    for artifact in sorted(excluded, key=lambda a: a.id):
        if matches(artifact.manifest.module, region.module):
            outcome.reject(artifact.id, Rejection.NOT_ENABLED, "not in the enable allowlist")
    candidates = []
    for artifact in sorted(artifacts, key=lambda a: a.id):
        m: Manifest = artifact.manifest
        if not matches(m.module, region.module):
            outcome.reject(artifact.id, Rejection.MODULE, f"pattern {m.module!r}")
            continue
        miss = _first_miss(m, region, torch_version)
        if miss is not None:
            outcome.reject(artifact.id, *miss)
            continue
        candidates.append(artifact)
    if candidates:
        outcome.selected = candidates[0]
        for other in candidates[1:]:
            outcome.reject(other.id, Rejection.NOT_SELECTED, f"{candidates[0].id} matched first (by id)")
    return outcome


def fingerprint_on(region: Region, device_type: str) -> str | None:
    """The fingerprint the region's graph has with its tensors on `device_type` (the same
    nodes, arguments, shapes, strides and dtypes); None once its nodes are erased (a region
    inside one substituted before it, which cannot be substituted either way)."""
    if any(getattr(n, "_erased", False) for n in region.nodes):
        return None
    # the boundary as it stands now: a region substituted before this one replaced the
    # inputs it produced with the call's items, at the same positions in first-use order
    members = set(region.nodes)
    inputs = list(dict.fromkeys(a for n in region.nodes for a in n.all_input_nodes if a not in members))
    if len(inputs) != len(region.inputs):
        return None

    def moved(spec: TensorSpec | None) -> TensorSpec | None:
        return spec if spec is None or spec.is_scalar else dataclasses.replace(spec, device=device_type)

    return fingerprint(region.nodes, inputs, region.outputs, [moved(s) for s in region.input_specs],
                       [moved(s) for s in region.output_specs])


def fingerprint_fits(m: Manifest, region: Region) -> bool:
    """The manifest pins no fingerprint, or the region's, or the one its graph has on
    another device the manifest lists (checked only when the plain comparison misses)."""
    if m.fingerprint is None or m.fingerprint == region.fingerprint:
        return True
    return any(fingerprint_on(region, d) == m.fingerprint for d in m.devices if d != region.device_type)


def _first_miss(m: Manifest, region: Region, torch_version: str) -> tuple[Rejection, str] | None:
    if region.device_type not in m.devices:
        return Rejection.DEVICE, f"region on {region.device_type}, artifact supports {list(m.devices)}"
    if (miss := torch_miss(m, torch_version)) is not None:
        return Rejection.TORCH_VERSION, miss
    if not fingerprint_fits(m, region):
        return Rejection.FINGERPRINT, f"manifest {m.fingerprint}, region {region.fingerprint}"
    if (miss := signature_miss(m, region)) is not None:
        return Rejection.SIGNATURE, miss
    if not region.convex:
        return Rejection.NOT_CONVEX, "a path leaves the region and re-enters it"
    if not region.deterministic:
        return Rejection.NONDETERMINISTIC, "the region draws random numbers"
    if region.collective:
        return Rejection.COLLECTIVE, COLLECTIVE_DETAIL
    return None


# Rejections made once the fingerprint check passed (or added after matching: substitution's
# `overlap`, a kernel that would not load): where the artifact got one, its pin fit the region.
PAST_FINGERPRINT = frozenset({Rejection.SIGNATURE, Rejection.NOT_CONVEX, Rejection.NONDETERMINISTIC,
                              Rejection.COLLECTIVE, Rejection.NOT_SELECTED, Rejection.OVERLAP, Rejection.LOAD_FAILED})


def pin_fits(entry: dict[str, Any], artifact: str) -> bool:
    """Whether a region's report entry says the artifact's pinned fingerprint fit it: the
    artifact was selected there, or refused for a reason checked after the fingerprint."""
    if entry.get("artifact") == artifact:
        return True
    return any(r["artifact"] == artifact and Rejection(r["reason"]) in PAST_FINGERPRINT
               for r in entry.get("rejections") or ())


# Each rank's gate decides on its own which calls it checks (its schedule, and new inputs: a
# tensor-parallel region's inputs differ per rank) and when it demotes the kernel; a check
# runs the region beside the kernel, so a region holding collectives would run them twice on
# one rank and once on another (a trial: gloo's size mismatch and an abort, or wrong values
# on one rank and then a hang). Until the gates agree over the ranks, it runs native.
COLLECTIVE_DETAIL = ("the region holds collectives (an all-reduce or all-gather): each rank's checks and "
                     "demotions are its own, and would put the ranks' collectives out of step; write the kernel "
                     "for a region that holds none (a column-parallel projection, the activation between)")

AUTOGRAD_DETAIL = ("the graph needs autograd and the manifest declares no backward (artifacts are "
                   "inference-only): the region runs native")


def match_for_autograd(region: Region, artifacts: Iterable[Any], excluded: Iterable[Any]) -> MatchOutcome:
    """An autograd graph substitutes nothing: a kernel without a backward would cut the
    gradient at the region. Every artifact whose pattern names the region is refused as
    `autograd` (so the report says the region runs native, and why); its signature is not
    judged, since a forward graph's regions also hand out the tensors saved for backward."""
    outcome = MatchOutcome(region.name)
    for artifact in sorted(excluded, key=lambda a: a.id):
        if matches(artifact.manifest.module, region.module):
            outcome.reject(artifact.id, Rejection.NOT_ENABLED, "not in the enable allowlist")
    for artifact in sorted(artifacts, key=lambda a: a.id):
        if matches(artifact.manifest.module, region.module):
            outcome.reject(artifact.id, Rejection.AUTOGRAD, AUTOGRAD_DETAIL)
        else:
            outcome.reject(artifact.id, Rejection.MODULE, f"pattern {artifact.manifest.module!r}")
    return outcome
