"""Shared helpers for the benchmark scripts (not a benchmark itself).

- `interleaved(variants, ...)`: per-call time of several callables measured A/B
  interleaved: every repeat runs each variant once for `inner` calls, in a fresh shuffled
  order, so drift and a busy neighbour hit all variants alike. Reports the median
  microseconds per call and, per variant, the median of the *paired* ratios to a
  baseline (same repeat), which is what the targets are judged on.
- `block_stack(...)`: the launch-bound model (48 small blocks, small tensors), optionally
  unrolled with a `torch._dynamo.graph_break()` after every block.
- `Target` and `emit(...)`: every script ends by printing a table and its JSON, and by
  writing `bench/results/<name>.json`; `run.py` reads the `targets` list from there.
- `parse_args(...)`: the options every script takes. `--smoke` is the CI mode: tiny sizes
  and repeats, seconds, every section and variant of the script run once; its figures are
  meaningless, so `emit` leaves every target unjudged (`met` None, the verdict it would
  have had in the note) and writes to `bench/results/smoke/<name>.json`, leaving a real
  run's results alone. An error a full run records as a result (a variant that failed to
  compile, a child process that crashed) fails a smoke run instead (`fail_on_errors`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphdispatch_backend.table import table

RESULTS = Path(__file__).resolve().parent / "results"


# -- the launch-bound model ---------------------------------------------------------------
class Block(nn.Module):
    """A small pre-norm residual block: ~6 ATen ops, 4 parameters."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(self.norm(x)))


def _unrolled_forward(depth: int, graph_breaks: bool) -> Callable[..., torch.Tensor]:
    # Unrolled on purpose: a graph break inside a Python `for` loop makes Dynamo skip the
    # whole frame and compile Block.forward once for all blocks (parameters as inputs),
    # which is a different case (see memory.py, "loop" variant).
    brk = "    torch._dynamo.graph_break()\n" if graph_breaks else ""
    src = "def forward(self, x):\n" + "".join(f"    x = self.blocks[{i}](x)\n{brk}" for i in range(depth))
    src += "    return x\n"
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(src, f"<block_stack depth={depth} breaks={graph_breaks}>", "exec"), namespace)
    return namespace["forward"]


def block_stack(depth: int = 48, dim: int = 16, graph_breaks: bool = False, loop: bool = False,
                seed: int = 0) -> nn.Module:
    """`depth` Blocks in sequence, in eval mode. `graph_breaks`: a graph break after every
    block (unrolled, so each block is its own Dynamo graph; with `loop=True` the natural
    `for block in self.blocks` loop instead)."""

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
                if graph_breaks:
                    torch._dynamo.graph_break()
            return x

    if not loop:
        Stack.forward = _unrolled_forward(depth, graph_breaks)  # type: ignore[method-assign]
    torch.manual_seed(seed)
    return Stack().eval()


def raise_dynamo_limits() -> None:
    """Several backends compile the same code object, and graph-broken stacks make many
    frames: keep Dynamo from falling back to eager behind our back."""
    cfg = torch._dynamo.config
    for name, value in (("cache_size_limit", 1024), ("recompile_limit", 1024),
                        ("accumulated_cache_size_limit", 1 << 16), ("accumulated_recompile_limit", 1 << 16)):
        if hasattr(cfg, name):
            setattr(cfg, name, value)


# -- timing -------------------------------------------------------------------------------
def interleaved(
    variants: dict[str, Callable[[], Any]],
    *,
    repeats: int,
    inner: int,
    baseline: str | None = None,
    seed: int = 0,
    after: Callable[[], None] | None = None,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> dict[str, dict[str, Any]]:
    """Microseconds per call of each variant, A/B interleaved (see module docstring).
    `after` runs at the end of each timed window, inside it (a device synchronization, so
    that work a window queued is charged to it). `clock`: nanoseconds, wall by default;
    `time.thread_time_ns` counts the calling thread's CPU time only (one-thread CPU work on
    a shared machine: the time other processes hold the core is not charged)."""
    rng = random.Random(seed)
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}
    perf = clock
    gc.collect()
    gc.freeze()  # what exists now is never looked at again: the collections between repeats stay cheap
    was_enabled = gc.isenabled()
    gc.disable()  # a collection in one variant's window would be charged to it alone
    try:
        for _ in range(repeats):
            order = names[:]
            rng.shuffle(order)
            for name in order:
                fn = variants[name]
                start = perf()
                for _ in range(inner):
                    fn()
                if after is not None:
                    after()
                samples[name].append((perf() - start) / inner / 1e3)
            gc.collect()
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        s = samples[name]
        row: dict[str, Any] = {"median_us": statistics.median(s), "min_us": min(s),
                               "iqr_us": _iqr(s), "repeats": len(s), "inner": inner, "samples_us": s}
        if baseline is not None:
            ratios = [a / b for a, b in zip(s, samples[baseline])]
            row["ratio"] = statistics.median(ratios)
        out[name] = row
    return out


