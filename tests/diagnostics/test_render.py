"""`python -m graphdispatch_backend report DIR`: the tables a user reads, and a clear
message with a non-zero exit for every way a report directory can be unusable."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

import graphdispatch_backend
import graphdispatch_backend.backend as backend_module
from graphdispatch_backend.__main__ import main
from graphdispatch_backend.passes import PIPELINE
from graphdispatch_backend.passes import run_pipeline as real_run_pipeline
from graphdispatch_backend.table import table


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory, write_mlp_bundle, net_factory, mlp_inputs_factory):
    """One session with something in every section: a serving artifact, a demoted one, one
    rejected by signature, a tampered bundle; a verified graph, a declined graph, a graph
    that fell back on a compile error; shadow timing."""
    base = tmp_path_factory.mktemp("render")
    root = base / "bundles"
    write_mlp_bundle(root, "mlp-exact", "exact", module="blocks.0.mlp")
    write_mlp_bundle(root, "mlp-off", "off", module="blocks.1.mlp")
    wide = [dict(i, shape=[32, 8]) if i["name"] == "fc1.weight" else i for i in mlp_inputs_factory()]
    write_mlp_bundle(root, "mlp-wide", "exact", inputs=wide)
    write_mlp_bundle(root, "mlp-tampered", "exact")
    with (root / "mlp-tampered" / "kernel.py").open("a") as f:
        f.write("# edited after hashing\n")
    out = base / "report"
    # warmup=3: an artifact is shadowed on eager calls only (a replay runs no Python), and
    # its first two calls are its gate and a parity re-check; the third is shadowed
    options = {"cuda_graphs": "emulate", "warmup": 3, "verify_inputs": 1, "max_captures": 1, "timing": "shadow",
               "artifacts": str(root), "report_dir": str(out)}
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    net = net_factory()
    small = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    broken = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    with torch.no_grad():
        compiled = torch.compile(net, backend="graphdispatch", options=options)
        for _ in range(6):
            compiled(torch.randn(4, 8))  # graph_0: verified, replays
        declined = torch.compile(small, backend="graphdispatch", options=options)
        for _ in range(6):  # graph_1: its weight moves on every call (offload): parameter_moved
            small[0].weight.data = torch.randn(8, 8)
            declined(torch.randn(4, 8))
        with pytest.MonkeyPatch.context() as mp:
            def broken_pass(gm, ctx):
                raise RuntimeError("injected pass failure")

            mp.setattr(backend_module, "run_pipeline",
                       lambda gm, ctx: real_run_pipeline(gm, ctx, (*PIPELINE, broken_pass)))
            fallback = torch.compile(broken, backend="graphdispatch", options=options)
            for _ in range(2):
                fallback(torch.randn(4, 8))  # graph_2: fell back
    graphdispatch_backend.flush()
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    return out


def _render(capsys, directory):
    rc = main(["report", str(directory)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _section(text, title):
    """The lines of one section: from the line starting with `title` to the next blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def _row(lines, *first):
    """The cells (split on runs of two or more spaces) of the table row starting with `first`."""
    for line in lines:
        cells = re.split(r"\s{2,}", line.strip())
        if cells[: len(first)] == list(first):
            return cells
    raise AssertionError(f"no row {first} in:\n" + "\n".join(lines))


def test_report_renders_every_section(capsys, report_dir):
    rc, out, err = _render(capsys, report_dir)
    assert rc == 0 and err == ""
    assert out.startswith("graphdispatch report (")
    summary = _section(out, "Summary")
    assert any("3 graphs" in line for line in summary)
    # the calls that reached graphdispatch: past Dynamo's recompile_limit a call runs outside any backend
    assert "  every call that reached graphdispatch accounted for: calls == replays + eager on each graph" in summary

    bundles = _section(out, "Artifact bundles")
    assert any("loaded: mlp-exact, mlp-off, mlp-wide" in line for line in bundles)
    assert any("REJECTED bundle" in line and "mlp-tampered" in line for line in bundles)


