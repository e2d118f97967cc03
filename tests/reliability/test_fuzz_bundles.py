"""Fuzzing bundle trees: bad bundles are rejected with a typed reason, and never run.

Hypothesis builds artifact roots of one to four bundles. Each bundle starts valid (an
exact reimplementation of the model's `blk` Linear, so it would pass bitwise parity) and
gets zero to three mutations: extra or nested files (declared or not), empty files, symlinks
to inside and outside files and folders, `..` and absolute paths in the manifest, huge
declared sizes and huge sparse files, a `__pycache__` with bytecode, non-UTF-8 names, FIFOs,
a tampered or missing file, a broken or symlinked manifest, duplicate ids.

Every Python file anywhere in the tree, and every file a symlink points to, creates its own
marker file when executed. The checks:

- `verify_bundle` raises BundleRejected with one of the reasons the mutations can cause,
  exactly for the bundles that got a rejecting mutation; a benign tree verifies;
- `Registry.load` lists exactly the good bundles (a bad one never hides a good one) and one
  typed error per bad bundle, and executes nothing (loading is lazy);
- compiling and running a model whose region every bundle would match executes at most the
  selected good bundle's entry file, gives eager's bits, and no other marker appears.

Trees live under pytest's tmp_path, one folder per example. GD_FUZZ_SCALE scales counts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import marshal
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import graphdispatch_backend
from graphdispatch_backend.artifacts.bundle import verify_bundle
from graphdispatch_backend.artifacts.registry import Registry
from graphdispatch_backend.errors import BundleRejected, BundleRejection

SCALE = float(os.environ.get("GD_FUZZ_SCALE", "1"))
R = BundleRejection


def _settings(n: int) -> settings:
    return settings(settings.get_profile("gd_reliability"), max_examples=max(1, int(n * SCALE)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blk = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.blk(x))


# The region report of `blk` for a [4, 8] input lists weight, bias, input0 in this order;
# test_signature_matches_the_region_report pins it, so the bundles really would match.
SIGNATURE = {
    "inputs": [{"name": "weight", "shape": [8, 8], "dtype": "float32"},
               {"name": "bias", "shape": [8], "dtype": "float32"},
               {"name": "input0", "shape": [4, 8], "dtype": "float32"}],
    "outputs": [{"shape": [4, 8], "dtype": "float32"}],
}


def marker_code(markers: Path, name: str, forward: bool = True) -> bytes:
    """Python that creates markers/<name> when executed, and (optionally) the exact kernel."""
    body = f"import os\nopen(os.path.join({str(markers)!r}, {name!r}), 'w').close()\n"
    if forward:
        body += ("import torch.nn.functional as F\n\n\n"
                 "def forward(weight, bias, input0):\n    return F.linear(input0, weight, bias)\n")
    return body.encode()


def entry(rel: str, data: bytes) -> dict[str, Any]:
    return {"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


@dataclasses.dataclass
class Tree:
    """One bundle folder being built: files on disk, the manifest to write, and what the
    mutations expect (the reasons verification may give; empty: it must verify)."""

    folder: Path
    outside: Path  # a folder next to the root, for symlink targets
    markers: Path
    name: str
    manifest: dict[str, Any]
    reasons: set[BundleRejection] = dataclasses.field(default_factory=set)
    manifest_written: bool = False

    def write(self, rel: str, data: bytes, declare: bool) -> None:
        path = self.folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if declare:
            self.manifest["files"].append(entry(rel, data))

    def py(self, label: str) -> bytes:
        return marker_code(self.markers, f"{self.name}-{label}")

    def outside_file(self, label: str) -> Path:
        target = self.outside / f"{self.name}-{label}.py"
        target.write_bytes(self.py(f"outside-{label}"))
        return target


# -- mutations: (tree, draw) -> None; each adds the reasons it can cause ------------------

def m_declared_data(t: Tree, draw: Any) -> None:
    rel = draw(st.sampled_from(["data.bin", "data/w.bin", "a/b/c/d.txt", "notes.md", "lib/helper.py"]))
    t.write(rel, draw(st.binary(max_size=64)), declare=True)


def m_declared_empty(t: Tree, draw: Any) -> None:
    t.write(draw(st.sampled_from(["empty", "sub/empty.bin"])), b"", declare=True)


def m_empty_dir(t: Tree, draw: Any) -> None:
    (t.folder / draw(st.sampled_from(["emptydir", "x/y/z"]))).mkdir(parents=True, exist_ok=True)


def m_undeclared_file(t: Tree, draw: Any) -> None:
    rel = draw(st.sampled_from(["extra.py", "sub/extra.py", "a/b/evil.py", ".hidden.py", "kernel.py.orig"]))
    t.write(rel, t.py(rel.replace("/", "_")), declare=False)
    t.reasons.add(R.UNDECLARED_FILE)


def m_undeclared_empty(t: Tree, draw: Any) -> None:
    t.write(draw(st.sampled_from(["stray-empty", "d/stray"])), b"", declare=False)
    t.reasons.add(R.UNDECLARED_FILE)


def m_symlink_inside(t: Tree, draw: Any) -> None:
    os.symlink("kernel.py", t.folder / "alias.py")
    t.reasons.add(R.SYMLINK)


def m_symlink_outside(t: Tree, draw: Any) -> None:
    os.symlink(t.outside_file("linked"), t.folder / draw(st.sampled_from(["outlink.py", "outlink"])))
    t.reasons.add(R.SYMLINK)


def m_symlink_declared_entry_outside(t: Tree, draw: Any) -> None:
    """The entry point is a symlink to an outside file, declared with the target's true hash."""
    target = t.outside_file("entry")
    os.symlink(target, t.folder / "evil.py")
    t.manifest["files"].append(entry("evil.py", target.read_bytes()))
    t.manifest["entry_point"]["file"] = "evil.py"
    t.reasons.add(R.SYMLINK)


