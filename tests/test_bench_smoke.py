"""Every benchmark script in bench/ runs, at tiny sizes: `python bench/run.py --smoke`.

The benchmarks reach into the package's internals (runtime objects built by hand, report
fields, a stand-in replay engine, patched lowering), and no other test runs them: without
this one, an interface change breaks a benchmark silently, and the breakage is found weeks
later, when someone needs a figure. The smoke mode runs every section and variant of every
script once at tiny sizes, bounded by work (tiny models, a few calls; the subprocess's
timeout is only a hang guard far above), and judges no figure: only that each script ran to
the end and wrote its JSON (bench/results/smoke/).
Not marked slow on purpose: CI must run it. One test per script, so that xdist's workers
share them (the set in one test held one worker for 3 minutes).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 80
# a hang guard, not a time limit: a smoke is bounded by its work (tiny sizes, few calls), and a
# loaded 2-core machine may take many times its quiet minutes (scale's: 2 quiet, 8 at load 14)
HANG_GUARD_S = 20 * 60


def _scripts() -> list[str]:
    """The scripts `bench/run.py --smoke` runs (its BENCHMARKS and GPU_SMOKE), read from its
    source: importing it would import the benches' helpers into the test process."""
    names: list[str] = []
    for node in ast.parse((ROOT / "bench" / "run.py").read_text("utf-8")).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in ("BENCHMARKS", "GPU_SMOKE"):
            value = ast.literal_eval(node.value)
            names += list(value)
    return names


def test_the_set_is_every_script_of_bench() -> None:
    helpers = {"common", "run", "serving"}  # imported by the scripts, not scripts of their own
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")} - helpers
    assert set(_scripts()) == scripts


@pytest.mark.parametrize("script", _scripts())
def test_each_bench_runs_in_smoke_mode(script: str) -> None:
    """One script per test (`bench/run.py --smoke --only SCRIPT`): xdist spreads them."""
    proc = subprocess.run([sys.executable, "bench/run.py", "--smoke", "--only", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    output = (proc.stdout + proc.stderr).strip().splitlines()
    tail = "\n".join(output[-TAIL_LINES:])
    assert proc.returncode == 0, f"bench/run.py --smoke --only {script} exited {proc.returncode}; last lines:\n{tail}"