def test_graphs_table_shows_cuda_graph_state_and_decline_reasons(capsys, report_dir):
    out = _render(capsys, report_dir)[1]
    graphs = _section(out, "Graphs")
    header = _row(graphs, "graph")
    verified = dict(zip(header, _row(graphs, "graph_0")))
    assert verified["kind"] == "inference" and verified["cuda graph"] == "host: verified"
    assert verified["calls"] == "6" and verified["calls=r+e"] == "ok" and verified["declines"] == "-"
    declined = dict(zip(header, _row(graphs, "graph_1")))
    assert "parameter_moved=" in declined["eager calls by reason"] and declined["declines"] == "parameter_moved=1"
    assert declined["calls=r+e"] == "ok"
    fallback = dict(zip(header, _row(graphs, "graph_2")))
    assert fallback["kind"] == "fallback" and fallback["cuda graph"] == "off: eager"
    assert fallback["eager calls by reason"] == "backend_error=2"

    why = _section(out, "Why calls ran eager")
    assert any(line.strip().startswith("graph_1: parameter_moved") for line in why)
    assert any("graph_2: backend_error" in line and "injected pass failure" in line for line in why)


def test_artifacts_table_shows_status_verdicts_demotions_and_timings(capsys, report_dir):
    out = _render(capsys, report_dir)[1]
    arts = _section(out, "Artifacts (")
    header = _row(arts, "artifact")
    exact = dict(zip(header, _row(arts, "mlp-exact")))
    assert exact["status"] == "serving" and exact["regions"] == "1" and exact["parity"] == "passed=1"
    assert int(exact["calls"]) + int(exact["replays"]) > 0 and exact["native"] == "0"
    assert exact["time vs native (>1.00x: artifact faster)"].startswith("shadow ")  # timing="shadow"
    assert "ms/call" in exact["time vs native (>1.00x: artifact faster)"]
    off = dict(zip(header, _row(arts, "mlp-off")))
    assert off["status"] == "demoted" and off["parity"] == "failed=1" and off["demotions"] == "parity=1"
    wide = dict(zip(header, _row(arts, "mlp-wide")))
    # every rejection by reason, `module` too (regions the pattern does not name)
    assert wide["status"] == "rejected" and wide["rejections"] == "module=10, signature=2" and wide["regions"] == "0"
    demotions = _section(out, "Demotions")
    assert any("mlp-off on graph_0 blocks.1.mlp: parity:" in line and "bits differ" in line for line in demotions)


def test_regions_table_shows_matches_and_rejections(capsys, report_dir):
    out = _render(capsys, report_dir)[1]
    regions = _section(out, "Regions with an artifact or a rejection")
    header = _row(regions, "graph")
    first = dict(zip(header, _row(regions, "graph_0", "blocks.0.mlp")))
    assert first["artifact"] == "mlp-exact" and first["verdict"] == "parity passed" and first["class"] == "Mlp"
    assert "mlp-wide:signature" in first["rejected"]
    second = dict(zip(header, _row(regions, "graph_0", "blocks.1.mlp")))
    assert second["artifact"] == "mlp-off" and second["verdict"] == "demoted (parity)"
    rejections = _section(out, "Rejections")
    assert any("blocks.0.mlp x mlp-wide: signature:" in line and "fc1.weight" in line for line in rejections)


def test_timing_phases_and_notes_are_rendered(capsys, report_dir):
    out = _render(capsys, report_dir)[1]
    phases = _section(out, "Timing phases")
    assert "timing='shadow'" in phases[0] and "synchronized" in phases[0]
    names = {_row(phases, name)[0] for name in ("validate", "execute", "replay", "artifact_gate",
                                                  "shadow.native_forward")}
    assert len(names) == 5
    # one per call of graph_0 and graph_1; graph_2 fell back to the plain Dynamo graph, untimed
    assert int(_row(phases, "validate")[1]) == 6 + 6
    notes = _section(out, "Notes")
    assert any("cuda_graph_declined" in line and "parameter_moved" in line for line in notes)
    assert any("demoted to native" in line and "mlp-off" in line for line in notes)


