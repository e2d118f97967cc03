"""Scaling: the runtime's own per-call cost against graph size and input count, and its
distance from a bare replay, the physical limit of the replay path.

What is measured: everything graphdispatch does on a call *except running the graph*:
the placeholder contract where it applies, the identity check of pinned inputs and
parameters, copy-in of moving inputs into static buffers, clones of the outputs, the
device lock and the counters, for graphs of about 10, 100 and 1000 nodes and 4 to 1024
inputs.

Method: the production objects are built directly, exactly as backend.py wires them for a
graph that Dynamo compiled and that is captured whole: `CompiledGraph(run=GraphRunner(...,
guarded=True, static_shapes=True), contract=PlaceholderContract.of(gm), guarded=True)` over
a real `fx.GraphModule` of N `aten.add` nodes and K placeholders. The replay engine is a
fake whose `capture` runs the graph once (so the static outputs are real), whose `replay`
does nothing and whose streams run every launch at once (ImmediateStreams), so a replayed
call costs only the runtime. The runner is taken through warmup, capture and verification
first (warmup=1, verify_inputs=1), then timed in its `verified` state. Nothing here runs
the graph per call, so any dependence on N means the runtime walks the graph per call
(the target says it must not).

The floor (`bare`): a hand-written loop over the same captured graph doing only what a
correct replay must do: one pointer check over the pinned inputs (in C on CUDA builds,
`torch._C._tensors_data_ptrs_at_indices_equal`; on CPU builds the cheapest Python, one
`data_ptr` list), one batched copy-in of the moving inputs (`torch._foreach_copy_`), the
replay call, one clone per output base. No lock, no counters, no fallback: what is left
when everything that can be taken off the replay path is.

Series (one output tensor each):
- `replay/pinned`: all K inputs are parameters (pinned: read in place, their addresses
  checked on every call), the common case of a captured transformer block.
- `replay/moving`: all K inputs are moving activations (copied into static buffers).
- `eager/contract`: the path a graph that is not captured takes (cuda_graphs off, or
  "auto" on CPU), compiled by a direct call of the backend: contract check and counters
  around a `run` that returns at once.

Timing: for each K, an A/B-interleaved run of a null call, the floor and the runtime
(N=100), then one of the runtime at 10 and at 1000 nodes (at the grid's K): every repeat
runs each variant once, in a fresh order, so paired windows are close in time; windows of
about a millisecond, many of them (on a shared machine a short window is more often a
clean one). Figures: microseconds per call net of the null call; the runtime / floor ratio
(median of per-repeat paired ratios, and fastest window / fastest window); the
1000-node / 10-node ratio (likewise); a least-squares line over K = 4..256 per series (1024
is measured for the grid and the floor ratio: its copies meet cache effects of their own)
(intercept, ns per input), fitted to each cell's fastest window: contention only adds
time, so on a shared machine the minimum is the cleanest estimate of a deterministic cost
(the line through the medians is in the JSON too); and a cProfile of the replay path (top
functions by own time), to say where the Python time goes.

`--smoke` (CI): every series, table and target on a tiny grid (4, 8, 16 nodes; 4 and 8
inputs), 3 repeats of short windows, a profile of 20 calls: the script's plumbing, no
figure (`smoke_grid`).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import operator
import pstats
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Target, emit, fit_line, fmt_us, interleaved, parse_args

from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import CudaGraphStats, GraphRecord
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.call.contract import PlaceholderContract
from graphdispatch_backend.runtime.cudagraph.streams import ImmediateStreams
from graphdispatch_backend.runtime.program.program import CompiledGraph
from graphdispatch_backend.runtime.runner import GraphRunner, RuntimeScope

NODES = (10, 100, 1000)
INPUTS = (4, 32, 256, 1024)  # the grid: node ratio and floor ratio at each
LINE_NODES = 100
LINE_INPUTS = (4, 16, 32, 64, 128, 256)  # the per-input fit: more points than the grid, up to 256
MEASURED = tuple(sorted(set(LINE_INPUTS) | set(INPUTS)))  # 1024: the grid only (cache effects of its own)
SERIES = ("replay/pinned", "replay/moving", "eager/contract")
REPLAY = ("replay/pinned", "replay/moving")
WINDOW_US = {True: 1000.0, False: 1000.0}  # quick / full: a timed window is this long (about)
SHAPE = (8,)  # tiny tensors: the copy-in cost is the dispatcher's, not memory bandwidth
FLOOR_RATIO = 1.3  # replay path / bare replay, at the large K
FLOOR_AT = (256, 1024)
PER_INPUT = {"replay/pinned": (2.0, 70.0), "replay/moving": (2.0, 300.0)}  # (intercept us, ns per input)
NODE_RATIO = 1.10
SMOKE = {"NODES": (4, 8, 16), "LINE_NODES": 8, "INPUTS": (4, 8), "LINE_INPUTS": (4, 8), "FLOOR_AT": (8,)}
SMOKE_WINDOW_US = 100.0
_data_ptr = torch.Tensor.data_ptr
_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def smoke_grid() -> None:
    """The tiny grid of `--smoke` (module globals: every function here reads them at call time)."""
    global NODES, LINE_NODES, INPUTS, LINE_INPUTS, FLOOR_AT, MEASURED
    NODES, LINE_NODES, INPUTS = SMOKE["NODES"], SMOKE["LINE_NODES"], SMOKE["INPUTS"]
    LINE_INPUTS, FLOOR_AT = SMOKE["LINE_INPUTS"], SMOKE["FLOOR_AT"]
    MEASURED = tuple(sorted(set(LINE_INPUTS) | set(INPUTS)))


class _NoReplay:
    def __init__(self, outputs: tuple[Any, ...]) -> None:
        self.outputs = outputs

    def replay(self) -> None:
        pass

    def reset(self) -> None:
        self.outputs = ()


class NoReplayEngine:
    """A ReplayEngine whose replay is free: capture runs the graph once for real outputs;
    its streams run every launch at once (ImmediateStreams), as a replay that costs nothing."""

    name = "no-replay"

    def __init__(self) -> None:
        self._streams = ImmediateStreams()

    def streams(self, device: Any) -> ImmediateStreams:
        return self._streams

    def guard(self, device: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def pool_bytes(self) -> int:
        return 0

    def capture(self, fn: Callable[..., Any], args: Any, device: Any = "cpu", warmup: bool = True,
                rewind: Callable[[], None] | None = None, like: Any = None) -> _NoReplay:
        """The ReplayEngine protocol's capture (runtime/cudagraph/engine.py): one run, no
        separate warmup run to rewind; a relocation (`like`) runs it too."""
        with torch.no_grad():
            return _NoReplay(tuple(fn(*args)))


def make_graph(nodes: int, inputs: int, device: str = "cpu") -> fx.GraphModule:
    """`inputs` placeholders and a chain of `nodes` aten.add calls reading them in turn."""
    graph = fx.Graph()
    placeholders = []
    for i in range(inputs):
        p = graph.placeholder(f"arg{i}")
        p.meta["val"] = torch.empty(SHAPE, device=device)
        placeholders.append(p)
    cur = placeholders[0]
    for j in range(nodes):
        cur = graph.call_function(torch.ops.aten.add.Tensor, (cur, placeholders[(j + 1) % inputs]))
    graph.output((cur,))
    return fx.GraphModule(torch.nn.Module(), graph)


def _args(inputs: int, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen).to(device) for _ in range(inputs)]


def build(series: str, nodes: int, inputs: int, timing: str = "off", engine: Any = None,
          device: str = "cpu") -> tuple[CompiledGraph, list[Any]]:
    """A CompiledGraph wired as backend.py wires a graph Dynamo compiled, taken to its
    steady state; returns it and the argument list to call it with."""
    gm = make_graph(nodes, inputs, device)
    contract = PlaceholderContract.of(gm)
    record = GraphRecord(index=0)
    tm = Timing(timing)
    args = _args(inputs, 1, device)
    if series == "eager/contract":
        outputs = tuple(gm.forward(*args))
        compiled = CompiledGraph(lambda *a: outputs, gm.forward, contract, record, tm, Decline.NOT_CUDA,
                                 lambda detail: None)
        compiled(list(args))
        return compiled, list(args)
    scope = RuntimeScope(engine if engine is not None else NoReplayEngine(), tm, Events(), make_contain(False))
    pinned = series == "replay/pinned"
    state = {i: f"p{i}" for i in range(inputs)} if pinned else {}
    runner = GraphRunner(gm.forward, "bench", scope, CudaGraphStats(), warmup=1, max_captures=8,
                         verify_inputs=1, state_names=state, device=device, guarded=True, static_shapes=True)
    compiled = CompiledGraph(runner, gm.forward, contract, record, tm, None, lambda detail: None, guarded=True)
    # warmup then capture + verify; moving inputs must change identity between the two
    # (both sets held alive: a freed set's addresses would be reused by the next one)
    warm = [list(args), list(args)] if pinned else [_args(inputs, 2, device), _args(inputs, 3, device)]
    for w in warm:
        compiled(w)
    compiled(list(args))
    stats = runner._stats
    if stats.state != "verified" or stats.replays < 1:
        raise RuntimeError(f"{series} N={nodes} K={inputs}: runner did not reach replay: {stats.to_dict()}")
    return compiled, list(args)


def _pick(positions: Sequence[int]) -> Callable[[Sequence[Any]], Any]:
    if positions and list(positions) == list(range(positions[0], positions[0] + len(positions))):
        return operator.itemgetter(slice(positions[0], positions[0] + len(positions)))
    return lambda args: [args[p] for p in positions]


def bare(compiled: CompiledGraph) -> Callable[[list[Any]], list[Any]]:
    """The floor over a built CompiledGraph's captured entry (see module docstring)."""
    runner = compiled._run
    assert isinstance(runner, GraphRunner)
    (entry,) = [e for e in runner._book.entries.values() if e.graph is not None]
    graph = entry.graph
    assert graph is not None
    pinned, ptrs = list(entry.pinned), list(entry.ptrs)
    pick_pinned = _pick(pinned)
    bufs = [buf for _, buf in entry.moving]
    pick_moving = _pick([pos for pos, _ in entry.moving])
    bases = list(graph.outputs)  # one output tensor, its own base
    replay = graph.replay
    if not pinned:
        def call(args: list[Any]) -> list[Any]:
            if bufs:
                torch._foreach_copy_(bufs, pick_moving(args))
            replay()
            return [b.clone() for b in bases]
    elif _PTRS_EQUAL is not None:  # CUDA builds: the check in C++
        at: list[int | None] = [None] * (max(pinned) + 1)
        for pos, ptr in zip(pinned, ptrs):
            at[pos] = ptr

        def call(args: list[Any]) -> list[Any]:
            if not _PTRS_EQUAL(args, at, pinned):
                raise RuntimeError("a pinned input moved")
            if bufs:
                torch._foreach_copy_(bufs, pick_moving(args))
            replay()
            return [b.clone() for b in bases]
    else:
        def call(args: list[Any]) -> list[Any]:
            if list(map(_data_ptr, pick_pinned(args))) != ptrs:
                raise RuntimeError("a pinned input moved")
            if bufs:
                torch._foreach_copy_(bufs, pick_moving(args))
            replay()
            return [b.clone() for b in bases]
    return call


