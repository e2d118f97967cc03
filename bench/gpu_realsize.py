"""One DiT transformer block at real size on a GPU: eager against graphdispatch's CUDA graph.

Model: `DiTBlock` of graphdispatch_backend.examples.dit (adaLN modulation: shift, scale
and gate from the conditioning through SiLU + Linear(dim, 6 dim); LayerNorm without
affine; attention through `scaled_dot_product_attention`; MLP with tanh GELU) at real
size: dim 3072, 24 heads of 128, MLP ratio 4 (a Flux / HunyuanVideo-wide block), batch 1,
65536 tokens, bfloat16: one hidden state is 384 MiB, the qkv projection 1.1 GiB, the MLP's
hidden 1.5 GiB. The token count is halved until an estimate of what the run needs (48
hidden states) fits in 80% of the free memory, so a 40 or 80 GB card runs it too.

Variants, same weights and inputs, under `torch.no_grad()`:
- `eager`: the block as is.
- `graphdispatch`: `torch.compile(block, backend="graphdispatch", options={"cuda_graphs":
  True})` (call 1: Dynamo compile + warmup, checked against eager; call 2: capture and
  bit-for-bit verification; then replays, the 4th, 8th, 16th ... call rechecked).

Inputs: two distinct (hidden state, conditioning) pairs, alternated call by call; eager's
outputs of its first two calls are the references.

Figures, per call (each call synchronized before and after, outside any other work):
- wall time of each of the first calls (eager 1-3, graphdispatch 1-4: compile + warmup,
  capture + verification, first replay, first recheck), and what graphdispatch did on
  that call, read from its report before and after it (replayed, ran eagerly and why,
  captured, checked against eager);
- peak GPU memory of the call: `torch.cuda.max_memory_allocated()` after
  `reset_peak_memory_stats()`, minus `memory_allocated()` right before the call; what the
  call left allocated (its output aside) and how much `memory_reserved()` grew. A replay
  runs in the CUDA graph's private pool, which is reserved but not allocated at replay:
  the pool's cost shows as the reserved growth of the capture call, not in a replay's
  peak. `peak_total` per variant = max over its calls of (what its earlier calls left
  allocated + the call's peak): the variant's real high-water mark above where it started;
- steady state: rounds of one eager and one graphdispatch call (order rotated), median
  milliseconds per call; graphdispatch's median over the calls its report shows as plain
  replays (no recheck) against eager's median;
- `torch.equal` of every graphdispatch output (first calls included) with eager's output on
  the same inputs, and of every later eager output with the reference (eager's own
  determinism);
- graphdispatch's report per graph: calls, replays, eager calls by reason, declines,
  captures, static bytes, eager checks.

A `torch.OutOfMemoryError` (or any other exception) in one call is recorded as that call's
error and the run goes on; the steady rounds stop early when `--budget-s` (130 s on a GPU)
would be passed, so the results are written within it.
Targets: every graphdispatch output bitwise equal to eager; steady calls replay with no
decline; replay median <= 1.05x eager's (the same kernels: the host path and the copy of
the moving input into the static buffer are the difference). Memory and capture time are
shown, not judged. Exit status 1 when an output differs or a call raised something other
than an out-of-memory error. Budget: about 1-2 minutes on an H200.

Without CUDA it prints "no CUDA device: skipping" and exits 0. `--cpu-smoke` runs the same
plumbing on CPU at a tiny size (dim 64, 4 heads, 512 tokens) with `cuda_graphs="emulate"`,
in seconds: a check of this script, not a figure (`--smoke`, the flag every benchmark
takes, is the same here). Results: `bench/results/gpu_realsize.json`
(`bench/results/smoke/gpu_realsize_cpu_smoke.json` for the smoke run, every target unjudged).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed copy

from common import Target, emit, parse_args

import graphdispatch_backend
from graphdispatch_backend.examples.dit import DiTBlock

SKIP_LINE = "no CUDA device: skipping"
MIB = 1 << 20
REPLAY_SLACK = 1.05
HIDDEN_STATES_NEEDED = 48  # the run's peak, in hidden states (eager ~12, capture and checks on top), with margin
SIZES = {
    "cuda": {"dim": 3072, "heads": 24, "mlp_ratio": 4, "tokens": 65536, "dtype": "bfloat16",
             "eager_first": 3, "gd_first": 4, "rounds": 16, "budget_s": 130.0},
    "smoke": {"dim": 64, "heads": 4, "mlp_ratio": 4, "tokens": 512, "dtype": "bfloat16",
              "eager_first": 3, "gd_first": 4, "rounds": 6, "budget_s": 60.0},
}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="check the plumbing on CPU (no figures); --smoke: the same")
    parser.add_argument("--tokens", type=int, default=None, help="sequence length (default 65536; smoke 512)")
    parser.add_argument("--dim", type=int, default=None, help="model width, heads of 128 (default 3072)")
    parser.add_argument("--budget-s", type=float, default=None, help="stop the steady rounds past this (s)")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def graph_state() -> dict[str, Any]:
    """graphdispatch's counters summed over the latest session's graphs."""
    graphs = (graphdispatch_backend.latest_report() or {}).get("graphs", [])
    eager_by: dict[str, int] = {}
    for g in graphs:
        for k, v in g["cuda_graph"]["eager_by_reason"].items():
            eager_by[k] = eager_by.get(k, 0) + v
    return {"calls": sum(g["calls"] for g in graphs),
            "replays": sum(g["cuda_graph"]["replays"] for g in graphs),
            "eager_calls": sum(g["cuda_graph"]["eager_calls"] for g in graphs),
            "captures": sum(g["cuda_graph"]["captures"] + g["cuda_graph"]["recaptures"] for g in graphs),
            "checks": sum(g["lowering_check"].get("checked", 0) for g in graphs),
            "declines": sum(sum(g["cuda_graph"]["declines"].values()) for g in graphs),
            "eager_by_reason": eager_by}


def what_happened(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The difference of two graph_state()s, in words ("replay", "eager (warmup) + capture + check")."""
    parts = []
    if after["replays"] > before["replays"]:
        parts.append("replay")
    if after["eager_calls"] > before["eager_calls"]:
        reasons = [k for k, v in after["eager_by_reason"].items() if v > before["eager_by_reason"].get(k, 0)]
        parts.append(f"eager ({', '.join(reasons) or '?'})")
    if after["captures"] > before["captures"]:
        parts.append("capture")
    if after["checks"] > before["checks"]:
        parts.append("check")
    if after["declines"] > before["declines"]:
        parts.append("DECLINE")
    return " + ".join(parts) or "?"