def m_kernel_is_symlink(t: Tree, draw: Any) -> None:
    """kernel.py replaced by a symlink to identical bytes outside: the hash would match."""
    data = (t.folder / "kernel.py").read_bytes()
    target = t.outside / f"{t.name}-same.py"
    target.write_bytes(data)
    (t.folder / "kernel.py").unlink()
    os.symlink(target, t.folder / "kernel.py")
    t.reasons.add(R.SYMLINK)


def m_symlink_dir(t: Tree, draw: Any) -> None:
    t.outside_file("indir")
    os.symlink(t.outside, t.folder / "linkdir")
    t.reasons.add(R.SYMLINK)


def m_dangling_symlink(t: Tree, draw: Any) -> None:
    os.symlink(t.folder / "does-not-exist.py", t.folder / "dangling.py")
    t.reasons.add(R.SYMLINK)


def m_dotdot_declared(t: Tree, draw: Any) -> None:
    target = t.outside_file("dotdot")
    rel = draw(st.sampled_from([f"../{target.parent.name}/{target.name}", "sub/../../x.py", "../x.py"]))
    t.manifest["files"].append(entry(rel, target.read_bytes()))
    t.reasons.add(R.MANIFEST)


def m_dotdot_entry(t: Tree, draw: Any) -> None:
    target = t.outside_file("dotdot-entry")
    rel = f"../{target.parent.name}/{target.name}"
    t.manifest["files"].append(entry(rel, target.read_bytes()))
    t.manifest["entry_point"]["file"] = rel
    t.reasons.add(R.MANIFEST)


def m_absolute_declared(t: Tree, draw: Any) -> None:
    target = t.outside_file("absolute")
    t.manifest["files"].append(entry(str(target), target.read_bytes()))
    if draw(st.booleans()):
        t.manifest["entry_point"]["file"] = str(target)
    t.reasons.add(R.MANIFEST)


def m_huge_declared_size(t: Tree, draw: Any) -> None:
    t.manifest["files"][0]["bytes"] = draw(st.sampled_from([2**40, 10**18, 2**63 - 1, 10**30]))
    t.reasons.add(R.SIZE_MISMATCH)


