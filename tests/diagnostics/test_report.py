"""dispatch.json: the DESIGN section 7 keys, when it is written (each compile, flush, exit),
metadata only, atomic writes, call accounting in every fallback scenario this machine can
produce, and per-artifact attribution."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import graphdispatch_backend
import graphdispatch_backend.backend as backend_module
from graphdispatch_backend.diagnostics.report_file import write_json_atomic
from graphdispatch_backend.diagnostics.session_report import SessionReport
from graphdispatch_backend.passes import PIPELINE
from graphdispatch_backend.passes import run_pipeline as real_run_pipeline
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine

EMULATE = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1}


def _run(model, options, calls=4, batch=4, dynamic=None, grad=False):
    compiled = torch.compile(model, backend="graphdispatch", options=options, dynamic=dynamic)
    outs = []
    with torch.set_grad_enabled(grad):
        for i in range(calls):
            x = torch.randn(batch if isinstance(batch, int) else batch[i], 8)
            out = compiled(x)
            torch.testing.assert_close(out, model(x), rtol=0, atol=0)  # every fallback is still right
            outs.append(out)
    return graphdispatch_backend.latest_report()


def _graph(report):
    (graph,) = report["graphs"]
    return graph


# -- contents ------------------------------------------------------------------------------
def test_dispatch_json_holds_every_contract_key(net, make_bundle, tmp_path, read_json, accounted):
    root = make_bundle("mlp-exact", "exact")
    _run(net, {**EMULATE, "artifacts": str(root), "report_dir": str(tmp_path)})
    graphdispatch_backend.flush()
    report = read_json(tmp_path / "dispatch.json")
    assert report["schema_version"] == 2
    assert report["options"]["cuda_graphs"] == "emulate" and report["options"]["artifacts"] == [str(root)]
    registry = report["registry"]
    assert {"roots", "loaded", "enabled_filter", "excluded_ids", "errors"} <= set(registry)
    assert registry["roots"] == [str(root)] and registry["loaded"] == ["mlp-exact"]
    assert registry["enabled_filter"] is None and registry["excluded_ids"] == [] and registry["errors"] == []
    graph = _graph(report)
    assert {"calls", "stripped_assertions", "regions", "substitutions", "cuda_graph"} <= set(graph)
    assert graph["calls"] == 4 and isinstance(graph["stripped_assertions"], int)
    region = next(r for r in graph["regions"] if r["name"] == "blocks.0.mlp")
    assert {"module", "class", "fingerprint", "inputs", "outputs", "nodes", "ops"} <= set(region)
    assert region["class"] == "Mlp" and re.fullmatch(r"[0-9a-f]{32}", region["fingerprint"])
    assert [i["name"] for i in region["inputs"]] == ["fc1.weight", "fc1.bias", "input0", "fc2.weight", "fc2.bias"]
    assert {"name", "shape", "stride", "dtype", "device"} <= set(region["inputs"][0])
    subs = graph["substitutions"]
    assert [(s["region"], s["artifact"]) for s in subs] == [("blocks.0.mlp", "mlp-exact"),
                                                            ("blocks.1.mlp", "mlp-exact")]
    for sub in subs:
        assert {"region", "artifact", "parity", "calls", "demoted"} <= set(sub)
        assert sub["parity"] == "passed" and sub["calls"] > 0 and sub["demoted"] is False
    cg = graph["cuda_graph"]
    assert {"state", "captures", "replays", "eager_calls", "declines"} <= set(cg)
    assert cg["state"] == "verified" and cg["captures"] == 1 and cg["replays"] == 2 and cg["declines"] == {}
    accounted(report)


def test_written_after_each_compile_on_flush_and_not_between(net, tmp_path, read_json):
    path = tmp_path / "dispatch.json"
    compiled = torch.compile(net, backend="graphdispatch", options={**EMULATE, "report_dir": str(tmp_path)})
    with torch.no_grad():
        compiled(torch.randn(4, 8))
        # written when the graph compiled, before its first call ran
        assert [g["calls"] for g in read_json(path)["graphs"]] == [0]
        compiled(torch.randn(4, 8))
        assert [g["calls"] for g in read_json(path)["graphs"]] == [0]  # calls do not write
        graphdispatch_backend.flush()
        assert [g["calls"] for g in read_json(path)["graphs"]] == [2]
        compiled(torch.randn(3, 8))  # a new shape: Dynamo compiles a second graph, and it is written
    assert [g["calls"] for g in read_json(path)["graphs"]] == [2, 0]


def test_written_at_process_exit_with_final_counts(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
        compiled = torch.compile(model, backend="graphdispatch",
                                 options={{"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1,
                                          "report_dir": {str(tmp_path)!r}}})
        with torch.no_grad():
            for _ in range(5):
                compiled(torch.randn(2, 8))
        # no flush(): the report must still hold these five calls
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "dispatch.json").read_text())
    graph = _graph(report)
    assert graph["calls"] == 5
    assert graph["cuda_graph"]["replays"] == 3 and graph["cuda_graph"]["eager_calls"] == 2
    assert json.loads((tmp_path / "timing.json").read_text())["timing_schema_version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dispatch.json", "timing.json"]


def _floats(value, path=""):
    """Every (path, list) in the JSON whose items are all floats: what a dumped tensor looks like."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _floats(v, f"{path}.{k}")
    elif isinstance(value, list):
        if len(value) > 1 and all(isinstance(v, float) for v in value):
            yield path, value
        for i, v in enumerate(value):
            yield from _floats(v, f"{path}[{i}]")


