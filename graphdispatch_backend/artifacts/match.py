"""Match regions against manifests: a selected artifact, or typed rejections (pure).

Checks run cheapest first: module pattern, enable filter, device, torch version,
fingerprint, signature, then the region's own shape (convex, deterministic). Every miss
is a RejectionRecord with a detail a human can act on ("input 1 'net.0.proj.weight':
dtype bfloat16, region has float32").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from graphdispatch_backend.artifacts.manifest import Manifest, SignatureEntry, version_tuple
from graphdispatch_backend.artifacts.patterns import matches
from graphdispatch_backend.errors import Rejection
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


def _signature_miss(entries: Sequence[SignatureEntry], names: Sequence[str] | None,
                    specs: Sequence[TensorSpec | None], side: str) -> str | None:
    if len(entries) != len(specs):
        return f"{len(entries)} {side}, region has {len(specs)}"
    for i, (entry, spec) in enumerate(zip(entries, specs)):
        label = f"{side[:-1]} {i}" + (f" {names[i]!r}" if names else "")
        if spec is None:
            return f"{label}: region value is not a tensor or scalar"
        if names is not None and entry.name != names[i]:
            return f"{label}: manifest names it {entry.name!r}"
        if entry.dtype != spec.dtype:
            return f"{label}: dtype {entry.dtype}, region has {spec.dtype}"
        if len(entry.shape) != len(spec.shape) or any(
            want is not None and want != got for want, got in zip(entry.shape, spec.shape)
        ):
            dynamic = len(entry.shape) == len(spec.shape) and any(
                want is not None and got is None for want, got in zip(entry.shape, spec.shape))
            hint = (" (null: a dim Dynamo made dynamic, as when it recompiles for a new batch size;"
                    " write null there to match it)") if dynamic else ""
            return f"{label}: shape {_shape(entry.shape)}, region has {_shape(spec.shape)}{hint}"
    return None


def _shape(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("null" if d is None else str(d) for d in shape) + "]"


def signature_miss(manifest: Manifest, region: Region) -> str | None:
    """Why the manifest's signature does not fit the region, or None if it does. The
    region's size inputs (dynamic shapes) are not part of it: a kernel never gets them."""
    return _signature_miss(manifest.inputs, region.kernel_names, region.kernel_specs, "inputs") or (
        _signature_miss(manifest.outputs, None, region.output_specs, "outputs")
    ) or _mutates_miss(manifest, region)


def _mutates_miss(manifest: Manifest, region: Region) -> str | None:
    """The inputs the kernel writes in place must be the ones the region writes: a kernel
    that writes what the region only reads would corrupt it, one that skips a write would
    leave it stale."""
    declared, written = set(manifest.mutates), set(region.mutates)
    if declared == written:
        return None
    if written - declared:
        names = ", ".join(repr(n) for n in sorted(written - declared))
        return (f"the region writes {names} in place (a cache update): declare it in signature.mutates "
                "and write it in place in the kernel")
    names = ", ".join(repr(n) for n in sorted(declared - written))
    return f"signature.mutates names {names}, which the region does not write"


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
