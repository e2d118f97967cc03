"""`artifacts verify ROOT... [--report DIR]` and `artifacts hash BUNDLE`: the registry's
verdicts, as a table, as a compile on this machine would judge each bundle (roots read
once however spelled, the entry symbol, the installed torch against the `torch` range, the
devices); with a report, each verified manifest is also matched against the regions of
that report (pattern, fingerprint, signature, inputs written in place), so a wrong dtype or
a missing `mutates` shows before a compile. No torch is imported, but to ask whether this
machine has a CUDA device for a bundle whose `devices` omit cpu."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphdispatch_backend.artifacts.bundle import claimed_id, entry_tree, hash_bundle, verify_bundle
from graphdispatch_backend.artifacts.manifest import Manifest
from graphdispatch_backend.artifacts.registry import (
    Read,
    devices_miss,
    discover,
    machine_devices,
    running_torch_version,
    torch_range_miss,
)
from graphdispatch_backend.artifacts.signature import manifest_miss
from graphdispatch_backend.errors import BundleRejected, BundleRejection, ManifestError
from graphdispatch_backend.patterns import matches, suggest
from graphdispatch_backend.table import table


def verify_command(roots: Sequence[str], report_dir: str | None = None) -> int:
    """Print id, verdict and reason per bundle; exit 1 if any bundle is rejected (or, with
    `report_dir`, fits no region of that report)."""
    regions = None
    if report_dir is not None:
        from graphdispatch_backend.diagnostics.report_dir import ReportError, load

        try:
            report, _, _ = load(report_dir)
        except ReportError as exc:
            print(f"graphdispatch artifacts verify: error: {exc}")
            return 2
        regions = [r for g in report["graphs"] if g.get("kind") == "inference" for r in g.get("regions", [])]
    rows: list[list[str]] = []
    read, torch_version, devices = Read(), running_torch_version(), None
    for root in roots:
        path = Path(root)
        if not read.new_root(root):
            continue
        if not path.is_dir():
            rows.append(["-", "rejected", f"missing_root: {root} is not a folder", root])
            continue
        try:
            folders = discover(path)
        except OSError as exc:
            rows.append(["-", "rejected", f"unreadable_root: cannot list {root}: {exc.strerror or exc}", root])
            continue
        if not folders:  # an empty root is a mistake in CI, not an "ok" with nothing checked
            rows.append(["-", "rejected", f"no_bundles: no artifact.json in {root} or its subfolders", root])
        for folder in folders:
            if not read.new_folder(folder):
                continue
            try:
                bundle = verify_bundle(folder)
            except BundleRejected as exc:
                rows.append([_id_of(folder), "rejected", f"{exc.reason.value}: {exc.detail}", str(folder)])
            else:
                m = bundle.manifest
                files = f"{len(m.files)} file{'' if len(m.files) == 1 else 's'}"
                fit = _fit(m, regions) if regions is not None else None
                missing = _entry_missing(folder, m)
                if (miss := torch_range_miss(m, torch_version)) is not None:
                    rows.append([m.id, "rejected", f"{BundleRejection.TORCH_VERSION.value}: {miss}", str(folder)])
                elif missing is not None:
                    rows.append([m.id, "rejected", missing, str(folder)])
                elif fit is not None and not fit[0]:
                    rows.append([m.id, "rejected", fit[1], str(folder)])
                else:
                    said = f"{m.module} ({files}, parity {m.parity.mode})" + (f"; {fit[1]}" if fit else "")
                    if "cpu" not in m.devices:  # not a rejection (registry.Registry._note_idle): said
                        devices = devices or machine_devices()
                        if (idle := devices_miss(m, devices)) is not None:
                            said += f"; {idle}"
                    rows.append([m.id, "ok", said, str(folder)])
    ids = [r[0] for r in rows if r[1] == "ok"]
    for row in rows:
        if row[1] == "ok" and ids.count(row[0]) > 1:
            row[1], row[2] = "rejected", f"duplicate_id: {row[0]} is provided by more than one folder"
    print(table(["id", "verdict", "reason", "bundle"], rows))
    return 0 if rows and all(r[1] == "ok" for r in rows) else 1


def _entry_missing(folder: Path, manifest: Manifest) -> str | None:
    """Why the entry file cannot give its symbol, read without running it, by the rule a
    compile applies before executing it (bundle.entry_tree): it does not parse, or nothing
    at its top level binds the name. None where it may."""
    path = folder / manifest.entry_file
    try:
        entry_tree(path.read_bytes(), str(path), manifest)
    except SyntaxError as exc:
        return f"{BundleRejection.ENTRY_SYNTAX.value}: {manifest.entry_file} line {exc.lineno}: {exc.msg}"
    except BundleRejected as exc:
        return f"{exc.reason.value}: {exc.detail}"
    return None


def _fit(manifest: Manifest, regions: list[dict[str, Any]]) -> tuple[bool, str]:
    """Whether the manifest fits a region of the report, and what to say."""
    named = [r for r in regions if matches(manifest.module, r["module"])]
    if not named:
        names = sorted({r["module"] for r in regions})
        return False, f"report: {suggest(manifest.module, names).text()}"
    if manifest.fingerprint is not None:
        if not any(r["fingerprint"] == manifest.fingerprint for r in named):
            return False, f"report: no region `{manifest.module}` names has fingerprint {manifest.fingerprint}"
        named = [r for r in named if r["fingerprint"] == manifest.fingerprint]
    misses, fits = {}, []
    for r in named:  # every region it fits, of every kind (a dynamic dimension fits a prefill's and a decode's)
        miss = manifest_miss(manifest, [i["name"] for i in r["inputs"]], [_Spec(i) for i in r["inputs"]],
                             [_Spec(o) for o in r["outputs"]], r.get("mutates", []))
        if miss is None:
            fits.append(r)
        else:
            misses.setdefault(miss, r["name"])
    if fits:
        kinds = len({r["fingerprint"] for r in fits})
        return True, f"fits {len(fits)} region(s) of the report" + (f", of {kinds} kinds" if kinds > 1 else "")
    miss, name = next(iter(misses.items()))
    return False, f"report: does not fit {name}: signature: {miss}"


class _Spec:
    """A report entry's dtype and shape, as signature.manifest_miss reads a spec."""

    def __init__(self, entry: dict[str, Any]) -> None:
        self.dtype = entry.get("dtype")
        self.shape = tuple(entry.get("shape", ()))


def _id_of(folder: Path) -> str:
    """The id a rejected bundle claims (a hash mismatch, an unknown key elsewhere in its
    manifest): it tells the author which bundle to fix; "?" where no id can be read."""
    return claimed_id(folder) or "?"


def hash_command(bundle: str) -> int:
    try:
        data = hash_bundle(Path(bundle))
    except (BundleRejected, ManifestError, OSError, json.JSONDecodeError) as exc:
        print(f"cannot hash {bundle}: {exc}")
        return 1
    for f in data["files"]:
        print(f"{f['sha256']}  {f['bytes']:>9}  {f['path']}")
    print(f"rewrote {Path(bundle) / 'artifact.json'} ({len(data['files'])} files)")
    return 0
