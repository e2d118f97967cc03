"""Scale: cost against the size of the buffers a graph touches, not against toy sizes.

Every other benchmark runs small tensors, where a cost that grows with a buffer's size is
invisible. Five measurements, each side by side in one run (CPU, one torch thread, under
`torch.no_grad()`):

1. `decode`: a decode step on a static cache, against the cache's size.
   `step(cache, pos, k)`: `cache.index_copy_(0, pos, k); return k * 2`, on a float32
   cache of rows of 1024 (4 KiB per row) of 4, 64 and 256 MiB (and 1 GiB with `--big`, or
   in full mode when at least 12 GiB are free; never in `--quick` without `--big`),
   called with a new position each call (`torch.tensor([i % rows])`) and a key row from a
   pool of 8. Variants: `eager` (the function), `inductor` (`torch.compile(step)`; a
   failure is recorded and the rest goes on), `aot_eager`, `graphdispatch`
   (`options={"cuda_graphs": False}`) and `graphdispatch/emulate` (`"emulate"`). Every
   (variant, size) compiles its own copy of `step` (its own code object), so each is one
   static graph, as a static cache is: no cell sees another's shapes, and Dynamo's
   automatic dynamic shapes never turn a second size into a symbolic graph.
   - check: 40 calls from the same start (a zero cache, the same positions and rows) per
     variant, every output and the cache afterwards compared with eager by `torch.equal`;
     a mismatch makes the script exit 1. Warm-up and graphdispatch's verification happen
     in these 40 calls; timing starts after them.
   - time: median microseconds per call; every repeat runs every (variant, size) once for
     a window of about the same length (calls per window set from the check's last calls),
     in a fresh shuffled order (A/B interleaved); ratios are medians of per-repeat paired
     ratios.
   - bytes moved per call: one more call under a TorchDispatchMode that sees the ATen ops
     the call runs (`ignore_compile_internals`: off while Dynamo compiles, on while the
     compiled artifact runs, so it sees the ops of aot's graph, graphdispatch's runtime
     and replays, not the eager function's) and sums the bytes each op WRITES: an
     out-of-place op, the bytes of its output tensors (views: 0; `empty*` allocations: 0,
     they write nothing); an in-place or `out=` op, the bytes of the region it writes:
     `index_copy_`/`index_add_`: `source`, `index_put_`: `values`, `scatter*`: `src`,
     `copy_` and any other mutating op: the mutated argument (the destination view);
     `set_`/`resize_`: 0. Eager's figure is the step's inherent traffic: the row written
     and the output (8 KiB). Kernels that are not ATen ops are invisible to it: Inductor's
     fused C++ kernel (shown `n/a`), and on CUDA a replayed CUDA graph's kernels.
   Targets: graphdispatch's time at 256 MiB <= 1.2x its time at 4 MiB (`cuda_graphs=False`
   and emulate); `cuda_graphs=False` <= 2x Inductor's time per call at every size.
2. `llama`: a tiny random transformers Llama (`LlamaForCausalLM(LlamaConfig(...))`, no
   download; 2 layers, hidden 256, 4 heads of 64, `num_key_value_heads` = heads (wide KV),
   eager attention, float32) generating 32 new tokens greedily from a fixed 8-token prompt
   with `cache_implementation="static"` at `max_cache_len` 256 and 4096 (a 1 MiB and a
   16 MiB cache). Variants: eager, and graphdispatch as transformers' docs compile a
   static-cache decode: `model.forward = torch.compile(model.forward, backend=
   "graphdispatch", options={"cuda_graphs": "emulate"}, dynamic=False)` (a model per
   variant and cache length: `generate` keeps a model's largest static cache length).
   Two generates warm (compile, and capture: the prefill graph, called once per generate,
   captures at its second call; `warm_s` holds their time); then every repeat (11; 5 with `--quick`) times one
   generate per (variant, length), in a rotated order, garbage collection run before and
   off during each (as timeit does); per-token time = its time / 32 (prefill included). Every
   generate's tokens and logits (`output_logits`) are compared with the eager model's at
   the same length by `torch.equal` (a mismatch: exit 1). Figure: graphdispatch's per-token
   ratio 4096/256 against eager's own (paired per repeat). Target: <= 1.2x eager's ratio.
   Also `graphdispatch+attn`: the decode step's `model.layers.*.self_attn` scaffolded as an
   author would (one compile with `report_dir`, `artifacts scaffold` of the decode kind at
   that length), a kernel that writes its cache rows in place (`signature.mutates`), served
   from the compiled model. Target: its 4096/256 ratio <= 1.2x graphdispatch's without it
   (the artifact is as flat in cache size as the native region), every kernel's parity passed.
3. `dit`: peak memory of DiT-like blocks compiled as regions. N blocks (LayerNorm, MLP
   dim -> dim -> dim with GELU, residual; dim 256; MLP ratio 1 to keep the CPU run short),
   each compiled with `block.compile(backend="graphdispatch", options={"cuda_graphs":
   "emulate"})` (diffusers' `compile_repeated_blocks` style), called as a chain for 8
   steps (each step's input is the previous step's output) on a hidden state of 4, 16 and
   64 MiB per block (4096, 16384, 65536 tokens of 256 floats) at N=4, and at N=8 for
   16 MiB; `eager` is the same stack uncompiled on the same input. Each (variant, N, size)
   runs in its own fresh subprocess (this script, `--child dit ...`; two at a time, each
   measures only itself). Peak = the process's RSS high-water mark after the 8 steps minus
   its RSS right before the first call (model and input built), the mark being reset to
   the current RSS at that moment (`/proc/self/clear_refs`, read back as `VmHWM`):
   `ru_maxrss` cannot serve in a child, because Linux carries the parent's high-water mark
   across fork and exec (a child of this 3 GiB process read 3.2 GiB). The children run
   with glibc's mmap threshold fixed at 1 MiB (`MALLOC_MMAP_THRESHOLD_`), so every tensor
   of 1 MiB or more is returned to the system when freed and the RSS follows the live
   tensors (with the default dynamic threshold, blocks under 32 MiB stay in the heap
   after a free and the same eager stack read 86 to 118 MiB at 16 MiB). Figure:
   graphdispatch's peak minus eager's, in MiB, and its slope in MiB per MiB of one block's
   hidden state between 4 and 64 MiB. Both children save their final output; the parent
   compares them (`torch.equal`; a mismatch: exit 1). Targets: slope <= 3 MiB/MiB; the
   peak above eager at N=8 <= that at N=4 + a tolerance of half a hidden state (8 MiB at
   16 MiB: one more retained hidden state per extra block would add 64 MiB).
4. `lifetime`: 20 rounds of compile (a Linear-GELU-Linear model, 64 wide,
   graphdispatch emulate or aot_eager), 8 calls (capture and replays), `torch._dynamo.reset()`,
   `del` and `gc.collect()`, each backend in its own subprocess (`--child lifetime ...`,
   both at once):
   after each round, the live `GraphRunner`s (`gc.get_objects()`) and the RSS; growth per
   round is the slope of a line fitted to the RSS over the last 10 rounds. Targets: no live
   runner after any round; graphdispatch's growth <= aot_eager's + 0.5 MiB per round.
   The same 20 rounds with a 2-layer diffusers LTX transformer (tiny, `examples/families.py`,
   8 calls of its inputs): a real model's many graphs, regions and records; target:
   graphdispatch's growth <= aot_eager's + 0.1 MiB per round.

5. `check`: what a check of a graph fused under a tolerance (`fuse={"rtol": r, "atol": a}`)
   holds beside an output it judges (runtime/checks/parity.py, runtime/checks/tolerance.py:
   compared and measured in float64 chunks). In a fresh process per size (`--child check`,
   glibc's mmap threshold fixed as for `dit`), a float32 output of 16 and 64 MiB and a copy
   1e-6 off: the comparison within the tolerance, the largest errors measured, then one
   element moved beyond it and compared again (the mismatch's path). Figure: the peak RSS
   above the level before, and its slope in MiB per MiB of output. Target: slope <= 0.5.
   Measured 2026-12-06 (`--only check`): 84 MiB at both sizes (the chunks' float64 copies);
   the comparison before, which took float64 copies and masks of the whole output, held
   194 and 758 MiB (11.8 MiB per MiB of output).

6. `weights`: what a check of a replayed call holds where an artifact serves inside the graph
   (runtime/checks/side_by_side.py: the inputs artifacts read and do not declare writing,
   its weights, are fingerprinted and copied while the copies fit `max_snapshot_bytes`,
   256 MiB, so that a kernel's undeclared write into one is put back). In a fresh process
   per size (`--child weights`), a block whose MLP region (an exact artifact, emulate,
   `artifact_recheck="every"`: every replayed call checked) holds 64 and 512 MiB of
   float32 weights; figure: the peak RSS of one checked replay above the level before.
   Target: at most min(weights, 256 MiB) + 16 MiB (the copies and no more; at 512 MiB
   they stop at the limit and the rest is only fingerprinted).

`--device cuda` runs sections 1 and 3 on one CUDA device instead (without a device it
prints one line and exits 0): the cache in float32 at 4, 64, 256 and 1024 MiB, with
graphdispatch `cuda_graphs=True` instead of emulate, every timed window ending in a
synchronization; the DiT block in bfloat16 at dim 1024 with an MLP ratio of 4 at 4, 16,
64 and 256 MiB of hidden state (2048 to 131072 tokens), N=4 and N=8 at 64 MiB, peak =
`torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()` minus the allocated
bytes right before the first call. Results go to `bench/results/scale_cuda.json`. The CPU
path never touches CUDA.

This script imports the graphdispatch_backend of the checkout it lives in (it puts the
repository root first on `sys.path`), not whichever copy the interpreter has installed.
`server`: a transformers server's requests at a 4096-long static cache, on a Llama and an
MoE: a new cache per request, one cache reused, short requests, a rotation of caches
(bench/serving.py says what and its targets). It runs in a fresh process of its own
(`--child server`), as `dit` and `lifetime` do: its figures are time ratios, and what the
sections before it leave in a process (their heap, Dynamo's caches) slowed both sides of
each request by about a fifth and moved the medians by several percent (one cache reused:
0.99x on its own, 1.07x and 1.12x after the decode and llama sections).

`--only decode,llama,server,dit,lifetime,check,weights` runs a subset (development; run.py runs all).

`--smoke` (CI): every section at tiny sizes (`SMOKE`): caches of 1 and 2 MiB with 12
checked calls; a Llama of one layer, hidden 64, at `max_cache_len` 16 and 32, 4 new tokens;
the server's models of one layer at 32, 3 requests (the MoE only its first case); DiT
blocks of dim 64 at 1 and 2 MiB, N=1 and 2, 4 steps (the 3rd replays); 2 lifetime rounds;
checks of 1 and 2 MiB outputs; weights of 1 and 2 MiB; 2-3 repeats. Inductor is skipped
(recorded as skipped, not failed: a cold C++ build takes 10-30 s). The script's plumbing,
no figure.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed copy

from common import Target, emit, fail_on_errors, fit_line, fmt_us, interleaved, parse_args, raise_dynamo_limits
from serving import section_server

import graphdispatch_backend
from graphdispatch_backend.artifacts.scaffold import scaffold

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("decode", "llama", "server", "dit", "lifetime", "check", "weights")
CUDA_SECTIONS = ("decode", "dit")
CHILD_TAG = "SCALE_CHILD "
CHILD_TIMEOUT_S = 900
CHILD_PARALLEL = 2
MIB = 1 << 20

# -- 1. decode step ------------------------------------------------------------------------
ROW = 1024  # floats per cache row
DECODE_MIB = {"cpu": (4, 64, 256), "cuda": (4, 64, 256, 1024)}
BIG_MIB = 1024
BIG_FREE_GIB = 12  # 5 caches of 1 GiB plus an out-of-place copy and a margin
WARM_CALLS = 40
K_POOL = 8
DECODE_SCALE_MAX = 1.2  # time at 256 MiB / time at 4 MiB
DECODE_PEER_MAX = 2.0  # graphdispatch (cuda_graphs=False) / inductor
SCALE_FROM, SCALE_TO = 4, 256

# -- 2. llama generate ---------------------------------------------------------------------
LLAMA = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 8192}
CACHE_LENS = (256, 4096)
NEW_TOKENS, PROMPT_LEN = 32, 8
LLAMA_RATIO_MAX = 1.2  # graphdispatch's 4096/256 per-token ratio over eager's
WARM_GENERATES = 2  # the prefill graph, called once per generate, captures at its 2nd call

# -- 3. DiT-like blocks ----------------------------------------------------------------------
DIT = {"cpu": {"dim": 256, "mlp_ratio": 1, "dtype": "float32", "sizes": (4, 16, 64), "n_at": 16},
       "cuda": {"dim": 1024, "mlp_ratio": 4, "dtype": "bfloat16", "sizes": (4, 16, 64, 256), "n_at": 64}}
DIT_STEPS = 8
DIT_BLOCKS = (4, 8)
DIT_SLOPE_MAX = 3.0  # MiB of peak above eager per MiB of hidden state
SLOPE_FROM, SLOPE_TO = 4, 64

# -- 4. lifetime -------------------------------------------------------------------------------
ROUNDS, ROUND_CALLS, FIT_LAST = 20, 8, 10
RSS_SLACK_MIB = 0.5
LTX_RSS_SLACK_MIB = 0.1  # a real model's graphs: what graphdispatch keeps per dropped graph must be small
LIFETIME_MODELS = ("mlp", "ltx")

# -- 5. a tolerance check of a large output ------------------------------------------------------------
CHECK_MIB = (16, 64)  # float32 output sizes
WEIGHTS_MIB = (64, 512)  # float32 weights of the artifact's region (section 6)
WEIGHTS_SLACK_MIB = 16  # a checked replay's peak beyond its copies: eager's activations, the fingerprints
CHECK_SLOPE_MAX = 0.5  # MiB of peak per MiB of output (whole-output float64 copies and masks held 11.8)

# -- --smoke: every section at tiny sizes (the script's plumbing; see the module docstring) ---------------
SMOKE: dict[str, Any] = {
    "DECODE_MIB": {"cpu": (1, 2), "cuda": (1, 2)}, "SCALE_FROM": 1, "SCALE_TO": 2, "WARM_CALLS": 12,
    "LLAMA": {**LLAMA, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32},
    "CACHE_LENS": (16, 32), "NEW_TOKENS": 4, "PROMPT_LEN": 4,
    "DIT": {device: {**cfg, "dim": 64, "mlp_ratio": 1, "sizes": (1, 2), "n_at": 1} for device, cfg in DIT.items()},
    "DIT_STEPS": 4, "DIT_BLOCKS": (1, 2), "SLOPE_FROM": 1, "SLOPE_TO": 2,
    "ROUNDS": 2, "FIT_LAST": 2, "CHECK_MIB": (1, 2), "WEIGHTS_MIB": (1, 2),
}
SMOKE_SKIPPED = {"inductor": "skipped (--smoke: a cold C++ build takes 10-30 s)"}
_SMOKE = [False]  # smoke sizes in force: the children are started with --smoke too


def smoke_sizes() -> None:
    """The tiny sizes of `--smoke`: the module's globals (every function reads them at call time)."""
    globals().update(SMOKE)
    _SMOKE[0] = True


