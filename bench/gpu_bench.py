"""GPU end-to-end latency of a launch-bound DiT-like stack, against the CUDA-graph peers.

Model: TinyDiT (graphdispatch_backend.examples.dit) with more, smaller blocks
(depth 28, dim 32, 2 heads, 8x8 patches grid, batch 1, float32) on one CUDA device: a few
hundred tiny kernels per call, so eager time is launch overhead and a CUDA graph pays off.

Variants (same weights, same inputs, `torch.no_grad()`):
- `eager`: the module as is.
- `cudagraphs`: torch.compile backend="cudagraphs" (aot + cudagraph trees, no fusion).
- `inductor/reduce-overhead`: torch.compile mode="reduce-overhead" (Triton fusion +
  cudagraph trees; `torch.compiler.cudagraph_mark_step_begin()` before each call, as its
  docs ask for loops).
- `graphdispatch`: backend="graphdispatch", options={"cuda_graphs": True} (warmup,
  capture, bit-for-bit verification against eager, then replay).
- `graphdispatch fuse=True`: the same with Inductor's fused kernels under the CUDA
  eager-numerics recipe (Triton, checked bit for bit like any lowering); its report's
  `fusion` records (kernels, ops kept and why) go to the JSON.

Figures:
- latency: milliseconds per call, back to back, synchronized before and after each batch
  of `inner` calls (so host overhead and device time both count); A/B interleaved over
  repeats, median; the inputs cycle through a pool of distinct tensors, as a denoising
  loop's would.
- bitwise: `torch.equal` with eager on the output of every step of a 4-step denoising
  loop (each step's input is the previous step's result).
- floor: the sum of device-side activity (kernels, copies) per eager call, from
  torch.profiler: what a perfect replay with zero host cost would take.
- graphdispatch's own report: replays / calls and any decline, so a silent eager
  fallback cannot pass for a fast path.
Targets: graphdispatch no slower than the best peer; within 10% of the floor; bitwise
equal to eager. Without CUDA it prints one line and exits 0.

Replay path vs bare replay, with a real CUDA graph (first, in seconds): scaling.py's
measurement on the device. The production objects (CompiledGraph + GraphRunner, as
backend.py wires a graph Dynamo compiled and captured whole) over a one-node graph of K
inputs (4, 32, 256, 1024; all pinned parameters, or all moving), captured by
CudaGraphEngine (a real `torch.cuda.CUDAGraph`), against the hand-written floor over the
same captured graph (one pointer check in C, one `_foreach_copy_`, `replay()`, one clone
per output base). Host time per call, each timed window ending in a synchronization; one
node, so that the device's work stays under the host's and the ratio is the host path's.
Target: <= 1.3x the floor at 256 and 1024 inputs.
Budget: well under 5 minutes on an H200 (inductor's compile dominates).

`--cpu-smoke` runs the same plumbing on CPU in seconds (graphdispatch in emulate mode,
no inductor, no floor, depth 4, one thread): a check of this script on a machine without
a GPU, not a figure. `--smoke` (the flag every benchmark takes) is the same here; its JSON
goes to `bench/results/smoke/gpu_bench_cpu_smoke.json`, every target unjudged.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Target, emit, fail_on_errors, parse_args, raise_dynamo_limits

FUSED = "graphdispatch fuse=True"

SKIP_LINE = "no CUDA device: skipping GPU benchmark"
FLOOR_SLACK = 1.10
STEPS = 4
REPLAY_NODES = 1  # graph nodes of the replay-path measurement: device work under the host's
DEPTH, SMOKE_DEPTH = 28, 4


def replay_floor(device: torch.device, smoke: bool, quick: bool) -> tuple[dict[str, Any], list[Target], Any]:
    """Replay path vs bare replay per series and K (see module docstring); CPU smoke: the
    same code over scaling.py's no-op engine."""
    import scaling

    engine: Any
    if smoke:
        engine, ks, repeats, window = scaling.NoReplayEngine(), (4, 32), 3, 500.0
    else:
        from graphdispatch_backend.runtime.cudagraph.cuda import CudaGraphEngine

        engine, ks, repeats = CudaGraphEngine(), scaling.INPUTS, 9 if quick else 21
        window = scaling.WINDOW_US[quick]
    after = None if smoke else torch.cuda.synchronize
    results: dict[str, Any] = {}
    targets = []
    with torch.no_grad():
        for series in scaling.REPLAY:
            rows = {}
            for k in ks:
                rows[k] = scaling.measure_k(series, k, repeats, window, engine=engine, device=str(device),
                                            after=after, nodes=(REPLAY_NODES,))
                print(f"gpu_bench: {series} K={k}: {rows[k]['floor_ratio']:.2f}x the bare replay",
                      file=sys.stderr, flush=True)
            results[series] = rows
            for k in ks:
                judged = k in scaling.FLOOR_AT and not smoke
                targets.append(Target(f"gpu: {series} x bare replay, K={k}",
                                      f"<= {scaling.FLOOR_RATIO}" if judged else "(info)",
                                      f"{rows[k]['floor_ratio']:.2f}x (min/min {rows[k]['floor_ratio_min']:.2f}x)",
                                      rows[k]["floor_ratio"] <= scaling.FLOOR_RATIO if judged else None))
    table = scaling.floor_table({"series": {s: {"rows": r} for s, r in results.items()}},
                                " with a real CUDA graph" if not smoke else " (cpu smoke, no-op engine)")
    return results, targets, table


