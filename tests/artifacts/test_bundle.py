"""Bundle trust (docs/design.md section 3): what makes a bundle folder rejected, and proof that a
rejected bundle's code never runs.

Every kernel here writes a marker file when its module code executes. For each way a bundle
can be corrupt, the registry must reject it with the right typed reason, and after a
torch.compile that the bundle's manifest would have matched, the marker must not exist. A
positive control shows the same marker does appear for a good bundle.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import graphdispatch_backend
from graphdispatch_backend.artifacts.bundle import entry_tree, hash_bundle, load_entry, verify_bundle
from graphdispatch_backend.artifacts.registry import Registry
from graphdispatch_backend.errors import BundleRejected, BundleRejection, ManifestError
from graphdispatch_backend.testing import MLP_INPUTS, MLP_OUTPUTS, Stack, write_bundle

# -- a bundle whose manifest matches the `blocks.*.mlp` regions of testing.Stack -------------------

# Module code with a side effect: the marker file proves whether it ever executed.
KERNEL = """
import pathlib
import torch

pathlib.Path({marker!r}).write_text("ran")


def forward(w1, b1, x, w2, b2):
    return torch.addmm(b2, torch.relu(torch.addmm(b1, x, w1.t())), w2.t())
"""


def marked_bundle(folder: Path, marker: Path, **kwargs) -> Path:
    source = KERNEL.format(marker=str(marker))
    return write_bundle(folder, "mlp", "blocks.*.mlp", MLP_INPUTS, MLP_OUTPUTS, source, **kwargs)


def compile_and_run(root: Path) -> dict:
    """Compile the stack with `root` as the bundle root, run it twice, check it against eager."""
    torch.manual_seed(0)
    model, x = Stack().eval(), torch.randn(2, 8)
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(root)})
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(x), model(x))
    return graphdispatch_backend.latest_report()


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[data.index(b"ran")] = ord("R")  # same size: only the hash can tell
    path.write_bytes(bytes(data))


def edit_manifest(folder: Path, edit: Callable[[dict], None]) -> None:
    doc = json.loads((folder / "artifact.json").read_text())
    edit(doc)
    (folder / "artifact.json").write_text(json.dumps(doc))


# -- the positive control ----------------------------------------------------------------------


def test_good_bundle_verifies_and_its_code_runs_when_it_matches(tmp_path):
    marker = tmp_path / "marker"
    marked_bundle(tmp_path / "root" / "mlp", marker)
    bundle = verify_bundle(tmp_path / "root" / "mlp")
    assert bundle.manifest.id == "mlp" and bundle.folder == tmp_path / "root" / "mlp"
    assert not marker.exists()  # verifying executes nothing
    report = compile_and_run(tmp_path / "root")
    assert marker.read_text() == "ran"
    assert report["registry"]["loaded"] == ["mlp"] and report["registry"]["errors"] == []
    subs = report["graphs"][0]["substitutions"]
    assert [s["region"] for s in subs] == ["blocks.0.mlp", "blocks.1.mlp"]
    assert all(s["parity"] == "passed" and s["calls"] == 2 for s in subs)


# -- every way a bundle is rejected; its code never runs -----------------------------------------


def _hash_mismatch(folder: Path, outside: Path) -> None:
    flip_one_byte(folder / "kernel.py")


def _size_mismatch(folder: Path, outside: Path) -> None:
    with open(folder / "kernel.py", "a") as fh:
        fh.write("# one more line\n")


def _missing_file(folder: Path, outside: Path) -> None:
    (folder / "helper.txt").unlink()


def _undeclared_file(folder: Path, outside: Path) -> None:
    (folder / "notes.txt").write_text("not in the manifest")


def _undeclared_file_in_subfolder(folder: Path, outside: Path) -> None:
    (folder / "sub").mkdir()
    (folder / "sub" / "extra.py").write_text("x = 1\n")


def _symlink_undeclared(folder: Path, outside: Path) -> None:
    (folder / "link.py").symlink_to(folder / "kernel.py")


def _symlink_declared(folder: Path, outside: Path) -> None:
    # the same bytes, but read through a link to a file outside the bundle
    target = outside / "helper.txt"
    target.write_bytes((folder / "helper.txt").read_bytes())
    (folder / "helper.txt").unlink()
    (folder / "helper.txt").symlink_to(target)


def _symlink_dir(folder: Path, outside: Path) -> None:
    (outside / "lib").mkdir()
    (folder / "lib").symlink_to(outside / "lib", target_is_directory=True)


def _symlink_manifest(folder: Path, outside: Path) -> None:
    (outside / "artifact.json").write_bytes((folder / "artifact.json").read_bytes())
    (folder / "artifact.json").unlink()
    (folder / "artifact.json").symlink_to(outside / "artifact.json")


def _pycache(folder: Path, outside: Path) -> None:
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "kernel.cpython-311.pyc").write_bytes(b"\x00" * 16)


def _empty_pycache(folder: Path, outside: Path) -> None:
    (folder / "__pycache__").mkdir()


def _dotdot_path(folder: Path, outside: Path) -> None:
    def edit(doc: dict) -> None:
        doc["files"][1]["path"] = "../helper.txt"
    (folder.parent / "helper.txt").write_bytes((folder / "helper.txt").read_bytes())
    edit_manifest(folder, edit)


def _absolute_path(folder: Path, outside: Path) -> None:
    def edit(doc: dict) -> None:
        doc["files"][1]["path"] = str(outside / "helper.txt")
    (outside / "helper.txt").write_bytes((folder / "helper.txt").read_bytes())
    edit_manifest(folder, edit)


def _invalid_json(folder: Path, outside: Path) -> None:
    (folder / "artifact.json").write_text("{not json")


def _unknown_manifest_key(folder: Path, outside: Path) -> None:
    edit_manifest(folder, lambda doc: doc.update(trusted=True))


def _huge_manifest(folder: Path, outside: Path) -> None:
    edit_manifest(folder, lambda doc: doc.update(description="x" * (1 << 20)))


CORRUPTIONS = [
    (_hash_mismatch, BundleRejection.HASH_MISMATCH),
    (_size_mismatch, BundleRejection.SIZE_MISMATCH),
    (_missing_file, BundleRejection.MISSING_FILE),
    (_undeclared_file, BundleRejection.UNDECLARED_FILE),
    (_undeclared_file_in_subfolder, BundleRejection.UNDECLARED_FILE),
    (_symlink_undeclared, BundleRejection.SYMLINK),
    (_symlink_declared, BundleRejection.SYMLINK),
    (_symlink_dir, BundleRejection.SYMLINK),
    (_symlink_manifest, BundleRejection.SYMLINK),
    (_pycache, BundleRejection.PYCACHE),
    (_empty_pycache, BundleRejection.PYCACHE),
    (_dotdot_path, BundleRejection.MANIFEST),
    (_absolute_path, BundleRejection.MANIFEST),
    (_invalid_json, BundleRejection.MANIFEST),
    (_unknown_manifest_key, BundleRejection.MANIFEST),
    (_huge_manifest, BundleRejection.MANIFEST),
]


@pytest.mark.parametrize("corrupt, reason", CORRUPTIONS, ids=[c.__name__.strip("_") for c, _ in CORRUPTIONS])
def test_rejected_bundle_is_reported_and_its_code_never_runs(tmp_path, corrupt, reason):
    marker, outside = tmp_path / "marker", tmp_path / "outside"
    outside.mkdir()
    folder = marked_bundle(tmp_path / "root" / "mlp", marker, extra_files={"helper.txt": b"helper data\n"})
    verify_bundle(folder)  # sound before the corruption
    corrupt(folder, outside)

    with pytest.raises(BundleRejected) as info:
        verify_bundle(folder)
    assert info.value.reason is reason, str(info.value)

    registry = Registry.load([str(tmp_path / "root")])
    assert registry.artifacts == {}
    assert [(e["bundle"], e["reason"]) for e in registry.errors] == [(str(folder), reason.value)]

    report = compile_and_run(tmp_path / "root")  # the manifest would have matched both blocks
    assert not marker.exists()
    assert report["graphs"][0]["substitutions"] == []
    assert [e["reason"] for e in report["registry"]["errors"]] == [reason.value]


def test_non_utf8_file_name_is_rejected_and_its_code_never_runs(tmp_path):
    marker = tmp_path / "marker"
    folder = marked_bundle(tmp_path / "root" / "mlp", marker)
    try:
        fd = os.open(os.fsencode(folder) + b"/bad-\xff.txt", os.O_CREAT | os.O_WRONLY, 0o644)
    except OSError:
        pytest.skip("this file system refuses non-UTF-8 file names")
    os.close(fd)
    with pytest.raises(BundleRejected) as info:
        verify_bundle(folder)
    assert info.value.reason is BundleRejection.UNSAFE_PATH
    report = compile_and_run(tmp_path / "root")
    assert not marker.exists()
    assert [e["reason"] for e in report["registry"]["errors"]] == ["unsafe_path"]


def test_bundle_folder_that_is_a_symlink_is_rejected(tmp_path):
    marker = tmp_path / "marker"
    real = marked_bundle(tmp_path / "elsewhere" / "mlp", marker)
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "mlp").symlink_to(real, target_is_directory=True)
    registry = Registry.load([str(tmp_path / "root")])
    assert registry.artifacts == {} and [e["reason"] for e in registry.errors] == ["symlink"]
    compile_and_run(tmp_path / "root")
    assert not marker.exists()


# -- loading: the entry file is hashed again and executed from those bytes ------------------------


def test_entry_file_changed_after_verification_is_tampered_and_not_run(tmp_path):
    marker = tmp_path / "marker"
    bundle = verify_bundle(marked_bundle(tmp_path / "mlp", marker))
    flip_one_byte(tmp_path / "mlp" / "kernel.py")
    with pytest.raises(BundleRejected) as info:
        load_entry(bundle)
    assert info.value.reason is BundleRejection.TAMPERED and "kernel.py" in info.value.detail
    assert not marker.exists()


def test_entry_file_swapped_for_a_symlink_after_verification_is_not_followed(tmp_path):
    marker = tmp_path / "marker"
    bundle = verify_bundle(marked_bundle(tmp_path / "mlp", marker))
    copy = tmp_path / "copy.py"
    copy.write_bytes((tmp_path / "mlp" / "kernel.py").read_bytes())
    (tmp_path / "mlp" / "kernel.py").unlink()
    (tmp_path / "mlp" / "kernel.py").symlink_to(copy)
    with pytest.raises(BundleRejected) as info:
        load_entry(bundle)
    assert info.value.reason is BundleRejection.SYMLINK
    assert not marker.exists()


def test_tampered_at_load_through_the_backend_is_load_failed_and_not_run(tmp_path):
    """The session verified the bundle at its first compile; the file changes before a later
    compile matches it and loads the entry code."""
    marker = tmp_path / "marker"
    marked_bundle(tmp_path / "root" / "mlp", marker)
    options = {"artifacts": str(tmp_path / "root")}
    lin, y = nn.Linear(4, 4).eval(), torch.randn(2, 4)
    with torch.no_grad():
        torch.compile(lin, backend="graphdispatch", options=options)(y)  # no region matches: nothing loads
    assert graphdispatch_backend.latest_report()["registry"]["loaded"] == ["mlp"]
    flip_one_byte(tmp_path / "root" / "mlp" / "kernel.py")

    report = compile_and_run(tmp_path / "root")  # same options: same session and registry
    assert not marker.exists()
    graph = report["graphs"][-1]
    assert graph["substitutions"] == []
    regions = {r["name"]: r for r in graph["regions"]}
    for name in ("blocks.0.mlp", "blocks.1.mlp"):
        (rejection,) = regions[name]["rejections"]
        assert rejection["reason"] == "load_failed" and "tampered" in rejection["detail"]


def test_load_entry_executes_verified_bytes_without_writing_bytecode(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # an import would write a .pyc now
    marker = tmp_path / "marker"
    folder = marked_bundle(tmp_path / "mlp", marker)
    before = sorted(p.name for p in folder.iterdir())
    modules = set(sys.modules)
    fn = load_entry(verify_bundle(folder))
    assert marker.read_text() == "ran"
    assert sorted(p.name for p in folder.iterdir()) == before  # no __pycache__, nothing written
    assert not (folder / "__pycache__").exists()
    assert fn.__code__.co_filename.startswith("<graphdispatch artifact mlp:kernel.py>")
    assert set(sys.modules) == modules  # not imported through the import system
    w1, b1, x, w2, b2 = torch.randn(16, 8), torch.randn(16), torch.randn(2, 8), torch.randn(8, 16), torch.randn(8)
    assert fn(w1, b1, x, w2, b2).shape == (2, 8)
    verify_bundle(folder)  # still a valid bundle after loading


def test_missing_entry_symbol_is_refused_before_its_code_runs(tmp_path):
    """A trial: the entry file was executed, then found to hold no `forward` (design.md
    section 3: a rejected bundle's code is never executed). It is read with `ast` first."""
    marker = tmp_path / "marker"
    folder = marked_bundle(tmp_path / "mlp", marker, symbol="not_there")
    with pytest.raises(BundleRejected) as info:
        load_entry(verify_bundle(folder))
    assert info.value.reason is BundleRejection.MISSING_SYMBOL
    assert info.value.detail == "kernel.py defines no 'not_there' at its top level (entry_point.symbol)"
    assert not marker.exists()


def test_missing_entry_symbol_through_the_backend_is_load_failed_and_not_run(tmp_path, gd_log):
    marker = tmp_path / "marker"
    source = KERNEL.format(marker=str(marker)).replace("def forward", "def forwrd")
    write_bundle(tmp_path / "root" / "mlp", "mlp", "blocks.*.mlp", MLP_INPUTS, MLP_OUTPUTS, source)
    report = compile_and_run(tmp_path / "root")
    assert not marker.exists()
    graph = report["graphs"][0]
    assert graph["substitutions"] == []
    regions = {r["name"]: r for r in graph["regions"]}
    (rejection,) = regions["blocks.0.mlp"]["rejections"]
    assert rejection["reason"] == "load_failed"
    assert rejection["detail"].startswith("missing_symbol: kernel.py defines no 'forward'")
    assert "(did you mean 'forwrd'?)" in rejection["detail"]
    said = [r.getMessage() for r in gd_log.records if r.levelname == "WARNING"]
    assert [w for w in said if "artifact mlp did not load: missing_symbol" in w], said


MARK = "open({marker!r}, 'w').write('ran')\n"


@pytest.mark.parametrize("source", [
    "def forward(*a):\n    pass\n",
    "class forward:\n    pass\n",
    "def impl(*a):\n    pass\nforward = impl\n",
    "def impl(*a):\n    pass\nforward: object = impl\n",
    "def impl(*a):\n    pass\nimpl2, forward = impl, impl\n",
    "from os.path import join as forward\n",
    "from os.path import forward\n",  # bound statically; the import itself fails when run
    "import os as forward\n",
    "import sys\nif sys:\n    def forward(*a):\n        pass\nelse:\n    forward = None\n",
    "try:\n    from triton_kernels import forward\nexcept ImportError:\n    def forward(*a):\n        pass\n",
    "for forward in [print]:\n    pass\n",
    "import contextlib\nwith contextlib.nullcontext(print) as forward:\n    pass\n",
    "if (forward := print):\n    pass\n",
    "async def forward(*a):\n    pass\nforward = print\n",  # an async def rebound at the top level
    "match print:\n    case forward:\n        pass\n",
    "from os.path import *\n",  # a star import may bind anything: trusted
])
def test_entry_symbol_bound_at_the_top_level_passes_the_static_check(tmp_path, source):
    manifest = verify_bundle(write_bundle(tmp_path / "b", "b", "m", [], MLP_OUTPUTS, source)).manifest
    entry_tree(source.encode(), "kernel.py", manifest)


@pytest.mark.parametrize("source, detail", [
    ("def forwrd(*a):\n    pass\n", "defines no 'forward' at its top level (entry_point.symbol) "
                                      "(did you mean 'forwrd'?)"),
    ("forward: object\n", "defines no 'forward'"),  # annotated, never bound
    ("def make():\n    global forward\n    forward = print\n", "defines no 'forward'"),  # bound only if called
    ("class K:\n    forward = print\n", "defines no 'forward'"),  # K.forward, not the module's
    ("globals()['forward'] = print\n", "defines no 'forward'"),  # nothing a reader can see
    ("try:\n    pass\nexcept Exception as forward:\n    pass\n", "defines no 'forward'"),  # unbound at its end
    ("async def forward(*a):\n    pass\n", "binds 'forward' only as an async def"),
])
def test_entry_symbol_not_bound_at_the_top_level_is_refused_and_not_run(tmp_path, source, detail):
    marker = tmp_path / "marker"
    folder = write_bundle(tmp_path / "b", "b", "m", [], MLP_OUTPUTS, MARK.format(marker=str(marker)) + source)
    with pytest.raises(BundleRejected) as info:
        load_entry(verify_bundle(folder))
    assert info.value.reason is BundleRejection.MISSING_SYMBOL and detail in info.value.detail, info.value.detail
    assert not marker.exists()


@pytest.mark.parametrize("source", ["def forward(*a):\n    pass\ndel forward\n", "forward = 1\n"])
def test_entry_symbol_gone_or_not_callable_after_running_is_still_refused(tmp_path, source):
    """Bound at the top level is not bound at the end: the check after the import stays."""
    marker = tmp_path / "marker"
    folder = write_bundle(tmp_path / "b", "b", "m", [], MLP_OUTPUTS, MARK.format(marker=str(marker)) + source)
    with pytest.raises(AttributeError, match="entry symbol 'forward' is not a callable in kernel.py"):
        load_entry(verify_bundle(folder))
    assert marker.read_text() == "ran"  # the static check passed it: this is the check after the import


READER = """
DATA = read_bundle_file("data/table.bin")


def forward():
    return DATA


def read(rel):
    return read_bundle_file(rel)
"""


def test_read_bundle_file_returns_verified_bytes_of_a_declared_file(tmp_path):
    payload = bytes(range(256))
    folder = write_bundle(tmp_path / "reader", "reader", "m", [], MLP_OUTPUTS, READER,
                          extra_files={"data/table.bin": payload})
    fn = load_entry(verify_bundle(folder))
    assert fn() == payload
    read = fn.__globals__["read"]
    assert read("data/table.bin") == payload
    assert read("kernel.py") == READER.encode()


@pytest.mark.parametrize("rel", ["../secret.txt", "artifact.json", "undeclared.txt", "/etc/passwd"])
def test_read_bundle_file_refuses_anything_undeclared(tmp_path, rel):
    (tmp_path / "secret.txt").write_text("secret")
    folder = write_bundle(tmp_path / "reader", "reader", "m", [], MLP_OUTPUTS, READER,
                          extra_files={"data/table.bin": b"t"})
    read = load_entry(verify_bundle(folder)).__globals__["read"]
    (folder / "undeclared.txt").write_text("added after verification")
    with pytest.raises(BundleRejected) as info:
        read(rel)
    assert info.value.reason is BundleRejection.UNDECLARED_FILE and rel in info.value.detail


def test_read_bundle_file_refuses_a_file_changed_after_verification(tmp_path):
    folder = write_bundle(tmp_path / "reader", "reader", "m", [], MLP_OUTPUTS, READER,
                          extra_files={"data/table.bin": b"abcd"})
    read = load_entry(verify_bundle(folder)).__globals__["read"]
    (folder / "data" / "table.bin").write_bytes(b"abce")
    with pytest.raises(BundleRejected) as info:
        read("data/table.bin")
    assert info.value.reason is BundleRejection.TAMPERED


# -- hash_bundle (for authors) ---------------------------------------------------------------------


def test_hash_bundle_rewrites_files_and_the_bundle_then_verifies(tmp_path):
    folder = marked_bundle(tmp_path / "mlp", tmp_path / "marker", description="keep me")
    (folder / "kernel.py").write_text((folder / "kernel.py").read_text() + "\n# edited by the author\n")
    (folder / "sub").mkdir()
    (folder / "sub" / "table.bin").write_bytes(b"\x01\x02")
    with pytest.raises(BundleRejected):
        verify_bundle(folder)
    data = hash_bundle(folder)
    expected = {
        rel: (hashlib.sha256((folder / rel).read_bytes()).hexdigest(), (folder / rel).stat().st_size)
        for rel in ("kernel.py", "sub/table.bin")
    }
    assert {f["path"]: (f["sha256"], f["bytes"]) for f in data["files"]} == expected
    assert json.loads((folder / "artifact.json").read_text()) == data
    assert data["description"] == "keep me" and data["id"] == "mlp"  # everything else is kept
    assert verify_bundle(folder).manifest.file("sub/table.bin").bytes == 2
    assert sorted(p.name for p in folder.iterdir()) == ["artifact.json", "kernel.py", "sub"]  # no temp file left


@pytest.mark.parametrize("corrupt, reason", [
    (_symlink_undeclared, BundleRejection.SYMLINK),
    (_symlink_dir, BundleRejection.SYMLINK),
    (_symlink_manifest, BundleRejection.SYMLINK),
    (_pycache, BundleRejection.PYCACHE),
], ids=["symlink_file", "symlink_dir", "symlink_manifest", "pycache"])
def test_hash_bundle_refuses_a_folder_it_could_not_trust(tmp_path, corrupt, reason):
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = marked_bundle(tmp_path / "mlp", tmp_path / "marker")
    corrupt(folder, outside)
    manifest = (folder / "artifact.json").read_bytes()
    with pytest.raises(BundleRejected) as info:
        hash_bundle(folder)
    assert info.value.reason is reason
    assert (folder / "artifact.json").read_bytes() == manifest  # nothing rewritten


def test_hash_bundle_refuses_to_write_a_manifest_the_registry_would_reject(tmp_path):
    folder = marked_bundle(tmp_path / "mlp", tmp_path / "marker")
    (folder / "kernel.py").rename(folder / "renamed.py")  # the entry file is gone
    manifest = (folder / "artifact.json").read_bytes()
    with pytest.raises(ManifestError) as info:
        hash_bundle(folder)
    assert info.value.field == "entry_point.file"
    assert (folder / "artifact.json").read_bytes() == manifest