def gd_options(device: str) -> dict[str, Any]:
    return {"cuda_graphs": True if device == "cuda" else "emulate"}


def replay_name(device: str) -> str:
    return "graphdispatch/cuda_graphs" if device == "cuda" else "graphdispatch/emulate"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux >= 4.0: VmHWM := the current RSS)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """VmHWM: this process's own high-water mark. ru_maxrss is not: Linux carries the mark of
    the forked copy of the parent over exec, so a child of a 3 GiB parent reports >= 3 GiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


# -- bytes written per call ----------------------------------------------------------------------
NO_WRITE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set", "resize", "resize_as",
            "as_strided", "detach", "lift_fresh", "alias"}
REGION_ARG = {"index_copy": "source", "index_add": "source", "index_put": "values", "_index_put_impl": "values",
              "scatter": "src", "scatter_add": "src", "scatter_reduce": "src", "masked_scatter": "source"}


def _arg(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name)
    return None


def written_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """The bytes one ATen op writes (see the module docstring, section 1)."""
    schema = func._schema
    name = schema.name.split("::")[-1]
    base = name[:-1] if name.endswith("_") else name
    if base in NO_WRITE:
        return 0
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if mutated:
        region = REGION_ARG.get(base)
        src = _arg(schema, args, kwargs, region) if region else None
        if isinstance(src, torch.Tensor):
            return src.nbytes
        total = 0
        for n in mutated:
            t = _arg(schema, args, kwargs, n)
            total += sum(x.nbytes for x in tree_flatten(t)[0] if isinstance(x, torch.Tensor))
        return total
    if any(r.alias_info is not None for r in schema.returns):
        return 0  # a view
    return sum(x.nbytes for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor))


class WriteCounter(TorchDispatchMode):
    """Sums `written_bytes` over the ATen ops run while active, including those of compiled
    artifacts (Dynamo turns the mode off while compiling and on while they run)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops = 0
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        n = written_bytes(func, args, kwargs, out)
        self.ops += 1
        self.bytes += n
        self.by_op[str(func)] += n
        return out


