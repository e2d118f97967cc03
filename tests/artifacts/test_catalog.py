"""`python -m graphdispatch_backend report DIR --regions [PATTERN]`: every region by kind, and
the manifest fields to copy; a manifest made of exactly those fields serves the region."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.__main__ import main
from graphdispatch_backend.artifacts.catalog import kinds
from graphdispatch_backend.testing import MLP_SOURCE, Stack, write_bundle


class Net(torch.nn.Module):
    """Two MLP blocks, plus one MLP of another width: two kinds of Mlp."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = Stack(depth=2, dim=8)
        self.head = Stack(depth=1, dim=4)
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.stack(x)))


def compile_once(report_dir: Path, artifacts: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Net().eval()
    options = {"report_dir": str(report_dir), **({"artifacts": str(artifacts)} if artifacts else {})}
    x = torch.randn(2, 8)
    with torch.no_grad():
        out = torch.compile(model, backend="graphdispatch", options=options)(x)
        eager = model(x)
    graphdispatch_backend.flush()
    return out, eager


@pytest.fixture
def report_dir(tmp_path: Path) -> Path:
    compile_once(tmp_path / "gd_out")
    return tmp_path / "gd_out"


def listing(capsys, *args: str) -> str:
    assert main(["report", *args]) == 0
    return capsys.readouterr().out


def test_every_region_is_listed_by_kind(report_dir, capsys):
    out = listing(capsys, str(report_dir), "--regions")
    report = json.loads((report_dir / "dispatch.json").read_text())
    (graph,) = report["graphs"]
    header = next(line for line in out.splitlines() if line.startswith("pattern "))
    rows = out.split(header, 1)[1].splitlines()[2:]
    rows = [re.split(r"\s{2,}", r) for r in rows if r.strip() and not r.startswith("list one")]
    # one row per kind, and every region counted once
    assert sum(int(r[2].lstrip("x")) for r in rows) == len(graph["regions"])
    by_pattern = {r[0]: r for r in rows}
    mlp = by_pattern["stack.blocks.*.mlp"]
    assert mlp[1] == "Mlp" and mlp[2] == "x2" and len(mlp[3]) == 32
    assert mlp[4].startswith("fc1.weight float32[16, 8]")
    assert by_pattern["head.blocks.*.mlp"][2] == "x1"  # another width: another kind
    assert f"{len(graph['regions'])} regions, {len(kinds(report))} kinds" in out


def test_a_pattern_lists_the_manifest_fields_to_copy_and_they_serve(report_dir, tmp_path, capsys):
    out = listing(capsys, str(report_dir), "--regions", "stack.blocks.*.mlp")
    region_line = next(line for line in out.splitlines() if line.lstrip().startswith('"region"'))
    signature_line = next(line for line in out.splitlines() if line.lstrip().startswith('"signature"'))
    fields = json.loads("{" + region_line.strip() + signature_line.strip().rstrip(",") + "}")
    assert fields["region"]["module"] == "stack.blocks.*.mlp"
    report = json.loads((report_dir / "dispatch.json").read_text())
    region = next(r for r in report["graphs"][0]["regions"] if r["name"] == "stack.blocks.0.mlp")
    assert fields["region"]["fingerprint"] == region["fingerprint"]
    assert [i["name"] for i in fields["signature"]["inputs"]] == [i["name"] for i in region["inputs"]]

    write_bundle(tmp_path / "kernels" / "mlp", "mlp", fields["region"]["module"], source=MLP_SOURCE,
                 fingerprint=fields["region"]["fingerprint"], **fields["signature"])
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    out_compiled, eager = compile_once(tmp_path / "second", tmp_path / "kernels")
    assert torch.equal(out_compiled, eager)
    subs = graphdispatch_backend.latest_report()["graphs"][0]["substitutions"]
    assert sorted(s["region"] for s in subs) == ["stack.blocks.0.mlp", "stack.blocks.1.mlp"]
    assert all(s["parity"] == "passed" for s in subs)


def test_a_pattern_naming_several_kinds_warns_to_keep_the_fingerprint(report_dir, capsys):
    out = listing(capsys, str(report_dir), "--regions", "*.blocks.*.mlp")
    assert out.count('"region"') == 2 and "also names 1 region(s) of other kinds: keep the fingerprint" in out


def test_a_pattern_naming_nothing_says_what_would(report_dir, capsys):
    out = listing(capsys, str(report_dir), "--regions", "blocks.*.mlp")
    assert "`blocks.*.mlp` names no region; did you mean `*.blocks.*.mlp`: 3 regions" in out


def test_a_missing_report_is_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope"), "--regions"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_report_and_artifact_commands_import_no_torch(report_dir, tmp_path):
    """`import torch` takes seconds: the CLI paths that only read files never pay it."""
    write_bundle(tmp_path / "kernels" / "mlp", "mlp", "x", [], [{"shape": [1], "dtype": "float32"}], "x = 1\n")
    commands = [
        ["--help"],
        ["report", str(report_dir)],
        ["report", str(report_dir), "--regions", "stack.blocks.*.mlp"],
        ["artifacts", "verify", str(tmp_path / "kernels")],
        ["artifacts", "hash", str(tmp_path / "kernels" / "mlp")],
        ["artifacts", "scaffold", str(report_dir), "--region", "stack.blocks.*.mlp", str(tmp_path / "scaffolded")],
    ]
    probe = (
        "import sys\n"
        "from graphdispatch_backend.__main__ import main\n"
        "try:\n"
        "    code = main(sys.argv[1:])\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'numpy')))\n"
        "print('HEAVY', heavy, 'CODE', code)\n"
    )
    for command in commands:
        done = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, timeout=120)
        assert "HEAVY [] CODE 0" in done.stdout, (command, done.stdout[-400:], done.stderr[-800:])


def test_the_package_loads_its_public_names_lazily():
    probe = (
        "import sys, graphdispatch_backend as gd\n"
        "light = 'torch' not in sys.modules\n"
        "names = sorted(gd.__all__)\n"
        "values = [getattr(gd, n) for n in names]\n"
        "from importlib.metadata import entry_points\n"
        "(ep,) = [e for e in entry_points(group='torch_dynamo_backends') if e.name == 'graphdispatch']\n"
        "print('LIGHT', light, 'LOADED', ep.load().__module__, callable(gd.flush), gd.latest_report())\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert "LIGHT True LOADED graphdispatch_backend.backend True None" in done.stdout, done.stderr[-800:]


def test_every_listed_pattern_names_one_kind_and_scaffolds(report_dir, tmp_path, capsys):
    """`stack.blocks.*.fc*`-like patterns of several kinds are what the scaffold refuses: the
    listing prints patterns that name their own kind alone (or the --fingerprint to add)."""
    from graphdispatch_backend.artifacts.catalog import kinds as all_kinds
    from graphdispatch_backend.artifacts.patterns import matches
    from graphdispatch_backend.artifacts.scaffold import scaffold

    report = json.loads((report_dir / "dispatch.json").read_text())
    every = all_kinds(report)
    for k in every:
        for pattern in k.own_patterns(every):
            if " --fingerprint " in pattern:
                continue
            named = {o.fingerprint for o in every for n in o.names if matches(pattern, n.split("#", 1)[0])}
            assert named == {k.fingerprint}, (pattern, named)
    linear = next(k for k in every if k.cls == "Linear" and len(k.regions) > 1)
    pattern = linear.own_patterns(every)[0]
    scaffold(report, pattern, tmp_path / "one")  # names one kind: written
