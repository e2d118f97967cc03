"""Sequence parallel: a video DiT whose attention is Ulysses across ranks, compiled per block.

Model: DEPTH pre-norm DiT blocks (dim DIM, HEADS heads, SEQ tokens per rank, batch 1),
the attention Ulysses as yunchang and FastVideo write it: `out = torch.empty_like(x);
dist.all_to_all_single(out, x)` (Dynamo traces it into the graph), four all-to-alls per
block. Each rank holds its own shard of the sequence. Every block's `forward` is compiled
on its own, `fullgraph=True`, as FastVideo's regional compile does, once per variant:
- `eager`: the blocks as they are;
- `aot_eager`: torch's own lowering, run as is;
- `graphdispatch (cuda_graphs=False)`: the same lowering, checked against eager on its
  schedule, no capture;
- `graphdispatch emulate` (CPU) or `graphdispatch cuda_graphs=True` (`--device cuda`): the
  pieces between the gloo all-to-alls captured and replayed (the CPU model of a CUDA graph),
  or on NCCL the all-to-alls captured inside the pieces.
Two ranks on gloo (CPU), or one rank per GPU on NCCL (`--device cuda`), each a process of
its own started by this script, one torch thread each.

Figures, per rank: every call of every variant compared with eager bit for bit (warmup
calls included); the replays per graph of the captured variant from the report (every
graph replays from its 3rd call per block: eager calls only `warmup` and `verifying`, at
most one each per block); both ranks reaching the same verdicts; µs per call of each
variant, A/B interleaved (both ranks run the variants in the same shuffled order, since
every call runs the same collectives), the paired ratios to eager and to aot_eager.
Targets: bitwise; replays from the 3rd call; ranks agreeing; graphdispatch
(`cuda_graphs=False`) <= 1.05x aot_eager; on a GPU no all-to-all split out of the pieces.
The captured variant's ratio is stated: on CPU it times the host model, not a GPU.

`--smoke` (CI): 2 blocks of dim 32, 8 tokens per rank, 2 repeats of 2 calls: the
script's plumbing (both ranks, every variant), no figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import Target, emit, fail_on_errors, interleaved, parse_args, raise_dynamo_limits

DEPTH, DIM, HEADS, SEQ = 4, 64, 4, 64
SMOKE = {"DEPTH": 2, "DIM": 32, "SEQ": 8}
WARM = 6  # calls per variant before timing: every entry replays from its 3rd
MAX_VS_AOT = 1.05
# hang guards for the ranks, not time limits (a smoke of 16 s quiet must pass on a loaded machine)
CHILD_TIMEOUT_S = {"smoke": 900, "quick": 900, "full": 1800}


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: 2 gloo ranks; cuda: one NCCL rank per GPU")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a child: this rank
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


# -- one rank -------------------------------------------------------------------------------

def _model(dist: Any, world: int, group: Any) -> Any:
    """A block class of the shared sequence-parallel DiT (graphdispatch_backend/examples/
    sequence_parallel.py), its Ulysses all-to-all written as yunchang and FastVideo write it."""
    from graphdispatch_backend.examples.sequence_parallel import SPBlock

    def all_to_all(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    class Block(SPBlock):
        def __init__(self) -> None:
            super().__init__(DIM, HEADS, world, all_to_all, mlp_ratio=4, gelu="tanh")

    return Block


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import graphdispatch_backend

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(args.rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{args.rendezvous}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=600))
    raise_dynamo_limits()
    torch.set_num_threads(1)
    device = torch.device("cuda", args.rank) if cuda else torch.device("cpu")
    block_class = _model(dist, args.world, dist.group.WORLD)
    torch.manual_seed(0)  # the same weights on every rank
    eager = torch.nn.ModuleList(block_class() for _ in range(DEPTH)).eval().to(device)
    captured = "graphdispatch cuda_graphs=True" if cuda else "graphdispatch emulate"
    backends = {"aot_eager": ("aot_eager", None),
                "graphdispatch (cuda_graphs=False)": ("graphdispatch", {"cuda_graphs": False}),
                captured: ("graphdispatch", {"cuda_graphs": True if cuda else "emulate"})}
    stacks: dict[str, Any] = {"eager": eager}
    for name, (backend, options) in backends.items():
        blocks = torch.nn.ModuleList(block_class() for _ in range(DEPTH)).eval().to(device)
        blocks.load_state_dict(eager.state_dict())
        for block in blocks:  # per block, fullgraph: FastVideo's regional compile
            block.forward = torch.compile(block.forward, backend=backend, fullgraph=True,
                                          **({"options": options} if options is not None else {}))
        stacks[name] = blocks

    def run(blocks: Any, x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = block(x)
        return x

    gen = torch.Generator().manual_seed(100 + args.rank)  # this rank's shard of the sequence
    xs = [torch.randn(1, SEQ, DIM, generator=gen).to(device) for _ in range(4)]
    bitwise, errors = True, []
    with torch.no_grad():
        for i in range(WARM):
            want = run(eager, xs[i % 4])
            for name in backends:
                try:
                    bitwise &= bool(torch.equal(run(stacks[name], xs[i % 4]), want))
                except Exception as exc:  # recorded: a smoke run fails on it (fail_on_errors)
                    errors.append(f"{name}: {type(exc).__name__}: {exc}")
                    raise
        report = graphdispatch_backend.latest_report()  # the captured variant's session, compiled last
        repeats, inner = (2, 2) if args.smoke else (5, 10) if args.quick else (15, 20)
        x = xs[0]
        after = torch.cuda.synchronize if cuda else None
        timed = interleaved({name: (lambda s=stacks[name]: run(s, x)) for name in stacks}, repeats=repeats,
                            inner=inner, baseline="eager", after=after)
        for name in backends:  # still eager's bits after the timed calls
            bitwise &= bool(torch.equal(run(stacks[name], x), run(eager, x)))
    graphs = [{"name": g["name"], "calls": g["calls"], "replays": g["cuda_graph"]["replays"],
               "eager_by_reason": g["cuda_graph"]["eager_by_reason"], "declines": g["cuda_graph"]["declines"],
               "split_reasons": g["split_reasons"], "lowering": g["lowering_check"].get("status")}
              for g in (report or {}).get("graphs", [])]
    result = {"rank": args.rank, "world": args.world, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "captured": captured, "bitwise": bitwise, "errors": errors, "graphs": graphs,
              "timing": {n: {k: v for k, v in r.items() if k != "samples_us"} for n, r in timed.items()},
              "vs_aot": {n: _paired(timed, n, "aot_eager") for n in timed}}
    Path(args.out).write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


def _paired(timed: dict[str, dict[str, Any]], name: str, base: str) -> float:
    from common import paired_ratio

    return paired_ratio(timed, name, base)


# -- the launcher ---------------------------------------------------------------------------

def launch(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start one process per rank (this script, `--rank`), wait for them all (a hang is
    killed at the limit), and return their results in rank order."""
    world = max(1, torch.cuda.device_count()) if args.device == "cuda" else 2
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    flags = [f"--{mode}"] if mode != "full" else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHDISPATCH_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory(prefix="gd_sp_") as folder:
        procs = []
        for rank in range(world):
            out = Path(folder) / f"rank{rank}.json"
            cmd = [sys.executable, __file__, "--rank", str(rank), "--world", str(world), "--rendezvous",
                   str(Path(folder) / "rendezvous"), "--out", str(out), "--device", args.device, *flags]
            procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True), out))
        results = []
        for proc, out in procs:
            try:
                log, _ = proc.communicate(timeout=CHILD_TIMEOUT_S[mode])
            except subprocess.TimeoutExpired:
                for p, _ in procs:
                    p.kill()
                raise SystemExit(f"sequence_parallel: a rank did not finish in {CHILD_TIMEOUT_S[mode]} s") from None
            if proc.returncode != 0 or not out.exists():
                print(log[-4000:], file=sys.stderr)
                raise SystemExit(f"sequence_parallel: a rank exited {proc.returncode}")
            results.append(json.loads(out.read_text()))
    return results


