"""`python -m graphdispatch_backend artifacts verify ROOT...` and `artifacts hash BUNDLE`
(docs/design.md section 3): one table row per bundle (id, verdict, reason, folder), exit code 1
when anything is rejected. Called through `__main__.main` (fast), plus one real `python -m`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from graphdispatch_backend.__main__ import main
from graphdispatch_backend.artifacts.bundle import verify_bundle
from graphdispatch_backend.testing import write_bundle

OUT = [{"shape": [2, 8], "dtype": "float32"}]
SOURCE = "def forward(x):\n    return x\n"


def bundle(folder: Path, artifact_id: str) -> Path:
    return write_bundle(folder, artifact_id, "blocks.*.mlp", [], OUT, SOURCE, extra_files={"data.bin": b"0123"})


def verify(capsys, *roots) -> tuple[int, list[list[str]]]:
    code = main(["artifacts", "verify", *map(str, roots)])
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    assert re.split(r"\s{2,}", lines[0]) == ["id", "verdict", "reason", "bundle"]
    assert set(lines[1]) <= {"-", " "}
    return code, [re.split(r"\s{2,}", line.rstrip()) for line in lines[2:]]


def test_verify_all_ok_exits_0(tmp_path, capsys):
    bundle(tmp_path / "root" / "a", "a")
    bundle(tmp_path / "root" / "b", "b")
    code, rows = verify(capsys, tmp_path / "root")
    assert code == 0
    assert [(r[0], r[1], r[3]) for r in rows] == [("a", "ok", str(tmp_path / "root" / "a")),
                                                  ("b", "ok", str(tmp_path / "root" / "b"))]
    assert rows[0][2] == "blocks.*.mlp (2 files, parity bitwise)"


def test_verify_a_root_that_is_itself_a_bundle(tmp_path, capsys):
    code, rows = verify(capsys, bundle(tmp_path / "one", "one"))
    assert code == 0 and [r[:2] for r in rows] == [["one", "ok"]]


def _hash(folder: Path) -> None:
    (folder / "data.bin").write_bytes(b"0124")


def _size(folder: Path) -> None:
    (folder / "data.bin").write_bytes(b"01234")


def _missing(folder: Path) -> None:
    (folder / "data.bin").unlink()


def _undeclared(folder: Path) -> None:
    (folder / "notes.md").write_text("hi")


def _symlink(folder: Path) -> None:
    (folder / "link").symlink_to(folder / "data.bin")


def _pycache(folder: Path) -> None:
    (folder / "__pycache__").mkdir()


def _unknown_key(folder: Path) -> None:
    doc = json.loads((folder / "artifact.json").read_text())
    doc["extra"] = 1
    (folder / "artifact.json").write_text(json.dumps(doc))


def _not_json(folder: Path) -> None:
    (folder / "artifact.json").write_text("{")


# (corruption, the id column, the reason column's start)
REJECTIONS = [
    (_hash, "bad", "hash_mismatch: data.bin"),
    (_size, "bad", "size_mismatch: data.bin: 5 bytes, declared 4"),
    (_missing, "bad", "missing_file: data.bin"),
    (_undeclared, "bad", "undeclared_file: notes.md"),
    (_symlink, "bad", "symlink: link"),
    (_pycache, "bad", "pycache: __pycache__"),
    # the id the manifest gives, even where another key fails it: the author sees which bundle to fix
    (_unknown_key, "bad", "manifest: extra: unknown key"),
    (_not_json, "?", "manifest: artifact.json is not valid JSON"),  # no id to read
]


@pytest.mark.parametrize("corrupt, shown_id, reason", REJECTIONS, ids=[c.__name__.strip("_") for c, _, _ in REJECTIONS])
def test_verify_reports_each_rejection_and_exits_1(tmp_path, capsys, corrupt, shown_id, reason):
    root = tmp_path / "root"
    bundle(root / "a", "a")
    corrupt(bundle(root / "bad", "bad"))
    code, rows = verify(capsys, root)
    assert code == 1
    assert rows[0][:2] == ["a", "ok"]  # the good bundle is still verified and shown
    assert rows[1][:2] == [shown_id, "rejected"] and rows[1][2].startswith(reason), rows[1]
    assert rows[1][3] == str(root / "bad")


@pytest.mark.parametrize(("source", "reason"), [
    ("def forwrd(x):\n    return x\n",
     "missing_symbol: kernel.py defines no 'forward' at its top level (entry_point.symbol) (did you mean 'forwrd'?)"),
    ("def forward(x)\n    return x\n", "entry_syntax: kernel.py line 1: expected ':'"),
])
def test_verify_reads_the_entry_symbol_without_running_it(tmp_path, capsys, source, reason):
    """A bundle whose entry file lacks its symbol verified `ok` and then only warned at the
    compile that it did not load (a trial, 2026-12-07)."""
    write_bundle(tmp_path / "root" / "a", "a", "blocks.*.mlp", [], OUT, source)
    code, rows = verify(capsys, tmp_path / "root")
    assert (code, rows[0][1], rows[0][2]) == (1, "rejected", reason), rows


@pytest.mark.parametrize("source", ["import torch\nif torch:\n    forward = torch.nn.Identity()\n",
                                    "from os.path import *\n"])
def test_verify_trusts_a_symbol_bound_where_it_cannot_see(tmp_path, capsys, source):
    write_bundle(tmp_path / "root" / "a", "a", "blocks.*.mlp", [], OUT, source)
    assert verify(capsys, tmp_path / "root")[1][0][1] == "ok"


def test_verify_duplicate_ids(tmp_path, capsys):
    bundle(tmp_path / "r1" / "x", "dup")
    bundle(tmp_path / "r2" / "y", "dup")
    bundle(tmp_path / "r2" / "z", "z")
    code, rows = verify(capsys, tmp_path / "r1", tmp_path / "r2")
    assert code == 1
    assert [r[:2] for r in rows] == [["dup", "rejected"], ["dup", "rejected"], ["z", "ok"]]
    assert all(r[2].startswith("duplicate_id") for r in rows[:2])


def test_verify_a_root_given_twice_reads_it_once(tmp_path, capsys):
    """A trial: `root` and `root/` made each bundle a duplicate of itself; a compile reads a
    root once by its real path (registry.Read), and so does verify."""
    root = tmp_path / "root"
    folder = bundle(root / "a", "a")
    code, rows = verify(capsys, root, f"{root}/", folder)
    assert code == 0 and [r[:2] for r in rows] == [["a", "ok"]]


def test_verify_says_a_torch_range_that_excludes_the_installed_torch(tmp_path, capsys, monkeypatch):
    """A trial: such a bundle verified `ok` and then served nothing, silently."""
    from graphdispatch_backend.artifacts import cli

    monkeypatch.setattr(cli, "running_torch_version", lambda: "2.13.0+cpu")
    write_bundle(tmp_path / "root" / "a", "a", "blocks.*.mlp", [], OUT, SOURCE, torch={"min": "2.14"})
    write_bundle(tmp_path / "root" / "b", "b", "blocks.*.mlp", [], OUT, SOURCE, torch={"min": "2.13"})
    code, rows = verify(capsys, tmp_path / "root")
    assert code == 1 and [r[:2] for r in rows] == [["a", "rejected"], ["b", "ok"]]
    assert rows[0][2].startswith("torch_version: the manifest's torch range (>= 2.14) excludes torch 2.13.0+cpu")


@pytest.mark.parametrize("here, said", [(("cpu",), "; devices ['cuda'], this machine has cpu only: it serves no "
                                                   "region here"), (("cpu", "cuda"), "")])
def test_verify_says_a_bundle_serves_nothing_on_a_machine_without_its_devices(tmp_path, capsys, monkeypatch,
                                                                             here, said):
    """Not a rejection (exit 0: a bundle set shipped to CPU and GPU hosts alike), but said."""
    from graphdispatch_backend.artifacts import cli

    monkeypatch.setattr(cli, "machine_devices", lambda: here)
    write_bundle(tmp_path / "root" / "a", "a", "blocks.*.mlp", [], OUT, SOURCE, devices=["cuda"])
    code, rows = verify(capsys, tmp_path / "root")
    assert code == 0 and rows[0][:3] == ["a", "ok", "blocks.*.mlp (1 file, parity bitwise)" + said]


def test_verify_missing_root(tmp_path, capsys):
    bundle(tmp_path / "root" / "a", "a")
    code, rows = verify(capsys, tmp_path / "nope", tmp_path / "root")
    assert code == 1
    assert rows[0][:2] == ["-", "rejected"] and rows[0][2].startswith("missing_root")
    assert rows[1][:2] == ["a", "ok"]


def test_verify_a_root_without_bundles_is_not_ok(tmp_path, capsys):
    (tmp_path / "empty" / "not-a-bundle").mkdir(parents=True)
    code, rows = verify(capsys, tmp_path / "empty")
    assert code == 1 and rows[0][:2] == ["-", "rejected"] and rows[0][2].startswith("no_bundles")


def test_verify_needs_a_root(capsys):
    with pytest.raises(SystemExit) as info:
        main(["artifacts", "verify"])
    assert info.value.code == 2


# -- hash -----------------------------------------------------------------------------------------


def test_hash_rewrites_files_and_the_bundle_then_verifies(tmp_path, capsys):
    folder = bundle(tmp_path / "root" / "a", "a")
    (folder / "kernel.py").write_text("def forward(x):\n    return x.clone()\n")
    (folder / "more").mkdir()
    (folder / "more" / "table.bin").write_bytes(b"\x00" * 10)
    assert verify(capsys, tmp_path / "root")[0] == 1

    assert main(["artifacts", "hash", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "kernel.py" in out and "more/table.bin" in out and "rewrote" in out and "(3 files)" in out
    assert {f.path for f in verify_bundle(folder).manifest.files} == {"kernel.py", "data.bin", "more/table.bin"}
    code, rows = verify(capsys, tmp_path / "root")
    assert code == 0 and rows[0][:2] == ["a", "ok"]


@pytest.mark.parametrize("corrupt", [_symlink, _pycache, _not_json], ids=["symlink", "pycache", "not_json"])
def test_hash_refuses_and_exits_1(tmp_path, capsys, corrupt):
    folder = bundle(tmp_path / "a", "a")
    corrupt(folder)
    before = (folder / "artifact.json").read_bytes()
    assert main(["artifacts", "hash", str(folder)]) == 1
    assert capsys.readouterr().out.startswith(f"cannot hash {folder}")
    assert (folder / "artifact.json").read_bytes() == before


def test_hash_of_a_missing_folder_exits_1(tmp_path, capsys):
    assert main(["artifacts", "hash", str(tmp_path / "nope")]) == 1
    assert "cannot hash" in capsys.readouterr().out


def test_python_dash_m_runs_the_cli(tmp_path):
    bundle(tmp_path / "root" / "a", "a")
    corrupt = bundle(tmp_path / "root" / "b", "b")
    _undeclared(corrupt)
    command = [sys.executable, "-m", "graphdispatch_backend", "artifacts", "verify", str(tmp_path / "root")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1, done.stderr
    rows = [re.split(r"\s{2,}", line) for line in done.stdout.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["a", "ok"], ["b", "rejected"]]
    assert rows[1][2].startswith("undeclared_file")


def test_a_reader_that_stops_early_ends_the_cli_quietly(tmp_path):
    """`... | head`: the table is longer than a pipe holds and the reader has gone; the
    command ends with status 141 (SIGPIPE's), no BrokenPipeError traceback (a trial's
    `report DIR | head`, 2026-12-07)."""
    for i in range(700):
        bundle(tmp_path / "root" / f"kernel_with_a_long_folder_name_{i:04d}", f"a{i}")
    command = [sys.executable, "-m", "graphdispatch_backend", "artifacts", "verify", str(tmp_path / "root")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=900) == 141 and "Traceback" not in err, err


def test_verify_against_a_report_shows_a_wrong_dtype_before_a_compile(tmp_path, capsys):
    import torch

    import graphdispatch_backend
    from graphdispatch_backend.testing import manifest_from_region, region_entry

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).relu()

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = Mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(x) + 1

    region = region_entry(Net().eval(), torch.randn(2, 8), name="mlp", cuda_graphs=False)
    with torch.no_grad():
        torch.compile(Net().eval(), backend="graphdispatch", options={"report_dir": str(tmp_path / "rep")})(
            torch.randn(2, 8))
    graphdispatch_backend.flush()
    sig = manifest_from_region(region)
    write_bundle(tmp_path / "good" / "mlp", "mlp", "mlp", sig["inputs"], sig["outputs"], SOURCE)
    bad = [dict(i, dtype="bfloat16") if i["name"] == "fc.weight" else i for i in sig["inputs"]]
    write_bundle(tmp_path / "bad" / "mlp", "mlp", "mlp", bad, sig["outputs"], SOURCE)
    assert main(["artifacts", "verify", str(tmp_path / "good"), "--report", str(tmp_path / "rep")]) == 0
    assert "fits 1 region(s) of the report" in capsys.readouterr().out
    assert main(["artifacts", "verify", str(tmp_path / "bad"), "--report", str(tmp_path / "rep")]) == 1
    out = capsys.readouterr().out
    assert "rejected" in out and "'fc.weight': dtype bfloat16, region has float32" in out
    # a dynamic first dimension fits every batch's region: each counted, of each kind (a trial's
    # manifest served 8 regions of 4 graphs, and the check said it fit 2)
    with torch.no_grad():
        compiled = torch.compile(Net().eval(), backend="graphdispatch", dynamic=False,
                                 options={"report_dir": str(tmp_path / "two")})
        compiled(torch.randn(2, 8))
        compiled(torch.randn(3, 8))
    graphdispatch_backend.flush()
    anybatch = [dict(i, shape=[None, 8]) if i["name"] == "input0" else i for i in sig["inputs"]]
    write_bundle(tmp_path / "any" / "mlp", "mlp", "mlp", anybatch, [{"shape": [None, 8], "dtype": "float32"}], SOURCE)
    assert main(["artifacts", "verify", str(tmp_path / "any"), "--report", str(tmp_path / "two")]) == 0
    assert "fits 2 region(s) of the report, of 2 kinds" in capsys.readouterr().out


def test_an_edited_file_says_to_rehash(tmp_path, capsys):
    folder = bundle(tmp_path / "root" / "a", "a")
    (folder / "kernel.py").write_text(SOURCE + "# edited\n")
    code, rows = verify(capsys, tmp_path / "root")
    assert code == 1 and "size_mismatch" in rows[0][2] and "artifacts hash" in rows[0][2]
