"""Every benchmark script in bench/ runs, at tiny sizes: `python bench/run.py --smoke`.

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
`--only`), so that it is not one long tail at the end of the suite.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def _commands() -> list[Any]:
    """(id, command) per test: `bench/run.py --smoke --only SCRIPT`, or for a script in
    SPLIT, the script's own smoke one section at a time (what run.py runs, in parts)."""
    out = []
    for script in _scripts():
        if script not in SPLIT:
            out.append(pytest.param(["bench/run.py", "--smoke", "--only", script], id=script))
            continue
        out += [pytest.param([f"bench/{script}.py", "--smoke", "--table-only", "--only", section],
                             id=f"{script}-{section}") for section in SPLIT[script]]
    return out


def test_the_set_is_every_script_of_bench() -> None:
    helpers = {"common", "run", "serving"}  # imported by the scripts, not scripts of their own
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")} - helpers
    assert set(_scripts()) == scripts


@pytest.mark.parametrize("command", _commands())
def test_each_bench_runs_in_smoke_mode(command: list[str]) -> None:
    """One script (or one section of a SPLIT script) per test: xdist spreads them."""
    proc = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    output = (proc.stdout + proc.stderr).strip().splitlines()
    tail = "\n".join(output[-TAIL_LINES:])
    assert proc.returncode == 0, f"{' '.join(command)} exited {proc.returncode}; last lines:\n{tail}"