def m_huge_sparse_file(t: Tree, draw: Any) -> None:
    """A declared file that is really 64 GiB (sparse): refused on size, never read."""
    with open(t.folder / "huge.bin", "wb") as fh:
        try:
            fh.truncate(1 << 36)
        except OSError:  # a file system without sparse files this large: any size but 12 will do
            fh.write(b"x" * 13)
    t.manifest["files"].append({"path": "huge.bin", "sha256": "0" * 64, "bytes": 12})
    t.reasons.add(R.SIZE_MISMATCH)


def m_pycache(t: Tree, draw: Any) -> None:
    code = compile(t.py("pyc").decode(), "kernel.py", "exec")
    data = importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code)  # a loadable .pyc
    rel = draw(st.sampled_from(["__pycache__/kernel.cpython-311.pyc", "sub/__pycache__/kernel.cpython-311.pyc"]))
    if draw(st.booleans()):  # declared: refused by the manifest's path rule instead
        t.write(rel, data, declare=True)
        t.reasons.add(R.MANIFEST)
    else:
        t.write(rel, data, declare=False)
    t.reasons.add(R.PYCACHE)


def m_non_utf8_name(t: Tree, draw: Any) -> None:
    name = draw(st.sampled_from([b"\xff\xfe.py", b"caf\xe9.py", b"sub/\x80bad"]))
    path = os.fsencode(t.folder) + b"/" + name
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(t.py("nonutf8"))
    t.reasons.add(R.UNSAFE_PATH)


def m_fifo(t: Tree, draw: Any) -> None:
    os.mkfifo(t.folder / "pipe")
    if draw(st.booleans()):
        t.manifest["files"].append(entry("pipe", b""))
    t.reasons.add(R.UNDECLARED_FILE)  # "not a regular file"; it is never opened


def m_declared_directory(t: Tree, draw: Any) -> None:
    (t.folder / "somedir").mkdir()
    t.manifest["files"].append(entry("somedir", b""))
    t.reasons.add(R.UNDECLARED_FILE)


def m_hash_mismatch(t: Tree, draw: Any) -> None:
    path = t.folder / "kernel.py"
    data = bytearray(path.read_bytes())
    at = draw(st.integers(0, len(data) - 1))
    data[at] ^= 1 << draw(st.integers(0, 7))
    path.write_bytes(bytes(data))
    t.reasons.add(R.HASH_MISMATCH)


def m_size_mismatch(t: Tree, draw: Any) -> None:
    with open(t.folder / "kernel.py", "ab") as fh:
        fh.write(draw(st.binary(min_size=1, max_size=8)))
    t.reasons.add(R.SIZE_MISMATCH)


def m_missing_declared(t: Tree, draw: Any) -> None:
    t.manifest["files"].append(entry(draw(st.sampled_from(["gone.bin", "sub/gone.py"])), b"x"))
    t.reasons.add(R.MISSING_FILE)


def m_entry_missing(t: Tree, draw: Any) -> None:
    (t.folder / "kernel.py").unlink()
    t.reasons.add(R.MISSING_FILE)


def m_manifest_broken(t: Tree, draw: Any) -> None:
    raw = draw(st.sampled_from([b"", b"{", b"\xff\xfe", b"[]", json.dumps(t.manifest).encode()[:-1]]))
    (t.folder / "artifact.json").write_bytes(raw)
    t.manifest_written = True
    t.reasons.add(R.MANIFEST)


def m_manifest_unknown_key(t: Tree, draw: Any) -> None:
    t.manifest[draw(st.sampled_from(["pre_import", "hooks", "Files"]))] = ["kernel.py"]
    t.reasons.add(R.MANIFEST)


def m_manifest_symlink(t: Tree, draw: Any) -> None:
    real = t.outside / f"{t.name}-artifact.json"
    real.write_text(json.dumps(t.manifest))
    os.symlink(real, t.folder / "artifact.json")
    t.manifest_written = True
    t.reasons.add(R.SYMLINK)


