"""Fusion: per-call time of `fuse=True` (bitwise) and of a declared tolerance (`fuse={"rtol":
r, "atol": a}`) against graphdispatch unfused, default Inductor and eager, each one's
numbers against eager, and the first call with Inductor's caches warm.

Models (tiny random configs, as tests build them; graphdispatch_backend/examples/families.py):
the DiT families (diffusers CogVideoX, HunyuanVideo, PixArt) and the LLM families
(transformers Phi3, Mistral, Gemma 2), each fp32 and bf16. CPU, one thread,
`torch.no_grad()`, `cuda_graphs=False` (what is timed is the kernels, not the host model of
a CUDA graph). Tolerances: fp32 rtol 1e-3, atol 1e-5; bf16 rtol 3e-2, atol 3e-2 (a few of
its ulps: Inductor's reductions round otherwise).

Method: each model and dtype is measured in `--processes` fresh processes (2 by default),
one after the other, the variants compiled in the order listed in the first and in the
reverse order in the second: where a process compiled first moves a ratio by several
percent (PixArt fp32's tolerance against Inductor: 1.016-1.091 over four processes, and
1.085 against 1.029 in one run's two), so the figures pool both orders (`per_process` in
the JSON keeps each one's). In each process every variant is compiled (Dynamo reset
between variants), called once to warm Inductor's caches, compiled again from a reset Dynamo and called once: the
warm first call (compile plus one run, every cache warm as a restarted server finds it;
`--cold`: the first compile's call, Inductor's caches empty). Then 5 calls on fresh inputs
are compared with eager: bit for bit (`fuse=True` must be), or the largest error
(absolute and relative; every call of the tolerance variant must be within its
tolerance), then 1100 calls more: past the 1024th, where the checks' schedules reach their
steady state (every ~1024th call checked under `doubling`, every ~256th under `dense`, the
tolerance's default), so the time per call counts the checks a long-running server pays. Per-call time is A/B
interleaved (common.interleaved: each repeat runs every variant in a fresh shuffled order),
median microseconds over the processes' repeats; ratios are the median of per-repeat paired
ratios (paired within a process), the first call the median over processes. `--clock cpu`
counts the thread's CPU time (a shared machine: the time other processes hold the core is
not charged); the default is the wall clock. The fused graphs' kernels, the ops fused and
kept, and the tolerance's checks and largest error are read from the report.

Learning: the demo (fp32) with one fused op made one ulp off (testing.perturbed,
`aten.mul.Tensor`), `recheck="every"`: the first call's time (compile, the check that
catches it, the bisection's compiles and runs), the runs it took, and that every later
call is bitwise; then the same model compiled again with that verdict cache: no round.

Targets: the tolerance variant per call <= 1.1x default Inductor on every model and dtype,
every call within its tolerance; `fuse=True` <= 1.35x default Inductor on the DiT families,
every call bitwise; the warm first call of both <= 1.2x default Inductor's.

    python bench/fusion.py                  # every model, both dtypes
    python bench/fusion.py --quick          # fewer repeats
    python bench/fusion.py --models cogvideox,mistral --dtypes fp32 --clock cpu
    python bench/fusion.py --scale 4 --no-learning    # the families 4x as wide (fixed per-call costs shrink)
    python bench/fusion.py --smoke          # a one-block demo, fp32, no Inductor, one child: the plumbing (CI)
    python bench/fusion.py --statistics --clock cpu   # only: where the tolerance's novelty statistics are taken
    python bench/fusion.py --frames         # only: the Python frames one steady call enters, per variant

`--frames`: only the Python frames one steady call enters, per variant and family
(`sys.setprofile` over 100 calls after the warm ones): exact and repeatable where per-call
times on a shared machine move by tens of percent between runs. JSON `fusion_frames`.

`--statistics`: only an A/B of where a tolerance graph takes its inputs' novelty
statistics, per family and dtype in one process, interleaved against default Inductor: in
its own kernels (the default, fusion/statistics.py) or by the check's own reduction before
the call (`watched_in_graph` made to watch nothing while it compiles), or not at all
(novelty checks off while it compiles). JSON `fusion_statistics`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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
from graphdispatch_backend.examples.families import DIT, FAMILIES, LLM, first_tensor

VARIANTS = ("eager", "graphdispatch", "inductor", "fused", "tolerance")
TOLERANCES = {torch.float32: {"rtol": 1e-3, "atol": 1e-5}, torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2}}
TARGET_TOLERANCE, TARGET_FUSED, TARGET_FIRST = 1.1, 1.35, 1.2
WARM_CALLS = 1100  # past the 1024th call: the checks' schedules (doubling, dense) are in their steady state
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _compiled(name: str, model: torch.nn.Module, dtype: torch.dtype) -> Callable[..., Any]:
    if name == "eager":
        return model
    if name == "inductor":
        return torch.compile(model, backend="inductor")
    fuse = {"graphdispatch": False, "fused": True, "tolerance": TOLERANCES[dtype]}[name]
    return torch.compile(model, backend="graphdispatch", options={"cuda_graphs": False, "cache_dir": False,
                                                                  "fuse": fuse})


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(largest absolute, largest relative error where eager is not 0)."""
    g, w = got.detach().double(), want.detach().double()
    gap = (g - w).abs()
    rel = gap[w != 0] / w[w != 0].abs()
    return float(gap.max()), float(rel.max()) if rel.numel() else 0.0


