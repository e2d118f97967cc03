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
    _patch()
    model = block_stack(depth=8, dim=64)
    x = torch.randn(8, 64)
    compiled = {
        "emulate (tape)": torch.compile(block_stack(depth=8, dim=64), backend="graphdispatch",
                                        options={"cuda_graphs": "emulate"}),
        "cuda_graphs=False": torch.compile(block_stack(depth=8, dim=64), backend="graphdispatch",
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
        res = interleaved(variants, repeats=5 if args.quick else 15, inner=50 if args.quick else 200,
                          baseline="eager")
    rows = [[name, f"{r['median_us']:.1f}", f"{r['ratio']:.2f}x"] for name, r in res.items()]
    payload = {"model": "block_stack depth 8 dim 64 batch 8", "replays_before_timing": replays, "bitwise": ok,
               "results": {n: {k: v for k, v in r.items() if k != "samples_us"} for n, r in res.items()}}
    emit("emulate", payload, [("emulated replay: us per call (median), paired ratio to eager",
                               ["variant", "us/call", "vs eager"], rows)], [], args)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