BENIGN = [m_declared_data, m_declared_empty, m_empty_dir]
REJECTING = [
    m_undeclared_file, m_undeclared_empty, m_symlink_inside, m_symlink_outside, m_symlink_declared_entry_outside,
    m_kernel_is_symlink, m_symlink_dir, m_dangling_symlink, m_dotdot_declared, m_dotdot_entry, m_absolute_declared,
    m_huge_declared_size, m_huge_sparse_file, m_pycache, m_non_utf8_name, m_fifo, m_declared_directory,
    m_hash_mismatch, m_size_mismatch, m_missing_declared, m_entry_missing, m_manifest_broken, m_manifest_unknown_key,
    m_manifest_symlink,
]
# Mutations that rewrite kernel.py or the manifest file must come after the others.
LAST = [m_hash_mismatch, m_size_mismatch, m_kernel_is_symlink, m_entry_missing, m_manifest_broken, m_manifest_symlink]


def _non_utf8_names_allowed(folder: Path) -> bool:
    try:
        with open(os.fsencode(folder) + b"/\xff", "wb"):
            pass
    except OSError:
        return False
    os.unlink(os.fsencode(folder) + b"/\xff")
    return True


@dataclasses.dataclass
class Built:
    root: Path
    markers: Path
    trees: list[Tree]


@st.composite
def roots(draw: st.DrawFn, base: Path, max_bundles: int = 4) -> Built:
    """An artifact root with 1..max_bundles fuzzed bundles, under a fresh folder of `base`."""
    case = Path(tempfile.mkdtemp(dir=base))
    root, outside, markers = case / "root", case / "outside", case / "markers"
    for folder in (root, outside, markers):
        folder.mkdir()
    utf8_only = not _non_utf8_names_allowed(case)
    trees = []
    for k in range(draw(st.integers(1, max_bundles), label="bundles")):
        name = f"b{k}"
        tree = Tree(root / name, outside, markers, name, {
            "schema_version": 1, "id": f"fz-{k}", "region": {"module": "blk"}, "signature": SIGNATURE,
            "entry_point": {"file": "kernel.py", "symbol": "forward"}, "files": [],
        })
        tree.folder.mkdir()
        tree.write("kernel.py", tree.py("kernel"), declare=True)
        pool = BENIGN + [m for m in REJECTING if not (utf8_only and m is m_non_utf8_name)]
        chosen = draw(st.lists(st.sampled_from(pool), max_size=3, unique=True), label=f"{name} mutations")
        chosen.sort(key=lambda m: m in LAST)
        if sum(m in LAST for m in chosen) > 1:  # two rewrites of the same file: keep the first
            chosen = [m for m in chosen if m not in LAST] + [next(m for m in chosen if m in LAST)]
        for mutation in chosen:
            mutation(tree, draw)
        if not tree.manifest_written:
            (tree.folder / "artifact.json").write_text(json.dumps(tree.manifest))
        trees.append(tree)
    if draw(st.booleans(), label="symlinked bundle"):
        # a valid bundle outside the root, reached through a symlinked bundle folder
        real = Tree(outside / "linked-bundle", outside, markers, "link", {
            "schema_version": 1, "id": "fz-link", "region": {"module": "blk"}, "signature": SIGNATURE,
            "entry_point": {"file": "kernel.py", "symbol": "forward"}, "files": []})
        real.folder.mkdir()
        real.write("kernel.py", real.py("kernel"), declare=True)
        (real.folder / "artifact.json").write_text(json.dumps(real.manifest))
        os.symlink(real.folder, root / "link")
        trees.append(dataclasses.replace(real, folder=root / "link", reasons={R.SYMLINK}))
    if len(trees) > 1 and draw(st.booleans(), label="duplicate id"):
        # rewrite the last bundle's manifest with the first one's id (before any other breakage)
        last = trees[-1]
        if not last.manifest_written:
            last.manifest["id"] = trees[0].manifest["id"]
            (last.folder / "artifact.json").write_text(json.dumps(last.manifest))
    return Built(root, markers, trees)