def test_metadata_only_no_tensor_value_reaches_the_file(net, make_bundle, tmp_path):
    needle = 4321.0625  # exact in float32, so a dumped weight would print these digits
    with torch.no_grad():  # fc1 stays random so the GELU inputs stay small and the tanh kernel fails parity
        for block in net.blocks:
            block.mlp.fc2.weight.fill_(needle)
            block.mlp.fc2.bias.fill_(needle)
    # Guard: the scan below finds the value when a tensor does reach a record.
    leaked = tmp_path / "leak.json"
    write_json_atomic(leaked, {"x": [needle] * 3})
    assert "4321.06" in leaked.read_text() and list(_floats(json.loads(leaked.read_text())))
    root = make_bundle("mlp-off", "off")  # a parity failure: its detail is in the report
    compiled = torch.compile(net, backend="graphdispatch",
                             options={**EMULATE, "artifacts": str(root), "report_dir": str(tmp_path / "r")})
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(4, 8))
    graphdispatch_backend.flush()
    report = graphdispatch_backend.latest_report()
    assert report["artifacts"]["mlp-off"]["demotions"], "the scenario must include a parity detail"
    for name in ("dispatch.json", "timing.json"):
        text = (tmp_path / "r" / name).read_text()
        assert "4321.06" not in text and "4.32106" not in text, name
        assert "tensor(" not in text, name
        assert list(_floats(json.loads(text))) == [], name


def test_a_tensor_that_reaches_a_record_is_written_as_metadata(tmp_path):
    report = SessionReport(options={"timing": "off"})
    record = report.new_graph()
    record.export.append({"example": torch.full((2, 3), 4321.0625)})  # a bug elsewhere must not leak values
    path = report.write(tmp_path)
    text = path.read_text()
    assert "4321.06" not in text
    assert json.loads(text)["graphs"][0]["export"] == [{"example": "Tensor[2, 3] float32 cpu"}]


