"""`artifacts verify ROOT...` and `artifacts hash BUNDLE`: the registry's verdicts, as a table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from graphdispatch_backend.artifacts.bundle import hash_bundle, read_manifest, verify_bundle
from graphdispatch_backend.artifacts.registry import discover
from graphdispatch_backend.errors import BundleRejected, ManifestError
from graphdispatch_backend.table import table


def verify_command(roots: Sequence[str]) -> int:
    """Print id, verdict and reason per bundle; exit 1 if any bundle is rejected."""
    rows: list[list[str]] = []
    for root in roots:
        path = Path(root)
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
            try:
                bundle = verify_bundle(folder)
            except BundleRejected as exc:
                rows.append([_id_of(folder), "rejected", f"{exc.reason.value}: {exc.detail}", str(folder)])
            else:
                m = bundle.manifest
                files = f"{len(m.files)} file{'' if len(m.files) == 1 else 's'}"
                rows.append([m.id, "ok", f"{m.module} ({files}, parity {m.parity.mode})", str(folder)])
    ids = [r[0] for r in rows if r[1] == "ok"]
    for row in rows:
        if row[1] == "ok" and ids.count(row[0]) > 1:
            row[1], row[2] = "rejected", f"duplicate_id: {row[0]} is provided by more than one folder"
    print(table(["id", "verdict", "reason", "bundle"], rows))
    return 0 if rows and all(r[1] == "ok" for r in rows) else 1


def _id_of(folder: Path) -> str:
    """The id a rejected bundle claims, when its manifest parses (a hash mismatch, say): it
    tells the author which bundle to fix. Reading the manifest executes nothing."""
    try:
        return read_manifest(folder).id
    except BundleRejected:
        return "?"


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
