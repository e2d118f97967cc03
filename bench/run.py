"""Run the CPU benchmark set and print one summary: each figure, its target, met or not.

    python bench/run.py --quick     # fewer repeats: under 5 minutes on 2 cores, noisier
    python bench/run.py             # the recorded figures
    python bench/run.py --smoke     # every script's plumbing at tiny sizes (CI, tests/test_bench_smoke.py)

Each benchmark runs in its own subprocess (a fresh Dynamo, fresh graphdispatch sessions,
no compiled code shared between them), prints its own tables, and writes
`bench/results/<name>.json`; this script reads the `targets` list from those files and
writes the summary to `bench/results/run.json`. The GPU benchmark (gpu_bench.py) is not
part of this set: bench/gpu_check.sh runs it on a machine with a GPU.

`--smoke` runs every benchmark with `--smoke` (tiny sizes and repeats, seconds each) and
the GPU scripts with `--cpu-smoke`, and prints how long each took; it exits 1 if any of
them failed. A smoke is bounded by its work (tiny sizes, few calls), not by seconds: its only
limit is a hang guard far above it (a loaded 2-core machine takes many times its quiet time;
a 120 s limit once failed CI's test command at load 5-8). Targets are not judged (the figures
of tiny sizes mean nothing); results go to `bench/results/smoke/`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Target, machine, results_dir, target_table

from graphdispatch_backend.table import table

HERE = Path(__file__).resolve().parent
BENCHMARKS = ("overhead", "scaling", "memory", "kv_cache", "compile_time", "recheck", "emulate", "scale", "fusion",
              "sequence_parallel")
TIMEOUT_S = {"quick": 300, "full": 1800}
# scale.py's quick run lasts 3-4 minutes while the per-call copies it measures are there; fusion.py
# compiles 6 families x 2 dtypes x 4 variants twice (a warm first call) and runs each past its 1024th call
QUICK_TIMEOUT_S = {"scale": 600, "fusion": 2400}
FULL_TIMEOUT_S = {"fusion": 3600}
# a hang guard, not a time limit (module docstring): the slowest smoke takes 1-2 minutes quiet
SMOKE_HANG_GUARD_S = 15 * 60
# --smoke only: the GPU scripts' own smoke mode, on CPU (`--cpu-smoke`), and the JSON each writes
GPU_SMOKE = {"gpu_bench": "gpu_bench_cpu_smoke", "gpu_realsize": "gpu_realsize_cpu_smoke"}
STDERR_TAIL = 30  # lines of a failed script's stderr shown
STDERR_TAILS: dict[str, str] = {}  # a failed script's, shown again after the summary


def run_one(name: str, mode: str) -> tuple[list[Target], float, str | None]:
    """Run bench/<name>.py in `mode` (quick, full or smoke) in its own process (group, so
    that a timeout also ends the processes it started); its targets, seconds and error.
    A failed script's last lines of stderr are printed, and kept in STDERR_TAILS."""
    flags = {"quick": ["--quick"], "full": [], "smoke": ["--cpu-smoke" if name in GPU_SMOKE else "--smoke"]}[mode]
    cmd = [sys.executable, str(HERE / f"{name}.py"), "--table-only", *flags]
    result = results_dir(mode == "smoke") / f"{GPU_SMOKE.get(name, name) if mode == 'smoke' else name}.json"
    result.unlink(missing_ok=True)  # never summarise a stale file from an earlier run
    start = time.perf_counter()
    print(f"\n===== {name} {f'({mode})' if mode != 'full' else ''} =====", flush=True)
    if mode == "smoke":
        timeout = SMOKE_HANG_GUARD_S
    else:
        timeout = QUICK_TIMEOUT_S.get(name, TIMEOUT_S["quick"]) if mode == "quick" else \
            FULL_TIMEOUT_S.get(name, TIMEOUT_S["full"])
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=HERE.parent, start_new_session=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        _show_tail(name, stderr)
        return [], time.perf_counter() - start, f"timed out after {timeout} s"
    elapsed = time.perf_counter() - start
    if proc.returncode != 0 or not result.exists():
        _show_tail(name, stderr)
        tail = (stderr.strip().splitlines() or ["(no stderr)"])[-1][:200]
        return [], elapsed, f"exit {proc.returncode}: {tail}" if proc.returncode else f"no {result.name} written"
    payload = json.loads(result.read_text())
    return [Target(**t) for t in payload["targets"]], elapsed, None


def _show_tail(name: str, stderr: str) -> None:
    lines = stderr.strip().splitlines()[-STDERR_TAIL:]
    STDERR_TAILS[name] = "\n".join([f"----- {name}: last {len(lines)} lines of stderr -----", *lines])
    print(STDERR_TAILS[name], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the CPU benchmark set.")
    mode_flags = parser.add_mutually_exclusive_group()
    mode_flags.add_argument("--quick", action="store_true", help="fewer repeats, under 5 minutes on 2 cores")
    mode_flags.add_argument("--smoke", action="store_true",
                            help=f"every script at tiny sizes ({', '.join(GPU_SMOKE)} with --cpu-smoke), "
                                 "bounded by work (a hang guard only); exit 1 if one fails; targets not judged (CI)")
    everything = (*BENCHMARKS, *GPU_SMOKE)
    parser.add_argument("--only", default="",
                        help=f"comma-separated subset of {','.join(BENCHMARKS)} (--smoke: and {','.join(GPU_SMOKE)})")
    args = parser.parse_args()
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    allowed = everything if args.smoke else BENCHMARKS
    names = [n for n in args.only.split(",") if n] or list(allowed)
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(allowed)}")
    start = time.perf_counter()
    targets: list[Target] = []
    durations: dict[str, float] = {}
    failures: dict[str, str] = {}
    for name in names:
        got, elapsed, error = run_one(name, mode)
        durations[name] = elapsed
        targets.extend(got)
        print(f"===== {name}: {'ok' if error is None else error} in {elapsed:.1f} s =====", flush=True)
        if error is not None:
            failures[name] = error
            targets.append(Target(f"{name}: benchmark ran", "exit 0", error, False))
    total = time.perf_counter() - start
    info = machine()
    label = {"smoke": "smoke, plumbing only", "quick": "quick, noisy", "full": "full"}[mode]
    print(f"\n===== summary ({label}; {info['cpu']}, {info['cores']} cores, "
          f"load {info['load_avg_1m']:.1f}; torch {info['torch']}; {total:.0f} s) =====")
    judged = [t for t in targets if t.met is not None]
    met = sum(1 for t in judged if t.met)
    if args.smoke:  # every target unjudged: what matters is that each script ran, and how long it took
        print(table(["benchmark", "seconds", "result"],
                    [[n, f"{durations[n]:.1f}", failures.get(n, "ok")] for n in names]))
        print(f"\n{len(names) - len(failures)}/{len(names)} benchmarks ran in {total:.0f} s (targets not judged)"
              + (f"; failed: {', '.join(failures)}" if failures else ""))
    else:
        print(target_table(targets))
        print(f"\n{met}/{len(judged)} targets met" + (f"; failed: {', '.join(failures)}" if failures else ""))
    for tail in STDERR_TAILS.values():  # again, where the end of a log shows it
        print(f"\n{tail}")
    folder = results_dir(args.smoke)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps({
        "quick": args.quick, "smoke": args.smoke, "machine": info, "seconds": total, "durations_s": durations,
        "failures": failures, "targets": [t.to_dict() for t in targets], "met": met, "judged": len(judged),
    }, indent=2) + "\n")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