def _fusion_row(row: dict[str, Any], name: str) -> None:
    fusions = [g["fusion"] for g in graphdispatch_backend.latest_report()["graphs"] if g.get("fusion")]
    row[f"{name}_kernels"] = sum(f.get("kernels", 0) for f in fusions)
    row[f"{name}_status"] = ",".join(sorted({f["status"] for f in fusions}))
    row[f"{name}_fused_ops"] = sorted({op for f in fusions for op in f.get("fused_ops", {})})
    row[f"{name}_recipe_keeps"] = sorted({k["op"] for f in fusions for k in f.get("kept", []) if k["why"] == "recipe"})
    row[f"{name}_learned"] = sorted({k["op"] for f in fusions for k in f.get("kept", []) if k["why"] != "recipe"})
    if name == "tolerance":
        row["tolerance_checks"] = sum(f.get("checks", 0) for f in fusions)
        row["tolerance_beyond"] = sum(f.get("beyond", 0) for f in fusions)
        largest = [f["largest_error"] for f in fusions if f.get("largest_error")]
        row["tolerance_report_budget"] = max((e["budget"] for e in largest), default=0.0)


def measure(family: str, dtype: torch.dtype, repeats: int, inner: int, variants: tuple[str, ...],
            warm: bool, clock: Callable[[], int], smoke: bool = False, scale: int = 1) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs = FAMILIES[family](**({"depth": 1} if family == "demo" else {"scale": scale} if scale > 1 else {}))
    model = model.to(dtype).eval()

    def under(fn: Callable[..., Any], i: int) -> torch.Tensor:
        with torch.no_grad():
            return first_tensor(fn(**inputs(i, dtype)))

    row: dict[str, Any] = {"model": family, "dtype": "bf16" if dtype == torch.bfloat16 else "fp32"}
    callables: dict[str, Callable[[], Any]] = {}
    for name in variants:
        torch._dynamo.reset()
        graphdispatch_backend.reset()
        if warm and name != "eager":  # Inductor's caches (and graphdispatch's) as a restarted server finds them
            under(_compiled(name, model, dtype), 0)
            torch._dynamo.reset()
            graphdispatch_backend.reset()
        fn = _compiled(name, model, dtype)
        start = time.perf_counter()
        under(fn, 0)
        row[f"{name}_first_s"] = time.perf_counter() - start
        pairs = [(under(fn, i), under(model, i)) for i in range(1, 6)]
        row[f"{name}_bitwise"] = all(torch.equal(g, w) and g.stride() == w.stride() for g, w in pairs)
        errors = [_errors(g, w) for g, w in pairs]
        row[f"{name}_max_abs"] = max(e[0] for e in errors)
        row[f"{name}_max_rel"] = max(e[1] for e in errors)
        if name == "tolerance":
            tol = TOLERANCES[dtype]
            row["tolerance_within"] = all(torch.allclose(g.double(), w.double(), **tol) and g.stride() == w.stride()
                                          for g, w in pairs)
        if name in ("fused", "tolerance"):
            _fusion_row(row, name)
        args = inputs(9, dtype)
        callables[name] = lambda fn=fn, args=args: under(lambda **_: fn(**args), 9)
    # Warmed only now: Dynamo's reset between variants dropped each earlier variant's compiled
    # code, which its next call compiles again (a graphdispatch variant's check schedules
    # starting over at call 1); warmed before the reset, they would be timed on their dense
    # first checks, not past the 1024th call
    for name in variants:
        for _ in range(2 if smoke else WARM_CALLS):
            callables[name]()
    times = interleaved(callables, repeats=repeats, inner=inner, baseline=variants[0], clock=clock)
    row["samples_us"] = {name: times[name]["samples_us"] for name in times}
    row["compile_order"] = list(variants)
    for name in VARIANTS:
        row[f"{name}_us"] = times[name]["median_us"] if name in times else float("nan")
        for key in ("bitwise", "first_s", "max_abs", "max_rel"):
            row.setdefault(f"{name}_{key}", float("nan") if key != "bitwise" else False)
    for a, b in (("fused", "inductor"), ("tolerance", "inductor"), ("fused", "graphdispatch"), ("fused", "eager"),
                 ("tolerance", "eager"), ("inductor", "eager")):
        row[f"{a}_vs_{b}"] = paired_ratio(times, a, b) if a in times and b in times else float("nan")
    for a in ("fused", "tolerance"):
        row[f"{a}_first_vs_inductor"] = row[f"{a}_first_s"] / row["inductor_first_s"]
    torch._dynamo.reset()
    return row