def test_written_atomically_a_reader_never_sees_a_partial_file(net, tmp_path, monkeypatch, read_json):
    seen = []
    real_replace = os.replace

    def checked_replace(src, dst):
        src, dst = Path(src), Path(dst)
        assert src.parent == dst.parent  # same folder: the replace is atomic on one file system
        data = read_json(src)  # complete JSON before it takes the file's name
        seen.append((dst.name, data.get("schema_version", data.get("timing_schema_version"))))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", checked_replace)
    _run(net, {**EMULATE, "report_dir": str(tmp_path)}, calls=2)
    graphdispatch_backend.flush()
    assert ("dispatch.json", 2) in seen and ("timing.json", 1) in seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dispatch.json", "timing.json"]  # no temp file left


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "dispatch.json"
    write_json_atomic(path, {"schema_version": 1, "graphs": []})

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError):
        write_json_atomic(path, {"schema_version": 1, "graphs": [{"name": "graph_0"}]})
    assert json.loads(path.read_text()) == {"schema_version": 1, "graphs": []}
    assert [p.name for p in tmp_path.iterdir()] == ["dispatch.json"]


# -- every fallback adds up and is named -------------------------------------------------------
def test_backend_error_runs_the_graph_eager_counted_and_named(net, monkeypatch, tmp_path, read_json, accounted):
    def broken_pass(gm, ctx):
        raise RuntimeError("injected pass failure")

    broken_pass.__name__ = "broken_pass"
    monkeypatch.setattr(backend_module, "run_pipeline",
                        lambda gm, ctx: real_run_pipeline(gm, ctx, (*PIPELINE[:1], broken_pass, *PIPELINE[1:])))
    report = _run(net, {**EMULATE, "report_dir": str(tmp_path)}, calls=3)
    accounted(report)
    graph = _graph(report)
    assert graph["kind"] == "fallback"
    assert "broken_pass" in graph["error"] and "injected pass failure" in graph["error"]
    assert graph["cuda_graph"]["eager_by_reason"] == {"backend_error": 3}
    assert graph["cuda_graph"]["declines"] == {"backend_error": 1}
    assert "injected pass failure" in graph["cuda_graph"]["decline_details"]["backend_error"]
    assert read_json(tmp_path / "dispatch.json")["graphs"][0]["kind"] == "fallback"  # written despite the error


def test_contract_mismatch_runs_native_counted_and_named(accounted):
    # A caller that breaks what the graph was traced for (Dynamo's guards skipped): the
    # backend's callable is driven directly with a batch of another size.
    from graphdispatch_backend.backend import graphdispatch_backend as gd_backend

    kept = []

    def keep(gm, example_inputs):
        kept.append(gd_backend(gm, example_inputs, options=EMULATE))
        return kept[-1]

    def f(x):
        return torch.relu(x) * 2

    with torch.no_grad():
        torch.compile(f, backend=keep)(torch.randn(4, 8))
        x = torch.randn(3, 8)
        (out,) = kept[0](x)
    assert torch.equal(out, f(x))
    report = graphdispatch_backend.latest_report()
    accounted(report)
    graph = _graph(report)
    assert graph["cuda_graph"]["eager_by_reason"]["contract_mismatch"] == 1
    assert graph["contract_mismatches"] == 1
    assert "expected 4 at dim 0" in graph["contract_detail"]