def paired_ratio(res: dict[str, dict[str, Any]], name: str, baseline: str) -> float:
    """Median over repeats of name/baseline, from one `interleaved` result (same repeat paired)."""
    return statistics.median(a / b for a, b in zip(res[name]["samples_us"], res[baseline]["samples_us"]))


def _iqr(values: Sequence[float]) -> float:
    if len(values) < 4:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


# -- reporting ----------------------------------------------------------------------------
@dataclasses.dataclass
class Target:
    figure: str
    target: str
    value: str
    met: bool | None  # None: not judged (skipped, failed to measure)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def machine() -> dict[str, Any]:
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "load_avg_1m": load,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (noisier), for run.py --quick")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON")
    parser.add_argument("--table-only", action="store_true", help="print the tables, not the JSON (still written)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes and repeats, seconds: the script's plumbing, not figures (CI)")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def results_dir(smoke: bool) -> Path:
    """Where a run's JSON goes: bench/results/, or bench/results/smoke/ for a smoke run."""
    return RESULTS / "smoke" if smoke else RESULTS


def unjudged(targets: Sequence[Target]) -> list[Target]:
    """The targets of a smoke run: figures of tiny sizes judge nothing (`met` None); what the
    verdict would have been stays in the note."""
    out = []
    for t in targets:
        said = f"smoke, not judged (would be {verdict(t.met)})" if t.met is not None else "smoke"
        out.append(dataclasses.replace(t, met=None, note=f"{said}; {t.note}" if t.note else said))
    return out


def emit(name: str, payload: dict[str, Any], tables: Sequence[tuple[str, Sequence[str], Sequence[Sequence[Any]]]],
         targets: Sequence[Target], args: argparse.Namespace) -> None:
    """Print the tables, the targets and the JSON (as `args` say); write bench/results/<name>.json
    (with `--smoke`: bench/results/smoke/<name>.json, every target unjudged)."""
    smoke = bool(getattr(args, "smoke", False))
    if smoke:
        targets = unjudged(targets)
    payload = {"benchmark": name, "machine": machine(), "smoke": smoke, **payload,
               "targets": [t.to_dict() for t in targets]}
    folder = results_dir(smoke)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n", "utf-8")
    os.replace(tmp, path)
    if not args.json_only:
        for title, header, rows in tables:
            print(f"\n{title}")
            print(table(header, rows))
        print(f"\n{name}: targets")
        print(target_table(targets))
        print()
    if args.table_only:
        print(f"(JSON written to {path})")
    else:
        print(json.dumps(payload, indent=2, default=str))
    sys.stdout.flush()


def fail_on_errors(args: argparse.Namespace, errors: Sequence[str]) -> None:
    """After `emit`: in a smoke run, an error that a full run records as a result (a peer
    that failed to compile, a crashed child process) ends the script with exit 1, since
    catching such breakage is what a smoke run is for. Outside smoke runs: nothing."""
    if getattr(args, "smoke", False) and errors:
        print("smoke run: errors recorded as results:", *(f"  {e}" for e in errors), sep="\n", file=sys.stderr)
        sys.exit(1)


def target_table(targets: Sequence[Target]) -> str:
    return table(["figure", "target", "value", "met"],
                 [[t.figure, t.target, t.value, verdict(t.met)] for t in targets])


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("yes" if met else "NO")


def fmt_us(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