# -- section 1: decode step against cache size -------------------------------------------------------
def _step(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, pos, k)
    return k * 2


def fresh_step(tag: str) -> Callable[..., torch.Tensor]:
    """`_step` with its own code object: its own Dynamo cache entries."""
    name = "step_" + "".join(c if c.isalnum() else "_" for c in tag)
    code = _step.__code__.replace(co_name=name, co_qualname=name) if sys.version_info >= (3, 11) else \
        _step.__code__.replace(co_name=name)
    return types.FunctionType(code, _step.__globals__, name)


def decode_variants(device: str) -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    return {
        "eager": lambda f: f,
        "inductor": lambda f: torch.compile(f),
        "aot_eager": lambda f: torch.compile(f, backend="aot_eager"),
        "graphdispatch": lambda f: torch.compile(f, backend="graphdispatch", options={"cuda_graphs": False}),
        replay_name(device): lambda f: torch.compile(f, backend="graphdispatch", options=gd_options(device)),
    }


class DecodeCell:
    """One (variant, cache size): its own cache, position counter and compiled step."""

    def __init__(self, variant: str, mib: int, device: str, fn: Callable[..., Any], ks: list[torch.Tensor]) -> None:
        self.variant, self.mib, self.device, self.fn, self.ks = variant, mib, device, fn, ks
        self.rows = mib * MIB // (ROW * 4)
        self.cache = torch.zeros(self.rows, ROW, device=device)
        self.i = 0
        self.n = 1
        self.error: str | None = None
        self.graphs: tuple[Any, int, int] | None = None  # (session, first graph, end) in its report

    def call(self) -> torch.Tensor:
        i = self.i
        self.i += 1
        return self.fn(self.cache, torch.tensor([i % self.rows], device=self.device), self.ks[i % K_POOL])

    def batch(self) -> None:
        for _ in range(self.n):
            self.call()


def _gd_session() -> Any:
    from graphdispatch_backend import session as gd_session

    return gd_session._LATEST[0] if gd_session._LATEST else None


def check_cell(cell: DecodeCell, reference: list[torch.Tensor] | None, ref_cache: torch.Tensor | None,
               window_us: float) -> dict[str, Any]:
    """The first WARM_CALLS calls (compile, warm-up, verification), each output compared with
    eager's; the cache afterwards; calls per timed window from the last 10 calls."""
    outputs: list[torch.Tensor] = []
    session = before = None
    if cell.variant.startswith("graphdispatch"):
        session = _gd_session()
        before = len(session.report.to_dict()["graphs"]) if session is not None else 0
    t_last = 0.0
    for i in range(WARM_CALLS):
        if i == WARM_CALLS - 10:
            sync(cell.device)
            t_last = time.perf_counter()
        outputs.append(cell.call())
        if i == 0 and cell.variant.startswith("graphdispatch"):
            new = _gd_session()
            if new is not session:  # the first compile of this options value made the session
                session, before = new, 0
    sync(cell.device)
    per_call_us = (time.perf_counter() - t_last) / 10 * 1e6
    cell.n = max(1, min(4000, round(window_us / max(per_call_us, 1e-3))))
    if session is not None:
        cell.graphs = (session, before or 0, len(session.report.to_dict()["graphs"]))
    if reference is None:  # eager: the reference, its cache as of WARM_CALLS calls (before the counted one)
        return {"outputs": outputs, "cache": cell.cache.clone(), "mismatched_calls": 0, "cache_equal": True,
                "est_us": per_call_us}
    bad = sum(not torch.equal(a, b) for a, b in zip(outputs, reference))
    return {"mismatched_calls": bad, "cache_equal": bool(torch.equal(cell.cache, ref_cache)),
            "est_us": per_call_us}


def count_bytes(cell: DecodeCell) -> dict[str, Any]:
    counter = WriteCounter()
    with counter:
        cell.call()
    sync(cell.device)
    top = dict(counter.by_op.most_common(4))
    # nothing written that the mode saw: the work ran in kernels that are not ATen ops (inductor)
    return {"bytes": counter.bytes or None, "ops": counter.ops, "by_op": top}


def gd_stats(cell: DecodeCell) -> dict[str, Any] | None:
    if cell.graphs is None:
        return None
    session, lo, hi = cell.graphs
    graphs = session.report.to_dict()["graphs"][lo:hi]
    calls = sum(g["calls"] for g in graphs)
    replays = sum(g["cuda_graph"]["replays"] for g in graphs)
    declines = {k: v for g in graphs for k, v in g["cuda_graph"]["declines"].items()}
    return {"graphs": len(graphs), "calls": calls, "replays": replays, "declines": declines,
            "states": sorted({str(g["cuda_graph"]["state"]) for g in graphs})}


