"""Emulate: what a replay costs under `cuda_graphs="emulate"`, now that it runs the ops
recorded at capture (runtime/cudagraph/tape.py) instead of the graph's Python.

Model: a stack of 8 small pre-norm blocks (common.block_stack, dim 64, batch 8) compiled
whole with `backend="graphdispatch", options={"cuda_graphs": "emulate"}`, under
`torch.no_grad()`, warmed until it replays. Variants, interleaved in one process:
- `eager`: the module as is;
- `emulate (tape)`: a replay runs the recorded ATen ops (today);
- `emulate (python)`: a replay runs the graph's Python again, as the host model did before
  the tape (patched back in for this variant only: `Tape.replay` calls the captured
  function on the pinned arguments);
- `cuda_graphs=False`: the lowered graph run eagerly, no capture.
Figure: microseconds per call (median over repeats) and each variant's paired ratio to
eager. Every output is compared with eager bit for bit (a mismatch: exit 1). No target:
emulation is a CPU model, not a product path; the figure says what CI pays for it.

`--smoke` (CI): every variant on a 2-block stack, 3 repeats of 5 calls: the script's
plumbing, no figure.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import block_stack, emit, interleaved, parse_args, raise_dynamo_limits

import graphdispatch_backend
from graphdispatch_backend.runtime.cudagraph import tape as tape_mod

_PYTHON = [False]  # the `emulate (python)` variant is running
DEPTH, SMOKE_DEPTH, DIM, BATCH = 8, 2, 64, 8


def _patch() -> None:
    """Every tape keeps its captured function; a replay runs it while _PYTHON is set."""
    record, replay = tape_mod.Recorder.record, tape_mod.Tape.replay

    def keeping(self: Any, fn: Any, args: Any) -> Any:
        self.tape.rerun = (fn, args)
        return record(self, fn, args)

    def either(self: Any) -> list[Any]:
        if _PYTHON[0]:
            fn, args = self.rerun
            return list(fn(*args))
        return replay(self)

    tape_mod.Recorder.record = keeping  # type: ignore[method-assign]
    tape_mod.Tape.replay = either  # type: ignore[method-assign]


def main() -> None:
    args = parse_args(__doc__)
    raise_dynamo_limits()
    torch.set_num_threads(1)  # as every CPU benchmark (bench/README.md): two threads on a busy 2-core guest spin
    _patch()
    depth = SMOKE_DEPTH if args.smoke else DEPTH
    model = block_stack(depth=depth, dim=DIM)
    x = torch.randn(BATCH, DIM)
    compiled = {
        "emulate (tape)": torch.compile(block_stack(depth=depth, dim=DIM), backend="graphdispatch",
                                        options={"cuda_graphs": "emulate"}),
        "cuda_graphs=False": torch.compile(block_stack(depth=depth, dim=DIM), backend="graphdispatch",
                                           options={"cuda_graphs": False}),
    }
    with torch.no_grad():
        want = model(x)
        for fn in compiled.values():
            for _ in range(8):
                fn(x)
        ok = all(torch.equal(fn(x), want) for fn in compiled.values())
        _PYTHON[0] = True
        ok &= bool(torch.equal(compiled["emulate (tape)"](x), want))
        _PYTHON[0] = False
        report = graphdispatch_backend.latest_report()
        replays = sum(g["cuda_graph"]["replays"] for g in report["graphs"]) if report else 0

        def python_replay() -> Any:
            _PYTHON[0] = True
            try:
                return compiled["emulate (tape)"](x)
            finally:
                _PYTHON[0] = False

        variants = {"eager": lambda: model(x), "emulate (tape)": lambda: compiled["emulate (tape)"](x),
                    "emulate (python)": python_replay, "cuda_graphs=False": lambda: compiled["cuda_graphs=False"](x)}
        repeats, inner = (3, 5) if args.smoke else (5, 50) if args.quick else (15, 200)
        res = interleaved(variants, repeats=repeats, inner=inner, baseline="eager")
    rows = [[name, f"{r['median_us']:.1f}", f"{r['ratio']:.2f}x"] for name, r in res.items()]
    payload = {"model": f"block_stack depth {depth} dim {DIM} batch {BATCH}", "replays_before_timing": replays,
               "bitwise": ok,
               "results": {n: {k: v for k, v in r.items() if k != "samples_us"} for n, r in res.items()}}
    emit("emulate", payload, [("emulated replay: us per call (median), paired ratio to eager",
                               ["variant", "us/call", "vs eager"], rows)], [], args)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
