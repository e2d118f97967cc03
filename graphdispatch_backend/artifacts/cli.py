"""`artifacts verify ROOT... [--report DIR]` and `artifacts hash BUNDLE`: the registry's
verdicts, as a table; with a report, each verified manifest is also matched against the
regions of that report (pattern, fingerprint, signature, inputs written in place), so a
wrong dtype or a missing `mutates` shows before a compile. No torch is imported."""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphdispatch_backend.artifacts.bundle import claimed_id, hash_bundle, verify_bundle
from graphdispatch_backend.artifacts.manifest import Manifest
from graphdispatch_backend.artifacts.registry import discover
from graphdispatch_backend.artifacts.signature import manifest_miss
from graphdispatch_backend.errors import BundleRejected, ManifestError, did_you_mean
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
                fit = _fit(m, regions) if regions is not None else None
                missing = _entry_missing(folder / m.entry_file, m.entry_symbol)
                if missing is not None:
                    rows.append([m.id, "rejected", missing, str(folder)])
                elif fit is not None and not fit[0]:
                    rows.append([m.id, "rejected", fit[1], str(folder)])
                else:
                    said = f"{m.module} ({files}, parity {m.parity.mode})" + (f"; {fit[1]}" if fit else "")
                    rows.append([m.id, "ok", said, str(folder)])
    ids = [r[0] for r in rows if r[1] == "ok"]
    for row in rows:
        if row[1] == "ok" and ids.count(row[0]) > 1:
            row[1], row[2] = "rejected", f"duplicate_id: {row[0]} is provided by more than one folder"
    print(table(["id", "verdict", "reason", "bundle"], rows))
    return 0 if rows and all(r[1] == "ok" for r in rows) else 1


def _entry_missing(path: Path, symbol: str) -> str | None:
    """Why the entry file cannot give its symbol, read without running it (no torch here):
    it does not parse, or nothing at its top level binds the name (a compile would only warn
    that the artifact did not load). None where it may: a star import can bind anything."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:
        return f"entry_syntax: {path.name} line {exc.lineno}: {exc.msg}"
    bound: set[str] = set()
    blocks = [tree.body]
    while blocks:
        for node in blocks.pop():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                if any(a.name == "*" for a in node.names):
                    return None
                bound.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                blocks += [getattr(node, f) for f in ("body", "orelse", "finalbody") if getattr(node, f, None)]
                blocks += [h.body for h in getattr(node, "handlers", [])]
            else:
                bound.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    if symbol in bound:
        return None
    near = did_you_mean(symbol, sorted(b for b in bound if not b.startswith("_")))
    return f"missing_symbol: {path.name} defines no {symbol!r} at its top level (entry_point.symbol){near}"


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
    misses = {}
    for r in named:
        miss = manifest_miss(manifest, [i["name"] for i in r["inputs"]], [_Spec(i) for i in r["inputs"]],
                             [_Spec(o) for o in r["outputs"]], r.get("mutates", []))
        if miss is None:
            return True, f"fits {sum(1 for x in named if x['fingerprint'] == r['fingerprint'])} region(s) of the report"
        misses.setdefault(miss, r["name"])
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