def section_decode(args: argparse.Namespace, device: str) -> tuple[dict[str, Any], list[Any], list[Target], bool]:
    sizes = list(DECODE_MIB[device])
    big_note = ""
    if device == "cpu":
        free = available_bytes()
        if args.smoke:
            big_note = "--smoke: 1 GiB skipped"
        elif args.big or (not args.quick and free >= BIG_FREE_GIB << 30):
            sizes.append(BIG_MIB)
        else:
            big_note = ("--quick" if args.quick else f"{free / (1 << 30):.1f} GiB free < {BIG_FREE_GIB} GiB") + \
                ": 1 GiB skipped (--big to force)"
    repeats = 3 if args.smoke else 5 if args.quick else 11
    window_us = 2_000.0 if args.smoke else 20_000.0 if args.quick else 40_000.0
    skipped = SMOKE_SKIPPED if args.smoke else {}
    gen = torch.Generator().manual_seed(0)
    ks = [torch.randn(1, ROW, generator=gen).to(device) for _ in range(K_POOL)]
    variants = decode_variants(device)
    cells: dict[tuple[str, int], DecodeCell] = {}
    checks: dict[tuple[str, int], dict[str, Any]] = {}
    errors: dict[str, str] = {}
    bitwise_ok = True
    with torch.no_grad():
        for mib in sizes:
            ref_out: list[torch.Tensor] | None = None
            ref_cache: torch.Tensor | None = None
            for variant, make in variants.items():
                key = (variant, mib)
                if variant in skipped:
                    checks[key] = {"skipped": skipped[variant]}
                    continue
                if variant in errors:
                    checks[key] = {"error": f"skipped: {errors[variant]}"}
                    continue
                start = time.perf_counter()
                try:
                    cell = DecodeCell(variant, mib, device, make(fresh_step(f"{variant}_{mib}")), ks)
                    check = check_cell(cell, ref_out, ref_cache, window_us)
                    check["bytes"] = count_bytes(cell)
                except Exception as exc:  # a variant that cannot compile or run is a result
                    errors[variant] = error_text(exc)
                    checks[key] = {"error": errors[variant]}
                    print(f"scale: decode {variant} @ {mib} MiB failed: {errors[variant]}", file=sys.stderr,
                          flush=True)
                    continue
                if variant == "eager":
                    ref_out, ref_cache = check.pop("outputs"), check.pop("cache")
                check["first_calls_s"] = time.perf_counter() - start
                ok = check["mismatched_calls"] == 0 and check["cache_equal"]
                bitwise_ok &= ok
                checks[key] = check
                cells[key] = cell
                print(f"scale: decode {variant} @ {mib} MiB: warm in {check['first_calls_s']:.1f} s, "
                      f"~{fmt_us(check['est_us'])} us/call, bitwise {'yes' if ok else 'NO'}", file=sys.stderr,
                      flush=True)
            ref_out = ref_cache = None
        timed = {f"{v}@{m}": c.batch for (v, m), c in cells.items()}
        res = interleaved(timed, repeats=repeats, inner=1, after=(lambda: sync(device)) if device == "cuda" else None)
    per_call: dict[tuple[str, int], list[float]] = {
        key: [s / cell.n for s in res[f"{key[0]}@{key[1]}"]["samples_us"]] for key, cell in cells.items()}

    def med(key: tuple[str, int]) -> float:
        return statistics.median(per_call[key])

    def paired(a: tuple[str, int], b: tuple[str, int]) -> float | None:
        if a not in per_call or b not in per_call:
            return None
        return statistics.median(x / y for x, y in zip(per_call[a], per_call[b]))

    rows = []
    results = []
    for mib in sizes:
        for variant in variants:
            key = (variant, mib)
            check = checks.get(key, {})
            if key not in cells:
                rows.append([mib, variant, "-", "-", "-", "-", "-", "-", "-",
                             check.get("skipped") or f"failed: {check.get('error', '?')}"])
                results.append({"variant": variant, "cache_mib": mib, "error": check.get("error"),
                                "skipped": check.get("skipped")})
                continue
            cell = cells[key]
            samples = per_call[key]
            iqr = statistics.quantiles(samples, n=4) if len(samples) >= 4 else [0, 0, 0]
            x_eager = paired(key, ("eager", mib))
            x_small = paired(key, (variant, sizes[0]))
            written = check["bytes"]["bytes"]
            stats = gd_stats(cell)
            replay = f"{stats['replays']}/{stats['calls']}" if stats else ""
            bitwise = check["mismatched_calls"] == 0 and check["cache_equal"]
            rows.append([mib, variant, fmt_us(med(key)), fmt_us(iqr[2] - iqr[0]),
                         f"{x_eager:.1f}" if x_eager is not None else "-",
                         f"{x_small:.2f}" if x_small is not None else "-",
                         f"{written:,}" if written is not None else "n/a", cell.n, replay,
                         "yes" if bitwise else "NO"])
            results.append({"variant": variant, "cache_mib": mib, "rows": cell.rows, "median_us": med(key),
                            "samples_us": samples, "calls_per_window": cell.n, "x_eager": x_eager,
                            f"x_own_{sizes[0]}mib": x_small, "bytes_written_per_call": written,
                            "bytes_by_op": check["bytes"]["by_op"], "aten_ops_per_call": check["bytes"]["ops"],
                            "mismatched_calls": check["mismatched_calls"], "cache_equal": check["cache_equal"],
                            "first_calls_s": check["first_calls_s"], "graphdispatch": stats})
    targets = []
    for variant in ("graphdispatch", replay_name(device)):
        r = paired((variant, SCALE_TO), (variant, SCALE_FROM))
        targets.append(Target(f"scale decode: {variant} t({SCALE_TO} MiB) / t({SCALE_FROM} MiB)",
                              f"<= {DECODE_SCALE_MAX}", f"{r:.2f}x" if r is not None else "failed",
                              r <= DECODE_SCALE_MAX if r is not None else False))
    for mib in sizes:
        r = paired(("graphdispatch", mib), ("inductor", mib))
        note = ""
        if r is None:
            note = (checks.get(("inductor", mib), {}).get("error") or checks.get(("inductor", mib), {}).get("skipped")
                    or checks.get(("graphdispatch", mib), {}).get("error") or "")
        targets.append(Target(f"scale decode: graphdispatch / inductor at {mib} MiB", f"<= {DECODE_PEER_MAX}",
                              f"{r:.2f}x ({fmt_us(med(('graphdispatch', mib)))} vs {fmt_us(med(('inductor', mib)))} us)"
                              if r is not None else f"not measured: {note[:80]}",
                              r <= DECODE_PEER_MAX if r is not None else None, note))
    r = paired(("eager", SCALE_TO), ("eager", SCALE_FROM))
    targets.append(Target(f"scale decode: eager t({SCALE_TO} MiB) / t({SCALE_FROM} MiB)", "(info)",
                          f"{r:.2f}x" if r is not None else "-", None))
    top = sizes[-1]
    moved = ", ".join(f"{v} {checks[(v, top)]['bytes']['bytes'] or 0:,} B" for v in variants
                      if (v, top) in cells and checks[(v, top)]["bytes"]["bytes"] is not None)
    targets.append(Target(f"scale decode: bytes written per call at {top} MiB", "(info; eager = row + output)",
                          moved, None))
    targets.append(Target("scale decode: outputs and cache bitwise equal to eager", "every variant, every size",
                          "yes" if bitwise_ok else "NO", bitwise_ok))
    title = (f"decode step on a static cache ({device}, rows of {ROW} float32; {repeats} repeats interleaved, "
             f"~{window_us / 1e3:.0f} ms windows; x eager and x {sizes[0]} MiB: medians of paired ratios)")
    table = (title, ["cache MiB", "variant", "us/call", "IQR us", "x eager", f"x own {sizes[0]} MiB",
                     "bytes written/call", "calls/window", "replays/calls", "bitwise"], rows)
    payload = {"sizes_mib": sizes, "big": big_note or "included", "repeats": repeats, "window_us": window_us,
               "warm_calls": WARM_CALLS, "results": results, "errors": errors, "skipped": skipped}
    return payload, [table], targets, bitwise_ok


