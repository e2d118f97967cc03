"""Timing modes through torch.compile: which phases each mode records, where shadow
timings land, that "off" touches no clock, that counters are per session, that notes are
bounded, and that timing.json is written atomically beside dispatch.json."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.diagnostics import timing as timing_module
from graphdispatch_backend.diagnostics.timing import MAX_NOTES, NOTE_CHARS, Timing
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine

EMULATE = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1}


def _run(model, options, calls=4, batch=4):
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(batch, 8)
            assert torch.equal(compiled(x), model(x))  # timing never changes a result
    graphdispatch_backend.flush()
    return graphdispatch_backend.latest_report()


def test_host_mode_times_every_phase_of_an_emulated_replay(net, make_bundle, tmp_path, read_json, accounted):
    root = make_bundle("mlp-exact", "exact")
    report = _run(net, {**EMULATE, "artifacts": str(root), "timing": "host", "report_dir": str(tmp_path / "r")})
    accounted(report)
    timing = read_json(tmp_path / "r" / "timing.json")
    assert timing["mode"] == "host" and timing["synchronized"] is False
    phases = timing["phases"]
    assert {"flatten", "validate", "shape_key", "execute", "copy_in", "replay", "unflatten",
            "artifact_gate"} <= set(phases)
    assert "shadow.native_forward" not in phases
    (graph,) = report["graphs"]
    assert graph["cuda_graph"]["replays"] >= 2, graph["cuda_graph"]  # the replay phases below are real replays
    assert phases["validate"]["calls"] == phases["execute"]["calls"] == graph["calls"] == 4
    assert phases["flatten"]["calls"] == 4  # aot's wrapper, from the backend's callable to the graph
    assert phases["shape_key"]["calls"] == 4  # one runner: one key per call
    # one parity gate per substituted region and shape key
    assert phases["artifact_gate"]["calls"] == len(graph["substitutions"]) == 2
    # every served replay (verification included) copies in, replays and clones out once
    assert phases["copy_in"]["calls"] == phases["replay"]["calls"] == phases["unflatten"]["calls"]
    assert phases["replay"]["calls"] >= graph["cuda_graph"]["replays"]
    for name, phase in phases.items():
        assert phase["total_seconds"] >= 0 and phase["calls"] > 0, name
        assert phase["mean_ms"] == pytest.approx(1e3 * phase["total_seconds"] / phase["calls"]), name


def test_sync_mode_synchronizes_around_phases_and_host_mode_does_not(net, monkeypatch, tmp_path, read_json):
    syncs = []
    monkeypatch.setattr(timing_module, "_sync", lambda: syncs.append(1))
    _run(net, {**EMULATE, "timing": "host", "report_dir": str(tmp_path / "host")}, calls=3)
    assert syncs == []
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    _run(net, {**EMULATE, "timing": "sync", "report_dir": str(tmp_path / "sync")}, calls=3)
    timing = read_json(tmp_path / "sync" / "timing.json")
    assert timing["mode"] == "sync" and timing["synchronized"] is True
    phase_calls = sum(p["calls"] for p in timing["phases"].values())
    assert phase_calls > 0
    # a clock read on each side of every phase, each one after a device synchronize
    assert len(syncs) >= phase_calls + 1


def test_shadow_mode_times_native_on_every_call_and_per_artifact(net, make_bundle, tmp_path, read_json, accounted):
    root = make_bundle("mlp-exact", "exact")
    # eager calls (cuda_graphs off): a captured graph's replay runs no Python, so an artifact
    # is shadowed on eager calls only (here the 3rd and 5th; the 1st is its gate, the 2nd
    # and 4th parity re-checks)
    report = _run(net, {"cuda_graphs": False, "artifacts": str(root), "timing": "shadow",
                        "report_dir": str(tmp_path / "r")}, calls=5)
    accounted(report)
    timing = read_json(tmp_path / "r" / "timing.json")
    assert timing["mode"] == "shadow" and timing["synchronized"] is True
    (graph,) = report["graphs"]
    assert timing["phases"]["shadow.native_forward"]["calls"] == graph["calls"] == 5
    shadow = report["artifacts"]["mlp-exact"]["shadow"]
    assert shadow["calls"] == 2 * len(graph["substitutions"])
    assert shadow["artifact_s"] > 0 and shadow["native_s"] > 0
    assert shadow["speedup"] == pytest.approx(shadow["native_s"] / shadow["artifact_s"])
    assert shadow["artifact_ms_per_call"] == pytest.approx(1e3 * shadow["artifact_s"] / shadow["calls"])
    # the per-region records add up to the artifact's entry
    per_region = [s["shadow"] for s in graph["substitutions"]]
    assert sum(s["calls"] for s in per_region) == shadow["calls"]
    # and they are in the file, not only in memory
    on_disk = read_json(tmp_path / "r" / "dispatch.json")
    assert on_disk["artifacts"]["mlp-exact"]["shadow"]["calls"] == shadow["calls"]


def test_off_records_no_phase_and_reads_no_clock(net, make_bundle, tmp_path, monkeypatch, read_json):
    clock = []
    monkeypatch.setattr(Timing, "now", lambda self: clock.append("now") or 0.0)
    monkeypatch.setattr(Timing, "add", lambda self, phase, seconds: clock.append(phase))
    root = make_bundle("mlp-exact", "exact")
    report = _run(net, {**EMULATE, "artifacts": str(root), "report_dir": str(tmp_path / "r")})
    assert report["graphs"][0]["cuda_graph"]["replays"] >= 2  # the replay path ran, untimed
    assert report["artifacts"]["mlp-exact"]["calls"] > 0  # so did the gate
    assert clock == []
    timing = read_json(tmp_path / "r" / "timing.json")
    assert timing["mode"] == "off" and timing["phases"] == {}


def test_counters_reset_per_session(net, tmp_path, read_json):
    options = {**EMULATE, "timing": "host", "report_dir": str(tmp_path / "a")}
    _run(net, options, calls=3)
    assert read_json(tmp_path / "a" / "timing.json")["phases"]["validate"]["calls"] == 3

    # A new Options value is a new session: its own timing, nothing carried over; the
    # first session keeps counting on its own.
    first = torch.compile(net, backend="graphdispatch", options=options)
    _run(net, {**options, "report_dir": str(tmp_path / "b")}, calls=2)
    with torch.no_grad():
        first(torch.randn(4, 8))
    graphdispatch_backend.flush()
    assert read_json(tmp_path / "b" / "timing.json")["phases"]["validate"]["calls"] == 2
    assert read_json(tmp_path / "a" / "timing.json")["phases"]["validate"]["calls"] == 4

    # reset() forgets every session: the same options start from zero.
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    report = _run(net, options, calls=1)
    assert read_json(tmp_path / "a" / "timing.json")["phases"]["validate"]["calls"] == 1
    assert [g["calls"] for g in report["graphs"]] == [1]


def test_notes_are_bounded_truncated_and_overflow_is_counted():
    timing = Timing("off")  # notes are on in every mode
    for i in range(MAX_NOTES + 72):
        timing.note(f"decline {i}")
    timing.note("decline 0")  # a known note still counts after the cap
    timing.note("x" * (NOTE_CHARS + 50))  # a new one is dropped
    data = timing.to_dict()
    assert len(data["notes"]) == MAX_NOTES == 128
    assert data["notes"]["decline 0"] == 2
    assert data["notes_dropped"] == 73
    assert "decline 200" not in data["notes"]

    long = Timing("host")
    whole = "a" * (NOTE_CHARS - 1) + "z"
    long.note(whole)  # up to NOTE_CHARS, a note is kept whole
    long.note("h" + "y" * (NOTE_CHARS + 50) + "t")
    long.note("h" + "y" * (NOTE_CHARS + 50) + "t")  # the same note, bounded the same way
    notes = long.to_dict()["notes"]
    assert notes[whole] == 1
    (cut,) = [n for n in notes if n != whole]
    assert notes[cut] == 2 and cut.startswith("hy") and cut.endswith("yt") and "[... 52 characters cut ...]" in cut
    assert len(cut) < NOTE_CHARS + 40

    timing.reset()
    assert timing.to_dict()["notes"] == {} and timing.to_dict()["notes_dropped"] == 0


def test_a_decline_is_a_note_in_timing_json(tmp_path, monkeypatch, read_json):
    def refuse(self, fn, args, device="cpu", **engine_kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(HostReplayEngine, "capture", refuse)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    report = _run(model, {**EMULATE, "report_dir": str(tmp_path)}, calls=3)
    assert report["graphs"][0]["cuda_graph"]["declines"] == {"capture_failed": 1}
    notes = read_json(tmp_path / "timing.json")["notes"]
    assert any("cuda_graph_declined" in n and "capture_failed" in n and "stream is capturing" in n
               for n in notes), notes


def test_timing_json_is_written_atomically_beside_dispatch_json(net, tmp_path, monkeypatch, read_json):
    replaced = []
    real_replace = os.replace

    def checked_replace(src, dst):
        if Path(dst).name == "timing.json":
            data = read_json(src)  # the temp file is complete JSON before it becomes timing.json
            assert data["timing_schema_version"] == 1
            replaced.append(Path(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", checked_replace)
    _run(net, {**EMULATE, "timing": "host", "report_dir": str(tmp_path / "r")}, calls=2)
    assert replaced and all(p == tmp_path / "r" / "timing.json" for p in replaced)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["dispatch.json", "timing.json"]
    timing = read_json(tmp_path / "r" / "timing.json")
    assert set(timing) == {"timing_schema_version", "mode", "synchronized", "phases", "notes", "notes_dropped"}
    assert timing["timing_schema_version"] == 1


@pytest.mark.cuda
def test_sync_mode_times_real_cuda_graph_replays(tmp_path, read_json, accounted):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).cuda().eval()
    options = {"cuda_graphs": True, "warmup": 1, "verify_inputs": 1, "timing": "sync", "report_dir": str(tmp_path)}
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(8, 64, device="cuda")
            assert torch.equal(compiled(x), model(x))
    graphdispatch_backend.flush()
    report = graphdispatch_backend.latest_report()
    accounted(report)
    cg = report["graphs"][0]["cuda_graph"]
    assert cg["mode"] == "cuda" and cg["state"] == "verified" and cg["replays"] >= 2, cg
    timing = read_json(tmp_path / "timing.json")
    assert timing["mode"] == "sync" and timing["synchronized"] is True
    assert timing["phases"]["replay"]["calls"] >= cg["replays"]
    assert timing["phases"]["validate"]["calls"] == report["graphs"][0]["calls"] == 5