class _Noisy(torch.nn.Module):
    """A random op between two linears: cut into two captured pieces around it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        return self.b(x + torch.rand_like(x))


def test_pieces_of_a_split_graph_are_rendered(capsys, tmp_path):
    options = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1, "report_dir": str(tmp_path)}
    compiled = torch.compile(_Noisy().eval(), backend="graphdispatch", options=options)
    with torch.no_grad():
        for _ in range(4):
            compiled(torch.randn(4, 8))
    graphdispatch_backend.flush()
    rc, out, _ = _render(capsys, tmp_path)
    assert rc == 0
    pieces = _section(out, "Pieces")
    header = _row(pieces, "graph")
    kinds = [dict(zip(header, _row(pieces, "graph_0", str(i)))) for i in range(3)]
    assert [k["kind"] for k in kinds] == ["captured", "eager", "captured"]
    assert kinds[1]["split by"] == "random_op=1"
    assert kinds[0]["state"] == kinds[2]["state"] == "verified"


def test_a_report_that_does_not_add_up_is_flagged(capsys, report_dir, tmp_path):
    shutil.copytree(report_dir, tmp_path / "r")
    path = tmp_path / "r" / "dispatch.json"
    report = json.loads(path.read_text())
    report["graphs"][0]["calls"] += 1
    path.write_text(json.dumps(report))
    rc, out, _ = _render(capsys, tmp_path / "r")
    assert rc == 0
    assert _row(_section(out, "Graphs"), "graph_0")[7] == "MISMATCH"
    assert any("ACCOUNTING MISMATCH" in line and "graph_0" in line for line in _section(out, "Summary"))


def test_speed_gate_timings_are_rendered(capsys, report_dir, tmp_path):
    shutil.copytree(report_dir, tmp_path / "r")
    path = tmp_path / "r" / "dispatch.json"
    report = json.loads(path.read_text())
    report["artifacts"]["mlp-exact"]["speed"] = [
        {"region": "blocks.0.mlp", "artifact_ms": 0.5, "native_ms": 0.75, "speedup": 1.5}]
    report["artifacts"]["mlp-exact"]["shadow"]["calls"] = 0
    path.write_text(json.dumps(report))
    out = _render(capsys, tmp_path / "r")[1]
    cells = _row(_section(out, "Artifacts ("), "mlp-exact")
    assert cells[-1] == "gate 1.50x (0.500 vs 0.750 ms)"


def test_fused_graphs_are_rendered_with_the_ops_kept_and_why(capsys, report_dir, tmp_path):
    shutil.copytree(report_dir, tmp_path / "r")
    path = tmp_path / "r" / "dispatch.json"
    report = json.loads(path.read_text())
    report["graphs"][0]["fusion"] = {
        "status": "fused", "kernels": 7, "aten_calls": 12, "fused_ops": {"aten.add.Tensor": 3, "aten.mul.Tensor": 2},
        "kept": [{"op": "aten.addmm.default", "why": "recipe"},
                 {"op": "aten.mul.Tensor", "why": "learned", "at_call": 4, "detail": "bits differ"},
                 {"op": "aten.div.Tensor", "why": "cache", "at_call": 1, "detail": "bits differ"}],
        "rounds": 1, "segments": 2, "compile_seconds": 3.5}
    report["graphs"][1]["fusion"] = {"status": "off", "detail": "dynamic shapes: ..."}
    path.write_text(json.dumps(report))
    out = _render(capsys, tmp_path / "r")[1]
    fusion = _section(out, "Fusion (")
    assert _row(fusion, "graph_0")[1:6] == ["fused", "bitwise", "7", "5", "12"]
    assert _row(fusion, "graph_1")[1] == "off"
    text = "\n".join(_section(out, "Fusion checks and ops kept as ATen calls"))
    assert "aten.mul.Tensor runs as an ATen call, learned at call 4: bits differ" in text
    assert "aten.div.Tensor runs as an ATen call, from the verdict cache" in text
    assert "left to ATen by the recipe: aten.addmm.default" in text and "graph_1: off: dynamic shapes" in text


def test_off_timing_says_how_to_turn_it_on(capsys, report_dir, tmp_path):
    shutil.copytree(report_dir, tmp_path / "r")
    (tmp_path / "r" / "timing.json").write_text(json.dumps(
        {"timing_schema_version": 1, "mode": "off", "synchronized": False, "phases": {}, "notes": {},
         "notes_dropped": 0}))
    out = _render(capsys, tmp_path / "r")[1]
    assert "Timing phases: none recorded (timing='off'; set timing='host', 'sync' or 'shadow')" in out


# -- unusable directories --------------------------------------------------------------------------
def _expect_error(capsys, directory, *phrases):
    rc, out, err = _render(capsys, directory)
    assert rc == 2 and out == ""
    assert err.startswith("graphdispatch report: error: ")
    for phrase in phrases:
        assert phrase in err, err


def test_missing_directory(capsys, tmp_path):
    _expect_error(capsys, tmp_path / "nope", "does not exist", str(tmp_path / "nope"))


def test_directory_without_dispatch_json(capsys, tmp_path):
    _expect_error(capsys, tmp_path, "no dispatch.json in", "report_dir")


def test_a_file_instead_of_a_directory(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("{}")
    _expect_error(capsys, tmp_path / "notes.txt", "is not a directory")


def test_a_json_file_is_read_as_one_report(capsys, tmp_path):
    """`report DIR/dispatch.rank1.json` renders that rank's report: a `.json` path is the
    report itself, checked as a directory's dispatch.json is."""
    (tmp_path / "dispatch.json").write_text("{}")
    _expect_error(capsys, tmp_path / "dispatch.json", "is not a graphdispatch report (no schema_version)")
    _expect_error(capsys, tmp_path / "dispatch.rank3.json", "report file", "does not exist", "rank 0: dispatch.json")


