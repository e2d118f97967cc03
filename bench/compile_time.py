"""Compile time: first-call latency of graphdispatch against aot_eager and inductor.

Model: the demo model (graphdispatch_backend.examples.dit, TinyDiT with its default
config, batch 2), CPU, one thread, under `torch.no_grad()`.

Method: every measurement is a fresh Python subprocess (this script with `--child
BACKEND`), so nothing compiled, imported lazily or cached in memory by an earlier run is
reused. Compile caches are off and every child gets its own empty cache folder
(TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, FX graph and AOTAutograd caches off,
TORCHINDUCTOR_CACHE_DIR=<new temp dir>). The child imports torch and builds the model
first (not timed), then times `torch.compile(model, backend=...)` plus the first call:
resolving the backend by name (for graphdispatch: the entry point and the package
import, also shown alone as `lookup`), Dynamo tracing, lowering, the backend's own work
(graphdispatch: passes, contract, registry, session), code generation (inductor: C++
with gcc) and one run. The second call
is timed too, to show the first call is compile-dominated, and Dynamo's own phase timers
split the first call into tracing (`tracing s`, the same work for every backend) and the
backend call (`backend s`: aot lowering, plus graphdispatch's passes and runtime set-up,
or inductor's code generation). Variants are round-robined
per repeat (A/B interleaved); the figure is the median, and the ratio to aot_eager is the
median of per-repeat paired ratios. Target: graphdispatch <= 1.3x aot_eager. If
inductor fails (no C++ compiler, ...), its reason is recorded instead of a time. Inductor
runs once in --quick mode, 3 times in full mode (its C++ builds take 20-100 s per run on 2
cores).

`--smoke` (CI): one run each of aot_eager and graphdispatch; inductor is skipped (recorded
as skipped, not failed: its C++ builds take tens of seconds): the script's plumbing, no
figure.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

BACKENDS = ("aot_eager", "graphdispatch", "inductor")
TARGET_RATIO = 1.3
CHILD_TIMEOUT_S = 600
SMOKE_SKIPPED = {"inductor": "skipped (--smoke: its C++ builds take tens of seconds)"}
# call_user_compiler is the backend (for graphdispatch and aot_eager: aot lowering inside it)
PHASES = ("bytecode_tracing", "OutputGraph.call_user_compiler", "create_aot_dispatcher_function", "build_guards")


def child(backend: str) -> None:
    """Runs in the fresh subprocess; prints one JSON line."""
    t0 = time.perf_counter()
    import torch

    from graphdispatch_backend.examples import dit

    import_s = time.perf_counter() - t0
    torch.set_num_threads(1)
    model = dit.make_model()
    x, t = dit.example_inputs()
    out: dict[str, Any] = {"backend": backend, "import_s": import_s}
    try:
        with torch.no_grad():
            start = time.perf_counter()
            compiled = torch.compile(model, backend=backend)  # resolves the backend (entry point, import)
            mid = time.perf_counter()
            y = compiled(x, t)
            end = time.perf_counter()
            out["first_call_s"] = end - start
            out["backend_lookup_s"] = mid - start
            start = time.perf_counter()
            compiled(x, t)
            out["second_call_s"] = time.perf_counter() - start
            out["bitwise_equal_to_eager"] = bool(torch.equal(y, model(x, t)))
        # Dynamo's own phase timers: where the first call went (tracing vs the backend)
        metrics = torch._dynamo.utils.compilation_time_metrics
        out["phases_s"] = {k: sum(metrics[k]) for k in PHASES if k in metrics}
    except Exception as exc:  # a failing backend is a result, not a crash of the benchmark
        out["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
    print(json.dumps(out))


def _env(cache_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
        "TORCHINDUCTOR_CACHE_DIR": cache_dir,
        "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton"),
        "OMP_NUM_THREADS": "1",
    })
    return env


def run_child(backend: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gd-bench-cache-") as cache_dir:
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", backend], capture_output=True, text=True,
                                  env=_env(cache_dir), timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"backend": backend, "error": f"timed out after {CHILD_TIMEOUT_S} s"}
        wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        return {"backend": backend, "error": f"exit {proc.returncode}: {tail}"}
    result = json.loads(lines[-1])
    result["process_wall_s"] = wall
    return result


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    from common import Target, emit, fail_on_errors, parse_args

    args = parse_args(__doc__ or "")
    repeats = 1 if args.smoke else 5 if args.quick else 9  # a busy neighbour can double one run: a median needs a few
    # inductor's C++ builds take 20 s (quiet) to 100 s (busy) per run on 2 cores: once in quick mode
    inductor_repeats = 1 if args.quick else 3
    skipped = SMOKE_SKIPPED if args.smoke else {}
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in BACKENDS}
    for r in range(repeats):
        order = list(BACKENDS) if r % 2 == 0 else list(reversed(BACKENDS))
        for backend in order:
            if backend in skipped:
                continue
            if backend == "inductor" and r >= inductor_repeats:
                continue
            if backend == "inductor" and runs["inductor"] and "error" in runs["inductor"][-1]:
                continue  # a failure is recorded once; retrying would only repeat it
            runs[backend].append(run_child(backend))
    summary: dict[str, dict[str, Any]] = {}
    for backend, results in runs.items():
        ok = [x for x in results if "error" not in x]
        errors = sorted({x["error"] for x in results if "error" in x})
        summary[backend] = {
            "runs": len(results),
            "ok": len(ok),
            "first_call_s": statistics.median(x["first_call_s"] for x in ok) if ok else None,
            "second_call_ms": 1e3 * statistics.median(x["second_call_s"] for x in ok) if ok else None,
            "backend_lookup_ms": 1e3 * statistics.median(x["backend_lookup_s"] for x in ok) if ok else None,
            "phases_s": {k: statistics.median(x["phases_s"].get(k, 0.0) for x in ok) for k in PHASES} if ok else {},
            "process_wall_s": statistics.median(x["process_wall_s"] for x in ok) if ok else None,
            "bitwise_equal_to_eager": all(x["bitwise_equal_to_eager"] for x in ok) if ok else None,
            "errors": errors,
            "skipped": skipped.get(backend),
        }
    pairs = [g["first_call_s"] / a["first_call_s"] for g, a in zip(runs["graphdispatch"], runs["aot_eager"])
             if "error" not in g and "error" not in a]
    ratio = statistics.median(pairs) if pairs else None
    base = summary["aot_eager"]["first_call_s"]
    rows = []
    for backend, s in summary.items():
        if s["first_call_s"] is None:
            why = s["skipped"] or "; ".join(s["errors"])[:100] or "not run"
            rows.append([backend, "-", "-", "-", "-", "-", "-", "-", "-", why])
            continue
        rel = f"{ratio:.2f}" if backend == "graphdispatch" and ratio else (
            f"{s['first_call_s'] / base:.2f}" if base else "-")
        tracing = s["phases_s"].get("bytecode_tracing", 0.0)
        backend_s = s["phases_s"].get("OutputGraph.call_user_compiler", 0.0)
        rows.append([backend, f"{s['first_call_s']:.2f}", rel, f"{s['backend_lookup_ms']:.0f}",
                     f"{tracing:.2f}", f"{backend_s:.2f}",
                     f"{s['second_call_ms']:.1f}", f"{s['process_wall_s']:.1f}",
                     "yes" if s["bitwise_equal_to_eager"] else "no", f"{s['ok']}/{s['runs']} ok"])
    targets = [Target("compile: graphdispatch / aot_eager first call", f"<= {TARGET_RATIO}",
                      f"{ratio:.2f}x" if ratio else "not measured", ratio <= TARGET_RATIO if ratio else None)]
    ind = summary["inductor"]
    if ind["first_call_s"] is not None:
        ind_value = f"{ind['first_call_s']:.1f} s"
    elif ind["skipped"]:
        ind_value = ind["skipped"]
    else:
        ind_value = ("failed: " + "; ".join(ind["errors"])) if ind["errors"] else "not run"
    targets.append(Target("compile: inductor first call (peer)", "(info)", ind_value, None))
    emit("compile_time", {"quick": args.quick, "skipped": skipped,
                          "model": "graphdispatch_backend.examples.dit (default config, batch 2)",
                          "repeats": repeats, "summary": summary, "ratio_graphdispatch_over_aot_eager": ratio,
                          "runs": runs},
         [("first-call latency (compile + first run), fresh subprocess per run, caches off",
           ["backend", "first call s", "x aot_eager", "lookup ms", "tracing s", "backend s", "2nd call ms",
            "process s", "bitwise", "runs"], rows)],
         targets, args)
    fail_on_errors(args, [f"{b}: {x['error']}" for b, results in runs.items() for x in results if "error" in x])


if __name__ == "__main__":
    main()