# -- section 2: transformers Llama generate with a static cache ------------------------------------------
def section_llama(args: argparse.Namespace) -> tuple[dict[str, Any], list[Any], list[Target], bool]:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    config = LlamaConfig(**LLAMA, attn_implementation="eager", bos_token_id=None, eos_token_id=None,
                         pad_token_id=0)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, LLAMA["vocab_size"], (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    models: dict[tuple[str, int], Any] = {}
    errors: dict[str, str] = {}

    def generate(key: tuple[str, int]) -> Any:
        return models[key].generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                    cache_implementation="static", max_cache_len=key[1], pad_token_id=0,
                                    return_dict_in_generate=True, output_logits=True, disable_compile=True)

    def compiled(options: dict[str, Any]) -> Any:
        model = copy.deepcopy(base)
        model.forward = torch.compile(model.forward, backend="graphdispatch",
                                      options={"cuda_graphs": "emulate", **options}, dynamic=False)
        return model

    kernels = Path(tempfile.mkdtemp(prefix="gd_scale_attn_"))
    for length in CACHE_LENS:
        models[("eager", length)] = copy.deepcopy(base)
        models[("graphdispatch", length)] = compiled({})
        # the decode step's attention, scaffolded as an author would from a report of this length
        # (its shapes are the cache's): a kernel that writes its cache rows in place
        try:
            models[("scaffold", length)] = compiled({"report_dir": str(kernels / f"report{length}")})
            with torch.no_grad():
                generate(("scaffold", length))
            graphdispatch_backend.flush()
            report = json.loads((kernels / f"report{length}" / "dispatch.json").read_text())
            decode = [r for g in report["graphs"] for r in g["regions"]
                      if r["module"] == "model.layers.0.self_attn" and len(r.get("mutates", [])) == 3]
            scaffold(report, "model.layers.*.self_attn", kernels / f"attn{length}" / "attn",
                     fingerprint=decode[0]["fingerprint"], artifact_id=f"attn{length}")
            models[("graphdispatch+attn", length)] = compiled({"artifacts": str(kernels / f"attn{length}"),
                                                               "report_dir": str(kernels / f"served{length}")})
        except Exception as exc:
            errors[f"graphdispatch+attn@{length}"] = error_text(exc)
            print(f"scale: llama scaffold at {length} failed: {error_text(exc)}", file=sys.stderr, flush=True)
        models.pop(("scaffold", length), None)

    reference: dict[int, Any] = {}
    mismatches: dict[str, int] = {}
    generates: dict[str, int] = {}
    warm_s: dict[str, float] = {}

    def check(key: tuple[str, int], out: Any) -> None:
        name = f"{key[0]}@{key[1]}"
        ref = reference.get(key[1])
        if ref is None:  # eager failed at this length: nothing to compare with (recorded in errors)
            return
        generates[name] = generates.get(name, 0) + 1
        same = (out.sequences.shape == ref.sequences.shape and torch.equal(out.sequences, ref.sequences)
                and len(out.logits) == len(ref.logits)
                and all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits)))
        mismatches[name] = mismatches.get(name, 0) + (not same)

    repeats = 2 if args.smoke else 5 if args.quick else 11
    with torch.no_grad():
        for key in models:
            start = time.perf_counter()
            try:
                for _ in range(WARM_GENERATES):
                    out = generate(key)
                    if key[0] == "eager" and key[1] not in reference:
                        reference[key[1]] = out
                    check(key, out)
            except Exception as exc:
                errors[f"{key[0]}@{key[1]}"] = error_text(exc)
                print(f"scale: llama {key} failed: {error_text(exc)}", file=sys.stderr, flush=True)
                continue
            warm_s[f"{key[0]}@{key[1]}"] = time.perf_counter() - start
            print(f"scale: llama {key[0]} max_cache_len={key[1]}: warm in {warm_s[f'{key[0]}@{key[1]}']:.1f} s",
                  file=sys.stderr, flush=True)
        live = [k for k in models if f"{k[0]}@{k[1]}" not in errors]
        samples: dict[tuple[str, int], list[float]] = {k: [] for k in live}
        gc.collect()
        for r in range(repeats):
            for key in live[r % len(live):] + live[: r % len(live)]:
                gc.collect()
                gc.disable()  # as timeit does: a collection inside one generate is another's noise
                try:
                    start = time.perf_counter()
                    out = generate(key)
                    samples[key].append((time.perf_counter() - start) / NEW_TOKENS * 1e3)
                finally:
                    gc.enable()
                check(key, out)
    prompt_ok = all(reference[length].sequences.shape[1] == PROMPT_LEN + NEW_TOKENS for length in reference)
    bitwise_ok = not any(mismatches.values())
    lo, hi = CACHE_LENS

    def ratio(variant: str) -> float | None:
        a, b = samples.get((variant, hi)), samples.get((variant, lo))
        return statistics.median(x / y for x, y in zip(a, b)) if a and b else None

    report = graphdispatch_backend.latest_report() or {}
    totals = report.get("totals", {})
    eager_r, gd_r, attn_r = ratio("eager"), ratio("graphdispatch"), ratio("graphdispatch+attn")
    graphdispatch_backend.flush()
    served = [sub for length in CACHE_LENS if (kernels / f"served{length}" / "dispatch.json").exists()
              for g in json.loads((kernels / f"served{length}" / "dispatch.json").read_text())["graphs"]
              for sub in g.get("substitutions", [])]
    # the reports are read: written and forgotten (none is written there again at exit), and the folder goes
    graphdispatch_backend.reset()
    shutil.rmtree(kernels, ignore_errors=True)
    rows = []
    for key in models:
        name = f"{key[0]}@{key[1]}"
        if key not in samples:
            rows.append([key[0], key[1], "-", "-", "-", f"failed: {errors.get(name)}"])
            continue
        cache_mib = 2 * LLAMA["num_hidden_layers"] * LLAMA["num_key_value_heads"] * key[1] * LLAMA["head_dim"] * 4 / MIB
        rows.append([key[0], key[1], f"{cache_mib:g}", f"{statistics.median(samples[key]):.2f}",
                     f"{(ratio(key[0]) or float('nan')):.2f}" if key[1] == hi else "",
                     f"{generates[name] - mismatches[name]}/{generates[name]} equal" if name in generates
                     else "not compared"])
    rel = gd_r / eager_r if gd_r is not None and eager_r else None
    targets = [
        Target(f"scale llama: graphdispatch per-token ratio {hi}/{lo} / eager's", f"<= {LLAMA_RATIO_MAX}",
               f"{rel:.2f}x (graphdispatch {gd_r:.2f}, eager {eager_r:.2f})" if rel is not None else "failed",
               rel <= LLAMA_RATIO_MAX if rel is not None else False),
        Target(f"scale llama: with the scaffolded in-place attention, per-token ratio {hi}/{lo} / without it",
               f"<= {LLAMA_RATIO_MAX}",
               f"{attn_r / gd_r:.2f}x (with {attn_r:.2f}, without {gd_r:.2f}; attention kernels: "
               f"{sum(s['replays'] for s in served)} replays, parity {sorted({s['parity'] for s in served})})"
               if attn_r is not None and gd_r else "failed",
               attn_r / gd_r <= LLAMA_RATIO_MAX and bool(served) and all(s["parity"] == "passed" for s in served)
               if attn_r is not None and gd_r else False),
        Target("scale llama: graphdispatch decode replays", "(info)",
               f"{totals.get('replays', 0)}/{totals.get('calls', 0)} graph calls replayed", None),
        Target("scale llama: tokens and logits bitwise equal to eager", "every generate",
               "yes" if bitwise_ok and prompt_ok else "NO", bitwise_ok and prompt_ok),
    ]
    payload = {"config": {**LLAMA, "attn_implementation": base.config._attn_implementation},
               "new_tokens": NEW_TOKENS, "prompt_len": PROMPT_LEN, "repeats": repeats,
               "ms_per_token": {f"{k[0]}@{k[1]}": s for k, s in samples.items()},
               "median_ms_per_token": {f"{k[0]}@{k[1]}": statistics.median(s) for k, s in samples.items()},
               "ratio_hi_lo": {"eager": eager_r, "graphdispatch": gd_r}, "warm_s": warm_s,
               "mismatched_generates": mismatches, "generates": generates, "errors": errors,
               "graphdispatch_totals": totals, "transformers": transformers.__version__}
    table = (f"tiny Llama generate, static cache, {NEW_TOKENS} new tokens (ms per token incl. prefill; "
             f"{repeats} repeats rotated; ratio = median of paired {hi}/{lo})",
             ["variant", "max_cache_len", "cache MiB", "ms/token", f"{hi}/{lo}", "bitwise"], rows)
    return payload, [table], targets, bitwise_ok and prompt_ok


# -- section 3: DiT-like blocks compiled as regions (children) ------------------------------------------
class DitBlock(nn.Module):
    def __init__(self, dim: int, ratio: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ratio * dim)
        self.fc2 = nn.Linear(ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def dit_child(variant: str, blocks: int, mib: int, out_path: str, device: str) -> dict[str, Any]:
    cfg = DIT[device]
    dtype = getattr(torch, cfg["dtype"])
    dim = cfg["dim"]
    tokens = mib * MIB // (dim * torch.empty((), dtype=dtype).element_size())
    torch.manual_seed(0)
    stack = [DitBlock(dim, cfg["mlp_ratio"]).to(device=device, dtype=dtype).eval() for _ in range(blocks)]
    x0 = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(1), dtype=dtype)
    if device == "cuda":
        x0 = x0.to(device)
    if variant == "graphdispatch":
        for block in stack:
            block.compile(backend="graphdispatch", options=gd_options(device))
    gc.collect()
    out: dict[str, Any] = {"variant": variant, "blocks": blocks, "hidden_mib": mib, "tokens": tokens}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    reset = device != "cuda" and reset_peak_rss()
    rss0, hw0 = rss_bytes(), (peak_rss_bytes() if reset else None) or maxrss_bytes()
    start = time.perf_counter()
    with torch.no_grad():
        x = x0
        for _ in range(DIT_STEPS):
            for block in stack:
                x = block(x)
    sync(device)
    out["seconds"] = time.perf_counter() - start
    if device == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated() - base
        out["base_bytes"] = base
    else:
        hw = (peak_rss_bytes() if reset else None) or maxrss_bytes()
        out["peak_bytes"] = hw - rss0
        out["base_bytes"] = rss0
        out["peak_source"] = "VmHWM reset before the first call" if reset else "ru_maxrss"
        out["ru_maxrss_bytes"] = maxrss_bytes()
        # a high-water mark from before the calls that they never passed would hide their peak
        out["peak_masked"] = hw == hw0 and hw0 > rss0
    torch.save(x.cpu() if device == "cuda" else x, out_path)  # the parent compares it with eager's
    if variant != "eager":
        report = graphdispatch_backend.latest_report() or {}
        totals = report.get("totals", {})
        out["graphdispatch"] = {"graphs": totals.get("graphs"), "calls": totals.get("calls"),
                                "replays": totals.get("replays"), "static_buffers": totals.get("static_buffers")}
    return out