def test_corrupt_json(capsys, tmp_path):
    (tmp_path / "dispatch.json").write_text('{"schema_version": 1, "graphs": [')
    _expect_error(capsys, tmp_path, "is not valid JSON")


@pytest.mark.parametrize(("payload", "phrase"), [
    ({"schema_version": 3, "graphs": []}, "has schema_version 3; this graphdispatch reads schema_version 1 or 2"),
    ([1, 2, 3], "is not a graphdispatch report (no schema_version)"),
    ({"graphs": []}, "is not a graphdispatch report (no schema_version)"),
    ({"schema_version": 1}, "graphs[] is missing"),
    ({"schema_version": 1, "graphs": [{"name": "graph_0"}]}, "a field the renderer needs"),
])
def test_wrong_schema(capsys, tmp_path, payload, phrase):
    (tmp_path / "dispatch.json").write_text(json.dumps(payload))
    _expect_error(capsys, tmp_path, phrase)


def test_corrupt_timing_json_is_said_not_fatal(capsys, report_dir, tmp_path):
    shutil.copytree(report_dir, tmp_path / "r")
    (tmp_path / "r" / "timing.json").write_text("{truncated")
    rc, out, _ = _render(capsys, tmp_path / "r")
    assert rc == 0 and "Graphs" in out
    assert any(line.startswith("Timing: ") and "not valid JSON" in line for line in out.splitlines())


def test_artifact_checks_say_per_graph_and_per_artifact_what_was_served_unchecked(
        capsys, tmp_path, write_mlp_bundle, net_factory):
    """How many calls each artifact served since its last check, and the most it served
    unchecked in a row, per graph and per artifact: dispatch.json always had the checks'
    positions in no form a reader could see; the rendered report and the CLI say it."""
    root = write_mlp_bundle(tmp_path / "bundles", "mlp-exact", "exact", module="*blocks.*.mlp")
    out = tmp_path / "report"

    class Outer(torch.nn.Module):  # a second graph holding the same artifact's regions
        def __init__(self) -> None:
            super().__init__()
            self.stack = net_factory()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.stack(x) * 2

    options = {"cuda_graphs": False, "artifact_recheck": 3, "artifacts": str(root), "report_dir": str(out)}
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    with torch.no_grad():
        first = torch.compile(net_factory(), backend="graphdispatch", options=options)
        # checked by the gate at 1, 4, 7, 10 and by the graph's own check (recheck="doubling",
        # which compares what a bitwise artifact served) at 1, 2, 4, 8: 5-6 served unchecked
        # in a row, and call 11 since the last check
        for _ in range(11):
            first(torch.randn(4, 8))
        second = torch.compile(Outer().eval(), backend="graphdispatch", options=options)
        for _ in range(5):  # checked at 1, 2, 4: calls 3 and 5 unchecked
            second(torch.randn(4, 8))
    graphdispatch_backend.flush()
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    rc, text, err = _render(capsys, out)
    assert rc == 0, err
    assert "artifact_recheck=3" in text.splitlines()[2]  # the header's options
    # in all: calls 3, 5, 6, 9, 11 of the first graph and 3, 5 of the second, two regions each
    assert ("artifacts: 4 region calls served since their last check (14 unchecked in all), at most 2 calls "
            "served unchecked in a row") in text
    assert graphdispatch_backend.load_report(out)["totals"]["artifact_served_unchecked"] == 14
    lines = _section(text, "Artifact checks (artifact_recheck=3")
    # regions, served, unchecked, largest gap, novelty checks
    assert _row(lines, "graph_0", "mlp-exact")[2:] == ["2", "22", "2", "2", "0"]
    assert _row(lines, "graph_1", "mlp-exact")[2:] == ["2", "10", "2", "1", "0"]
    assert _row(lines, "all graphs", "mlp-exact")[2:] == ["4", "32", "4", "2", "0"]
    report = json.loads((out / "dispatch.json").read_text())
    assert (report["totals"]["artifact_unchecked_calls"], report["totals"]["artifact_largest_gap"]) == (4, 2)
    assert [[(s["served_since_check"], s["largest_gap"]) for s in g["substitutions"]] for g in report["graphs"]] == [
        [(1, 2), (1, 2)], [(1, 1), (1, 1)]]


