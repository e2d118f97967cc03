"""Trust checks for one bundle folder, and loading its entry code from verified bytes.

A bundle is accepted only when its manifest parses, every declared file exists with the
declared size and sha256, and nothing else is in the folder (no undeclared file, no
symlink, no `__pycache__`). A rejected bundle's code is never executed. At load the entry
file is read once, hashed again, and those same bytes are parsed, checked to bind the entry
symbol at their top level (`entry_tree`, which runs nothing), compiled and executed: no
import machinery, no `.pyc`, nothing read from outside the bundle folder.
"""

from __future__ import annotations

import ast
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
from graphdispatch_backend.errors import BundleRejected, BundleRejection, ManifestError, did_you_mean

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


# The blocks of a compound statement (if, try, with, for, while) run at import, as the top level does.
_BLOCKS = ("body", "orelse", "finalbody")
_ASYNC = "async def"


def _top_level_bindings(tree: ast.Module) -> dict[str, set[str]] | None:
    """Each name a statement at the module's top level binds, to how ("def", "class",
    "import", "assignment", "async def"), the blocks of its compound statements included;
    None where a star import binds names no reader can list. Function and class bodies are
    not read: they bind when called, or in their own namespace. The walk over a statement's
    own expressions also counts a comprehension's variable: it errs toward accepting, and
    load_entry's check after the import still refuses what is not there."""
    bound: dict[str, set[str]] = {}
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            how = "class" if isinstance(node, ast.ClassDef) else "def" if isinstance(node, ast.FunctionDef) else _ASYNC
            bound.setdefault(node.name, set()).add(how)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                bound.setdefault(alias.asname or alias.name.split(".")[0], set()).add("import")
            continue
        if isinstance(node, ast.AnnAssign) and node.value is None:
            continue  # `forward: Callable` annotates a name, binds none
        for field in _BLOCKS:
            pending += getattr(node, field, None) or []
        for handler in getattr(node, "handlers", None) or []:  # its `as name` is unbound when it ends
            pending += handler.body
        for case in getattr(node, "cases", None) or []:  # match: `case ... as name` binds
            pending += case.body
            for p in ast.walk(case.pattern):
                for name in (getattr(p, "name", None), getattr(p, "rest", None)):
                    if name:
                        bound.setdefault(name, set()).add("assignment")
        # the statement's own expressions: assignment, for and with targets, `:=`
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                continue
            for n in ast.walk(child):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    bound.setdefault(n.id, set()).add("assignment")
    return bound


def entry_tree(source: bytes, filename: str, manifest: Manifest) -> ast.Module:
    """The entry file parsed, never executed: raises SyntaxError where it does not parse (as
    compiling it would), and BundleRejected(MISSING_SYMBOL) where no statement at its top
    level binds entry_point.symbol: a `def`, a `class`, an assignment's target (an annotated
    one with a value), an `import ... as name` or `from ... import name`, also inside the
    blocks of an `if`, `try`, `with`, `for`, `while` or `match` there (they run at import).
    A name bound only by `async def` is refused too: the entry point is called, not awaited,
    and a coroutine is never a tensor. A star import may bind anything: trusted. So a typo in
    entry_point.symbol runs none of the file's code (design.md section 3)."""
    tree = compile(source, filename, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    bound = _top_level_bindings(tree)
    if bound is None:
        return tree
    symbol, where = manifest.entry_symbol, manifest.entry_file
    how = bound.get(symbol, set())
    if how == {_ASYNC}:
        raise _reject(BundleRejection.MISSING_SYMBOL, f"{where} binds {symbol!r} only as an async def "
                      "(entry_point.symbol): the entry point is called, not awaited, and returns no tensor")
    if not how:
        near = did_you_mean(symbol, sorted(b for b in bound if not b.startswith("_")))
        raise _reject(BundleRejection.MISSING_SYMBOL,
                      f"{where} defines no {symbol!r} at its top level (entry_point.symbol){near}")
    return tree


def load_entry(bundle: VerifiedBundle) -> Callable[..., Any]:
    """Execute the entry file from bytes hashed at this moment; return its entry symbol.

    Raises BundleRejected(TAMPERED) if the file changed since verification, SyntaxError or
    BundleRejected(MISSING_SYMBOL) where it does not parse or binds no entry symbol at its
    top level (`entry_tree`: its code is then not executed), AttributeError where the
    executed module holds no callable by that name, or whatever the module code raises.
    """
    manifest = bundle.manifest
    source = _read_verified(bundle, manifest.entry_file)
    entry = manifest.file(manifest.entry_file)
    filename = f"<graphdispatch artifact {manifest.id}:{manifest.entry_file}>"
    # Parsed and checked before any of it runs: a rejected bundle's code is never executed.
    code = compile(entry_tree(source, filename, manifest), filename, "exec", dont_inherit=True)
    # Tracebacks show the verified source without reading the file again.
    text = source.decode("utf-8", errors="replace")
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    safe = "".join(c if c.isalnum() else "_" for c in manifest.id)
    module = types.ModuleType(f"graphdispatch_artifacts.{safe}_{entry.sha256[:16]}")
    module.__dict__["read_bundle_file"] = lambda rel: _read_verified(bundle, rel)
    exec(code, module.__dict__)
    # Bound at the top level is not bound at the end: `del forward`, `forward = None`.
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
