#!/usr/bin/env bash
# GPU checks for the rare machine that has one: one call, under 8 minutes (480 s) on one GPU,
# the editable install included. Each step runs under `timeout` with the smaller of its own
# limit and what is left before DEADLINE_S (460 s after the start), so the whole run ends in time.
#   0. torch and the device name; `pip install -e .` (offline, no deps, 30 s) when torch.compile
#      cannot find backend="graphdispatch" (a fresh machine)
#   1. pytest -m cuda tests  (110 s): every test marked cuda (CudaGraphEngine and the runner on a
#      real device, autograd graphs, autocast, timing), junit xml bench/results/gpu_check_pytest.xml
#   2. bench/gpu_bench.py  (130 s), if present: latency of a launch-bound TinyDiT against the
#      CUDA-graph peers, replay path against a bare replay
#   3. bench/gpu_realsize.py  (120 s): one DiT block at real size (dim 3072, 24 heads, 65536
#      tokens, bf16; fewer tokens on a card with too little free memory), eager against
#      graphdispatch cuda_graphs=True: peak memory, time of the first calls (capture +
#      verification), replay vs eager time, bitwise equality, graphdispatch's counts
#   4. bench/sequence_parallel.py --device cuda --quick  (75 s): a Ulysses DiT on one NCCL rank
#      per GPU, the all-to-alls (`all_to_all_single` into `empty_like`) captured inside the
#      pieces: bitwise, replays per graph, time against eager and aot_eager; only when 60 s or
#      more are left, else skipped
#   5. bench/scale.py --device cuda --quick --only decode,dit  (150 s): a decode step on caches
#      up to 1 GiB, DiT blocks at long sequences; only when 90 s or more are left, else skipped
#   6. gpu_check.json in $OUT when set, else in bench/results/: torch version, device, per step
#      {exit code, seconds, limit}, the junit counts (tests, failures, errors, skipped, the
#      failing tests' names) and the JSON of gpu_bench.json, gpu_realsize.json,
#      sequence_parallel_cuda.json, scale_cuda.json (null for a step that wrote none). With
#      $OUT set, those files and the junit xml are copied there too.
# Steps 2-5 print their tables only; their full JSON is in the files.
# Without a CUDA device it prints "gpu_check: no CUDA device: skipping" and exits 0, writing nothing.
#
# Usage: bench/gpu_check.sh            (PYTHON=... to pick the interpreter)
# Exit status: 0 when every step that ran passed; else the first failing step's status
# (124 or 137: it ran past its limit).
set -u
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
TESTS_S=110       # step limits; each is also cut to what is left before DEADLINE_S (the start and
BENCH_S=130       # the install take about 30 s, at most 150)
REALSIZE_S=120
SP_MIN_S=60       # step 4 runs only with this much left, and for at most SP_S
SP_S=75
SCALE_MIN_S=90    # step 5 runs only with this much left, and for at most SCALE_S
SCALE_S=150
DEADLINE_S=460    # every step (its 10 s kill grace included) ends by then; step 5 takes a few seconds
RESULTS=bench/results
NAMES="gpu_bench gpu_realsize sequence_parallel_cuda scale_cuda"

info=$(timeout 60 "$PY" -c 'import sys, torch
if not torch.cuda.is_available(): sys.exit(1)
print(torch.__version__); print(torch.cuda.get_device_name())' 2>/dev/null) || {
    echo "gpu_check: no CUDA device: skipping"
    exit 0
}
TORCH_VERSION=$(sed -n 1p <<<"$info")
DEVICE_NAME=$(sed -n 2p <<<"$info")
echo "gpu_check: torch $TORCH_VERSION on $DEVICE_NAME"

# torch.compile finds backend="graphdispatch" through the package's entry point: a fresh
# machine has the checkout but not the installed package. Install it in place, offline.
if ! timeout 60 "$PY" -c 'from torch._dynamo.backends.registry import lookup_backend; lookup_backend("graphdispatch")' \
        >/dev/null 2>&1; then
    echo "gpu_check: installing the checkout (editable, no dependencies, offline)"
    timeout 30 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
        || echo "gpu_check: install failed; tests that compile will fail to find the backend"
fi

mkdir -p "$RESULTS"
JUNIT="$RESULTS/gpu_check_pytest.xml"
for name in $NAMES; do rm -f "$RESULTS/$name.json"; done  # no stale figures from an earlier run
rm -f "$JUNIT"
STEPS=$(mktemp)
trap 'rm -f "$STEPS"' EXIT
status=0

