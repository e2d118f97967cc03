"""Run the CPU benchmark set and print one summary: each figure, its target, met or not.

    python bench/run.py --quick     # fewer repeats: under 5 minutes on 2 cores, noisier
    python bench/run.py             # the recorded figures

Each benchmark runs in its own subprocess (a fresh Dynamo, fresh graphdispatch sessions,
no compiled code shared between them), prints its own tables, and writes
`bench/results/<name>.json`; this script reads the `targets` list from those files and
writes the summary to `bench/results/run.json`. The GPU benchmark (gpu_bench.py) is not
part of this set: bench/gpu_check.sh runs it on a machine with a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, Target, machine, target_table

HERE = Path(__file__).resolve().parent
BENCHMARKS = ("overhead", "scaling", "memory", "kv_cache", "compile_time", "recheck", "emulate", "scale", "fusion")
TIMEOUT_S = {"quick": 300, "full": 1800}
# scale.py's quick run lasts 3-4 minutes while the per-call copies it measures are there
QUICK_TIMEOUT_S = {"scale": 600, "fusion": 900}


def run_one(name: str, quick: bool) -> tuple[list[Target], float, str | None]:
    cmd = [sys.executable, str(HERE / f"{name}.py"), "--table-only"] + (["--quick"] if quick else [])
    result = RESULTS / f"{name}.json"
    result.unlink(missing_ok=True)  # never summarise a stale file from an earlier run
    start = time.perf_counter()
    print(f"\n===== {name} {'(quick)' if quick else ''} =====", flush=True)
    timeout = QUICK_TIMEOUT_S.get(name, TIMEOUT_S["quick"]) if quick else TIMEOUT_S["full"]
    try:
        proc = subprocess.run(cmd, timeout=timeout, stderr=subprocess.PIPE, text=True, cwd=HERE.parent,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return [], time.perf_counter() - start, f"timed out after {timeout} s"
    elapsed = time.perf_counter() - start
    if proc.returncode != 0 or not result.exists():
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1][:200]
        return [], elapsed, f"exit {proc.returncode}: {tail}"
    payload = json.loads(result.read_text())
    return [Target(**t) for t in payload["targets"]], elapsed, None


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the CPU benchmark set.")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, under 5 minutes on 2 cores")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}")
    start = time.perf_counter()
    targets: list[Target] = []
    durations: dict[str, float] = {}
    failures: dict[str, str] = {}
    for name in names:
        got, elapsed, error = run_one(name, args.quick)
        durations[name] = elapsed
        targets.extend(got)
        if error is not None:
            failures[name] = error
            targets.append(Target(f"{name}: benchmark ran", "exit 0", error, False))
    total = time.perf_counter() - start
    info = machine()
    print(f"\n===== summary ({'quick, noisy' if args.quick else 'full'}; {info['cpu']}, {info['cores']} cores, "
          f"load {info['load_avg_1m']:.1f}; torch {info['torch']}; {total:.0f} s) =====")
    print(target_table(targets))
    judged = [t for t in targets if t.met is not None]
    met = sum(1 for t in judged if t.met)
    print(f"\n{met}/{len(judged)} targets met" + (f"; failed: {', '.join(failures)}" if failures else ""))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "run.json").write_text(json.dumps({
        "quick": args.quick, "machine": info, "seconds": total, "durations_s": durations, "failures": failures,
        "targets": [t.to_dict() for t in targets], "met": met, "judged": len(judged),
    }, indent=2) + "\n")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
