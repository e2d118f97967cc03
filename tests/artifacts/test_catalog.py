"""`python -m graphdispatch_backend report DIR --regions [PATTERN]`: every region by kind, and
the manifest fields to copy; a manifest made of exactly those fields serves the region."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.__main__ import _parser, main
from graphdispatch_backend.artifacts.catalog import kinds
from graphdispatch_backend.diagnostics.report_dir import load
from graphdispatch_backend.diagnostics.report_file import expand
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
    rows = out.split(header, 1)[1].split("\n\n", 1)[0].splitlines()[2:]  # the table, not the commands below it
    rows = [re.split(r"\s{2,}", r) for r in rows if r.strip()]
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
    report = expand(json.loads((report_dir / "dispatch.json").read_text()))  # every region whole
    region = next(r for r in report["graphs"][0]["regions"] if r["name"] == "stack.blocks.0.mlp")
    assert "fingerprint" not in fields["region"]  # the pattern names this kind alone: no pin (scaffold.py)
    assert [i["name"] for i in fields["signature"]["inputs"]] == [i["name"] for i in region["inputs"]]

    write_bundle(tmp_path / "kernels" / "mlp", "mlp", fields["region"]["module"], source=MLP_SOURCE,
                 **fields["signature"])
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    out_compiled, eager = compile_once(tmp_path / "second", tmp_path / "kernels")
    assert torch.equal(out_compiled, eager)
    subs = graphdispatch_backend.latest_report()["graphs"][0]["substitutions"]
    assert sorted(s["region"] for s in subs) == ["stack.blocks.0.mlp", "stack.blocks.1.mlp"]
    assert all(s["parity"] == "passed" for s in subs)


def test_a_pattern_naming_several_kinds_warns_to_keep_the_fingerprint(report_dir, capsys):
    out = listing(capsys, str(report_dir), "--regions", "*.blocks.*.mlp")
    assert out.count('"region"') == 2 and "also names 1 region(s) of other kinds (" in out
    assert "keep the fingerprint" in out
    # pinned here, where only the fingerprint picks the kind
    assert all('"fingerprint": ' in line for line in out.splitlines() if line.lstrip().startswith('"region"'))


def test_a_pattern_naming_nothing_says_what_would(report_dir, capsys):
    out = listing(capsys, str(report_dir), "--regions", "blocks.*.mlp")
    assert "`blocks.*.mlp` names no region; did you mean `*.blocks.*.mlp`: 3 regions" in out


def test_a_missing_report_is_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope"), "--regions"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_report_and_artifact_commands_import_no_torch(report_dir, tmp_path):
    """`import torch` takes seconds: the CLI paths that only read files never pay it."""
    write_bundle(tmp_path / "kernels" / "mlp", "mlp", "x", [], [{"shape": [1], "dtype": "float32"}],
                 "def forward(x):\n    return x\n")
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
        done = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, timeout=900)
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
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=900)
    assert "LIGHT True LOADED graphdispatch_backend.backend True None" in done.stdout, done.stderr[-800:]


def test_every_listed_pattern_names_one_kind_and_scaffolds(report_dir, tmp_path, capsys):
    """`stack.blocks.*.fc*`-like patterns of several kinds are what the scaffold refuses: the
    listing prints patterns that name their own kind alone (or the --fingerprint to add)."""
    from graphdispatch_backend.artifacts.catalog import kinds as all_kinds
    from graphdispatch_backend.artifacts.scaffold import scaffold
    from graphdispatch_backend.patterns import matches

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


# -- the commands the listing prints are ones to copy ---------------------------------------------


def compile_twice(report_dir: Path) -> None:
    """A Stack at batch 2, then 5: Dynamo recompiles with a symbolic batch, so every module
    name has two kinds (two graphs), and only a fingerprint tells them apart."""
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = torch.compile(Stack(depth=2, dim=8).eval(), backend="graphdispatch",
                             options={"report_dir": str(report_dir)})
    with torch.no_grad():
        for batch in (2, 5):
            compiled(torch.randn(batch, 4, 8))
    graphdispatch_backend.flush()


def printed_commands(out: str) -> list[list[str]]:
    """Every `python -m graphdispatch_backend ...` line of the output, as the argv a shell
    would give `main` (after `python -m graphdispatch_backend`)."""
    lines = [line.split("python -m graphdispatch_backend ", 1)[1] for line in out.splitlines()
             if "python -m graphdispatch_backend " in line]
    return [shlex.split(line) for line in lines]


def test_the_printed_next_commands_parse_and_do_what_they_say(tmp_path, capsys, monkeypatch):
    """The hint used to be `--regions 'blocks.* --fingerprint a910634b'`: a pattern that names
    nothing, and `report` takes no --fingerprint. Now: commands with the real directory."""
    compile_twice(tmp_path / "gd_out")
    monkeypatch.chdir(tmp_path)  # the scaffold command writes under my_kernels/, relative
    out = listing(capsys, str(tmp_path / "gd_out"), "--regions")
    report_argv, scaffold_argv = printed_commands(out)
    for argv in (report_argv, scaffold_argv):
        _parser().parse_args(argv)  # an argparse error would SystemExit here
    assert report_argv[:2] == ["report", str(tmp_path / "gd_out")] and report_argv[2] == "--regions"
    assert scaffold_argv[:4] == ["artifacts", "scaffold", str(tmp_path / "gd_out"), "--region"]
    assert scaffold_argv[4] == report_argv[3]  # the same pattern
    assert "--fingerprint" in scaffold_argv  # the same names in two graphs: the fingerprint picks one kind

    # the listing command lists the kind, with its fields; the scaffold command writes its bundle
    listed = listing(capsys, *report_argv[1:])
    assert main(scaffold_argv) == 0
    written = capsys.readouterr().out
    manifest = json.loads((tmp_path / scaffold_argv[-1] / "artifact.json").read_text())
    fingerprint = scaffold_argv[scaffold_argv.index("--fingerprint") + 1]
    assert manifest["region"]["fingerprint"].startswith(fingerprint) and "wrote" in written
    assert f'"fingerprint": "{manifest["region"]["fingerprint"]}"' in listed


def test_under_a_pattern_each_kind_prints_a_scaffold_command_that_writes_it(tmp_path, capsys, monkeypatch):
    compile_twice(tmp_path / "gd_out")
    monkeypatch.chdir(tmp_path)
    out = listing(capsys, str(tmp_path / "gd_out"), "--regions", "blocks.*.mlp")
    commands = printed_commands(out)
    assert len(commands) == 2 and all(c[:2] == ["artifacts", "scaffold"] for c in commands)
    below = out.split("\n\n", 1)[1]  # under the table, a `--fingerprint` is a command's argument, never prose
    assert all("python -m graphdispatch_backend " in line for line in below.splitlines() if "--fingerprint" in line)
    manifests = []
    for argv in commands:
        _parser().parse_args(argv)
        assert main(argv) == 0
        manifests.append(json.loads((tmp_path / argv[-1] / "artifact.json").read_text()))
    capsys.readouterr()
    # one bundle per kind, in folders of their own; the same modules at other shapes: unpinned
    assert [m["region"].get("fingerprint") for m in manifests] == [None, None]
    assert manifests[0]["signature"] != manifests[1]["signature"]
    assert main(["artifacts", "verify", "my_kernels"]) == 0


def test_strides_of_inputs_and_outputs_are_listed(report_dir, capsys):
    """Parity compares output strides: the listing shows them before a failure does."""
    report, _, _ = load(report_dir)
    region = next(r for r in report["graphs"][0]["regions"] if r["name"] == "stack.blocks.0.mlp")

    def stride(entry: dict) -> str:
        return "(" + ", ".join(map(str, entry["stride"])) + ("," if len(entry["stride"]) == 1 else "") + ")"

    table = listing(capsys, str(report_dir), "--regions")
    row = next(line for line in table.splitlines() if line.startswith("stack.blocks.*.mlp "))
    output = region["outputs"][0]
    assert f"{output['dtype']}[{', '.join(map(str, output['shape']))}] stride {stride(output)}" in row
    out = listing(capsys, str(report_dir), "--regions", "stack.blocks.*.mlp")
    (line,) = [line for line in out.splitlines() if line.lstrip().startswith("strides")]
    want = (", ".join(f"{i['name']} {stride(i)}" for i in region["inputs"]) + "; "
            + ", ".join(f"{o['name']} {stride(o)}" for o in region["outputs"]))
    assert line.endswith(want), (line, want)


def test_the_same_modules_recompiled_with_other_shapes_are_no_reason_to_pin(tmp_path, capsys):
    """A trial's LLM recompiled its MLPs with dynamic sizes: the listing called them "other
    kinds" and said to keep the fingerprint, and the pinned kernel served 25 of 40 calls
    (refused in 3 of 4 graphs). The same modules in another graph are said as such, unpinned."""
    from graphdispatch_backend.testing import Block

    compiled = torch.compile(Block().eval(), backend="graphdispatch", options={"report_dir": str(tmp_path / "gd")})
    with torch.no_grad():
        for batch in (2, 3):  # the second recompiles with a dynamic batch
            compiled(torch.randn(batch, 8))
    graphdispatch_backend.flush()
    out = listing(capsys, str(tmp_path / "gd"), "--regions", "mlp")
    assert out.count('"region": {"module": "mlp"}') == 2 and "keep the fingerprint" not in out, out
    assert "also names 1 region(s) of these modules in other graphs (Dynamo compiled them again" in out


def test_a_training_graphs_regions_are_left_out_and_said(tmp_path, capsys):
    """The same Net trained (grad on) and evaluated under no_grad: artifacts serve only the
    inference graph, so only its kinds are listed, the training graph's regions are counted
    as left out, no pattern reads as "compiled again, with other shapes", and the listed
    pattern scaffolds (a trial's training-graph kind printed a scaffold command that failed)."""
    from graphdispatch_backend.artifacts.scaffold import scaffold

    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend="graphdispatch", options={"report_dir": str(tmp_path / "gd")})
    compiled(torch.randn(2, 8)).sum().backward()
    with torch.no_grad():
        compiled(torch.randn(2, 8))
    graphdispatch_backend.flush()
    report = json.loads((tmp_path / "gd" / "dispatch.json").read_text())
    assert sorted(g["kind"] for g in report["graphs"]) == ["autograd", "inference"]
    every = kinds(report)
    assert {graph for k in every for graph, _ in k.regions} == {
        next(g["name"] for g in report["graphs"] if g["kind"] == "inference")}
    out = listing(capsys, str(tmp_path / "gd"), "--regions")
    assert "regions of training graphs not listed" in out, out
    out = listing(capsys, str(tmp_path / "gd"), "--regions", "stack.blocks.*.fc1")
    assert "other shapes" not in out, out
    scaffold(report, "stack.blocks.*.fc1", tmp_path / "fc1")


