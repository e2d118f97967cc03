"""Distributed: FSDP2-sharded model, 2 CPU processes (gloo), compiled with graphdispatch.

Two processes (launched like torchrun: RANK, WORLD_SIZE and a file:// rendezvous in
tmp_path) each build the same small model, shard it with
`torch.distributed.fsdp.fully_shard` (every Linear, then the root) next to an identical
sharded reference, and compile the Linears' forwards with graphdispatch
(`cuda_graphs="emulate"`, warmup=1, verify_inputs=2). Every call is compared with the
uncompiled sharded model, bit for bit, on both ranks. FSDP2 frees the unsharded parameters
after each forward (reshard_after_forward) and all-gathers them again before the next,
so a captured graph that read them in place would replay stale or freed memory: each
graph must decline (parameter_moved) or re-capture, never serve stale values, and its
report must balance.

What torch 2.13 allows on CPU (found while writing this test, see
test_compiling_an_fsdp2_module_captures_no_graph): `torch.compile(fsdp_module)` and
`fsdp_module.compile()` reach no backend at all (Dynamo converts the frames but captures
no graph; any backend, not only graphdispatch), so the sharded model runs entirely eager
and nothing is tested. Compiling each sharded module's `forward` (FSDP2's hooks then run
eagerly around the compiled forward, as with per-block compilation) does reach the backend,
and that is what this test runs.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import forked
import pytest

pytestmark = pytest.mark.distributed

WORLD = 2
TIMEOUT_S = 900  # a hang guard (forked.run_ranks), not a time limit

WORKER = textwrap.dedent('''
    import copy, json, logging, os, sys
    import torch, torch.distributed as dist
    from torch import nn

    logging.disable(logging.WARNING)  # declines are logged at WARNING once; the report has them
    rank, world, init_file, out_path, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard
    import graphdispatch_backend as gd

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 16)).eval()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    opts = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 2}
    for model in (ref, mine):
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    if mode == "forward":
        for layer in mine:
            if isinstance(layer, nn.Linear):  # FSDP2's hooks run eagerly around the compiled forward
                layer.forward = torch.compile(layer.forward, backend="graphdispatch", options=opts)
        run = mine
    else:  # "module": compile the sharded root module itself
        run = torch.compile(mine, backend="graphdispatch", options=opts)
    gen = torch.Generator().manual_seed(100 + rank)
    calls, equal = 0, []
    with torch.no_grad():
        for _ in range(8):
            x = torch.randn(4, 16, generator=gen)
            got, want = run(x), ref(x)
            equal.append(bool(got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)))
            calls += 1
    report = gd.latest_report()
    with open(out_path, "w") as fh:
        json.dump({"rank": rank, "calls": calls, "equal": equal,
                   "graphs": [] if report is None else report["graphs"]}, fh)
    dist.barrier()
    dist.destroy_process_group()
''')


def run_ranks(tmp_path: Path, mode: str) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = []
    for run in forked.run_ranks(script, tmp_path, mode, WORLD, TIMEOUT_S):
        assert run.returncode == 0, run.log
        results.append(json.loads(run.out.read_text()))
    return results


def test_fsdp2_sharded_model_compiled_per_module_equals_uncompiled(tmp_path, counts):
    results = run_ranks(tmp_path, "forward")
    for result in results:
        rank = result["rank"]
        assert result["equal"] == [True] * result["calls"], f"rank {rank}: {result['equal']}"
        graphs = result["graphs"]
        assert graphs, f"rank {rank}: no graph reached graphdispatch"
        for graph in graphs:
            cg = graph["cuda_graph"]
            assert graph["kind"] == "inference", graph
            assert graph["calls"] == cg["replays"] + cg["eager_calls"], graph["name"]
            assert sum(cg["eager_by_reason"].values()) == cg["eager_calls"], cg
        # every compiled forward went through the runner; FSDP2 re-gathered the parameters
        # between calls, so no graph may have served replays without re-checking them:
        # the outputs above were all equal, and any graph that replayed was captured anew
        # or declined by name
        declined = {reason for g in graphs for reason in g["cuda_graph"]["declines"]}
        replays = sum(g["cuda_graph"]["replays"] for g in graphs)
        assert "parameter_moved" in declined or replays > 0, [g["cuda_graph"] for g in graphs]
        counts["distributed:replays"] += replays
        counts["distributed:calls_compared"] += result["calls"]
        for reason in declined:
            counts[f"distributed:decline:{reason}"] += 1
    counts["distributed_runs"] += 1


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="torch 2.13 limitation: compiling an FSDP2-sharded module captures no graph on CPU "
                          "(frames converted, nothing reaches any backend)")
def test_compiling_an_fsdp2_module_captures_no_graph(tmp_path):
    """Still correct (it runs eagerly), but graphdispatch never sees the model."""
    results = run_ranks(tmp_path, "module")
    for result in results:
        if result["equal"] != [True] * result["calls"]:  # pytest.fail: not the AssertionError xfail expects
            pytest.fail(f"rank {result['rank']}: wrong output {result['equal']}")
    assert all(result["graphs"] for result in results), "no graph reached graphdispatch"