def _inner(fn: Callable[[], Any], window_us: float) -> int:
    """Calls per timed window: about `window_us` of them, at least 5."""
    fn()
    start = time.perf_counter()
    for _ in range(5):
        fn()
    per = (time.perf_counter() - start) / 5 * 1e6
    return max(5, min(5000, int(window_us / max(per, 1e-3))))


def measure_k(series: str, k: int, repeats: int, window_us: float, engine: Any = None, device: str = "cpu",
              after: Callable[[], None] | None = None, nodes: Sequence[int] | None = None) -> dict[str, Any]:
    """At K inputs, two interleaved runs, each of a few variants so that paired windows are
    close in time: a null call, the floor (replay series) and the runtime at the middle node
    count; then, where several node counts are measured at this K, the smallest and the
    largest (the node ratio)."""
    if nodes is None:
        nodes = NODES if k in INPUTS else (LINE_NODES,)
    mid = nodes[len(nodes) // 2]
    out = (torch.empty(SHAPE),)

    def null(args: list[Any]) -> Any:
        return out

    null_args = _args(1, 0)
    built = {n: build(series, n, k, engine=engine, device=device) for n in nodes}
    calls = {n: (lambda c, a: lambda: c(a))(compiled, args) for n, (compiled, args) in built.items()}
    variants: dict[str, Callable[[], Any]] = {"null": lambda: null(null_args), f"N{mid}": calls[mid]}
    if series in REPLAY:
        compiled, args = built[mid]
        floor = bare(compiled)
        variants["floor"] = (lambda f, a: lambda: f(a))(floor, args)
    inner = _inner(calls[mid], window_us)
    res = interleaved(variants, repeats=repeats, inner=inner, baseline="floor" if "floor" in variants else None,
                      after=after)
    if len(nodes) > 1:
        ends = {f"N{nodes[0]}": calls[nodes[0]], f"N{nodes[-1]}": calls[nodes[-1]]}
        res.update(interleaved(ends, repeats=repeats, inner=inner, baseline=f"N{nodes[0]}", after=after, seed=1))
    row: dict[str, Any] = {"inputs": k, "inner": inner, "null_us": res["null"]["median_us"],
                           "null_min_us": res["null"]["min_us"]}
    for name, r in res.items():
        row[name] = {key: r[key] for key in ("median_us", "min_us", "iqr_us") if key in r}
        row[name]["net_us"] = r["median_us"] - res["null"]["median_us"]
        row[name]["net_min_us"] = r["min_us"] - res["null"]["min_us"]
    if "floor" in res:
        row["floor_ratio"] = res[f"N{mid}"]["ratio"]
        row["floor_ratio_min"] = res[f"N{mid}"]["min_us"] / res["floor"]["min_us"]
        row["floor_ratio_of"] = f"N{mid}"
    if len(nodes) > 1:
        row["node_ratio"] = res[f"N{nodes[-1]}"]["ratio"]
        row["node_ratio_min"] = res[f"N{nodes[-1]}"]["min_us"] / res[f"N{nodes[0]}"]["min_us"]
    return row


def fit(rows: dict[int, dict[str, Any]], variant: str) -> dict[str, Any]:
    """Lines over K (LINE_INPUTS) through the fastest windows (judged) and through the
    medians (kept)."""
    ks = [k for k in sorted(rows) if k in LINE_INPUTS]
    lines = {}
    for stat in ("net_min_us", "net_us"):
        ys = [rows[k][variant][stat] for k in ks]
        intercept, slope = fit_line(ks, ys)
        span = intercept + slope * ks[-1]
        resid = max(abs(y - (intercept + slope * k)) for k, y in zip(ks, ys)) / max(span, 1e-9)
        lines[stat] = {"inputs": ks, "net_us": ys, "intercept_us": intercept, "ns_per_input": 1e3 * slope,
                       "max_residual_share": resid}
    return {**lines["net_min_us"], "from": "fastest windows", "median_line": lines["net_us"]}


def profile(series: str, nodes: int, inputs: int, calls: int, top: int = 12) -> list[dict[str, Any]]:
    compiled, args = build(series, nodes, inputs)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        compiled(args)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    total = sum(v[2] for v in stats.stats.values()) or 1.0  # type: ignore[attr-defined]
    rows = []
    for (file, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({
            "function": f"{_short(file)}:{line}({func})" if line else func,
            "calls_per_call": ncalls / calls,
            "own_us_per_call": 1e6 * tottime / calls,
            "cum_us_per_call": 1e6 * cumtime / calls,
            "own_share": tottime / total,
        })
    rows.sort(key=lambda r: r["own_us_per_call"], reverse=True)
    return rows[:top]


def _short(path: str) -> str:
    for marker in ("graphdispatch_backend/", "torch/", "bench/"):
        if marker in path:
            return marker + path.split(marker, 1)[1]
    return Path(path).name


def floor_table(results: dict[str, Any], label: str = "") -> tuple[str, list[str], list[list[Any]]]:
    """Replay path vs bare replay, per series and K (both net of nothing: raw time per call)."""
    rows = []
    for series in REPLAY:
        m = results["series"].get(series)
        if m is None:
            continue
        for k in INPUTS:
            r = m["rows"].get(k)
            if r is None or "floor_ratio" not in r:
                continue
            mid = r["floor_ratio_of"]
            rows.append([series, k, fmt_us(r[mid]["median_us"]), fmt_us(r["floor"]["median_us"]),
                         f"{r['floor_ratio']:.2f}", f"{r['floor_ratio_min']:.2f}"])
    return (f"replay path vs bare replay{label} (us per call; x floor: median of paired ratios, and fastest "
            "window / fastest window)",
            ["series", "inputs", "runtime us", "floor us", "x floor", "min / min"], rows)


def main() -> None:
    args = parse_args(__doc__ or "")
    torch.set_num_threads(1)
    if args.smoke:
        smoke_grid()
    # short windows, many of them: on a shared machine a short window is more often a clean one
    repeats = 3 if args.smoke else 15 if args.quick else 61
    window = SMOKE_WINDOW_US if args.smoke else WINDOW_US[args.quick]
    lo, hi = NODES[0], NODES[-1]
    results: dict[str, Any] = {"method": "direct construction, no-op replay engine, bare-replay floor (see docstring)",
                               "quick": args.quick, "series": {}}
    tables = []
    targets = []
    with torch.no_grad():
        for series in SERIES:
            rows = {k: measure_k(series, k, repeats, window) for k in MEASURED}
            line = fit(rows, f"N{LINE_NODES}")
            m: dict[str, Any] = {"rows": rows, "line": line}
            if series in REPLAY:
                m["floor_line"] = fit(rows, "floor")
            results["series"][series] = m
            grid = [[f"{n}"] + [fmt_us(rows[k][f"N{n}"]["net_us"]) for k in INPUTS] for n in NODES]
            grid.append([f"{hi}/{lo} (paired)"] + [f"{rows[k]['node_ratio']:.3f}" for k in INPUTS])
            grid.append([f"{hi}/{lo} (min/min)"] + [f"{rows[k]['node_ratio_min']:.3f}" for k in INPUTS])
            title = (f"{series}: runtime us per call, net of a null call; line (fastest windows, N={LINE_NODES}) "
                     f"over K={list(LINE_INPUTS)}: {line['intercept_us']:.2f} us + {line['ns_per_input']:.0f} ns/input")
            if series in REPLAY:
                fl = m["floor_line"]
                grid.append(["floor (bare replay)"] + [fmt_us(rows[k]["floor"]["net_us"]) for k in INPUTS])
                title += f"; floor: {fl['intercept_us']:.2f} us + {fl['ns_per_input']:.0f} ns/input"
            tables.append((title, ["nodes"] + [f"K={k}" for k in INPUTS], grid))
            worst = max(rows[k]["node_ratio"] for k in INPUTS)
            worst_min = max(rows[k]["node_ratio_min"] for k in INPUTS)
            targets.append(Target(f"scaling {series}: {hi}-node/{lo}-node", f"<= {NODE_RATIO:.2f}",
                                  f"{worst:.3f} (worst K; min/min {worst_min:.3f})", worst <= NODE_RATIO))
            resid = line["max_residual_share"]
            if series in PER_INPUT:
                cap_us, cap_ns = PER_INPUT[series]
                kind = series.split("/")[1]
                ok = line["intercept_us"] <= cap_us and line["ns_per_input"] <= cap_ns
                targets.append(Target(f"scaling {series}: cost per {kind} input",
                                      f"<= {cap_us:.0f} us + {cap_ns:.0f} ns/input",
                                      f"{line['intercept_us']:.2f} us + {line['ns_per_input']:.0f} ns/input "
                                      f"(floor {m['floor_line']['intercept_us']:.2f} us + "
                                      f"{m['floor_line']['ns_per_input']:.0f} ns)", ok))
                for k in FLOOR_AT:
                    ratio = rows[k]["floor_ratio"]
                    targets.append(Target(f"scaling {series}: x bare replay, K={k}", f"<= {FLOOR_RATIO}",
                                          f"{ratio:.2f}x (min/min {rows[k]['floor_ratio_min']:.2f}x)",
                                          ratio <= FLOOR_RATIO))
                for k in INPUTS:
                    if k not in FLOOR_AT:
                        targets.append(Target(f"scaling {series}: x bare replay, K={k}", "(info)",
                                              f"{rows[k]['floor_ratio']:.2f}x (min/min "
                                              f"{rows[k]['floor_ratio_min']:.2f}x)", None))
            else:
                targets.append(Target(f"scaling {series}: cost per input", "linear (max residual <= 10%)",
                                      f"{line['ns_per_input']:.0f} ns/input + {line['intercept_us']:.1f} us, "
                                      f"residual {100 * resid:.0f}%", resid <= 0.10))
        tables.insert(0, floor_table(results))
        calls = 20 if args.smoke else 2000 if args.quick else 20000
        k_big, k_mid = (INPUTS[-1], INPUTS[0]) if args.smoke else (256, 32)
        results["profile"] = {
            f"replay/pinned N{LINE_NODES} K{k_big}": profile("replay/pinned", LINE_NODES, k_big, max(1, calls // 4)),
            f"replay/moving N{LINE_NODES} K{k_mid}": profile("replay/moving", LINE_NODES, k_mid, calls),
        }
    for name, rows in results["profile"].items():
        tables.append((f"cProfile of the replay path, {name} (top by own time; cProfile inflates small calls)",
                       ["function", "calls/call", "own us/call", "cum us/call", "own %"],
                       [[r["function"][:80], f"{r['calls_per_call']:.0f}", f"{r['own_us_per_call']:.2f}",
                         f"{r['cum_us_per_call']:.2f}", f"{100 * r['own_share']:.0f}"] for r in rows]))
    emit("scaling", results, tables, targets, args)


if __name__ == "__main__":
    main()