class Gated(torch.nn.Module):
    """A module called with or without a gate: the same module, two region layouts."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.relu(self.fc(x))
        return y if gate is None else y * gate


class TwoPaths(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blk = Gated()

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        return self.blk(x, gate) + 1


def test_the_same_modules_with_another_layout_are_pinned_away_and_strict_compiles(tmp_path, capsys, monkeypatch):
    """A trial's static-cache Llama: its attention's decode region takes 9 inputs, its prefill
    region 11. The scaffold left the bundle unpinned ("the same modules compiled again with
    other shapes"), so every prefill graph rejected it on its signature, and under `strict`,
    as the docs advise for CI, the compile failed. The same modules with another layout (here
    a gate passed or not) count as another kind: the fingerprint is kept, and a strict
    compile of both paths serves the one and leaves the other alone."""
    torch.manual_seed(0)
    model = TwoPaths().eval()
    x, gate = torch.randn(2, 8), torch.rand(2, 8)

    def both(options: dict) -> None:
        torch._dynamo.reset()
        graphdispatch_backend.reset()
        compiled = torch.compile(model, backend="graphdispatch", options=options)
        with torch.no_grad():
            assert torch.equal(compiled(x), model(x))
            assert torch.equal(compiled(x, gate), model(x, gate))
        graphdispatch_backend.flush()

    both({"report_dir": str(tmp_path / "gd")})
    monkeypatch.chdir(tmp_path)
    out = listing(capsys, str(tmp_path / "gd"), "--regions", "blk")
    assert "keep the fingerprint" in out and "Dynamo compiled them again" not in out, out
    commands = printed_commands(out)
    assert len(commands) == 2 and all("--fingerprint" in c for c in commands), commands
    assert main(commands[0]) == 0
    manifest = json.loads((tmp_path / commands[0][-1] / "artifact.json").read_text())
    assert manifest["region"].get("fingerprint"), manifest["region"]
    capsys.readouterr()
    both({"artifacts": str(tmp_path / Path(commands[0][-1]).parent), "strict": True})
    report = graphdispatch_backend.latest_report()
    served = [s for g in report["graphs"] for s in g.get("substitutions", [])]
    assert len(served) == 1 and served[0]["calls"] + served[0]["replays"] == 1, served
    reasons = {x["reason"] for g in report["graphs"] for r in g["regions"] for x in r.get("rejections") or ()}
    assert reasons == {"fingerprint"}, reasons  # the other layout: not this kind (no `signature` rejection)
