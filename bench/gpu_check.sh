#!/usr/bin/env bash
# GPU checks for the rare machine that has one, in under 8 minutes on one GPU:
#   1. pytest -m cuda tests                        (every test marked cuda: CudaGraphEngine and the
#      runner on a real device, autograd graphs, autocast, timing)
#   2. python bench/gpu_bench.py                   (latency against the CUDA-graph peers), if present
#   3. python bench/scale.py --device cuda         (real size: a decode step on caches up to 1 GiB,
#      DiT blocks in bf16 at long sequences: time and peak memory against eager)
# Without a CUDA device it prints "no CUDA device: skipping" and exits 0.
#
# Usage: bench/gpu_check.sh            (PYTHON=... to pick the interpreter)
# Exit status: 0 when every step that ran passed; else the first failing step's status.
set -u
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
TESTS_S=150   # step budgets: together with the install they stay under 480 s
BENCH_S=150
SCALE_S=150

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device: skipping"
    exit 0
fi
"$PY" -c 'import torch; print(f"gpu_check: torch {torch.__version__} on {torch.cuda.get_device_name()}")'

# torch.compile finds backend="graphdispatch" through the package's entry point: a fresh
# machine has the checkout but not the installed package. Install it in place, offline.
if ! "$PY" -c 'from torch._dynamo.backends.registry import lookup_backend; lookup_backend("graphdispatch")' \
        >/dev/null 2>&1; then
    echo "gpu_check: installing the checkout (editable, no dependencies, offline)"
    timeout 30 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
        || echo "gpu_check: install failed; tests that compile will fail to find the backend"
fi

status=0
start=$SECONDS
echo "gpu_check: [1/3] pytest -m cuda tests (limit ${TESTS_S}s)"
timeout -k 10 "$TESTS_S" "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
rc=$?
[ $rc -eq 124 ] && echo "gpu_check: the CUDA tests ran past ${TESTS_S}s"
[ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
echo "gpu_check: [1/3] exit $rc after $((SECONDS - start))s"

start=$SECONDS
if [ -f bench/gpu_bench.py ]; then
    echo "gpu_check: [2/3] python bench/gpu_bench.py (limit ${BENCH_S}s)"
    PYTHONUNBUFFERED=1 timeout -k 10 "$BENCH_S" "$PY" bench/gpu_bench.py
    rc=$?
    [ $rc -eq 124 ] && echo "gpu_check: the benchmark ran past ${BENCH_S}s"
    [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
    echo "gpu_check: [2/3] exit $rc after $((SECONDS - start))s"
else
    echo "gpu_check: [2/3] bench/gpu_bench.py not present: skipping the benchmark"
fi

start=$SECONDS
echo "gpu_check: [3/3] python bench/scale.py --device cuda --quick --only decode,dit (limit ${SCALE_S}s)"
PYTHONUNBUFFERED=1 timeout -k 10 "$SCALE_S" "$PY" bench/scale.py --device cuda --quick --only decode,dit
rc=$?
[ $rc -eq 124 ] && echo "gpu_check: the scale benchmark ran past ${SCALE_S}s"
[ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
echo "gpu_check: [3/3] exit $rc after $((SECONDS - start))s"

echo "gpu_check: done, exit $status"
exit $status
