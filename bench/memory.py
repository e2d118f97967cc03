"""Static memory and copy traffic in emulate mode, for 48 graph pieces with one signature.

Model: the 48-block stack of overhead.py (dim 16, input [1, 8, 16]) with a
`torch._dynamo.graph_break()` after every block, compiled with
`backend="graphdispatch", options={"cuda_graphs": "emulate"}` (HostReplayEngine: the full
warmup -> capture -> verify -> replay state machine on CPU). Each call passes a new input
tensor, as a denoising loop does.

Two ways to write that stack, each in a fresh session:
- `unrolled`: forward written out block by block (generated source). Dynamo compiles 48
  graphs, one per block, each reading its block's parameters (pinned) and the moving
  activation. The design says the static buffers are shared per session by flat position
  and layout, so these 48 pieces hold ONE buffer set.
- `loop`: the natural `for block in self.blocks: x = block(x); graph_break()`. Dynamo
  skips a frame with a graph break inside a loop and compiles `Block.forward` once, with
  the parameters as graph inputs: one graph serves all 48 blocks with 48 parameter sets.

Figures, read from the runtime itself after the runners reach steady state:
- static bytes: `scope.buffers` of the session (the shared StaticBuffers: bytes and
  number of buffers) against what per-piece buffers would take (the sum of every captured
  entry's moving-input buffers, as if none were shared); and what the report says
  (`report`: `totals.static_buffers`, the session's shared buffers counted once).
- copy traffic: the bytes the replays copied, from the pieces' stats (`copy_bytes`: moving
  inputs in, mutated ones back, outputs out) per model call, less what the captured
  entries' plans copy out and back (each entry replays once per call): the copy-in; against
  the bytes of all tensor inputs the graphs receive per call (parameters included, counted
  by a wrapper of CompiledGraph.__call__ installed by this script), and the split of inputs
  into pinned and moving.
Targets: one buffer set (shared / per-piece = 1/48); copy-in only for moving inputs
(copied bytes == moving-input bytes == what the plans copy in; no parameter bytes copied);
and every piece replays.

`--smoke` (CI): both variants with 4 blocks and 2 steady calls: the script's plumbing, no
figure.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Target, block_stack, emit, parse_args, raise_dynamo_limits

import graphdispatch_backend
from graphdispatch_backend import session as gd_session
from graphdispatch_backend.runtime.program.program import CompiledGraph
from graphdispatch_backend.runtime.runner import GraphRunner

DEPTH, DIM, SHAPE = 48, 16, (1, 8, 16)
SMOKE_DEPTH = 4
WARM_CALLS = 12


class Traffic:
    """Counts the tensor bytes every compiled graph receives, by wrapping CompiledGraph.__call__
    (each graph call passes through it once, replayed or not)."""

    def __init__(self) -> None:
        self.received = 0
        self.counting = False
        self._orig_call = CompiledGraph.__call__

    def install(self) -> None:
        traffic = self
        orig_call = self._orig_call

        def __call__(graph: CompiledGraph, args: list[Any]) -> Any:
            if traffic.counting:
                traffic.received += sum(a.nbytes for a in args if isinstance(a, torch.Tensor))
            return orig_call(graph, args)

        CompiledGraph.__call__ = __call__  # type: ignore[method-assign]

    def uninstall(self) -> None:
        CompiledGraph.__call__ = self._orig_call  # type: ignore[method-assign]


def _copy_bytes(runners: list[GraphRunner]) -> int:
    """What the pieces' stats say the replays copied (moving inputs in, mutated ones back,
    outputs out), summed."""
    return sum(r._stats.to_dict()["copy_bytes"] for r in runners)


def run_variant(loop: bool, steady_calls: int, traffic: Traffic, depth: int = DEPTH) -> dict[str, Any]:
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    model = block_stack(depth, DIM, graph_breaks=True, loop=loop)
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    gen = torch.Generator().manual_seed(0)
    # warmup (3) + capture/verify (2 distinct input sets), twice over: an activation whose
    # address repeated during warmup (the allocator's reuse) is pinned, then re-captured as
    # moving when it does move (counted in `recaptures`); steady state starts after that
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(WARM_CALLS):
            compiled(torch.randn(SHAPE, generator=gen))
        warm_s = time.perf_counter() - start
        sess = gd_session._LATEST[0]
        before = sess.report.to_dict()["totals"]
        scope = sess._scopes.get("host")
        if scope is None:
            raise RuntimeError("no emulate scope in the session: did the graphs take the emulate path?")
        # type(), not isinstance(): gc also holds weak proxies, which raise once their referent is gone
        runners = [o for o in gc.get_objects() if type(o) is GraphRunner and o._scope is scope]
        copied_before = _copy_bytes(runners)
        traffic.received = 0
        traffic.counting = True
        equal = True
        try:
            for _ in range(steady_calls):
                x = torch.randn(SHAPE, generator=gen)
                equal &= bool(torch.equal(compiled(x), model(x)))
        finally:
            traffic.counting = False
    copied = _copy_bytes(runners) - copied_before
    report = sess.report.to_dict()
    entries = [e for r in runners for e in r._book.entries.values()]
    captured = [e for e in entries if e.graph is not None and e.inputs is not None and e.outputs is not None]
    per_piece = sum(buf.untyped_storage().nbytes() for e in captured for _, buf in e.moving)
    moving_positions = sorted({len(e.moving) for e in captured})
    pinned_counts = sorted({len(e.pinned) for e in captured})
    # every captured entry replays once per model call (checked by the `pieces replay` target):
    # the stats' bytes split into what the plans copy in, back and out
    out_bytes = sum(e.outputs.bytes_out + e.inputs.bytes_back for e in captured)  # type: ignore[union-attr]
    in_bytes = sum(e.inputs.bytes_in for e in captured)  # type: ignore[union-attr]
    graphs = report["graphs"]
    totals = report["totals"]
    calls = steady_calls
    return {
        "variant": "loop" if loop else "unrolled",
        "dynamo_graphs": len(graphs),
        "runners": len(runners),
        "entries": len(entries),
        "captured_entries": len(captured),
        "states": sorted({g["cuda_graph"]["state"] for g in graphs}),
        "totals": totals,
        "steady_piece_calls": totals["calls"] - before["calls"],
        "steady_replays": totals["replays"] - before["replays"],
        "declines": {k: v for g in graphs for k, v in g["cuda_graph"]["declines"].items()},
        "recaptures": sum(g["cuda_graph"].get("recaptures", 0) for g in graphs),
        "warm_seconds": warm_s,
        "bitwise_equal_to_eager": equal,
        "static_buffers": len(scope.buffers),
        "static_bytes_shared": scope.buffers.nbytes,
        "static_bytes_per_piece": per_piece,
        "report_static_bytes_per_graph": [g["cuda_graph"]["static_bytes"] for g in graphs],
        "report_static_bytes_session": totals.get("static_buffers", {}).get("host", {}).get("bytes"),
        "moving_inputs_per_entry": moving_positions,
        "pinned_inputs_per_entry": pinned_counts,
        "copy_bytes_per_call": copied / calls,  # the pieces' stats: in + back + out
        "copy_in_bytes_per_call": copied / calls - out_bytes,
        "plans_bytes_per_call": {"in": in_bytes, "back_and_out": out_bytes},
        "input_bytes_per_call": traffic.received / calls,
        "activation_bytes": int(torch.empty(SHAPE).nbytes),
    }


def main() -> None:
    args = parse_args(__doc__ or "")
    torch.set_num_threads(1)
    raise_dynamo_limits()
    steady = 2 if args.smoke else 4 if args.quick else 20
    depth = SMOKE_DEPTH if args.smoke else DEPTH
    traffic = Traffic()
    traffic.install()
    try:
        results = [run_variant(loop, steady, traffic, depth) for loop in (False, True)]
    finally:
        traffic.uninstall()
    rows = []
    for r in results:
        shared, per_piece = r["static_bytes_shared"], r["static_bytes_per_piece"]
        rows.append([
            r["variant"], r["dynamo_graphs"], r["captured_entries"], ",".join(r["states"]),
            f"{r['steady_replays']}/{r['steady_piece_calls']}", r["recaptures"],
            f"{r['static_buffers']} ({shared} B)", f"{r['report_static_bytes_session']} B", f"{per_piece} B",
            f"1/{per_piece / shared:.0f}" if shared else "-",
            f"{r['copy_in_bytes_per_call']:.0f} B", f"{r['input_bytes_per_call']:.0f} B",
            "yes" if r["bitwise_equal_to_eager"] else "NO",
        ])
    targets = []
    for r in results:
        shared, per_piece = r["static_bytes_shared"], r["static_bytes_per_piece"]
        moving_bytes = depth * r["activation_bytes"]
        one_set = r["static_buffers"] == 1 and per_piece == depth * shared
        targets.append(Target(f"memory {r['variant']}: static buffers shared", f"one set (1/{depth})",
                              f"{r['static_buffers']} buffer(s), {shared} B vs {per_piece} B per-piece", one_set))
        copy_ok = r["copy_in_bytes_per_call"] == moving_bytes == r["plans_bytes_per_call"]["in"]
        targets.append(Target(f"memory {r['variant']}: copy-in per call", "moving inputs only",
                              f"{r['copy_in_bytes_per_call']:.0f} B of {r['input_bytes_per_call']:.0f} B "
                              f"(activations {moving_bytes} B)", copy_ok))
        replays, piece_calls = r["steady_replays"], r["steady_piece_calls"]
        targets.append(Target(f"memory {r['variant']}: pieces replay",
                              f"all steady calls (after {WARM_CALLS} warm), bitwise",
                              f"{replays}/{piece_calls} piece calls replayed"
                              + (f"; declines {r['declines']}" if r["declines"] else ""),
                              replays == piece_calls > 0 and r["bitwise_equal_to_eager"] and not r["declines"]))
    emit("memory", {"quick": args.quick, "model": {"depth": depth, "dim": DIM, "input": list(SHAPE)},
                    "steady_calls": steady, "variants": results},
         [(f"static memory and copy traffic, emulate mode, {depth} blocks with a graph break each (per model call)",
           ["variant", "graphs", "captures", "state", "steady replays", "recaptures", "static buffers",
            "report", "per-piece", "shared", "copy-in", "inputs", "bitwise"], rows)],
         targets, args)


if __name__ == "__main__":
    main()