def test_autograd_graph_counts_its_forward_and_its_backward(accounted):
    """Forward calls are the graph's calls; backward runs have their own record, the
    lowering check's among them (`checks`), accounted the same way."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    compiled = torch.compile(model, backend="graphdispatch", options=EMULATE)
    for _ in range(4):
        compiled(torch.randn(4, 8)).sum().backward()
    report = graphdispatch_backend.latest_report()
    accounted(report)
    graph = _graph(report)
    assert graph["kind"] == "autograd" and graph["calls"] == 4
    assert graph["cuda_graph"]["eager_by_reason"] == {"warmup": 1, "verifying": 1}
    assert graph["cuda_graph"]["replays"] == 2 and graph["lowering_check"] == {"checked": 3, "status": "bitwise"}
    backward = graph["backward"]
    assert backward["name"] == "graph_0.backward" and backward["kind"] == "backward"
    assert backward["calls"] == 4 + 3 and backward["checks"] == 3  # the user's 4, the check's 3
    assert backward["cuda_graph"]["replays"] > 0 and backward["cuda_graph"]["declines"] == {}
    totals = report["totals"]
    assert totals["backward_calls"] == 7 and totals["calls"] == 4


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.mark.parametrize(("cuda_graphs", "reason"), [("auto", "not_cuda"), (False, "disabled"),
                                                     pytest.param(True, "no_cuda_device", marks=CPU_ONLY)])
def test_graph_level_declines_are_counted_and_named(net, cuda_graphs, reason, accounted):
    report = _run(net, {"cuda_graphs": cuda_graphs}, calls=3)
    accounted(report)
    cg = _graph(report)["cuda_graph"]
    assert cg["eager_by_reason"] == {reason: 3}
    assert cg["declines"] == {reason: 1} and cg["decline_details"][reason]
    assert cg["state"] == "eager" and cg["replays"] == 0


def test_a_declined_lowering_says_eager_in_its_cuda_graph_and_fusion_records(accounted):
    """A graph whose lowering was declined (here the lowered graph's output strides differ
    from eager's on size-1 dimensions) runs as the Dynamo graph: its cuda_graph state said
    `warming`, reason null, and its fusion `fused`, while no call ran either."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d((1, 1))).eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate", "fuse": True,
                                                                      "cache_dir": False})
    with torch.no_grad():
        for _ in range(4):
            compiled(torch.randn(2, 3, 2, 2).contiguous(memory_format=torch.channels_last))
    report = graphdispatch_backend.latest_report()
    accounted(report)
    g = _graph(report)
    assert g["lowering_check"]["status"] == "lowering_mismatch"
    assert g["cuda_graph"]["state"] == "eager" and g["cuda_graph"]["reason"] == "lowering_mismatch"
    assert g["fusion"]["status"] == "fused" and g["fusion"]["unused"] == "lowering_mismatch"


def test_parity_demotion_is_counted_named_and_the_graph_still_replays(net, make_bundle, accounted):
    root = make_bundle("mlp-off", "off")
    report = _run(net, {**EMULATE, "artifacts": str(root)}, calls=4)
    accounted(report)
    graph = _graph(report)
    assert graph["cuda_graph"]["replays"] == 2  # a demoted artifact does not cost the graph its capture
    caught, kin = graph["substitutions"]  # the kernel caught at blocks.0.mlp, so demoted at blocks.1.mlp
    assert caught["demoted"] and caught["reason"] == "parity" and caught["parity"] == "failed"
    assert caught["max_abs_diff"] > 0 and caught["first_mismatch_index"] is not None
    assert "bits differ" in caught["detail"]
    assert kin["demoted"] and kin["reason"] == "demoted_elsewhere"
    assert kin["detail"].startswith("its kernel was demoted at region blocks.0.mlp (parity): ")
    for sub in (caught, kin):
        assert sub["calls"] == 0 and sub["native_calls"] > 0


def test_demotion_after_capture_recaptures_counted_and_named(net, make_bundle, accounted):
    # Passes parity, serves a few calls, then raises: demoted mid-run, under a captured graph.
    root = make_bundle("mlp-flaky", "flaky", module="blocks.0.mlp", fail_after=3)
    report = _run(net, {**EMULATE, "artifacts": str(root)}, calls=8)
    accounted(report)
    graph = _graph(report)
    (sub,) = graph["substitutions"]
    assert sub["parity"] == "passed" and sub["demoted"] and sub["reason"] == "raised"
    # it ran 3 times before raising: the gate call (served), the capture's recording and the
    # verification replay (neither serves a call), so 1 served call and no served replay
    assert "kernel fault" in sub["detail"] and sub["calls"] == 1 and sub["replays"] == 0
    cg = graph["cuda_graph"]
    # the capture held the artifact, which was demoted while that capture was being verified:
    # the graph is captured again without it (no decline), and the run goes on replaying
    assert cg["recaptures"] >= 1 and cg["declines"] == {} and cg["replays"] >= 1
    attribution = report["artifacts"]["mlp-flaky"]
    assert attribution["status"] == "demoted"
    assert attribution["demotions"] == [{"graph": "graph_0", "region": "blocks.0.mlp", "reason": "raised",
                                         "detail": sub["detail"]}]