def run_children(argvs: list[list[str]], device: str, heap: bool = True) -> list[dict[str, Any]]:
    """This script's `--child` modes, two processes at a time (what they measure is their own
    process's: a neighbour's memory does not enter it). With `heap` (the memory children),
    glibc is told to serve every allocation of 1 MiB or more by mmap and to give it back on
    free (a fixed threshold: no dynamic raise), so the RSS follows the live tensors instead
    of a heap's free chunks; a child that times (the server's) keeps glibc's defaults."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if heap:
        env.update(MALLOC_MMAP_THRESHOLD_=str(MIB), MALLOC_TRIM_THRESHOLD_=str(MIB))
    results: list[dict[str, Any]] = [{} for _ in argvs]
    pending = list(enumerate(argvs))
    running: list[tuple[int, subprocess.Popen[str], float]] = []
    while pending or running:
        while pending and len(running) < CHILD_PARALLEL:
            i, argv = pending.pop(0)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--device", device, *(["--smoke"] * _SMOKE[0]),
                   "--child", *argv]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
            running.append((i, proc, time.monotonic()))
        i, proc, started = running.pop(0)
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, CHILD_TIMEOUT_S - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            results[i] = {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
            continue
        for line in reversed(stdout.splitlines()):
            if line.startswith(CHILD_TAG):
                results[i] = json.loads(line[len(CHILD_TAG):])
                break
        else:
            tail = (stderr.strip().splitlines() or ["(no stderr)"])[-1][:300]
            results[i] = {"error": f"exit {proc.returncode}: {tail}"}
    return results


def server_in_child() -> tuple[dict[str, Any], list[Any], list[Target], bool]:
    """section_server, in a fresh process (module docstring)."""
    (got,) = run_children([["server"]], "cpu", heap=False)
    if "error" in got:
        raise SystemExit(f"scale: the server section's process failed: {got['error']}")
    tables = [(title, header, rows) for title, header, rows in got["tables"]]
    return got["payload"], tables, [Target(**t) for t in got["targets"]], got["bitwise"]


def section_dit(args: argparse.Namespace, device: str) -> tuple[dict[str, Any], list[Any], list[Target], bool]:
    cfg = DIT[device]
    configs = [(DIT_BLOCKS[0], mib) for mib in cfg["sizes"]] + [(DIT_BLOCKS[1], cfg["n_at"])]
    runs: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    bitwise_ok = True
    variants = ("eager", "graphdispatch")
    with tempfile.TemporaryDirectory(prefix="scale_dit_") as tmp:
        argvs = [["dit", v, str(b), str(m), str(Path(tmp) / f"{v}_{b}_{m}.pt")] for b, m in configs for v in variants]
        got = run_children(argvs, device)
        for (blocks, mib), pair_runs in zip(configs, zip(got[::2], got[1::2])):
            pair = dict(zip(variants, pair_runs))
            for variant, r in pair.items():
                print(f"scale: dit {variant} N={blocks} {mib} MiB: "
                      + (f"peak {r['peak_bytes'] / MIB:.1f} MiB in {r['seconds']:.1f} s" if "error" not in r
                         else r["error"]), file=sys.stderr, flush=True)
            if not any("error" in r for r in pair_runs):
                outs = [torch.load(Path(tmp) / f"{v}_{blocks}_{mib}.pt") for v in variants]
                pair["graphdispatch"]["bitwise"] = bool(torch.equal(outs[0], outs[1]))
                bitwise_ok &= pair["graphdispatch"]["bitwise"]
                del outs
            runs[(blocks, mib)] = pair

    def above(blocks: int, mib: int) -> float | None:
        pair = runs.get((blocks, mib), {})
        if any("error" in pair.get(v, {"error": 1}) for v in ("eager", "graphdispatch")):
            return None
        return (pair["graphdispatch"]["peak_bytes"] - pair["eager"]["peak_bytes"]) / MIB

    rows = []
    for (blocks, mib), pair in runs.items():
        e, g = pair.get("eager", {}), pair.get("graphdispatch", {})
        a = above(blocks, mib)
        gd = g.get("graphdispatch") or {}
        rows.append([blocks, mib, g.get("tokens", e.get("tokens", "-")),
                     f"{e['peak_bytes'] / MIB:.1f}" if "peak_bytes" in e else e.get("error", "-"),
                     f"{g['peak_bytes'] / MIB:.1f}" if "peak_bytes" in g else g.get("error", "-"),
                     f"{a:.1f}" if a is not None else "-", f"{a / mib:.2f}" if a is not None else "-",
                     f"{gd.get('replays')}/{gd.get('calls')}" if gd else "-",
                     {True: "yes", False: "NO"}.get(g.get("bitwise"), "-")])
    n0, n1, at = DIT_BLOCKS[0], DIT_BLOCKS[1], cfg["n_at"]
    lo, hi = above(n0, SLOPE_FROM), above(n0, SLOPE_TO)
    slope = (hi - lo) / (SLOPE_TO - SLOPE_FROM) if lo is not None and hi is not None else None
    a0, a1 = above(n0, at), above(n1, at)
    tol = at / 2
    masked = [f"{v} N={b} {m} MiB" for (b, m), p in runs.items() for v, r in p.items() if r.get("peak_masked")]
    targets = [
        Target(f"scale dit: peak above eager, slope {SLOPE_FROM}->{SLOPE_TO} MiB (N={n0})",
               f"<= {DIT_SLOPE_MAX} MiB/MiB",
               f"{slope:.2f} MiB/MiB ({lo:.0f} -> {hi:.0f} MiB above eager)" if slope is not None else "failed",
               slope <= DIT_SLOPE_MAX if slope is not None else False, "; ".join(masked)),
        Target(f"scale dit: peak above eager, N={n1} vs N={n0} at {at} MiB", f"<= N={n0} + {tol:g} MiB",
               f"{a1:.1f} vs {a0:.1f} MiB" if a0 is not None and a1 is not None else "failed",
               a1 <= a0 + tol if a0 is not None and a1 is not None else False),
        Target("scale dit: output bitwise equal to eager", "every run", "yes" if bitwise_ok else "NO", bitwise_ok),
    ]
    unit = "GPU allocated" if device == "cuda" else "RSS"
    table = (f"DiT-like blocks compiled as regions, {DIT_STEPS} chained steps, peak {unit} above the level before "
             f"the first call ({device}, dim {cfg['dim']}, {cfg['dtype']}, MLP ratio {cfg['mlp_ratio']}; "
             "each in a fresh process)",
             ["blocks", "hidden MiB", "tokens", "eager peak MiB", "graphdispatch peak MiB", "above eager MiB",
              "above / hidden", "replays/calls", "bitwise"], rows)
    payload = {"config": {**cfg, "steps": DIT_STEPS}, "tolerance_mib": tol, "slope_mib_per_mib": slope,
               "runs": [{"blocks": b, "hidden_mib": m, **{v: r for v, r in p.items()}} for (b, m), p in runs.items()]}
    return payload, [table], targets, bitwise_ok


# -- section 4: lifetime (children) ----------------------------------------------------------------------
def _lifetime_model(kind: str, seed: int) -> tuple[nn.Module, Callable[[int], dict[str, Any]]]:
    """An MLP, or a diffusers LTX transformer (2 layers, tiny: a real model's many graphs and records)."""
    torch.manual_seed(seed)
    if kind == "ltx":
        from graphdispatch_backend.examples.families import ltx

        model, inputs = ltx()
        return model.eval(), lambda i: inputs(i, torch.float32)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).eval()
    return model, lambda i: {"input": torch.randn(8, 64, generator=torch.Generator().manual_seed(i))}


