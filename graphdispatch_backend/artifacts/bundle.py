"""Trust checks for one bundle folder, and loading its entry code from verified bytes.

A bundle is accepted only when its manifest parses, every declared file exists with the
declared size and sha256, and nothing else is in the folder (no undeclared file, no
symlink, no `__pycache__`). A rejected bundle's code is never executed. At load the entry
file is read once, hashed again, and those same bytes are compiled and executed: no
import machinery, no `.pyc`, nothing read from outside the bundle folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import linecache
import os
import stat
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphdispatch_backend.artifacts.manifest import MANIFEST_NAME, Manifest, parse_manifest
from graphdispatch_backend.errors import BundleRejected, BundleRejection, ManifestError

MAX_MANIFEST_BYTES = 1 << 20
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class VerifiedBundle:
    folder: Path
    manifest: Manifest


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _reject(reason: BundleRejection, detail: str) -> BundleRejected:
    return BundleRejected(reason, detail)


def _regular(path: Path, rel: str) -> os.stat_result:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise _reject(BundleRejection.MISSING_FILE, f"{rel} is declared but missing") from None
    except OSError as exc:
        raise _reject(BundleRejection.UNREADABLE, f"{rel}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise _reject(BundleRejection.SYMLINK, f"{rel} is a symlink")
    if not stat.S_ISREG(st.st_mode):
        raise _reject(BundleRejection.UNDECLARED_FILE, f"{rel} is not a regular file")
    return st


def _manifest_json(folder: Path) -> Any:
    """The manifest's JSON, read within the size cap (BundleRejected: it is not one)."""
    path = folder / MANIFEST_NAME
    st = _regular(path, MANIFEST_NAME)
    if st.st_size > MAX_MANIFEST_BYTES:
        raise _reject(BundleRejection.MANIFEST, f"{MANIFEST_NAME} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except RecursionError:  # "[[[[...]]]]" within the size cap: reject, never crash the compile
        raise _reject(BundleRejection.MANIFEST, f"{MANIFEST_NAME} nests too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _reject(BundleRejection.MANIFEST, f"{MANIFEST_NAME} is not valid JSON: {exc}") from None


def read_manifest(folder: Path) -> Manifest:
    data = _manifest_json(folder)
    try:
        return parse_manifest(data)
    except ManifestError as exc:
        raise _reject(BundleRejection.MANIFEST, str(exc)) from None


def claimed_id(folder: Path) -> str | None:
    """The id a bundle's manifest gives, read on its own, or None: for a bundle rejected for
    anything else (a hash mismatch, an unknown key), so the verdict and `enable` can name the
    bundle the author means. Reading it executes nothing."""
    try:
        data = _manifest_json(folder)
    except (BundleRejected, OSError):
        return None
    artifact_id = data.get("id") if isinstance(data, dict) else None
    return artifact_id if isinstance(artifact_id, str) and artifact_id else None


def list_folder(folder: Path) -> list[str]:
    """Every entry below `folder` as a relative posix path, refusing what a bundle may not hold."""
    found: list[str] = []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        try:
            entries = sorted(os.scandir(folder / rel_dir), key=lambda e: e.name)
        except OSError as exc:
            raise _reject(BundleRejection.UNREADABLE, f"{rel_dir or '.'}: {exc.strerror}") from None
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                raise _reject(BundleRejection.UNSAFE_PATH, f"non-UTF-8 file name {rel!r}") from None
            if entry.is_symlink():
                raise _reject(BundleRejection.SYMLINK, f"{rel} is a symlink")
            if entry.is_dir(follow_symlinks=False):
                if entry.name == "__pycache__":
                    raise _reject(BundleRejection.PYCACHE, f"{rel} (bytecode is never trusted)")
                pending.append(rel)
            else:
                found.append(rel)
    return found


def verify_bundle(folder: Path) -> VerifiedBundle:
    """Raise BundleRejected, or return the bundle with its parsed manifest."""
    folder = Path(folder)
    if os.path.islink(folder):
        raise _reject(BundleRejection.SYMLINK, f"{folder} is a symlink")
    manifest = read_manifest(folder)
    declared = {f.path: f for f in manifest.files}
    for rel in list_folder(folder):
        if rel != MANIFEST_NAME and rel not in declared:
            raise _reject(BundleRejection.UNDECLARED_FILE, f"{rel} is not declared in files")
    for rel, entry in declared.items():
        st = _regular(folder / rel, rel)
        if st.st_size != entry.bytes:  # checked before hashing: a huge file is never read
            raise _reject(BundleRejection.SIZE_MISMATCH, f"{rel}: {st.st_size} bytes, declared {entry.bytes} (after "
                          f"editing a file, run `python -m graphdispatch_backend artifacts hash {folder}`)")
        if sha256_file(folder / rel) != entry.sha256:
            raise _reject(BundleRejection.HASH_MISMATCH, f"{rel}: sha256 differs from the manifest (after editing "
                          f"a file, run `python -m graphdispatch_backend artifacts hash {folder}`)")
    return VerifiedBundle(folder, manifest)


def _read_verified(bundle: VerifiedBundle, rel: str) -> bytes:
    try:
        entry = bundle.manifest.file(rel)
    except KeyError:  # `read_bundle_file("../x")` from artifact code: nothing undeclared is read
        raise _reject(BundleRejection.UNDECLARED_FILE, f"{rel!r} is not declared in files") from None
    _regular(bundle.folder / rel, rel)
    try:  # O_NOFOLLOW: a file swapped for a symlink after the lstat above is not followed
        fd = os.open(bundle.folder / rel, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise _reject(BundleRejection.TAMPERED, f"{rel} changed since it was verified ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(entry.bytes + 1)
    if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
        raise _reject(BundleRejection.TAMPERED, f"{rel} changed since it was verified")
    return data


def load_entry(bundle: VerifiedBundle) -> Callable[..., Any]:
    """Execute the entry file from bytes hashed at this moment; return its entry symbol.

    Raises BundleRejected(TAMPERED) if the file changed since verification (its code is
    then not executed), or whatever the artifact's own module code raises.
    """
    manifest = bundle.manifest
    source = _read_verified(bundle, manifest.entry_file)
    entry = manifest.file(manifest.entry_file)
    filename = f"<graphdispatch artifact {manifest.id}:{manifest.entry_file}>"
    code = compile(source, filename, "exec", dont_inherit=True)
    # Tracebacks show the verified source without reading the file again.
    text = source.decode("utf-8", errors="replace")
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    safe = "".join(c if c.isalnum() else "_" for c in manifest.id)
    module = types.ModuleType(f"graphdispatch_artifacts.{safe}_{entry.sha256[:16]}")
    module.__dict__["read_bundle_file"] = lambda rel: _read_verified(bundle, rel)
    exec(code, module.__dict__)
    fn = getattr(module, manifest.entry_symbol, None)
    if not callable(fn):
        raise AttributeError(f"entry symbol {manifest.entry_symbol!r} is not a callable in {manifest.entry_file}")
    return fn


def hash_bundle(folder: Path) -> dict[str, Any]:
    """Rewrite the manifest's `files` from the folder's contents (for authors); return it."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    listed = list_folder(folder)  # first: a symlinked artifact.json is refused before it is read
    data = json.loads(path.read_text("utf-8"))
    files = []
    for rel in listed:
        if rel in (MANIFEST_NAME, MANIFEST_NAME + ".tmp"):
            continue
        files.append({"path": rel, "sha256": sha256_file(folder / rel), "bytes": os.lstat(folder / rel).st_size})
    data["files"] = files
    parse_manifest(data)  # refuse to write a manifest the registry would reject
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", "utf-8")
    os.replace(tmp, path)
    return data