def _replays_from_third_call(graphs: list[dict[str, Any]]) -> bool:
    """Every graph's eager calls are its entries' warmup and verifying calls, at most one of
    each per block, and the rest replays."""
    return bool(graphs) and all(
        set(g["eager_by_reason"]) <= {"warmup", "verifying"} and all(n <= DEPTH for n in g["eager_by_reason"].values())
        and g["replays"] >= g["calls"] - 2 * DEPTH and g["lowering"] == "bitwise" for g in graphs)


def main() -> None:
    args = parse_args(__doc__, _extra)
    global DEPTH, DIM, SEQ
    if args.smoke:
        DEPTH, DIM, SEQ = SMOKE["DEPTH"], SMOKE["DIM"], SMOKE["SEQ"]
    if args.rank is not None:
        rank_main(args)
        # its result written and its process group destroyed, a rank skips the interpreter's
        # teardown: there gloo's worker threads have aborted a rank that had finished ("terminate
        # called without an active exception", exit -6; once in a dozen smoke runs)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sequence_parallel: no CUDA device: skipping")
        return
    results = launch(args)
    first = results[0]
    captured = first["captured"]
    agree = all(r["graphs"] == first["graphs"] for r in results)
    bitwise = all(r["bitwise"] for r in results)
    replaying = all(_replays_from_third_call(r["graphs"]) for r in results)
    rows = [[f"rank {r['rank']}", name, f"{t['median_us']:.0f}", f"{t['min_us']:.0f}", f"{t['ratio']:.2f}x",
             f"{r['vs_aot'][name]:.3f}x"] for r in results for name, t in r["timing"].items()]
    graph_rows = [[f"rank {r['rank']}", g["name"], g["calls"], g["replays"], g["eager_by_reason"], g["split_reasons"]]
                  for r in results for g in r["graphs"]]
    plain = max(r["vs_aot"]["graphdispatch (cuda_graphs=False)"] for r in results)
    targets = [
        Target("sequence parallel: every call bitwise with eager, every variant, every rank", "yes",
               str(bitwise), bitwise),
        Target(f"sequence parallel: every graph of {captured} replays from its 3rd call per block", "yes",
               f"{sum(g['replays'] for g in first['graphs'])}/{sum(g['calls'] for g in first['graphs'])} "
               f"calls replayed (rank 0)", replaying),
        Target("sequence parallel: ranks reach the same verdict for every graph", "yes", str(agree), agree),
        Target("sequence parallel: graphdispatch (cuda_graphs=False) / aot_eager", f"<= {MAX_VS_AOT}",
               f"{plain:.3f}x (the slower rank)", plain <= MAX_VS_AOT),
        Target(f"sequence parallel: {captured} / eager (info)", "(info)",
               ", ".join(f"rank {r['rank']} {r['timing'][captured]['ratio']:.2f}x" for r in results), None,
               "on CPU the host model of a CUDA graph, not a GPU's replay"),
    ]
    if args.device == "cuda":
        inside = all("collective" not in g["split_reasons"] for r in results for g in r["graphs"])
        targets.append(Target("sequence parallel (NCCL): the all-to-alls captured inside the pieces", "yes",
                              str(inside), inside))
    name = "sequence_parallel_cuda" if args.device == "cuda" else "sequence_parallel"
    emit(name, {"model": f"{DEPTH} DiT blocks, dim {DIM}, {HEADS} heads, {SEQ} tokens per rank, Ulysses "
                         f"(all_to_all_single into empty_like)", "ranks": results},
         [(f"µs per call, {len(results)} ranks (A/B interleaved, the same order on every rank; median and "
           f"fastest window; median of paired ratios)",
           ["rank", "variant", "µs/call", "min µs/call", "vs eager", "vs aot_eager"], rows),
          (f"graphs of {captured}", ["rank", "graph", "calls", "replays", "eager calls", "split"], graph_rows)],
         targets, args)
    fail_on_errors(args, [e for r in results for e in r["errors"]])
    if not bitwise:
        sys.exit(1)


if __name__ == "__main__":
    main()