# step NUMBER NAME LIMIT COMMAND...: runs COMMAND under min(LIMIT, what is left before DEADLINE_S),
# records "name<TAB>exit<TAB>seconds<TAB>limit" in $STEPS (exit "skipped" when under 20 s were left).
step() {
    local num=$1 name=$2 limit=$3
    shift 3
    local left=$((DEADLINE_S - SECONDS - 10))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        echo "gpu_check: [$num] $name: skipped, ${left}s left"
        printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >>"$STEPS"
        return
    fi
    echo "gpu_check: [$num] $* (limit ${limit}s)"
    local start=$SECONDS rc
    PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$@"
    rc=$?
    { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo "gpu_check: [$num] $name ran past ${limit}s"
    [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
    echo "gpu_check: [$num] $name: exit $rc after $((SECONDS - start))s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >>"$STEPS"
}

step 1/5 pytest "$TESTS_S" "$PY" -m pytest -q -m cuda -p no:cacheprovider --junitxml="$JUNIT" tests
if [ -f bench/gpu_bench.py ]; then
    step 2/5 gpu_bench "$BENCH_S" "$PY" bench/gpu_bench.py --table-only
else
    echo "gpu_check: [2/5] bench/gpu_bench.py not present: skipping the benchmark"
    printf '%s\tskipped\t0\t0\n' gpu_bench >>"$STEPS"
fi
# the realsize script stops its steady rounds in time to write its results within the limit
realsize_budget=$((REALSIZE_S - 30))
left=$((DEADLINE_S - SECONDS - 10 - 30))
[ "$left" -lt "$realsize_budget" ] && realsize_budget=$left
[ "$realsize_budget" -lt 10 ] && realsize_budget=10
step 3/5 gpu_realsize "$REALSIZE_S" "$PY" bench/gpu_realsize.py --table-only --budget-s "$realsize_budget"
left=$((DEADLINE_S - SECONDS - 10))
if [ "$left" -ge "$SP_MIN_S" ]; then
    step 4/5 sequence_parallel_cuda "$SP_S" "$PY" bench/sequence_parallel.py --device cuda --quick --table-only
else
    echo "gpu_check: [4/5] sequence_parallel.py: skipped, ${left}s left (needs ${SP_MIN_S}s)"
    printf '%s\tskipped\t0\t%s\n' sequence_parallel_cuda "$left" >>"$STEPS"
fi
left=$((DEADLINE_S - SECONDS - 10))
if [ "$left" -ge "$SCALE_MIN_S" ]; then
    step 5/5 scale_cuda "$SCALE_S" "$PY" bench/scale.py --device cuda --quick --only decode,dit --table-only
else
    echo "gpu_check: [5/5] scale.py: skipped, ${left}s left (needs ${SCALE_MIN_S}s)"
    printf '%s\tskipped\t0\t%s\n' scale_cuda "$left" >>"$STEPS"
fi

# 6: one file with everything
DEST="${OUT:-$RESULTS}"
mkdir -p "$DEST"
if [ -n "${OUT:-}" ]; then
    for name in $NAMES; do [ -f "$RESULTS/$name.json" ] && cp "$RESULTS/$name.json" "$DEST/"; done
    [ -f "$JUNIT" ] && cp "$JUNIT" "$DEST/"
fi
GC_TORCH="$TORCH_VERSION" GC_DEVICE="$DEVICE_NAME" GC_STATUS="$status" GC_SECONDS="$SECONDS" \
    timeout 15 "$PY" - "$RESULTS" "$STEPS" "$JUNIT" "$DEST/gpu_check.json" $NAMES <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET

results, steps_path, junit, dest, *names = sys.argv[1:]
steps = {}
for line in open(steps_path, encoding="utf-8"):
    name, rc, seconds, limit = line.rstrip("\n").split("\t")
    steps[name] = {"exit": None if rc == "skipped" else int(rc), "skipped": rc == "skipped",
                   "timed_out": rc in ("124", "137"), "seconds": int(seconds), "limit_s": int(limit)}
pytest = None
if os.path.exists(junit):
    try:
        root = ET.parse(junit).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        pytest = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        pytest["failing"] = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
                             if c.find("failure") is not None or c.find("error") is not None]
    except (ET.ParseError, ValueError) as exc:
        pytest = {"error": f"unreadable junit xml: {exc}"}
payloads = {}
for name in names:
    path = os.path.join(results, name + ".json")
    try:
        with open(path, encoding="utf-8") as f:
            payloads[name] = json.load(f)
    except (OSError, ValueError):
        payloads[name] = None  # the step was skipped, cut or failed before writing
doc = {"torch": os.environ["GC_TORCH"], "device": os.environ["GC_DEVICE"], "exit": int(os.environ["GC_STATUS"]),
       "seconds": int(os.environ["GC_SECONDS"]), "steps": steps, "pytest": pytest, **payloads}
tmp = dest + ".tmp"
with open(tmp, "w", encoding="utf-8") as f:
    json.dump(doc, f, indent=2, default=str)
    f.write("\n")
os.replace(tmp, dest)
counts = ", ".join(f"{k} {pytest[k]}" for k in ("tests", "failures", "errors", "skipped")) \
    if pytest and "error" not in pytest else (pytest or {}).get("error", "no junit xml (pytest cut or absent)")
print(f"gpu_check: results in {dest}; pytest: {counts}")
for name in (pytest or {}).get("failing", []):
    print(f"gpu_check:   failed: {name}")
EOF
rc=$?
if [ $rc -ne 0 ]; then
    echo "gpu_check: could not write gpu_check.json (exit $rc)"
    [ $status -eq 0 ] && status=1
fi

echo "gpu_check: done, exit $status after ${SECONDS}s"
exit $status