def _first(out: Any) -> torch.Tensor:
    while not isinstance(out, torch.Tensor):
        out = out[0]
    return out


def lifetime_child(backend: str, rounds: int, kind: str = "mlp") -> dict[str, Any]:
    from graphdispatch_backend.runtime.runner import GraphRunner

    records = []
    equal = True
    for r in range(rounds):
        model, inputs = _lifetime_model(kind, r)
        if backend == "graphdispatch":
            compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate"})
        else:
            compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            for i in range(ROUND_CALLS):
                equal &= bool(torch.equal(_first(compiled(**inputs(i))), _first(model(**inputs(i)))))
        torch._dynamo.reset()
        del compiled, model
        gc.collect()
        # type(), not isinstance(): gc also holds weak proxies, which raise once their referent is gone
        runners = sum(1 for o in gc.get_objects() if issubclass(type(o), GraphRunner))
        records.append({"round": r, "runners": runners, "rss_bytes": rss_bytes()})
    return {"backend": backend, "rounds": records, "bitwise": equal}


def section_lifetime(args: argparse.Namespace) -> tuple[dict[str, Any], list[Any], list[Target], bool]:
    cases = [(b, k) for k in LIFETIME_MODELS for b in ("aot_eager", "graphdispatch")]
    found = run_children([["lifetime", b, str(ROUNDS), k] for b, k in cases], "cpu")
    runs = {b if k == "mlp" else f"{b} ({k})": run for (b, k), run in zip(cases, found)}
    for backend, run in runs.items():
        print(f"scale: lifetime {backend}: " + (run.get("error") or "done"), file=sys.stderr, flush=True)

    def slope(backend: str) -> float | None:
        recs = runs[backend].get("rounds")
        if not recs:
            return None
        last = recs[-FIT_LAST:]
        return fit_line([r["round"] for r in last], [r["rss_bytes"] / MIB for r in last])[1]

    rows = []
    for backend, run in runs.items():
        if "error" in run:
            rows.append([backend, "-", "-", "-", "-", f"failed: {run['error']}"])
            continue
        recs = run["rounds"]
        s = slope(backend)
        rows.append([backend, " ".join(str(r["runners"]) for r in recs), f"{recs[0]['rss_bytes'] / MIB:.1f}",
                     f"{recs[-1]['rss_bytes'] / MIB:.1f}", f"{s:.3f}" if s is not None else "-",
                     "yes" if run["bitwise"] else "NO"])
    gd, aot = runs["graphdispatch"], runs["aot_eager"]
    most = max((r["runners"] for r in gd.get("rounds", [])), default=None)
    s_gd, s_aot = slope("graphdispatch"), slope("aot_eager")
    bitwise_ok = all(r.get("bitwise", True) for r in runs.values())
    s_ltx, s_ltx_aot = slope("graphdispatch (ltx)"), slope("aot_eager (ltx)")
    targets = [
        Target("scale lifetime: live GraphRunners after each round", "0",
               f"max {most} (after round {ROUNDS}: {gd['rounds'][-1]['runners']})" if most is not None
               else f"failed: {gd.get('error')}", most == 0 if most is not None else False),
        Target(f"scale lifetime: RSS growth per round (last {FIT_LAST})", f"<= aot_eager + {RSS_SLACK_MIB} MiB",
               f"{s_gd:.3f} vs {s_aot:.3f} MiB/round" if s_gd is not None and s_aot is not None
               else f"failed: {gd.get('error') or aot.get('error')}",
               s_gd <= s_aot + RSS_SLACK_MIB if s_gd is not None and s_aot is not None else False),
        Target(f"scale lifetime: a diffusers LTX, emulate: RSS growth per round (last {FIT_LAST})",
               f"<= aot_eager + {LTX_RSS_SLACK_MIB} MiB",
               f"{s_ltx:.3f} vs {s_ltx_aot:.3f} MiB/round" if s_ltx is not None and s_ltx_aot is not None
               else "failed", s_ltx <= s_ltx_aot + LTX_RSS_SLACK_MIB
               if s_ltx is not None and s_ltx_aot is not None else False),
        Target("scale lifetime: outputs bitwise equal to eager", "every call", "yes" if bitwise_ok else "NO",
               bitwise_ok),
    ]
    table = (f"lifetime: {ROUNDS} rounds of compile, {ROUND_CALLS} calls, torch._dynamo.reset(), del "
             "(each backend in a fresh process)",
             ["backend", "live GraphRunners after each round", "RSS round 1 MiB", f"RSS round {ROUNDS} MiB",
              f"MiB/round (last {FIT_LAST})", "bitwise"], rows)
    payload = {"rounds": ROUNDS, "calls_per_round": ROUND_CALLS, "fit_last": FIT_LAST,
               "slope_mib_per_round": {"graphdispatch": s_gd, "aot_eager": s_aot}, "runs": runs}
    return payload, [table], targets, bitwise_ok


