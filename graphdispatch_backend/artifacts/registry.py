"""The artifact registry: discover bundle roots, verify every bundle, apply `enable`.

Roots are searched one level deep (`root/artifact.json`, `root/*/artifact.json`). A root is
one folder however it is spelled: roots are de-duplicated by their resolved real path
(`root` and `root/`, a symlink to it), and a bundle folder reached through two roots
(`root` and `root/bundle`) is read once; two different folders giving one id are a
`duplicate_id`. Every bundle is verified even when `enable` narrows the selection, so a
corrupt bundle is always reported; a bad bundle is recorded in `errors` and never hides
the good ones. A bundle whose `torch` range excludes the running torch is one of them
(`torch_version`). Entry code is loaded lazily, the first time an artifact matches a region.

`enable` naming an id that no bundle claims (a typo) is an error, with the closest id. One
that a rejected bundle claims (its kernel edited after `artifacts hash`) is not: it is that
bundle's rejection, said as every rejection is (a WARNING naming the fix; `strict` raises),
and the run goes on without it, as it would without `enable`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from graphdispatch_backend.artifacts.bundle import VerifiedBundle, claimed_id, load_entry, verify_bundle
from graphdispatch_backend.artifacts.manifest import MANIFEST_NAME, Manifest, version_tuple
from graphdispatch_backend.errors import BundleRejected, BundleRejection, Contain, RegistryError, did_you_mean

log = logging.getLogger("graphdispatch_backend")  # diagnostics.events' logger, without importing torch


class ArtifactLoadError(Exception):
    """The entry code of a verified bundle would not load (or was tampered with)."""


@dataclasses.dataclass
class Artifact:
    """A verified bundle; `load()` executes its entry code once, from verified bytes."""

    bundle: VerifiedBundle
    _fn: Callable[..., Any] | None = None
    _error: str | None = None
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def id(self) -> str:
        return self.manifest.id

    @property
    def manifest(self) -> Manifest:
        return self.bundle.manifest

    def load(self, contain: Contain) -> Callable[..., Any]:
        """Load once. `contain` (from backend.py, the one broad boundary) runs the
        untrusted module code and hands back what it raised instead of raising it."""
        with self._lock:
            if self._fn is None and self._error is None:
                fn, exc = contain(self._load_entry)
                if isinstance(exc, ArtifactLoadError):
                    self._error = str(exc)
                elif exc is not None:
                    self._error = f"{type(exc).__name__}: {exc}"
                else:
                    self._fn = fn
            if self._fn is None:
                raise ArtifactLoadError(self._error)
            return self._fn

    def _load_entry(self) -> Callable[..., Any]:
        # `contain` lets our own typed errors through, and BundleRejected is one: raised as
        # is, a bundle tampered with after verification would fail the whole graph's
        # compile instead of leaving this one region native. As an ArtifactLoadError it is
        # contained like any failure of the artifact's code (and raised under `strict`).
        try:
            return load_entry(self.bundle)
        except BundleRejected as exc:
            raise ArtifactLoadError(f"{exc.reason.value}: {exc.detail}") from exc


def _nearby(path: Path) -> str:
    """A missing root's closest existing names: the folders in its nearest existing parent
    like the part of its path that is missing, as " (did you mean '...'?)", or ""."""
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    try:
        names = [p.name for p in parent.iterdir() if p.is_dir()]
    except OSError:
        return ""
    missing, *rest = path.relative_to(parent).parts or (path.name,)
    return did_you_mean(missing, names, os.path.join(parent, ""), os.sep + os.path.join(*rest) if rest else "")


def _deeper(root: Path) -> str:
    """A root that holds bundles two levels down (`root/group/bundle/artifact.json`) was
    given one level too high: say which folders to give instead."""
    try:
        groups = sorted({str(m.parent.parent) for m in root.glob(f"*/*/{MANIFEST_NAME}")})
    except OSError:
        return ""
    if not groups:
        return ""
    return f"; bundles are two levels down: give {' or '.join(groups[:3])} (roots are searched one level deep)"


def discover(root: Path) -> list[Path]:
    """Bundle folders under a root: the root itself if it holds a manifest, else its children."""
    if (root / MANIFEST_NAME).exists() or (root / MANIFEST_NAME).is_symlink():
        return [root]
    return sorted(p for p in root.iterdir() if (p / MANIFEST_NAME).exists() or (p / MANIFEST_NAME).is_symlink())


@dataclasses.dataclass
class Read:
    """The real paths of the roots and bundle folders read so far. `root` and `root/` (or a
    link to it) are one root: read twice, each of its bundles was a duplicate of itself and
    none served. A bundle folder that is also a root (`root` and `root/bundle`) is read once."""

    roots: set[str] = dataclasses.field(default_factory=set)
    folders: set[str] = dataclasses.field(default_factory=set)

    def new_root(self, root: str) -> bool:
        real = os.path.realpath(root)
        if real in self.roots or real in self.folders:
            return False
        self.roots.add(real)
        return True

    def new_folder(self, folder: Path) -> bool:
        # a symlinked bundle folder keeps its spelling: it is read, to be refused as a symlink
        place = str(folder) if os.path.islink(folder) else os.path.realpath(folder)
        if place in self.folders:
            return False
        self.folders.add(place)
        return True


def running_torch_version() -> str | None:
    """The torch this process runs, or, where it has not imported torch (`artifacts verify`),
    the one installed, read without importing it; None where there is none."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_devices() -> tuple[str, ...]:
    """The device types a kernel could run on here: cpu, and cuda where torch sees a CUDA
    device. It imports torch: called only for a bundle whose `devices` omit cpu."""
    import torch

    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def torch_range_miss(manifest: Manifest, version: str | None) -> str | None:
    """How the manifest's `torch` range excludes `version` (the running torch), or None."""
    if version is None:
        return None
    low, high = manifest.torch_min, manifest.torch_max_exclusive
    have = version_tuple(version)
    if (low is None or have >= version_tuple(low)) and (high is None or have < version_tuple(high)):
        return None
    wanted = ", ".join(w for w in (low and f">= {low}", high and f"< {high}") if w)
    return (f"the manifest's torch range ({wanted}) excludes torch {version}, which runs here: the bundle would "
            f"serve nothing; once its kernel passes on torch {version}, widen torch.min or torch.max_exclusive")