def make(device: torch.device, depth: int = DEPTH) -> tuple[torch.nn.Module, Any]:
    from graphdispatch_backend.examples import dit

    cfg = dit.DiTConfig(image_size=16, patch=2, in_channels=4, dim=32, heads=2, depth=depth, mlp_ratio=4, freq_dim=32)
    return dit.make_model(seed=0, cfg=cfg).to(device), cfg


def inputs(cfg: Any, device: torch.device, count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    pool = []
    for i in range(count):
        x = torch.randn(1, cfg.in_channels, cfg.image_size, cfg.image_size, generator=gen).to(device)
        t = torch.full((1,), 999.0 * (1 - (i % STEPS) / STEPS), device=device)
        pool.append((x, t))
    return pool


def denoise(fn: Callable[..., torch.Tensor], x: torch.Tensor, device: torch.device,
            before: Callable[[], None]) -> list[torch.Tensor]:
    """The model on its own output for STEPS steps; every step's result, cloned."""
    out = []
    for i in range(STEPS):
        t = torch.full((x.shape[0],), 999.0 * (1 - i / STEPS), device=device)
        before()
        x = x - fn(x, t) / STEPS
        out.append(x.clone())
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_floor_ms(model: torch.nn.Module, pool: list[tuple[torch.Tensor, torch.Tensor]], calls: int) -> float:
    """Sum of device activity per eager call (torch.profiler, CUDA activities)."""
    from torch.profiler import ProfilerActivity, profile

    for x, t in pool[:3]:
        model(x, t)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            x, t = pool[i % len(pool)]
            model(x, t)
        torch.cuda.synchronize()
    total_us = 0.0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:  # kernels, memcpy, memset: each once
            total_us += evt.time_range.elapsed_us()
    return total_us / calls / 1e3


def main() -> None:
    args = parse_args(__doc__ or "", lambda p: p.add_argument(
        "--cpu-smoke", action="store_true", help="check the plumbing on CPU (no figures); --smoke: the same"))
    smoke = args.smoke = args.cpu_smoke or args.smoke
    if not torch.cuda.is_available() and not smoke:
        print(SKIP_LINE)
        return
    raise_dynamo_limits()
    if smoke:
        torch.set_num_threads(1)  # two threads on a busy 2-core machine spin
    device = torch.device("cpu" if smoke else "cuda")
    replay_results, replay_targets, replay_table = replay_floor(device, smoke, args.quick)
    repeats, inner = (3, 2) if smoke else (10, 20) if args.quick else (25, 50)
    model, cfg = make(device, SMOKE_DEPTH if smoke else DEPTH)
    pool = inputs(cfg, device, 8)
    nothing: Callable[[], None] = lambda: None
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", nothing)
    variants: dict[str, tuple[Callable[..., Any], Callable[[], None]]] = {
        "eager": (model, nothing),
        "cudagraphs": (torch.compile(model, backend="cudagraphs"), nothing),
        "inductor/reduce-overhead": (torch.compile(model, mode="reduce-overhead"), mark),
        # compiled before plain graphdispatch, so the report read at the end is plain graphdispatch's
        FUSED: (torch.compile(model, backend="graphdispatch", options={"cuda_graphs": True, "fuse": True,
                                                                       "cache_dir": False}), nothing),
        "graphdispatch": (torch.compile(model, backend="graphdispatch",
                                        options={"cuda_graphs": "emulate" if smoke else True}), nothing),
    }
    if smoke:  # C++ builds of minutes on CPU: not a plumbing check
        del variants["inductor/reduce-overhead"], variants[FUSED]
    fusion: list[dict[str, Any]] = []
    import graphdispatch_backend

    graphdispatch_backend.reset()
    compile_s: dict[str, float] = {}
    errors: dict[str, str] = {}
    with torch.no_grad():
        # compile, warm up, capture and (graphdispatch) verify on distinct inputs before anything is timed
        for name, (fn, before) in list(variants.items()):
            start = time.perf_counter()
            try:
                for x, t in pool + pool:
                    before()
                    fn(x, t)
                sync(device)
            except Exception as exc:  # a peer that fails is reported, the others still run
                errors[name] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                del variants[name]
                continue
            compile_s[name] = time.perf_counter() - start
            if name == FUSED:
                fusion = [g.get("fusion") for g in (graphdispatch_backend.latest_report() or {}).get("graphs", [])]
            # progress on stderr: under gpu_check.sh's time limit, a cut run still says how far it got
            print(f"gpu_bench: {name}: compiled and warm in {compile_s[name]:.1f} s", file=sys.stderr, flush=True)
        reference = denoise(model, pool[0][0], device, nothing)
        bitwise = {}
        for name, (fn, before) in variants.items():
            got = denoise(fn, pool[0][0], device, before)
            bitwise[name] = all(torch.equal(a, b) for a, b in zip(got, reference))
        samples: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order each repeat
                fn, before = variants[name]
                sync(device)
                start = time.perf_counter()
                for i in range(inner):
                    x, t = pool[i % len(pool)]
                    before()
                    fn(x, t)
                sync(device)
                samples[name].append(1e3 * (time.perf_counter() - start) / inner)
        floor = float("nan") if smoke else device_floor_ms(model, pool, calls=20)
    report = graphdispatch_backend.latest_report() or {}
    totals = report.get("totals", {})
    declines = {k: v for g in report.get("graphs", []) for k, v in g["cuda_graph"]["declines"].items()}
    lat = {name: statistics.median(s) for name, s in samples.items()}
    peers = [lat[n] for n in ("cudagraphs", "inductor/reduce-overhead") if n in lat]
    gd = lat.get("graphdispatch")
    rows = []
    for name in lat:
        rows.append([name, f"{lat[name]:.3f}", f"{lat[name] / floor:.2f}", f"{lat['eager'] / lat[name]:.2f}",
                     "yes" if bitwise[name] else "no", f"{compile_s[name]:.1f}"])
    for name, err in errors.items():
        rows.append([name, "-", "-", "-", "-", f"failed: {err[:80]}"])
    rows.append(["floor (device time per eager call)", f"{floor:.3f}", "1.00", "", "", ""])
    targets = []
    if gd is not None:
        best = min(peers) if peers else None
        targets.append(Target("gpu: graphdispatch vs best peer", "<= 1.00x",
                              f"{gd / best:.3f}x ({gd:.3f} vs {best:.3f} ms)" if best else "no peer ran",
                              gd <= best if best and not smoke else None))
        targets.append(Target("gpu: graphdispatch vs device floor", f"<= {FLOOR_SLACK:.2f}x",
                              f"{gd / floor:.3f}x" if not smoke else "n/a (cpu smoke)",
                              gd <= FLOOR_SLACK * floor if not smoke else None))
        targets.append(Target("gpu: graphdispatch bitwise equal to eager", "yes", "yes" if bitwise["graphdispatch"]
                              else "NO", bitwise["graphdispatch"]))
        targets.append(Target("gpu: graphdispatch replays", "steady calls replay, no decline",
                              f"{totals.get('replays', 0)}/{totals.get('calls', 0)} calls replayed"
                              + (f"; declines {declines}" if declines else ""),
                              totals.get("replays", 0) > 0 and not declines))
    else:
        targets.append(Target("gpu: graphdispatch", "runs", f"failed: {errors.get('graphdispatch')}", False))
    if FUSED in bitwise:
        targets.append(Target("gpu: graphdispatch fuse=True bitwise equal to eager", "yes",
                              "yes" if bitwise[FUSED] else "NO", bitwise[FUSED]))
        targets.append(Target("gpu: graphdispatch fuse=True vs graphdispatch", "< 1.00x",
                              f"{lat[FUSED] / gd:.3f}x" if gd else "n/a", lat[FUSED] < gd if gd else None))
    targets.extend(replay_targets)
    emit("gpu_bench_cpu_smoke" if smoke else "gpu_bench", {
        "quick": args.quick,
        "cpu_smoke": smoke,
        "device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(),
        "model": {"config": dataclasses.asdict(cfg), "batch": 1},
        "latency_ms": lat, "samples_ms": samples, "floor_ms": floor, "bitwise_equal_to_eager": bitwise,
        "compile_and_warmup_s": compile_s, "errors": errors, "graphdispatch_totals": totals,
        "graphdispatch_declines": declines, "fusion": fusion,
        "replay_path_vs_bare_replay": {s: {str(k): row for k, row in r.items()} for s, r in replay_results.items()},
    }, [(f"GPU latency per call, batch 1, {repeats}x{inner} calls interleaved (median)",
         ["variant", "ms/call", "x floor", "speedup vs eager", "bitwise (4 steps)", "compile+warmup s"], rows),
        replay_table],
        targets, args)
    fail_on_errors(args, [f"{name}: {err}" for name, err in errors.items()])


if __name__ == "__main__":
    main()