def test_capture_failure_declines_counted_and_named(net, monkeypatch, accounted):
    def refuse(self, fn, args, device="cpu", **engine_kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(HostReplayEngine, "capture", refuse)
    report = _run(net, EMULATE, calls=4)
    accounted(report)
    cg = _graph(report)["cuda_graph"]
    assert cg["declines"] == {"capture_failed": 1}
    assert cg["eager_by_reason"].get("capture_failed") == 3 and cg["replays"] == 0
    assert "stream is capturing" in cg["decline_details"]["capture_failed"]


def test_max_captures_evicts_the_least_recently_used_key_and_counts_it(net, accounted):
    """warmup=1, verify_inputs=1: a key captures on its 2nd call and replays from its 3rd."""
    report = _run(net, {**EMULATE, "max_captures": 1}, calls=9, batch=[2, 2, 2, 3, 3, 3, 2, 2, 2], dynamic=True)
    accounted(report)
    graph = _graph(report)
    cg = graph["cuda_graph"]
    assert cg["captures"] == 3 and cg["declines"] == {}
    assert cg["replays"] == 3  # 2 on its 3rd call, 3 on its 3rd, 2 again on its 3rd after coming back
    assert sum(p["cuda_graph"]["evictions"] for p in graph["pieces"] if "cuda_graph" in p) == 2


def test_keys_past_the_warming_bound_forget_the_oldest_warming_key(net, accounted):
    """max_captures=1 keeps at most 8 keys warming: a 9th forgets the least recently used."""
    report = _run(net, {**EMULATE, "max_captures": 1}, calls=10, batch=list(range(2, 11)) + [2], dynamic=True)
    accounted(report)
    graph = _graph(report)
    cg = graph["cuda_graph"]
    assert cg["declines"] == {} and cg["captures"] == 0  # batch 2 was forgotten: it warms up again
    assert cg["eager_by_reason"] == {"warmup": 10}


def test_speed_gate_demotion_is_counted_named_and_timed(net, make_bundle, accounted):
    root = make_bundle("mlp-slow", "slow", module="blocks.0.mlp")
    report = _run(net, {**EMULATE, "artifacts": str(root), "speed_gate": True}, calls=3)
    accounted(report)
    (sub,) = _graph(report)["substitutions"]
    assert sub["demoted"] and sub["reason"] == "slower"
    (speed,) = report["artifacts"]["mlp-slow"]["speed"]
    assert speed["region"] == "blocks.0.mlp"
    assert speed["artifact_ms"] > 0 and speed["native_ms"] > 0
    assert speed["speedup"] == pytest.approx(speed["native_ms"] / speed["artifact_ms"])
    assert report["artifacts"]["mlp-slow"]["status"] == "demoted"


# -- attribution ---------------------------------------------------------------------------------
def test_per_artifact_attribution(net, make_bundle, mlp_inputs, tmp_path, read_json):
    make_bundle("mlp-exact", "exact", module="blocks.0.mlp")
    make_bundle("mlp-off", "off", module="blocks.1.mlp")
    wrong = [dict(i, shape=[32, 8]) if i["name"] == "fc1.weight" else i for i in mlp_inputs]
    make_bundle("mlp-wide", "exact", inputs=wrong)  # right pattern, wrong signature
    make_bundle("mlp-nowhere", "exact", module="decoder.*")  # a pattern that matches no region
    root = make_bundle("mlp-excluded", "exact", module="blocks.0.mlp")  # verified, left out by `enable`
    enable = ["mlp-exact", "mlp-off", "mlp-wide", "mlp-nowhere"]
    _run(net, {**EMULATE, "artifacts": str(root), "enable": enable, "report_dir": str(tmp_path)}, calls=4)
    graphdispatch_backend.flush()
    report = read_json(tmp_path / "dispatch.json")
    assert report["registry"]["excluded_ids"] == ["mlp-excluded"]
    assert report["registry"]["enabled_filter"] == sorted(enable)
    arts = report["artifacts"]
    assert set(arts) == {*enable, "mlp-excluded"}

    exact = arts["mlp-exact"]
    assert exact["status"] == "serving" and exact["enabled"] is True
    assert exact["regions_matched"] == ["graph_0:blocks.0.mlp"]
    assert exact["calls"] > 0 and exact["native_calls"] == 0
    assert exact["parity"] == {"passed": 1} and exact["demotions"] == []

    off = arts["mlp-off"]
    assert off["status"] == "demoted" and off["regions_matched"] == ["graph_0:blocks.1.mlp"]
    assert off["calls"] == 0 and off["native_calls"] > 0 and off["parity"] == {"failed": 1}
    (demotion,) = off["demotions"]
    assert demotion["region"] == "blocks.1.mlp" and demotion["reason"] == "parity"
    assert "bits differ" in demotion["detail"]

    wide = arts["mlp-wide"]
    assert wide["status"] == "rejected" and wide["regions_matched"] == [] and wide["calls"] == 0
    assert wide["rejections"]["signature"] == 2  # both blocks' MLPs, each with a reason in its region entry
    details = [j["detail"] for r in report["graphs"][0]["regions"] for j in r.get("rejections", [])
               if j["artifact"] == "mlp-wide"]
    assert len(details) == 2 and all("fc1.weight" in d and "[32, 8]" in d for d in details)

    assert arts["mlp-nowhere"]["status"] == "unmatched"
    assert set(arts["mlp-nowhere"]["rejections"]) <= {"module"}

    excluded = arts["mlp-excluded"]
    assert excluded["enabled"] is False and excluded["status"] == "not_enabled" and excluded["calls"] == 0
    assert excluded["rejections"].get("not_enabled", 0) >= 1

    assert report["totals"]["substitutions"] == 2 and report["totals"]["demotions"] == 1


def test_calls_dynamo_runs_past_its_recompile_limit_are_said_missing(tmp_path):
    """Past `recompile_limit` Dynamo runs a function without itself, outside every backend:
    those calls reach no report, which said "every call accounted for" (a trial's static-cache
    server held 60 of 192 forward calls). The report counts the hits since its session began
    and the rendered summary says what they mean."""
    from graphdispatch_backend.diagnostics.render import render

    graphdispatch_backend.reset()
    torch._dynamo.reset()

    def f(x):
        return x * 2 + 1

    compiled = torch.compile(f, backend="graphdispatch", dynamic=False, options={"report_dir": str(tmp_path)})
    with torch._dynamo.config.patch(recompile_limit=2, automatic_dynamic_shapes=False):
        for n in range(2, 7):  # a graph per size: the third size hits the limit
            assert torch.equal(compiled(torch.ones(n)), f(torch.ones(n)))
    report = graphdispatch_backend.latest_report()
    assert len(report["graphs"]) == 2 and report["totals"]["dynamo_recompile_limit_hits"] == 1, report["totals"]
    assert "Dynamo hit its recompile_limit 1 time in this process" in render(report)
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="graphdispatch", options={"report_dir": str(tmp_path)})
    compiled(torch.ones(3))
    assert graphdispatch_backend.latest_report()["totals"]["dynamo_recompile_limit_hits"] == 0  # a new session's own
