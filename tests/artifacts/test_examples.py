"""The shipped example bundles and the demo: one bundle passes bitwise parity on every
block, the other fails it on purpose, and the demo's output is still bitwise equal to eager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphdispatch_backend.__main__ import main
from graphdispatch_backend.artifacts.bundle import verify_bundle
from graphdispatch_backend.examples import demo

EXAMPLES = Path(demo.__file__).with_name("bundles")


@pytest.mark.parametrize("name, module", [("block-mlp", "blocks.*.mlp"), ("temb-mlp-gelu-tanh", "t_embedder.mlp")])
def test_example_bundle_verifies(name, module):
    bundle = verify_bundle(EXAMPLES / name)
    assert bundle.manifest.id == name and bundle.manifest.module == module
    assert bundle.manifest.parity.mode == "bitwise"


def test_examples_root_verifies_from_the_command_line(capsys):
    assert main(["artifacts", "verify", str(EXAMPLES)]) == 0
    out = capsys.readouterr().out
    assert "block-mlp" in out and "temb-mlp-gelu-tanh" in out and "rejected" not in out


def test_demo_shows_both_verdicts_and_stays_bitwise_equal(tmp_path, capsys):
    steps = 4  # warmup, capture (verified in that call), 2 replays
    assert demo.run(str(tmp_path / "report"), steps=steps) == 0
    out = capsys.readouterr().out
    assert f"bitwise equal to eager on all {steps} steps: YES" in out
    assert "DEMOTED" in out

    report = json.loads((tmp_path / "report" / "dispatch.json").read_text())
    assert report["registry"]["loaded"] == ["block-mlp", "temb-mlp-gelu-tanh"] and report["registry"]["errors"] == []
    (graph,) = report["graphs"]
    subs = {s["region"]: s for s in graph["substitutions"]}
    assert sorted(subs) == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp", "blocks.3.mlp", "t_embedder.mlp"]
    for i in range(4):
        sub = subs[f"blocks.{i}.mlp"]
        assert (sub["artifact"], sub["parity"], sub["demoted"]) == ("block-mlp", "passed", False)
        assert (sub["calls"], sub["replays"], sub["native_calls"]) == (2, steps - 2, 0)
    temb = subs["t_embedder.mlp"]
    assert (temb["artifact"], temb["parity"], temb["demoted"], temb["reason"]) == (
        "temb-mlp-gelu-tanh", "failed", True, "parity")
    assert temb["max_abs_diff"] > 0 and temb["first_mismatch_index"] is not None
    # native counts calls the native region answered (eagerly or replayed), never the runs
    # made to check or record, so it is the same under emulate as on a GPU
    assert (temb["calls"], temb["replays"], temb["native_calls"]) == (0, 0, steps)
    assert graph["calls"] == graph["cuda_graph"]["replays"] + graph["cuda_graph"]["eager_calls"]


def test_demo_with_fusion_replays_fused_around_the_artifacts(tmp_path, capsys):
    """`demo --fuse`: Inductor's kernels between the artifacts' calls, captured (the fused
    parts are steps of the host model's tape) and replayed, bitwise."""
    steps = 5
    assert main(["demo", "--fuse", "--steps", str(steps), "--report-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert f"bitwise equal to eager on all {steps} steps: YES" in out and "fusion: fused" in out
    (graph,) = json.loads((tmp_path / "r" / "dispatch.json").read_text())["graphs"]
    assert graph["fusion"]["status"] == "fused" and graph["fusion"]["kernels"] > 0
    assert graph["cuda_graph"]["replays"] == steps - 2 and not graph["cuda_graph"]["declines"]
    assert all(s["replays"] == steps - 2 for s in graph["substitutions"] if s["artifact"] == "block-mlp")


@pytest.mark.parametrize("steps, said", [("0", "must be at least 1, got 0"), ("-3", "must be at least 1"),
                                         ("two", "must be an integer, got 'two'")])
def test_demo_steps_are_validated(capsys, steps, said):
    """Zero steps would compare nothing and still print "bitwise equal: YES"."""
    with pytest.raises(SystemExit) as info:
        main(["demo", "--steps", steps])
    assert info.value.code == 2 and said in capsys.readouterr().err
