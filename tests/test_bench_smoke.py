"""Every benchmark script in bench/ runs, at tiny sizes: what `python bench/run.py --smoke` runs.

The benchmarks reach into the package's internals (runtime objects built by hand, report
fields, a stand-in replay engine, patched lowering), and no other test runs them: without
this one, an interface change breaks a benchmark silently, and the breakage is found weeks
later, when someone needs a figure. The smoke mode runs every section and variant of every
script once at tiny sizes, bounded by work (tiny models, a few calls; the subprocess's
timeout is only a hang guard far above), and judges no figure: only that each script ran to
the end and wrote its JSON (bench/results/smoke/).
Not marked slow on purpose: CI must run it. One test per script, so that xdist's workers
share them (the set in one test held one worker for 3 minutes); `scale.py`, the longest
(76-120 s on 2 cores, most of it its `server` section), one test per section (its own
`--only`), so that it is not one long tail at the end of the suite. Each script is run as
run.py runs it (its smoke flag, `--table-only`), not through run.py, whose own process
imports torch for its summary (2.5 s of CPU per script); one test runs run.py itself. Each
is forked from a server that imported torch (tests/forked.py; the file's 21 tests took 148 s
on 2 workers started as new processes, 119 s forked, 2026-12-07)."""

from __future__ import annotations

import ast
import json
import os
import time
from pathlib import Path
from typing import Any

import forked
import pytest

ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 80
# a hang guard, not a time limit: a smoke is bounded by its work (tiny sizes, few calls), and a
# loaded 2-core machine may take many times its quiet minutes (scale's: 2 quiet, 8 at load 14)
HANG_GUARD_S = 20 * 60


def _scripts() -> list[str]:
    """The scripts `bench/run.py --smoke` runs (its BENCHMARKS and GPU_SMOKE), read from its
    source: importing it would import the benches' helpers into the test process."""
    return [*_literal("run", "BENCHMARKS"), *_literal("run", "GPU_SMOKE")]


def _literal(script: str, name: str) -> Any:
    """A module-level constant of bench/SCRIPT.py, read from its source (not imported)."""
    for node in ast.parse((ROOT / "bench" / f"{script}.py").read_text("utf-8")).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value)
    raise LookupError(f"bench/{script}.py has no {name}")


SPLIT = {"scale": _literal("scale", "SECTIONS")}  # scripts run one section per test
GPU_SMOKE = _literal("run", "GPU_SMOKE")  # GPU scripts: their smoke flag and the JSON it writes


def _commands() -> list[Any]:
    """(command, the JSON it writes) per test: a script's smoke as run.py runs it, or for
    a script in SPLIT, one section of it at a time."""
    out = []
    for script in _scripts():
        flag = "--cpu-smoke" if script in GPU_SMOKE else "--smoke"
        command = [f"bench/{script}.py", flag, "--table-only"]
        written = f"{GPU_SMOKE.get(script, script)}.json"
        if script not in SPLIT:
            out.append(pytest.param(command, written, id=script))
            continue
        out += [pytest.param([*command, "--only", section], written, id=f"{script}-{section}")
                for section in SPLIT[script]]
    return out


def _run(command: list[str], log: Path) -> None:
    """The script run as `python *command` would run it, forked from a server that imported
    torch (tests/forked.py: 3 s of CPU less a script; its children start as they always do)."""
    code, output = forked.run_script(command, ROOT, {**os.environ, "PYTHONWARNINGS": "ignore"}, log, HANG_GUARD_S)
    tail = "\n".join(output.strip().splitlines()[-TAIL_LINES:])
    assert code == 0, f"{' '.join(command)} exited {code}; last lines:\n{tail}"


def test_the_set_is_every_script_of_bench() -> None:
    helpers = {"common", "run", "serving"}  # imported by the scripts, not scripts of their own
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")} - helpers
    assert set(_scripts()) == scripts


@pytest.mark.parametrize(("command", "written"), _commands())
def test_each_bench_runs_in_smoke_mode(command: list[str], written: str, tmp_path: Path) -> None:
    """One script (or one section of a SPLIT script) per test: xdist spreads them. It exits
    0 and writes its JSON (sections of one script write the same file: written since the
    test started)."""
    result = ROOT / "bench" / "results" / "smoke" / written
    start = time.time()
    _run(command, tmp_path / "log")
    assert result.exists() and result.stat().st_mtime >= start - 1, f"{' '.join(command)} wrote no {written}"


def test_run_py_runs_a_script_and_summarises_it(tmp_path: Path) -> None:
    """run.py's own plumbing (its subprocess, the JSON it reads back, the summary), on the
    cheapest script."""
    _run(["bench/run.py", "--smoke", "--only", "emulate"], tmp_path / "log")
    summary = json.loads((ROOT / "bench" / "results" / "smoke" / "run.json").read_text("utf-8"))
    assert list(summary["durations_s"]) == ["emulate"] and not summary["failures"], summary


def test_fusions_frame_count_runs_and_counts_every_variant(tmp_path: Path) -> None:
    """bench/fusion.py --frames (the Python frames a steady call enters), on the demo: each
    variant counted, none at zero (the demo's own Python is in every call)."""
    start = time.time()
    _run(["bench/fusion.py", "--frames", "--smoke", "--table-only"], tmp_path / "log")
    result = ROOT / "bench" / "results" / "smoke" / "fusion_frames.json"
    assert result.stat().st_mtime >= start - 1
    (row,) = json.loads(result.read_text("utf-8"))["rows"]
    assert all(row[f"{v}_frames"] > 0 for v in ("graphdispatch", "fused", "tolerance")), row
