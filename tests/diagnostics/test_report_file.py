"""dispatch.json is sized to what a reader needs, and every reader still gets all of it.

A region with news (an artifact, a rejection, an export) keeps its whole entry; the others
keep name, module and fingerprint, their kind's detail once per fingerprint in
`region_kinds`; `region_graphs` (the scaffold's) are compressed. `expand` of the file is
`latest_report()`, so `report`, `report --regions`, `artifacts verify --report` and
`artifacts scaffold` read from the small file what they read from the whole one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.__main__ import main
from graphdispatch_backend.artifacts.bundle import verify_bundle
from graphdispatch_backend.diagnostics.report_file import KIND_KEYS, SCHEMA_VERSION, expand, json_default
from graphdispatch_backend.diagnostics.session_report import SessionReport
from graphdispatch_backend.testing import Stack

KB = 1000


def _plain(report: dict[str, Any] | None) -> dict[str, Any]:
    """A report dict as JSON reads it back (tuples as lists, Counters as dicts)."""
    assert report is not None
    return json.loads(json.dumps(report, default=json_default))


def _compile(model: torch.nn.Module, inputs: list[dict[str, Any]], report_dir: Path) -> dict[str, Any]:
    compiled = torch.compile(model.eval(), backend="graphdispatch",
                             options={"cuda_graphs": "emulate", "report_dir": str(report_dir)})
    with torch.no_grad():
        for kwargs in inputs:
            compiled(**kwargs)
    graphdispatch_backend.flush()
    return _plain(graphdispatch_backend.latest_report())


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_a_two_layer_diffusers_model_writes_under_100_kb_and_every_command_reads_it(tmp_path, capsys):
    pytest.importorskip("diffusers")
    from graphdispatch_backend.examples.families import ltx

    torch.manual_seed(0)
    model, inputs = ltx()  # 2 transformer blocks: 65 regions of 28 kinds
    latest = _compile(model, [inputs(i, torch.float32) for i in range(2)], tmp_path / "gd_out")
    path = tmp_path / "gd_out" / "dispatch.json"
    text = path.read_text("utf-8")
    whole = len(json.dumps(latest, indent=2))  # the file as schema 1 wrote it: about 380 KB
    assert len(text) < 100 * KB < whole, (len(text), whole)
    written = json.loads(text)
    assert written["schema_version"] == SCHEMA_VERSION == 2
    (graph,) = written["graphs"]
    assert graph["region_graphs"]["encoding"] == "zlib+base64"
    brief = [r for r in graph["regions"] if "inputs" not in r]
    assert brief and all(set(r) <= {"name", "module", "fingerprint", "mutates"} for r in brief)
    assert {r["fingerprint"] for r in brief} == set(graph["region_kinds"])
    assert expand(written) == latest  # everything is still there
    assert graphdispatch_backend.load_report(path.parent) == latest  # the public reader: the same

    # `report DIR`, `report DIR --regions [PATTERN]`: every region by kind, from the small file
    assert "every call that reached graphdispatch accounted for" in _cli(capsys, "report", str(path.parent))
    regions = latest["graphs"][0]["regions"]
    listing = _cli(capsys, "report", str(path.parent), "--regions")
    assert f"{len(regions)} regions, {len({r['fingerprint'] for r in regions})} kinds" in listing
    fields = _cli(capsys, "report", str(path.parent), "--regions", "transformer_blocks.*.ff")
    ff = next(r for r in regions if r["name"] == "transformer_blocks.0.ff")
    # the pattern names one kind: no pin to copy (a fingerprint covers shapes; artifacts/scaffold.py)
    assert '"region": {"module": "transformer_blocks.*.ff"}' in fields and '"signature"' in fields

    # `artifacts scaffold` writes the kernel from the compressed region graph; `verify
    # --report` matches the bundle against the file's regions
    bundle = tmp_path / "kernels" / "ff"
    assert "wrote" in _cli(capsys, "artifacts", "scaffold", str(path.parent), "--region", "transformer_blocks.*.ff",
                           str(bundle))
    manifest = verify_bundle(bundle).manifest
    assert manifest.fingerprint is None and ff["fingerprint"] in (bundle / "kernel.py").read_text()
    assert "torch.ops.aten." in (bundle / "kernel.py").read_text()
    assert "ff  ok" in _cli(capsys, "artifacts", "verify", str(tmp_path / "kernels"), "--report", str(path.parent))


def test_identical_blocks_add_a_brief_entry_per_region(tmp_path):
    """40 identical blocks: 160 regions of 4 kinds; each region past the first blocks costs
    its name, module and fingerprint, a line of the file."""
    sizes = {}
    for depth in (4, 40):
        graphdispatch_backend.reset()
        torch._dynamo.reset()
        latest = _compile(Stack(depth=depth, dim=8), [{"x": torch.randn(2, 8)}], tmp_path / str(depth))
        text = (tmp_path / str(depth) / "dispatch.json").read_text("utf-8")
        assert expand(json.loads(text)) == latest
        sizes[depth] = len(text)
    per_region = (sizes[40] - sizes[4]) / (36 * 4)
    assert per_region < 150 and sizes[40] < 30 * KB, sizes


# -- the shape, on a record made by hand --------------------------------------------------
def _region(name: str, fp: str, **fields: Any) -> dict[str, Any]:
    module, _, instance = name.partition("#")
    spec = {"name": "input0", "shape": [2, 8], "stride": [8, 1], "dtype": "float32", "device": "cpu"}
    entry = {"name": name, "module": module, "instance": int(instance or 0), "class": "Mlp", "fingerprint": fp,
             "inputs": [spec], "sizes": [], "outputs": [{**spec, "name": "output0"}], "nodes": 3,
             "ops": {"aten::relu.default": 1}, "convex": True, "deterministic": True, "mutates": [],
             "artifact": None, "rejections": []}
    return {**entry, **fields}


def _session() -> SessionReport:
    report = SessionReport(options={"timing": "off"})
    record = report.new_graph()
    a, b = "a" * 32, "b" * 32
    record.regions = [
        _region("blocks.0.mlp", a, artifact="mlp"),  # served: whole
        _region("blocks.1.mlp", a, rejections=[{"artifact": "mlp", "reason": "signature", "detail": "dtype"}]),
        _region("blocks.2.mlp", a),  # brief
        _region("blocks.2.mlp#1", a),  # brief: its instance is in its name
        _region("blocks.3.mlp", a, **{"class": "OtherMlp"}),  # another class of the same graph: whole
        _region("cache", b, mutates=["input0"]),  # brief, and says it writes in place
        _region("blocks.4.mlp", a),  # exported: whole
    ]
    record.export = [{"region": "blocks.4.mlp", "shape_key": 0, "status": "exported"},
                     {"region": "blocks.2.mlp", "shape_key": 0, "status": "same_as"}]
    record.region_graphs = {a: {"inputs": ["input0"], "nodes": [{"name": "relu", "target": "aten.relu.default",
                                                                   "args": [{"input": 0}], "kwargs": {}}],
                                "outputs": [{"node": 0}]}}
    return report


def test_brief_entries_and_region_kinds_give_every_entry_back(tmp_path):
    report = _session()
    before = _plain(report.to_dict())
    written = json.loads(report.write(tmp_path).read_text())
    graph = written["graphs"][0]
    brief = {r["name"]: r for r in graph["regions"] if "inputs" not in r}
    assert sorted(brief) == ["blocks.2.mlp", "blocks.2.mlp#1", "cache"]
    assert brief["cache"]["mutates"] == ["input0"] and "mutates" not in brief["blocks.2.mlp"]
    assert set(graph["region_kinds"]) == {"a" * 32, "b" * 32}
    assert set(graph["region_kinds"]["a" * 32]) == set(KIND_KEYS)
    assert graph["region_graphs"]["kinds"] == 1 and graph["region_graphs"]["encoding"] == "zlib+base64"
    assert expand(written) == before
    assert expand(before) == before  # a whole report (schema 1, latest_report()) is left as it is


def test_a_retired_graph_writes_the_same_file(tmp_path):
    """A graph whose compiled callable is gone keeps its region detail compressed in memory
    (GraphRecord.retire): the file it writes is the one it wrote alive."""
    report = _session()
    alive = report.write(tmp_path / "alive").read_text()
    (record,) = report.graphs
    record.retire()
    assert record.regions == [] and record.region_graphs == {}
    assert report.write(tmp_path / "gone").read_text() == alive


def test_a_schema_1_report_still_renders(tmp_path, capsys):
    whole = {**_plain(_session().to_dict()), "schema_version": 1}
    (tmp_path / "dispatch.json").write_text(json.dumps(whole, indent=2))
    assert "graph_0 blocks.1.mlp x mlp: signature: dtype" in _cli(capsys, "report", str(tmp_path))
    assert "7 regions, 3 kinds" in _cli(capsys, "report", str(tmp_path), "--regions")


def test_load_report_gives_every_region_entry_whole_without_torch(tmp_path):
    """`graphdispatch_backend.load_report(dir)` is what `latest_report()` was in the process
    that wrote the directory, brief entries made whole; it imports no torch (a script
    reading reports after a run need not pay for it)."""
    report = _session()
    before = _plain(report.to_dict())
    report.write(tmp_path)
    loaded = graphdispatch_backend.load_report(tmp_path)
    assert loaded == before
    assert all("inputs" in r and "ops" in r for r in loaded["graphs"][0]["regions"])
    script = ("import sys, graphdispatch_backend as g; r = g.load_report(sys.argv[1]); "
              "assert 'torch' not in sys.modules; print(len(r['graphs'][0]['regions']))")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7"


@pytest.mark.parametrize("case", ["missing", "a_file", "empty", "not_json"])
def test_load_report_says_why_a_directory_holds_no_report(tmp_path, case):
    folder = tmp_path / "gd_out"
    if case == "a_file":
        folder.write_text("x")
    elif case != "missing":
        folder.mkdir()
    if case == "not_json":
        (folder / "dispatch.json").write_text("{")
    with pytest.raises(graphdispatch_backend.ReportError) as err:
        graphdispatch_backend.load_report(folder)
    assert isinstance(err.value, graphdispatch_backend.GraphDispatchError)
    assert {"missing": "does not exist", "a_file": "is not a directory", "empty": "no dispatch.json",
            "not_json": "is not valid JSON"}[case] in str(err.value)


def test_region_graphs_that_do_not_decode_are_a_clear_error(tmp_path, capsys):
    written = json.loads(_session().write(tmp_path).read_text())
    written["graphs"][0]["region_graphs"]["data"] = "bm90IHpsaWI="  # base64, not zlib
    (tmp_path / "dispatch.json").write_text(json.dumps(written))
    assert main(["report", str(tmp_path)]) == 2
    assert "holds region detail that does not decode" in capsys.readouterr().err