def measure(fn: Callable[..., torch.Tensor], x: torch.Tensor, c: torch.Tensor, device: torch.device,
            ref: torch.Tensor | None) -> dict[str, Any]:
    """One synchronized call: seconds, peak bytes above the allocation right before it, what
    it left allocated (its output aside), reserved growth, bitwise equality with `ref`."""
    cuda = device.type == "cuda"
    rec: dict[str, Any] = {"seconds": None, "peak_bytes": None, "left_bytes": None, "reserved_growth": None,
                           "bitwise": None, "error": None, "oom": False}
    gc.collect()
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    out = None
    try:
        start = time.perf_counter()
        out = fn(x, c)
        sync(device)
        rec["seconds"] = time.perf_counter() - start
    except torch.OutOfMemoryError as exc:
        rec["error"], rec["oom"] = f"OutOfMemoryError: {str(exc).strip()[:300]}", True
    except Exception as exc:  # recorded, the run goes on
        rec["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    if cuda:
        rec["peak_bytes"] = torch.cuda.max_memory_allocated() - base
        out_bytes = out.untyped_storage().nbytes() if out is not None else 0
        rec["left_bytes"] = torch.cuda.memory_allocated() - base - out_bytes
        rec["reserved_growth"] = torch.cuda.memory_reserved() - reserved0
    if out is not None and ref is not None:
        rec["bitwise"] = bool(torch.equal(out, ref))
    rec["out"] = out
    if rec["oom"] and cuda:
        gc.collect()
        torch.cuda.empty_cache()
    return rec


def pick_tokens(size: dict[str, Any], device: torch.device, dtype: torch.dtype,
                requested: int | None) -> tuple[int, str]:
    tokens = requested or size["tokens"]
    if device.type != "cuda" or requested:
        return tokens, "as asked" if requested else "fixed"
    free, total = torch.cuda.mem_get_info()
    per_state = size["dim"] * torch.empty((), dtype=dtype).element_size()
    start = tokens
    while tokens > 4096 and HIDDEN_STATES_NEEDED * tokens * per_state > 0.8 * free:
        tokens //= 2
    note = f"{start} halved to {tokens}: {free / MIB:.0f} MiB free of {total / MIB:.0f}" if tokens != start else \
        f"{free / MIB:.0f} MiB free of {total / MIB:.0f}"
    return tokens, note


def summarize(calls: list[dict[str, Any]], first: int) -> dict[str, Any]:
    """Per variant: first calls, steady medians, memory high-water mark above its start."""
    held = 0
    peak_total = None
    for rec in calls:
        if rec["peak_bytes"] is not None:
            peak_total = max(peak_total or 0, held + rec["peak_bytes"])
        held += rec["left_bytes"] or 0
    steady = [r for r in calls[first:] if r["seconds"] is not None]
    peaks = [r["peak_bytes"] for r in steady if r["peak_bytes"] is not None]
    return {
        "first_calls_s": [r["seconds"] for r in calls[:first]],
        "steady_calls": len(steady),
        "steady_median_ms": statistics.median(r["seconds"] for r in steady) * 1e3 if steady else None,
        "steady_min_ms": min(r["seconds"] for r in steady) * 1e3 if steady else None,
        "steady_max_ms": max(r["seconds"] for r in steady) * 1e3 if steady else None,
        "first_calls_peak_bytes": [r["peak_bytes"] for r in calls[:first]],
        "steady_peak_bytes_median": statistics.median(peaks) if peaks else None,
        "steady_peak_bytes_max": max(peaks) if peaks else None,
        "held_bytes": held if calls and calls[0]["left_bytes"] is not None else None,
        "reserved_growth_bytes": sum(r["reserved_growth"] or 0 for r in calls)
        if calls and calls[0]["reserved_growth"] is not None else None,
        "peak_total_bytes": peak_total,
        "errors": [f"call {i + 1}: {r['error']}" for i, r in enumerate(calls) if r["error"]],
    }


def main() -> None:
    args = parse_args(__doc__ or "", options)
    smoke = args.smoke = args.cpu_smoke or args.smoke
    if not torch.cuda.is_available() and not smoke:
        print(SKIP_LINE)
        return
    if smoke:
        torch.set_num_threads(1)  # two threads on a busy 2-core machine spin
    began = time.perf_counter()
    size = dict(SIZES["smoke" if smoke else "cuda"])
    if args.dim:
        size["dim"], size["heads"] = args.dim, max(1, args.dim // 128)
    budget = args.budget_s or size["budget_s"]
    device = torch.device("cpu" if smoke else "cuda")
    dtype = getattr(torch, size["dtype"])
    tokens, tokens_note = pick_tokens(size, device, dtype, args.tokens)
    dim = size["dim"]
    hidden_bytes = tokens * dim * torch.empty((), dtype=dtype).element_size()
    print(f"gpu_realsize: dim {dim}, {size['heads']} heads, {tokens} tokens, {size['dtype']}: "
          f"hidden state {hidden_bytes / MIB:.2f} MiB ({tokens_note})", file=sys.stderr, flush=True)

    torch.manual_seed(0)
    block = DiTBlock(dim, size["heads"], size["mlp_ratio"]).to(device=device, dtype=dtype).eval()
    gen = torch.Generator(device=device).manual_seed(1)
    pool = [(torch.randn(1, tokens, dim, generator=gen, device=device, dtype=dtype),
             torch.randn(1, dim, generator=gen, device=device, dtype=dtype)) for _ in range(2)]
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="graphdispatch",
                             options={"cuda_graphs": "emulate" if smoke else True})
    refs: list[torch.Tensor | None] = [None, None]
    calls: dict[str, list[dict[str, Any]]] = {"eager": [], "graphdispatch": []}
    labels: list[str] = []  # what graphdispatch did on each of its calls

    def run(name: str, i: int) -> None:
        x, c = pool[i % 2]
        fn = block if name == "eager" else compiled
        before = graph_state() if name == "graphdispatch" else None
        rec = measure(fn, x, c, device, refs[i % 2])
        out = rec.pop("out")
        if name == "eager" and refs[i % 2] is None and out is not None:
            refs[i % 2] = out  # eager's first output on this input: the reference
        del out
        if before is not None:
            rec["did"] = what_happened(before, graph_state())
            labels.append(rec["did"])
        calls[name].append(rec)
        n = len(calls[name])
        if n <= size["eager_first" if name == "eager" else "gd_first"] or rec["error"]:
            secs = f"{rec['seconds']:.3f} s" if rec["seconds"] is not None else rec["error"]
            print(f"gpu_realsize: {name} call {n}: {secs}" + (f", peak {mib(rec['peak_bytes'])} MiB"
                  if rec["peak_bytes"] is not None else "") + (f" ({rec['did']})" if "did" in rec else ""),
                  file=sys.stderr, flush=True)

    with torch.no_grad():
        for i in range(size["eager_first"]):
            run("eager", i)
        for i in range(size["gd_first"]):
            run("graphdispatch", i)
        rounds = 0
        while rounds < size["rounds"]:
            t0 = time.perf_counter()
            order = ("eager", "graphdispatch") if rounds % 2 == 0 else ("graphdispatch", "eager")
            for name in order:
                run(name, size["eager_first"] + rounds if name == "eager" else size["gd_first"] + rounds)
            rounds += 1
            spent = time.perf_counter() - began
            if rounds >= 3 and spent + 2 * (time.perf_counter() - t0) > budget:
                print(f"gpu_realsize: stopping after {rounds} steady rounds ({spent:.0f} s of {budget:.0f})",
                      file=sys.stderr, flush=True)
                break

    report = graphdispatch_backend.latest_report() or {}
    graphs = [{"name": g["name"], "calls": g["calls"], "replays": g["cuda_graph"]["replays"],
               "eager_calls": g["cuda_graph"]["eager_calls"], "eager_by_reason": g["cuda_graph"]["eager_by_reason"],
               "declines": g["cuda_graph"]["declines"], "decline_details": g["cuda_graph"]["decline_details"],
               "state": g["cuda_graph"]["state"], "captures": g["cuda_graph"]["captures"],
               "recaptures": g["cuda_graph"]["recaptures"], "static_bytes": g["cuda_graph"]["static_bytes"],
               "eager_checks": g["lowering_check"].get("checked"), "lowering": g["lowering_check"].get("status")}
              for g in report.get("graphs", [])]
    totals = report.get("totals", {})
    declines = {k: v for g in graphs for k, v in g["declines"].items()}
    eager, gd = summarize(calls["eager"], size["eager_first"]), summarize(calls["graphdispatch"], size["gd_first"])
    replay_s = [r["seconds"] for r, did in zip(calls["graphdispatch"][size["gd_first"]:], labels[size["gd_first"]:])
                if r["seconds"] is not None and did == "replay"]
    gd["replay_median_ms"] = statistics.median(replay_s) * 1e3 if replay_s else None
    gd["replay_calls"] = len(replay_s)
    gd["capture_verify_s"] = calls["graphdispatch"][1]["seconds"] if len(calls["graphdispatch"]) > 1 else None
    ratio = gd["replay_median_ms"] / eager["steady_median_ms"] \
        if gd["replay_median_ms"] and eager["steady_median_ms"] else None
    gd_bitwise = [r["bitwise"] for r in calls["graphdispatch"]]
    eager_bitwise = [r["bitwise"] for r in calls["eager"] if r["bitwise"] is not None]
    mismatches = [i + 1 for i, b in enumerate(gd_bitwise) if b is False]
    unchecked = [i + 1 for i, b in enumerate(gd_bitwise) if b is None]
    errors = {"eager": eager["errors"], "graphdispatch": gd["errors"]}
    hard_errors = [r["error"] for r in calls["eager"] + calls["graphdispatch"] if r["error"] and not r["oom"]]

    first_rows = []
    for name in ("eager", "graphdispatch"):
        n_first = size["eager_first"] if name == "eager" else size["gd_first"]
        for i, r in enumerate(calls[name][:n_first]):
            first_rows.append([name, i + 1, r.get("did", "eager (cold)" if i == 0 else "eager"),
                               f"{r['seconds']:.3f}" if r["seconds"] is not None else r["error"][:60],
                               mib(r["peak_bytes"]), mib(r["left_bytes"]), mib(r["reserved_growth"]),
                               {True: "yes", False: "NO", None: "-"}[r["bitwise"]]])
    steady_rows = []
    for name, s in (("eager", eager), ("graphdispatch", gd)):
        steady_rows.append([name, s["steady_calls"], f"{s['steady_median_ms']:.2f}" if s["steady_median_ms"] else "-",
                            f"{s['steady_min_ms']:.2f}" if s["steady_min_ms"] else "-",
                            f"{s['steady_max_ms']:.2f}" if s["steady_max_ms"] else "-",
                            f"{s['replay_median_ms']:.2f} ({s['replay_calls']})" if name == "graphdispatch"
                            and s["replay_median_ms"] else "-",
                            mib(s["steady_peak_bytes_median"]), mib(s["steady_peak_bytes_max"]),
                            mib(s["held_bytes"]), mib(s["reserved_growth_bytes"]), mib(s["peak_total_bytes"])])
    report_rows = [[g["name"], g["calls"], g["replays"], g["eager_calls"], g["eager_by_reason"], g["declines"] or "-",
                    g["captures"], mib(g["static_bytes"]), g["eager_checks"]] for g in graphs]

    replayed = bool(graphs) and sum(g["replays"] for g in graphs) >= rounds and not declines
    targets = [
        Target("realsize: graphdispatch outputs bitwise equal to eager", "every call",
               f"{len(gd_bitwise) - len(mismatches) - len(unchecked)}/{len(gd_bitwise)} equal"
               + (f"; differ at calls {mismatches}" if mismatches else "")
               + (f"; not compared at calls {unchecked}" if unchecked else ""),
               not mismatches and not unchecked and bool(gd_bitwise)),
        Target("realsize: steady calls replay, no decline", f">= {rounds} replays",
               f"{sum(g['replays'] for g in graphs)}/{sum(g['calls'] for g in graphs)} calls replayed"
               + (f"; declines {declines}" if declines else ""), replayed),
        Target("realsize: replay median / eager median", f"<= {REPLAY_SLACK:.2f}",
               f"{ratio:.3f}x ({gd['replay_median_ms']:.2f} vs {eager['steady_median_ms']:.2f} ms)" if ratio
               else "not measured", (ratio <= REPLAY_SLACK) if ratio and not smoke else (None if smoke else False)),
        Target("realsize: capture + verification call", "(info)",
               f"{gd['capture_verify_s']:.3f} s" if gd["capture_verify_s"] is not None else "failed", None),
        Target("realsize: peak memory above start, graphdispatch vs eager", "(info)",
               f"{mib(gd['peak_total_bytes'])} vs {mib(eager['peak_total_bytes'])} MiB; graphdispatch reserved "
               f"+{mib(gd['reserved_growth_bytes'])} MiB" if not smoke else "n/a (cpu smoke)", None),
    ]
    name = "gpu_realsize_cpu_smoke" if smoke else "gpu_realsize"
    emit(name, {
        "cpu_smoke": smoke,
        "device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(),
        "config": {**{k: size[k] for k in ("dim", "heads", "mlp_ratio", "dtype")}, "tokens": tokens,
                   "tokens_note": tokens_note, "batch": 1, "hidden_state_bytes": hidden_bytes,
                   "parameters": sum(p.numel() for p in block.parameters())},
        "steady_rounds": rounds, "seconds": time.perf_counter() - began, "budget_s": budget,
        "eager": eager, "graphdispatch": gd, "replay_vs_eager": ratio,
        "bitwise_graphdispatch_per_call": gd_bitwise, "bitwise_eager_self": all(eager_bitwise) if eager_bitwise
        else None, "graphdispatch_did_per_call": labels,
        "calls": calls, "errors": errors, "graphdispatch_graphs": graphs, "graphdispatch_totals": totals,
        "graphdispatch_declines": declines,
    }, [("first calls (peak: max allocated above the allocation before the call; left: still allocated after"
         " it, output aside; reserved: memory_reserved growth), MiB", ["variant", "call", "did", "seconds", "peak",
                                                                         "left", "reserved", "bitwise"], first_rows),
        (f"steady state, {rounds} rounds of one call each (ms; peak per call MiB; held/reserved/peak_total: above "
         "the variant's start, MiB)", ["variant", "calls", "median", "min", "max", "replay median (n)",
                                       "peak med", "peak max", "held", "reserved", "peak_total"], steady_rows),
        ("graphdispatch report", ["graph", "calls", "replays", "eager", "eager by reason", "declines", "captures",
                                  "static MiB", "checks"], report_rows)],
        targets, args)
    if mismatches or hard_errors:
        print(f"gpu_realsize: {'outputs differ from eager at calls ' + str(mismatches) if mismatches else ''}"
              f"{'; ' if mismatches and hard_errors else ''}{'errors: ' + hard_errors[0] if hard_errors else ''}",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