def test_command_line_in_a_subprocess(report_dir):
    done = subprocess.run([sys.executable, "-m", "graphdispatch_backend", "report", str(report_dir)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert "Graphs" in done.stdout and "graph_0" in done.stdout and "mlp-exact" in done.stdout


def test_table_keeps_rows_on_one_line_and_cuts_long_cells():
    text = table(["a", "b"], [["x", "line one\nline two"], ["y", "z" * 60]], max_width=20)
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[2].split(None, 1)[1] == "line one line two"
    assert lines[3].endswith("z" * 17 + "...") and len(lines[3].split(None, 1)[1]) == 20
    assert all(line == line.rstrip() for line in lines)


def test_a_tolerance_fused_graph_renders_its_tolerance_largest_error_and_where_an_op_was_learned(
        capsys, report_dir, tmp_path):
    shutil.copytree(report_dir, tmp_path / "r")
    path = tmp_path / "r" / "dispatch.json"
    report = json.loads(path.read_text())
    report["graphs"][0]["fusion"] = {
        "status": "fused", "kernels": 9, "aten_calls": 0, "fused_ops": {"aten.native_layer_norm.default": 2},
        "kept": [{"op": "aten.mul.Tensor", "why": "device", "learned_in": "graph_3", "at_call": 1,
                  "detail": "not within rtol=0.001 atol=1e-05"}],
        "rounds": 0, "segments": 1, "compile_seconds": 2.0, "tolerance": {"rtol": 1e-3, "atol": 1e-5},
        "checks": 5, "beyond": 0, "largest_error": {"abs": 2.5e-7, "abs_at": "output 0 [0, 1], call 2", "rel": 1e-4,
                                                     "rel_at": "output 0 [1, 1], call 4", "budget": 0.25,
                                                     "budget_at": "output 0 [0, 3], call 1"}}
    path.write_text(json.dumps(report))
    out = _render(capsys, tmp_path / "r")[1]
    assert _row(_section(out, "Fusion ("), "graph_0")[1:4] == ["fused", "rtol=0.001 atol=1e-05", "9"]
    text = "\n".join(_section(out, "Fusion checks and ops kept as ATen calls"))
    calls = report["graphs"][0]["calls"]
    assert ("graph_0: tolerance rtol=0.001 atol=1e-05: 5 checks, 0 beyond it (answered with eager's values), "
            f"{max(calls - 5, 0)} calls served unchecked (not compared); "
            "largest error at a checked call: 2.5e-07 abs (output 0 [0, 1], call 2), "
            "0.0001 rel (output 0 [1, 1], call 4), 0.25 of the budget (output 0 [0, 3], call 1)") in text
    assert "aten.mul.Tensor runs as an ATen call, learned on this device and recipe by graph_3 (call 1)" in text