def expected_verdicts(built: Built) -> tuple[dict[str, str], dict[str, set[str]]]:
    """(good bundle id -> folder name, folder name -> reasons a rejection may give)."""
    good: dict[str, list[Tree]] = {}
    rejected: dict[str, set[str]] = {}
    for tree in built.trees:
        if tree.reasons:
            rejected[tree.name] = {r.value for r in tree.reasons}
        else:
            good.setdefault(tree.manifest["id"], []).append(tree)
    for trees in good.values():
        if len(trees) > 1:
            for tree in trees:
                rejected[tree.name] = {R.DUPLICATE_ID.value}
    return {i: ts[0].name for i, ts in good.items() if len(ts) == 1}, rejected


def markers(built: Built) -> set[str]:
    return {p.name for p in built.markers.iterdir()}


def check_verify(built: Built) -> None:
    for tree in built.trees:
        if tree.reasons:
            with pytest.raises(BundleRejected) as info:
                verify_bundle(tree.folder)
            assert info.value.reason in tree.reasons, (tree.name, info.value, tree.reasons)
        else:
            assert verify_bundle(tree.folder).manifest.id == tree.manifest["id"]
    assert not markers(built), "verification executed bundle code"


def check_registry(built: Built) -> dict[str, str]:
    good, rejected = expected_verdicts(built)
    registry = Registry.load([str(built.root)])
    assert set(registry.artifacts) == set(good), (registry.errors, good)
    for error in registry.errors:
        assert error["reason"] in {r.value for r in BundleRejection}, error
        names = {Path(part).name for part in error["bundle"].split(" and ")}
        assert all(error["reason"] in rejected.get(n, ()) for n in names), (error, rejected)
    reported = {Path(part).name for e in registry.errors for part in e["bundle"].split(" and ")}
    assert reported == set(rejected), (registry.errors, rejected)
    assert not markers(built), "Registry.load executed bundle code"
    return good


@_settings(300)
@given(data=st.data())
def test_fuzzed_trees_verify_or_reject_with_a_typed_reason(data, tmp_path, counts):
    built = data.draw(roots(tmp_path))
    check_verify(built)
    check_registry(built)
    counts["fuzz_cases:bundle_trees"] += 1
    counts["fuzz:bundles_built"] += len(built.trees)
    counts["fuzz:bundles_rejected"] += sum(bool(t.reasons) for t in built.trees)


@_settings(80)
@given(data=st.data())
def test_fuzzed_trees_never_execute_rejected_code_in_a_compile(data, tmp_path, counts):
    built = data.draw(roots(tmp_path))
    good = check_registry(built)
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    model = Net().eval()
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"artifacts": str(built.root), "cuda_graphs": "emulate", "warmup": 1})
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(compiled(x), model(x))
    report = graphdispatch_backend.latest_report()
    (graph,) = report["graphs"]
    (region,) = graph["regions"]
    selected = min(good) if good else None  # matching picks the smallest id among candidates
    assert region["artifact"] == selected, (region, good)
    # only the selected good bundle's entry file ran; nothing of a rejected bundle did
    assert markers(built) == ({f"{good[selected]}-kernel"} if selected else set()), markers(built)
    if selected:
        (sub,) = graph["substitutions"]
        assert sub["parity"] == "passed" and not sub["demoted"], sub
    assert graph["calls"] == graph["cuda_graph"]["replays"] + graph["cuda_graph"]["eager_calls"]
    counts["fuzz_cases:bundle_compiles"] += 1
    counts["fuzz:bundle_compiles_substituted"] += selected is not None


def test_signature_matches_the_region_report():
    """The fuzzed bundles are only meaningful if a valid one really matches and serves."""
    model = Net().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": False})
    with torch.no_grad():
        compiled(torch.randn(4, 8))
    (region,) = graphdispatch_backend.latest_report()["graphs"][0]["regions"]
    assert [(i["name"], i["shape"], i["dtype"]) for i in region["inputs"]] == [
        (i["name"], i["shape"], i["dtype"]) for i in SIGNATURE["inputs"]]
    assert [o["shape"] for o in region["outputs"]] == [o["shape"] for o in SIGNATURE["outputs"]]