def in_processes(family: str, dtype: str, processes: int, args: Any) -> dict[str, Any]:
    """`measure` of one row in `processes` fresh processes, sequentially, the variants compiled
    in the listed order in the even ones and in the reverse order in the odd ones; pooled.
    Where a process compiled first moves a ratio by several percent (the same PixArt fp32
    tolerance against Inductor: 1.016-1.091 over four processes and both orders, 2026-12-06),
    a row measured in one process carries that placement; pooled, it carries their median.
    Per call: the median over every process's repeats (paired within its process); the first
    call: the median over processes. `per_process` keeps each process's ratios."""
    rows = []
    for index in range(processes):
        command = [sys.executable, __file__, "--child", family, dtype, "reversed" if index % 2 else "listed",
                   "--clock", args.clock, "--scale", str(args.scale)] + (["--quick"] if args.quick else []) + (
                   ["--cold"] if args.cold else []) + (["--smoke"] if args.smoke else [])
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"fusion bench: {family} {dtype} process {index} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"fusion: {family} {dtype} process {index + 1}/{processes}: tolerance/ind "
              f"{rows[-1]['tolerance_vs_inductor']:.3f}, fused/ind {rows[-1]['fused_vs_inductor']:.3f}",
              file=sys.stderr, flush=True)  # nan in a smoke run: no Inductor
    return pooled(rows)


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the same row measured in several processes (`in_processes`)."""
    row = dict(rows[0])
    row["per_process"] = [{"compile_order": r["compile_order"], **{k: r[k] for k in r if k.endswith("_vs_inductor")}}
                          for r in rows]
    for key in [k for k in row if k.endswith(("_bitwise", "_within"))]:
        row[key] = all(r[key] for r in rows)
    for key in [k for k in row if k.endswith(("_max_abs", "_max_rel", "_checks", "_beyond", "_budget"))]:
        row[key] = max(r[key] for r in rows)
    for key in [k for k in row if k.endswith("_learned")]:  # what any process learned
        row[key] = sorted({op for r in rows for op in r[key]})
    for key in [k for k in row if k.endswith("_status")]:
        row[key] = ",".join(sorted({status for r in rows for status in r[key].split(",") if status}))
    for name in VARIANTS:
        row[f"{name}_first_s"] = statistics.median(r[f"{name}_first_s"] for r in rows)
        if name in row["samples_us"]:
            row[f"{name}_us"] = statistics.median(t for r in rows for t in r["samples_us"][name])
    for key in [k for k in row if "_vs_" in k and not k.endswith("first_vs_inductor")]:
        a, b = key.split("_vs_")
        if a in row["samples_us"] and b in row["samples_us"]:
            row[key] = statistics.median(x / y for r in rows for x, y in zip(r["samples_us"][a], r["samples_us"][b]))
    for a in ("fused", "tolerance"):
        row[f"{a}_first_vs_inductor"] = row[f"{a}_first_s"] / row["inductor_first_s"]
    row["samples_us"] = {name: [t for r in rows for t in r["samples_us"][name]] for name in row["samples_us"]}
    return row


def statistics_ablation(family: str, dtype: torch.dtype, repeats: int, inner: int,
                        clock: Callable[[], int]) -> dict[str, Any]:
    """Per call, in one process: default Inductor, the tolerance with its statistics in its
    kernels (`in_graph`), with the check taking them itself (`by_check`), and with no
    novelty statistics at all (`without`: runtime/checks/novelty.py ENABLED off while it
    compiles)."""
    from unittest import mock

    from graphdispatch_backend import backend
    from graphdispatch_backend.runtime.checks import novelty

    torch.manual_seed(0)
    model, inputs = FAMILIES[family]()
    model = model.to(dtype).eval()
    args = inputs(9, dtype)
    fns = {"inductor": _compiled("inductor", model, dtype)}
    for name in ("in_graph", "by_check", "without"):
        fns[name] = _compiled("tolerance", model, dtype)  # one session (same options), a graph each

    def call(name: str) -> torch.Tensor:
        with torch.no_grad():
            return first_tensor(fns[name](**args))

    for name in fns:
        if name == "by_check":  # compiled at its first call
            with mock.patch.object(backend, "watched_in_graph", lambda *a, **k: []):
                call(name)
        elif name == "without":
            with mock.patch.object(novelty, "ENABLED", False):
                call(name)
        for _ in range(WARM_CALLS):
            call(name)
    times = interleaved({n: (lambda n=n: call(n)) for n in fns}, repeats=repeats, inner=inner, baseline="inductor",
                        clock=clock)
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    return {"model": family, "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
            **{f"{n}_us": times[n]["median_us"] for n in fns},
            "in_graph_vs_inductor": paired_ratio(times, "in_graph", "inductor"),
            "by_check_vs_inductor": paired_ratio(times, "by_check", "inductor"),
            "in_graph_vs_by_check": paired_ratio(times, "in_graph", "by_check"),
            "in_graph_vs_without": paired_ratio(times, "in_graph", "without"),
            "by_check_vs_without": paired_ratio(times, "by_check", "without")}


def frames(family: str, dtype: torch.dtype, variants: tuple[str, ...], warm: int = WARM_CALLS,
           calls: int = 100) -> dict[str, Any]:
    """The Python frames one steady call enters, per variant (`sys.setprofile` over `calls`
    calls after `warm`): the model's own Python, Dynamo's guards and aot's wrapper in every
    variant, then each one's own. Exact and repeatable, where per-call times on a shared
    machine move by tens of percent between runs; inside a model's call each frame costs
    several times what it costs alone (its code evicted by the model's kernels)."""
    torch.manual_seed(0)
    model, inputs = FAMILIES[family]()
    model = model.to(dtype).eval()
    args = inputs(9, dtype)
    row: dict[str, Any] = {"model": family, "dtype": "bf16" if dtype == torch.bfloat16 else "fp32"}
    for name in variants:
        torch._dynamo.reset()
        fn = _compiled(name, model, dtype)
        entered = [0]

        def count(frame: Any, event: str, arg: Any, entered: list[int] = entered) -> None:
            if event == "call":
                entered[0] += 1

        with torch.no_grad():
            for _ in range(warm):
                fn(**args)
            sys.setprofile(count)
            try:
                for _ in range(calls):
                    fn(**args)
            finally:
                sys.setprofile(None)
        row[f"{name}_frames"] = entered[0] / calls
    torch._dynamo.reset()
    graphdispatch_backend.reset()
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


def _targets(rows: list[dict[str, Any]], first: bool) -> list[Target]:
    targets = []
    for r in rows:
        label = f"{r['model']} {r['dtype']}"
        if r["inductor_us"] == r["inductor_us"]:  # measured (not in a smoke run)
            targets.append(Target(f"{label}: tolerance / default Inductor per call", f"<= {TARGET_TOLERANCE}",
                                  f"{r['tolerance_vs_inductor']:.2f}", r["tolerance_vs_inductor"] <= TARGET_TOLERANCE))
            if r["model"] in DIT:
                targets.append(Target(f"{label}: fuse=True / default Inductor per call", f"<= {TARGET_FUSED}",
                                      f"{r['fused_vs_inductor']:.2f}", r["fused_vs_inductor"] <= TARGET_FUSED))
            if first:
                worst = max(r["fused_first_vs_inductor"], r["tolerance_first_vs_inductor"])
                targets.append(Target(f"{label}: warm first call, fused and tolerance / default Inductor",
                                      f"<= {TARGET_FIRST}", f"{r['fused_first_vs_inductor']:.2f}, "
                                      f"{r['tolerance_first_vs_inductor']:.2f}", worst <= TARGET_FIRST))
    targets.append(Target("fuse=True bitwise with eager on every call", "all", ", ".join(
        f"{r['model']} {r['dtype']}" for r in rows if not r["fused_bitwise"]) or "all",
        all(r["fused_bitwise"] for r in rows)))
    targets.append(Target("tolerance: every call within it (bench), every check within it or answered by eager",
                          "all", ", ".join(f"{r['model']} {r['dtype']}" for r in rows if not r["tolerance_within"])
                          or "all", all(r["tolerance_within"] for r in rows)))
    return targets


def _variants(smoke: bool) -> tuple[str, ...]:
    """What is measured: in a smoke run no default Inductor (a C++ build of half a minute on a
    fresh machine: figures, not plumbing)."""
    return tuple(v for v in VARIANTS if v != "inductor") if smoke else VARIANTS


def main() -> None:
    def extra(p: Any) -> None:
        p.add_argument("--cold", action="store_true", help="first call with Inductor's caches empty (a temp folder)")
        p.add_argument("--models", default=",".join((*DIT, *LLM)), help="families, comma-separated")
        p.add_argument("--dtypes", default="fp32,bf16")
        p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
        p.add_argument("--no-learning", action="store_true")
        p.add_argument("--scale", type=int, default=1,
                       help="the families' widths and latent sides (LLMs: sequence and vocabulary) times N")
        p.add_argument("--statistics", action="store_true",
                       help="only: the tolerance with its novelty statistics in its kernels or taken by the check")
        p.add_argument("--frames", action="store_true",
                       help="only: the Python frames a steady call enters, per variant")
        p.add_argument("--processes", type=int, default=2,
                       help="each row measured in N fresh processes, compile order alternating, pooled "
                            "(1: all rows in this one)")
        p.add_argument("--child", nargs=3, metavar=("MODEL", "DTYPE", "ORDER"), help=argparse.SUPPRESS)

    args = parse_args(__doc__, extra)
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gd-fusion-bench-")
    torch.set_num_threads(1)
    raise_dynamo_limits()
    clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    models = ["demo"] if args.smoke else args.models.split(",")
    dtypes = ["fp32"] if args.smoke else args.dtypes.split(",")
    repeats, inner = (3, 2) if args.smoke else (9, 5) if args.quick else (21, 10)
    if args.child:  # one row, in this process, for in_processes: its JSON on the last line
        family, dtype, order = args.child
        listed = _variants(args.smoke) if order == "listed" else tuple(reversed(_variants(args.smoke)))
        row = measure(family, DTYPES[dtype], repeats, inner, listed, warm=not (args.cold or args.smoke), clock=clock,
                      smoke=args.smoke, scale=args.scale)
        print(json.dumps(row))
        return
    if args.statistics:
        got = [statistics_ablation(m, DTYPES[d], repeats, inner, clock) for m in models for d in dtypes]
        emit("fusion_statistics", {"rows": got, "repeats": repeats, "inner": inner, "clock": args.clock}, [(
            f"The tolerance's novelty statistics: in its kernels or by the check (per call, us, {args.clock} clock)",
            ["model", "dtype", "inductor us", "in graph us", "by check us", "without us", "in graph/ind",
             "by check/ind", "in graph/by check", "in graph/without", "by check/without"],
            [[r["model"], r["dtype"], *(fmt_us(r[f"{n}_us"]) for n in ("inductor", "in_graph", "by_check", "without")),
              *(f"{r[k]:.3f}" for k in ("in_graph_vs_inductor", "by_check_vs_inductor", "in_graph_vs_by_check",
                                        "in_graph_vs_without", "by_check_vs_without"))]
             for r in got])], [], args)
        return
    variants = _variants(args.smoke)
    if args.frames:
        counted = ("inductor", "graphdispatch", "fused", "tolerance") if not args.smoke else variants[1:]
        got = [frames(m, DTYPES[d], counted, warm=2 if args.smoke else WARM_CALLS) for m in models for d in dtypes]
        emit("fusion_frames", {"rows": got, "calls": 100, "warm": WARM_CALLS}, [(
            "Python frames one steady call enters (sys.setprofile over 100 calls after the warm ones)",
            ["model", "dtype", *counted], [[r["model"], r["dtype"], *(f"{r[f'{v}_frames']:g}" for v in counted)]
                                          for r in got])], [], args)
        return
    if args.processes <= 1:
        rows = [measure(m, DTYPES[d], repeats, inner, variants, warm=not (args.cold or args.smoke), clock=clock,
                        smoke=args.smoke, scale=args.scale) for m in models for d in dtypes]
    else:
        # a smoke runs one child: the plumbing of a pooled row, without a second compile of each variant
        processes = 1 if args.smoke else args.processes
        rows = [in_processes(m, d, processes, args) for m in models for d in dtypes]
    learned = None if args.smoke or args.no_learning else learning()
    header = ["model", "dtype", *(f"{v} us" for v in VARIANTS), "fused/ind", "tol/ind", "fused/gd", "fused/eager",
              "ind/eager", "tol/ind, fused/ind per process", "fused bitwise", "tol max abs", "tol max rel",
              "tol checks", "kernels (fused, tol)"]
    table_rows = [[r["model"], r["dtype"], *(fmt_us(r[f"{v}_us"]) for v in VARIANTS),
                   *(f"{r[k]:.2f}" for k in ("fused_vs_inductor", "tolerance_vs_inductor", "fused_vs_graphdispatch",
                                             "fused_vs_eager", "inductor_vs_eager")),
                   "; ".join(f"{p['tolerance_vs_inductor']:.2f}, {p['fused_vs_inductor']:.2f}"
                             for p in r.get("per_process", [])) or "-",
                   "yes" if r["fused_bitwise"] else "NO", f"{r['tolerance_max_abs']:.2g}",
                   f"{r['tolerance_max_rel']:.2g}", f"{r['tolerance_checks']} ({r['tolerance_beyond']} beyond)",
                   f"{r['fused_kernels']}, {r['tolerance_kernels']}"] for r in rows]
    first = [[r["model"], r["dtype"], *(f"{r[f'{v}_first_s']:.2f}" for v in VARIANTS[1:]),
              f"{r['fused_first_vs_inductor']:.2f}", f"{r['tolerance_first_vs_inductor']:.2f}"] for r in rows]
    kept = [[r["model"], r["dtype"], ", ".join(o.split(".")[1] for o in r["fused_recipe_keeps"]) or "-",
             ", ".join(r["fused_learned"] + r["tolerance_learned"]) or "-"] for r in rows]
    caches = ("empty (--cold)" if args.cold else "as found (--smoke)" if args.smoke
              else "warm (compiled once before, Dynamo reset)")
    sized = f", the families at {args.scale}x their width" if args.scale > 1 else ""
    tables = [(f"Per call, CPU, one thread (us, median, {args.clock} clock; ratios paired per repeat{sized})", header,
               table_rows),
              (f"First call (compile + one run, seconds; Inductor's caches {caches})",
               ["model", "dtype", *VARIANTS[1:], "fused/ind", "tol/ind"], first),
              ("Ops fuse=True leaves to ATen (the recipe), ops learned", ["model", "dtype", "recipe keeps", "learned"],
               kept)]
    targets = _targets(rows, first=not (args.cold or args.smoke))
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
    name = "fusion" if args.scale == 1 else f"fusion_scale{args.scale}"
    emit(name, {"rows": rows, "scale": args.scale, "repeats": repeats, "inner": inner, "clock": args.clock,
                "caches": caches, "tolerances": {str(k): v for k, v in TOLERANCES.items()}, "learning": learned},
         tables, targets, args)


if __name__ == "__main__":
    main()