def devices_miss(manifest: Manifest, devices: Sequence[str]) -> str | None:
    """How the manifest's `devices` exclude every device of this machine, or None."""
    if any(d in devices for d in manifest.devices):
        return None
    return f"devices {list(manifest.devices)}, this machine has {' and '.join(devices)} only: it serves no region here"


@dataclasses.dataclass
class Registry:
    roots: tuple[str, ...] = ()
    artifacts: dict[str, Artifact] = dataclasses.field(default_factory=dict)  # verified and enabled
    verified_ids: tuple[str, ...] = ()
    enabled_filter: tuple[str, ...] | None = None
    excluded: dict[str, Artifact] = dataclasses.field(default_factory=dict)
    errors: list[dict[str, str]] = dataclasses.field(default_factory=list)

    @classmethod
    def load(cls, roots: Sequence[str], enable: Sequence[str] | None = None, *, torch_version: str | None = None,
             devices: Sequence[str] | None = None) -> Registry:
        """Verify every bundle of `roots`. `torch_version` and `devices` are the running
        torch's and this machine's unless given (tests)."""
        reg = cls(roots=tuple(roots), enabled_filter=tuple(enable) if enable is not None else None)
        torch_version = torch_version if torch_version is not None else running_torch_version()
        found: dict[str, list[VerifiedBundle]] = {}
        refused: dict[str, dict[str, str]] = {}  # id a rejected bundle claims -> its error
        read = Read()
        for root in reg.roots:
            path = Path(root)
            if not read.new_root(root):
                continue
            if not path.is_dir():
                what = "is a file, not a folder" if path.exists() else "does not exist"
                reg.errors.append({"bundle": root, "reason": BundleRejection.MISSING_ROOT.value,
                                   "message": f"{root} {what}{_nearby(path)}"})
                continue
            try:
                folders = discover(path)
            except OSError as exc:
                reg.errors.append({"bundle": root, "reason": BundleRejection.UNREADABLE_ROOT.value,
                                   "message": f"cannot list {root}: {exc.strerror or exc}"})
                continue
            if not folders:  # a root with nothing in it is a wrong path, not "no artifacts wanted"
                reg.errors.append({"bundle": root, "reason": BundleRejection.NO_BUNDLES.value,
                                   "message": f"no artifact.json in {root} or its subfolders{_deeper(path)}"})
            for folder in folders:
                if not read.new_folder(folder):
                    continue
                try:
                    bundle = verify_bundle(folder)
                except BundleRejected as exc:
                    error = {"bundle": str(folder), "reason": exc.reason.value, "message": exc.detail}
                    reg.errors.append(error)
                    if (claimed := claimed_id(folder)) is not None:
                        refused.setdefault(claimed, error)
                    continue
                # A torch range is the author's word on which torch the kernel was checked with;
                # outside it the bundle serves nothing in this process, and the usual cause, a
                # torch upgrade that left the bundle behind, is what must not pass unsaid: a
                # rejection, warned, in the report's errors, raised under strict. Judged before
                # duplicate ids, so one folder per torch version for one id serves the one in range.
                if (miss := torch_range_miss(bundle.manifest, torch_version)) is not None:
                    error = {"bundle": str(folder), "reason": BundleRejection.TORCH_VERSION.value, "message": miss}
                    reg.errors.append(error)
                    refused.setdefault(bundle.manifest.id, error)
                    continue
                found.setdefault(bundle.manifest.id, []).append(bundle)
        verified: dict[str, Artifact] = {}
        duplicated: set[str] = set()
        for artifact_id, bundles in sorted(found.items()):
            if len(bundles) > 1:
                duplicated.add(artifact_id)
                folders = " and ".join(str(b.folder) for b in bundles)
                reg.errors.append({
                    "bundle": folders,
                    "reason": BundleRejection.DUPLICATE_ID.value,
                    "message": f"id {artifact_id!r} is provided by {folders}; neither is used",
                })
                continue
            verified[artifact_id] = Artifact(bundles[0])
        reg.verified_ids = tuple(sorted(verified))
        if enable is None:
            reg.artifacts = verified
            reg._note_idle(devices)
            return reg
        missing = sorted(set(enable) - set(verified))
        for artifact_id in missing:
            if artifact_id in refused and artifact_id not in duplicated:  # its rejection says why (docstring)
                refused[artifact_id]["message"] += f"; enable names {artifact_id!r}: the run goes on without it"
        missing = [m for m in missing if m not in refused or m in duplicated]
        if missing:
            dup = sorted(duplicated.intersection(missing))
            rejected = ", ".join(f"{i} ({e['reason']})" for i, e in sorted(refused.items()))
            meant = did_you_mean(missing[0], [*verified, *refused])
            raise RegistryError(
                f"enable names {', '.join(repr(m) for m in missing)}{meant}, which no verified bundle provides; "
                f"available: {', '.join(reg.verified_ids) or 'none'}"
                + (f" ({', '.join(dup)}: provided by more than one folder, see errors)" if dup else "")
                + (f"; rejected: {rejected}" if rejected else "")
            )
        reg.artifacts = {k: v for k, v in verified.items() if k in enable}
        reg.excluded = {k: v for k, v in verified.items() if k not in enable}
        reg._note_idle(devices)
        return reg

    def _note_idle(self, devices: Sequence[str] | None) -> None:
        """Say, at INFO, each enabled artifact whose `devices` this machine has none of.

        Not a rejection, nor a WARNING, nor an error under strict: a bundle for CUDA only on a
        CPU-only host is a deployment that ships one bundle set to CPU and GPU hosts alike,
        not an author's mistake, and a warning no one can act on (or a strict CI on a CPU
        runner failing a correct bundle) would teach users to ignore the real ones. The
        artifact stays loaded; each region it names is refused as `device` in the report,
        with the devices, and `artifacts verify` says it serves nothing on this machine."""
        for artifact in self.artifacts.values():
            if "cpu" in artifact.manifest.devices:
                continue  # every machine has one: torch is not imported to ask
            devices = devices if devices is not None else machine_devices()
            if (miss := devices_miss(artifact.manifest, devices)) is not None:
                log.info("graphdispatch: artifacts: %s (%s): %s", artifact.id, artifact.bundle.folder, miss)

    def summary(self) -> dict[str, Any]:
        return {
            "roots": list(self.roots),
            "loaded": sorted(self.artifacts),
            "verified": list(self.verified_ids),
            "enabled_filter": list(self.enabled_filter) if self.enabled_filter is not None else None,
            "excluded_ids": sorted(self.excluded),
            "errors": list(self.errors),
            # id -> region.module, so the report can say what an unmatched artifact asked for
            "patterns": {a.id: a.manifest.module for a in [*self.artifacts.values(), *self.excluded.values()]},
        }
