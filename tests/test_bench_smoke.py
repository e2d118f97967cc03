"""Every benchmark script in bench/ runs, at tiny sizes: `python bench/run.py --smoke`.

The benchmarks reach into the package's internals (runtime objects built by hand, report
fields, a stand-in replay engine, patched lowering), and no other test runs them: without
this one, an interface change breaks a benchmark silently, and the breakage is found weeks
later, when someone needs a figure. The smoke mode runs every section and variant of every
script once at tiny sizes, each in seconds (the set: 2-3 minutes on 2 cores), and judges no
figure: only that each script ran to the end and wrote its JSON (bench/results/smoke/).
Not marked slow on purpose: CI must run it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 80


def test_every_bench_runs_in_smoke_mode() -> None:
    proc = subprocess.run([sys.executable, "bench/run.py", "--smoke"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    output = (proc.stdout + proc.stderr).strip().splitlines()
    tail = "\n".join(output[-TAIL_LINES:])
    assert proc.returncode == 0, f"bench/run.py --smoke exited {proc.returncode}; last lines:\n{tail}"
