"""Fusion: per-call time of `fuse=True` against graphdispatch unfused, eager, aot_eager and
default Inductor, with each one's bits against eager.

Models (tiny random configs, batch as in tests): the demo (`examples/dit.py`), two
diffusers DiTs (LTX video, SD3 image) and a transformers LLM (Llama), each fp32 and bf16
(the demo under bf16 autocast, its weights fp32, as its users run it). CPU, one thread,
`torch.no_grad()`, `cuda_graphs=False` (what is timed is the kernels, not the host model of
a CUDA graph).

Method: every variant is compiled in this process (Dynamo reset between models), called
once (the first-call time: compile plus one run; Inductor's on-disk caches as they are,
or empty with `--cold`), then called on 5 fresh inputs and compared with eager, bit for
bit (`bitwise`), then 40 times more (past the checks of the first calls, which the
`recheck` schedule makes every 1024th call in steady state). Per-call time is A/B
interleaved (common.interleaved: each repeat runs every variant in a fresh shuffled
order), median microseconds; ratios are the median of per-repeat paired ratios. The fused
graph's kernels, the ops Inductor lowered, the ops the recipe left to ATen and the ops the
graph learned to keep are read from the report.

Learning: the demo (fp32) with one fused op made one ulp off (testing.perturbed,
`aten.mul.Tensor`), `recheck="every"`: the first call's time (compile, the check that
catches it, the bisection's compiles and runs), the runs it took, and that every later
call is bitwise; then the same model compiled again with that verdict cache: its first
call, and no round.

Targets: on the DiT-like models (demo, LTX, SD3) fused <= 0.9x graphdispatch unfused per
call, fp32 and bf16; every fused variant bitwise equal to eager on every call.

    python bench/fusion.py            # every model, both dtypes (cold caches: --cold)
    python bench/fusion.py --quick    # fewer repeats
    python bench/fusion.py --smoke    # the demo, fp32, 3 repeats: the plumbing, in CI
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import Target, emit, fmt_us, interleaved, paired_ratio, parse_args, raise_dynamo_limits

import graphdispatch_backend
from graphdispatch_backend.examples import dit
from graphdispatch_backend.examples.families import FAMILIES, first_tensor

TARGET = 0.9
DIT_LIKE = ("demo", "ltx", "sd3")
VARIANTS = ("eager", "aot_eager", "inductor", "graphdispatch", "fused")
WARM_CALLS = 40

def _compiled(name: str, model: torch.nn.Module) -> Callable[..., Any]:
    if name == "eager":
        return model
    if name in ("aot_eager", "inductor"):
        return torch.compile(model, backend=name)
    options = {"cuda_graphs": False, "cache_dir": False, "fuse": name == "fused"}
    return torch.compile(model, backend="graphdispatch", options=options)


def measure(family: str, dtype: torch.dtype, repeats: int, inner: int,
            variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs = FAMILIES[family]()
    autocast = family == "demo" and dtype == torch.bfloat16  # the demo's users run bf16 under autocast
    model = model.to(torch.float32 if autocast else dtype).eval()
    feed = torch.float32 if autocast else dtype

    def under(fn: Callable[..., Any], i: int) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            return first_tensor(fn(**inputs(i, feed)))

    row: dict[str, Any] = {"model": family, "dtype": "bf16" if dtype == torch.bfloat16 else "fp32"}
    callables: dict[str, Callable[[], Any]] = {}
    for name in variants:
        torch._dynamo.reset()
        graphdispatch_backend.reset()
        fn = _compiled(name, model)
        start = time.perf_counter()
        under(fn, 0)
        row[f"{name}_first_s"] = time.perf_counter() - start
        row[f"{name}_bitwise"] = all(torch.equal(under(fn, i), under(model, i)) for i in range(1, 6))
        if name == "fused":
            fusions = [g["fusion"] for g in graphdispatch_backend.latest_report()["graphs"] if g.get("fusion")]
            row["kernels"] = sum(f.get("kernels", 0) for f in fusions)
            row["status"] = ",".join(sorted({f["status"] for f in fusions}))
            row["fused_ops"] = sorted({op for f in fusions for op in f.get("fused_ops", {})})
            row["recipe_keeps"] = sorted({k["op"] for f in fusions for k in f.get("kept", []) if k["why"] == "recipe"})
            row["learned"] = sorted({k["op"] for f in fusions for k in f.get("kept", []) if k["why"] != "recipe"})
        args = inputs(9, feed)
        callables[name] = lambda fn=fn, args=args: under(lambda **_: fn(**args), 9)
        for _ in range(WARM_CALLS):  # past the checks of the first calls (1st, 2nd, 4th, ... 32nd)
            callables[name]()
    times = interleaved(callables, repeats=repeats, inner=inner, baseline="graphdispatch")
    for name in VARIANTS:
        row[f"{name}_us"] = times[name]["median_us"] if name in times else float("nan")
        row.setdefault(f"{name}_bitwise", False)
        row.setdefault(f"{name}_first_s", float("nan"))
    row["fused_vs_graphdispatch"] = paired_ratio(times, "fused", "graphdispatch")
    row["fused_vs_eager"] = paired_ratio(times, "fused", "eager")
    row["inductor_vs_graphdispatch"] = (paired_ratio(times, "inductor", "graphdispatch") if "inductor" in times
                                        else float("nan"))
    torch._dynamo.reset()
    return row


def learning() -> dict[str, Any]:
    """The demo with a fused op one ulp off: what the call that finds it costs, and a restart."""
    from unittest import mock

    from graphdispatch_backend.testing import perturbed

    cache = tempfile.mkdtemp(prefix="gd-fusion-verdicts-")
    torch.manual_seed(0)
    model = dit.TinyDiT(dit.DiTConfig()).eval()
    out: dict[str, Any] = {}
    with mock.patch.object(*perturbed("aten.mul.Tensor")), torch.no_grad():
        for run in ("first", "restart"):
            torch._dynamo.reset()
            graphdispatch_backend.reset()
            compiled = torch.compile(model, backend="graphdispatch",
                                     options={"fuse": True, "recheck": "every", "cache_dir": cache})
            x = [dit.example_inputs(seed=i) for i in range(6)]
            start = time.perf_counter()
            same = [torch.equal(compiled(*x[0]), model(*x[0]))]
            out[f"{run}_call_s"] = time.perf_counter() - start
            same += [torch.equal(compiled(*a), model(*a)) for a in x[1:]]
            (f,) = [g["fusion"] for g in graphdispatch_backend.latest_report()["graphs"] if g.get("fusion")]
            kept = [k for k in f["kept"] if k["why"] != "recipe"]
            out[run] = {"bitwise": all(same), "rounds": f["rounds"], "kept": [(k["op"], k["why"]) for k in kept],
                        "runs": int(kept[0]["detail"].rsplit("(", 1)[1].split()[0]) if run == "first" and kept else 0}
    torch._dynamo.reset()
    return out


def main() -> None:
    args = parse_args(__doc__, lambda p: p.add_argument("--cold", action="store_true",
                                                        help="Inductor's caches empty (a temp folder)"))
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gd-fusion-bench-")
    torch.set_num_threads(1)
    raise_dynamo_limits()
    cases = [("demo", torch.float32)] if args.smoke else [
        (m, dt) for m in FAMILIES for dt in (torch.float32, torch.bfloat16)]
    repeats, inner = (3, 3) if args.smoke else (9, 5) if args.quick else (21, 10)
    # smoke: no default Inductor (a C++ build of half a minute on a fresh machine: figures, not plumbing)
    variants = tuple(v for v in VARIANTS if v != "inductor") if args.smoke else VARIANTS
    rows = [measure(m, dt, repeats, inner, variants) for m, dt in cases]
    learned = None if args.smoke else learning()
    header = ["model", "dtype", *(f"{v} us" for v in VARIANTS), "fused/gd", "fused/eager", "inductor/gd",
              "bitwise (aot, ind, gd, fused)", "kernels", "learned"]
    table_rows = [[r["model"], r["dtype"], *(fmt_us(r[f"{v}_us"]) for v in VARIANTS),
                   f"{r['fused_vs_graphdispatch']:.2f}", f"{r['fused_vs_eager']:.2f}",
                   f"{r['inductor_vs_graphdispatch']:.2f}",
                   " ".join("yes" if r[f"{v}_bitwise"] else "NO" for v in VARIANTS[1:]), r["kernels"],
                   ", ".join(r["learned"]) or "-"] for r in rows]
    first = [[r["model"], r["dtype"], *(f"{r[f'{v}_first_s']:.2f}" for v in VARIANTS[1:])] for r in rows]
    targets = [Target(f"{r['model']} {r['dtype']}: fused / graphdispatch per call", f"<= {TARGET}",
                      f"{r['fused_vs_graphdispatch']:.2f}", r["fused_vs_graphdispatch"] <= TARGET)
               for r in rows if r["model"] in DIT_LIKE]
    targets.append(Target("fused bitwise with eager on every call", "all", ", ".join(
        f"{r['model']} {r['dtype']}" for r in rows if not r["fused_bitwise"]) or "all",
        all(r["fused_bitwise"] for r in rows)))
    cache = "cold (an empty Inductor cache)" if args.cold else "as found (Inductor's on-disk caches)"
    tables = [("Per call, CPU, one thread (us, median; ratios paired per repeat)", header, table_rows),
              (f"First call (compile + one run, seconds; caches {cache})", ["model", "dtype", *VARIANTS[1:]], first)]
    if learned is not None:
        tables.append(("Learning (demo fp32, aten.mul.Tensor one ulp off when fused, recheck='every')",
                       ["run", "first call s", "runs to isolate", "rounds", "kept", "every call bitwise"],
                       [[run, f"{learned[f'{run}_call_s']:.1f}", learned[run]["runs"], learned[run]["rounds"],
                         ", ".join(f"{op} ({why})" for op, why in learned[run]["kept"]),
                         "yes" if learned[run]["bitwise"] else "NO"] for run in ("first", "restart")]))
        alone = learned["first"]["kept"] == [("aten.mul.Tensor", "learned")]
        targets.append(Target("learning: the 1-ulp op found, kept alone, every call bitwise", "yes",
                              str(learned["first"]["kept"]), alone and learned["first"]["bitwise"]))
        targets.append(Target("learning: a restart with the verdict cache", "no round, bitwise",
                              f"rounds {learned['restart']['rounds']}", learned["restart"]["rounds"] == 0
                              and learned["restart"]["bitwise"]))
    emit("fusion", {"rows": rows, "repeats": repeats, "inner": inner, "caches": cache, "learning": learned},
         tables, targets, args)


if __name__ == "__main__":
    main()