# -- section 5: a tolerance check of a large output (children) ------------------------------------------
def check_child(mib: int) -> dict[str, Any]:
    """Peak RSS of one check of a float32 output of `mib` MiB under a tolerance: compared and
    measured within it, then compared once more with one element beyond it."""
    from graphdispatch_backend.diagnostics.fusion_report import FusionReport
    from graphdispatch_backend.runtime.checks.tolerance import Tolerance

    n = mib * MIB // 4
    expected = torch.randn(n, generator=torch.Generator().manual_seed(0))
    actual = expected * (1 + 1e-6)
    tolerance = Tolerance(1e-3, 1e-5, FusionReport({}))
    gc.collect()
    reset = reset_peak_rss()
    rss0 = rss_bytes()
    start = time.perf_counter()
    within = tolerance.compare([expected], [actual]) is None
    tolerance.observe(1, [expected], [actual])
    actual[n // 2] += 1.0
    beyond = tolerance.compare([expected], [actual])
    hw = (peak_rss_bytes() if reset else None) or maxrss_bytes()
    return {"mib": mib, "peak_bytes": hw - rss0, "seconds": time.perf_counter() - start, "within": within,
            "beyond_found": beyond is not None and beyond.first_index == (n // 2,),
            "peak_source": "VmHWM reset before the check" if reset else "ru_maxrss"}


def section_check() -> tuple[dict[str, Any], list[Any], list[Target], bool]:
    runs = run_children([["check", str(mib)] for mib in CHECK_MIB], "cpu")
    for mib, r in zip(CHECK_MIB, runs):
        print(f"scale: check {mib} MiB: " + (f"peak {r['peak_bytes'] / MIB:.1f} MiB in {r['seconds']:.1f} s"
                                             if "error" not in r else r["error"]), file=sys.stderr, flush=True)
    ok = [r for r in runs if "error" not in r]
    right = len(ok) == len(runs) and all(r["within"] and r["beyond_found"] for r in ok)
    slope = None
    if len(ok) == len(runs):
        slope = (runs[-1]["peak_bytes"] - runs[0]["peak_bytes"]) / MIB / (CHECK_MIB[-1] - CHECK_MIB[0])
    rows = [[mib, f"{r['peak_bytes'] / MIB:.1f}" if "error" not in r else r["error"],
             f"{r['peak_bytes'] / MIB / mib:.2f}" if "error" not in r else "-",
             f"{r['seconds']:.1f}" if "error" not in r else "-",
             "yes" if r.get("within") and r.get("beyond_found") else "NO"] for mib, r in zip(CHECK_MIB, runs)]
    targets = [
        Target(f"scale check: peak RSS of a tolerance check, slope {CHECK_MIB[0]}->{CHECK_MIB[-1]} MiB of output",
               f"<= {CHECK_SLOPE_MAX} MiB/MiB", f"{slope:.2f} MiB/MiB" if slope is not None else "failed",
               slope <= CHECK_SLOPE_MAX if slope is not None else False),
        Target("scale check: within passes, the element beyond is found where it is", "every size",
               "yes" if right else "NO", right),
    ]
    table = ("a check under a tolerance (rtol 1e-3, atol 1e-5) of one float32 output: peak RSS above the level "
             "before (each size in a fresh process)", ["output MiB", "peak MiB", "peak / output", "seconds",
                                                       "judged right"], rows)
    return {"runs": runs, "slope_mib_per_mib": slope}, [table], targets, right


# -- section 6: a checked replay of a graph serving an artifact over large weights (children) ------------
WEIGHTS_KERNEL = """
import torch
def forward(w1, b1, x, w2, b2):
    return torch.addmm(b2, torch.relu(torch.addmm(b1, x, w1.t())), w2.t())
"""


def weights_child(mib: int) -> dict[str, Any]:
    """Peak RSS of one checked replay of a block whose MLP region, served by an exact artifact,
    holds `mib` MiB of float32 weights (4 * dim**2 values)."""
    from graphdispatch_backend import testing

    dim = max(8, int((mib * MIB / 16) ** 0.5))
    torch.manual_seed(0)
    model = testing.Block(dim).eval()
    sig = [{"name": "fc1.weight", "shape": [2 * dim, dim], "dtype": "float32"},
           {"name": "fc1.bias", "shape": [2 * dim], "dtype": "float32"},
           {"name": "input0", "shape": [None, dim], "dtype": "float32"},
           {"name": "fc2.weight", "shape": [dim, 2 * dim], "dtype": "float32"},
           {"name": "fc2.bias", "shape": [dim], "dtype": "float32"}]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory() as root:
        testing.write_bundle(Path(root) / "mlp", "mlp-exact", "mlp", sig, [{"shape": [None, dim], "dtype": "float32"}],
                             WEIGHTS_KERNEL)
        compiled = torch.compile(model, backend="graphdispatch", options={
            "cuda_graphs": "emulate", "artifacts": root, "artifact_recheck": "every"})
        x = torch.randn(4, dim, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            for _ in range(4):  # warmup, capture, verification: from here every call replays, checked
                compiled(x)
            gc.collect()
            reset = reset_peak_rss()
            rss0 = rss_bytes()
            start = time.perf_counter()
            out = compiled(x)
            hw = (peak_rss_bytes() if reset else None) or maxrss_bytes()
            seconds = time.perf_counter() - start
            bitwise = torch.equal(out, model(x))
    (graph,) = testing.accounted_graphs()
    return {"mib": mib, "weights_bytes": weights, "peak_bytes": hw - rss0, "seconds": seconds, "bitwise": bitwise,
            "replays": graph["cuda_graph"]["replays"], "checked": graph["lowering_check"]["checked"],
            "limit_bytes": graphdispatch_backend.Options().max_snapshot_bytes,
            "peak_source": "VmHWM reset before the call" if reset else "ru_maxrss"}


def section_weights() -> tuple[dict[str, Any], list[Any], list[Target], bool]:
    runs = run_children([["weights", str(mib)] for mib in WEIGHTS_MIB], "cpu")
    ok = [r for r in runs if "error" not in r]
    bitwise = len(ok) == len(runs) and all(r["bitwise"] and r["replays"] > 0 for r in ok)

    def bound(r: dict[str, Any]) -> float:
        return min(r["weights_bytes"], r["limit_bytes"]) + WEIGHTS_SLACK_MIB * MIB

    rows = [[mib, f"{r['weights_bytes'] / MIB:.0f}", f"{r['peak_bytes'] / MIB:.1f}", f"{bound(r) / MIB:.0f}",
             f"{r['seconds']:.2f}", "yes" if r["bitwise"] else "NO"] if "error" not in r else [mib, r["error"], "-",
                                                                                              "-", "-", "-"]
            for mib, r in zip(WEIGHTS_MIB, runs)]
    met = len(ok) == len(runs) and all(r["peak_bytes"] <= bound(r) for r in ok)
    targets = [Target("scale weights: peak RSS of a checked replay above the level before, per size",
                      f"<= min(weights, max_snapshot_bytes) + {WEIGHTS_SLACK_MIB} MiB",
                      ", ".join(f"{r['peak_bytes'] / MIB:.0f} MiB at {r['weights_bytes'] / MIB:.0f}" for r in ok)
                      or "failed", met)]
    table = ("a checked replay of a graph serving an artifact over its weights: peak RSS above the level before "
             "(each size in a fresh process)", ["size MiB", "weights MiB", "peak MiB", "bound MiB", "seconds",
                                                "bitwise"], rows)
    return {"runs": runs}, [table], targets, bitwise


# -- main ------------------------------------------------------------------------------------------------------
def recorded_errors(payload: dict[str, Any]) -> list[str]:
    """The failures the sections record as results (a variant, a generate, a child process)."""
    errors = [f"{section} {name}: {error}" for section in ("decode", "llama")
              for name, error in payload.get(section, {}).get("errors", {}).items()]
    errors += [f"dit {variant} N={run['blocks']} {run['hidden_mib']} MiB: {run[variant]['error']}"
               for run in payload.get("dit", {}).get("runs", []) for variant in ("eager", "graphdispatch")
               if "error" in run.get(variant, {})]
    errors += [f"lifetime {backend}: {run['error']}"
               for backend, run in payload.get("lifetime", {}).get("runs", {}).items() if "error" in run]
    errors += [f"check {mib} MiB: {run['error']}"
               for mib, run in zip(CHECK_MIB, payload.get("check", {}).get("runs", [])) if "error" in run]
    errors += [f"weights {mib} MiB: {run['error']}"
               for mib, run in zip(WEIGHTS_MIB, payload.get("weights", {}).get("runs", [])) if "error" in run]
    return errors


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: sections decode and dit on the GPU (bench/results/scale_cuda.json)")
    parser.add_argument("--big", action="store_true", help="include the 1 GiB cache (even with --quick)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)


def main() -> None:
    args = parse_args(__doc__ or "", options)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipping the scale benchmark on CUDA")
        return
    torch.set_num_threads(1)
    raise_dynamo_limits()
    if args.smoke:
        smoke_sizes()
    if args.child:
        kind, *rest = args.child
        if kind == "dit":
            got = dit_child(rest[0], int(rest[1]), int(rest[2]), rest[3], device)
        elif kind == "lifetime":
            got = lifetime_child(rest[0], int(rest[1]), *rest[2:])
        elif kind == "check":
            got = check_child(int(rest[0]))
        elif kind == "weights":
            got = weights_child(int(rest[0]))
        elif kind == "server":
            payload, tables, targets, bitwise = section_server(args.smoke)
            got = {"payload": payload, "tables": tables, "targets": [t.to_dict() for t in targets], "bitwise": bitwise}
        else:
            raise SystemExit(f"unknown child {kind!r}")
        print(CHILD_TAG + json.dumps(got), flush=True)
        return
    allowed = CUDA_SECTIONS if device == "cuda" else SECTIONS
    chosen = [s for s in args.only.split(",") if s] or list(allowed)
    unknown = sorted(set(chosen) - set(allowed))
    if unknown:
        raise SystemExit(f"unknown section {unknown[0]!r} for {device}; choose from {', '.join(allowed)}")
    start = time.perf_counter()
    payload: dict[str, Any] = {"quick": args.quick, "device": device, "package": graphdispatch_backend.__file__}
    if device == "cuda":
        payload["gpu"] = torch.cuda.get_device_name()
    tables: list[Any] = []
    targets: list[Target] = []
    mismatched: list[str] = []
    for section in chosen:
        t0 = time.perf_counter()
        if section == "decode":
            got = section_decode(args, device)
        elif section == "llama":
            got = section_llama(args)
        elif section == "server":
            got = server_in_child()
        elif section == "dit":
            got = section_dit(args, device)
        elif section == "check":
            got = section_check()
        elif section == "weights":
            got = section_weights()
        else:
            got = section_lifetime(args)
        part, tabs, tgts, bitwise_ok = got
        payload[section] = {**part, "seconds": round(time.perf_counter() - t0, 1)}
        tables.extend(tabs)
        targets.extend(tgts)
        if not bitwise_ok:
            mismatched.append(section)
    payload["seconds"] = round(time.perf_counter() - start, 1)
    payload["bitwise_mismatch"] = mismatched
    emit("scale_cuda" if device == "cuda" else "scale", payload, tables, targets, args)
    fail_on_errors(args, recorded_errors(payload))
    if mismatched:
        print(f"scale: results differ from eager (not bitwise) in: {', '.join(mismatched)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
