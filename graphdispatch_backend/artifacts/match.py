"""Match regions against manifests: a selected artifact, or typed rejections (pure).

Checks run cheapest first: module pattern, enable filter, device, torch version,
fingerprint, signature, then the region's own shape (convex, deterministic). Every miss
is a RejectionRecord with a detail a human can act on ("input 1 'net.0.proj.weight':
dtype bfloat16, region has float32").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from graphdispatch_backend.artifacts.manifest import Manifest, version_tuple
from graphdispatch_backend.artifacts.patterns import matches
from graphdispatch_backend.artifacts.signature import manifest_miss
from graphdispatch_backend.errors import Rejection
from graphdispatch_backend.region import Region


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


def _first_miss(m: Manifest, region: Region, torch_version: str) -> tuple[Rejection, str] | None:
    if region.device_type not in m.devices:
        return Rejection.DEVICE, f"region on {region.device_type}, artifact supports {list(m.devices)}"
    if (miss := torch_miss(m, torch_version)) is not None:
        return Rejection.TORCH_VERSION, miss
    if m.fingerprint is not None and m.fingerprint != region.fingerprint:
        return Rejection.FINGERPRINT, f"manifest {m.fingerprint}, region {region.fingerprint}"
    if (miss := signature_miss(m, region)) is not None:
        return Rejection.SIGNATURE, miss
    if not region.convex:
        return Rejection.NOT_CONVEX, "a path leaves the region and re-enters it"
    if not region.deterministic:
        return Rejection.NONDETERMINISTIC, "the region draws random numbers"
    return None


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
