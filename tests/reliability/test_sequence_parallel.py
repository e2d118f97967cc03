"""Sequence parallelism on 2 gloo ranks: a video DiT's attention in the forms people write it
(Ulysses with functional collectives, with `dist.all_to_all_single(out, x)` into
`empty_like`, with `async_op=True` and `wait()`; K/V all-gathered; a ring of
`batch_isend_irecv`; FastVideo's AllToAll4D under its regional compile), each block
compiled on its own with graphdispatch (`cuda_graphs="emulate"`), 8 calls per rank
(tests/reliability/sp_worker.py). Each must be bitwise equal to the same blocks run
eagerly on its rank, with every graph that makes no host sync replaying from its 3rd call
per block, no graph or piece judged `eager_nondeterministic`, and both ranks reaching the
same verdict for every graph, reason included. Every rank runs under
`testing.uninitialized_memory()`, so memory nobody wrote differs on every call: a check
that compared it would fail every time, not by the allocator's chance. Two scenarios
remove the rules (the buffer placed with the piece that fills it; a buffer returned
unwritten not compared) and see the old failure, named for the op whose bits differed.
A hang fails: each run is bounded (`forked.run_ranks`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import forked
import pytest

pytestmark = pytest.mark.distributed

WORLD = 2
TIMEOUT_S = 900  # a hang guard (forked.run_ranks), not a time limit
BLOCKS, CALLS = 3, 8
WORKER = Path(__file__).with_name("sp_worker.py")


def run_ranks(tmp_path: Path, scenario: str) -> list[dict[str, Any]]:
    results = []
    for run in forked.run_ranks(WORKER, tmp_path, scenario, WORLD, TIMEOUT_S):
        assert run.returncode == 0, run.log
        results.append(json.loads(run.out.read_text()))
    return results


def verdicts(graph: dict[str, Any]) -> tuple[Any, ...]:
    """What a rank decided about a graph (its ranks must decide alike)."""
    cg = graph["cuda_graph"]
    return (graph["name"], graph["calls"], graph["lowering_check"].get("status"), cg["replays"],
            cg["eager_by_reason"], cg["declines"], graph["split_reasons"])


def check(results: list[dict[str, Any]], counts: Any) -> list[dict[str, Any]]:
    """Bitwise on each rank, ranks agreeing on every verdict, nothing judged
    nondeterministic, and every graph that runs a captured piece replaying from its 3rd
    call per block; returns rank 0's graphs."""
    for result in results:
        assert result["equal"] == [True] * CALLS, (result["rank"], result["equal"])
    assert results[0]["outs"] != results[1]["outs"]  # each rank holds its own shard of the sequence
    assert [verdicts(g) for g in results[0]["graphs"]] == [verdicts(g) for g in results[1]["graphs"]]
    graphs = results[0]["graphs"]
    assert graphs
    for graph in graphs:
        cg = graph["cuda_graph"]
        assert graph["calls"] == cg["replays"] + cg["eager_calls"], graph["name"]
        assert graph["lowering_check"].get("status") != "eager_nondeterministic", graph["lowering_check"]
        assert "eager_nondeterministic" not in cg["declines"], cg["decline_details"]
        if graph["lowering_check"].get("status") == "not_lowered":  # nothing of graphdispatch's to run
            assert graph["split_reasons"] == {"unwritten_buffer": 1}, graph
            continue
        if graph["calls"] < 3:  # a frame Dynamo gave up on after one call (a graph break in a loop)
            continue
        assert set(cg["eager_by_reason"]) <= {"warmup", "verifying"}, (graph["name"], cg)
        assert all(n <= BLOCKS for n in cg["eager_by_reason"].values()), (graph["name"], cg)  # once per block
        assert cg["replays"] >= graph["calls"] - 2 * BLOCKS, (graph["name"], cg)
        counts["distributed:sp_replays"] += cg["replays"]
    counts["distributed_runs"] += 1
    return graphs


def test_ulysses_with_functional_collectives(tmp_path, counts):
    (graph,) = check(run_ranks(tmp_path, "functional"), counts)
    assert graph["split_reasons"] == {"collective": 8}  # gloo: each all-to-all and its wait between pieces


def test_ulysses_as_people_write_it_all_to_all_single_into_empty_like(tmp_path, counts):
    """`out = torch.empty_like(x); dist.all_to_all_single(out, x)`, traced by Dynamo: the
    buffer goes to the piece that fills it (the `copy` after the collective), never out of
    the piece before."""
    (graph,) = check(run_ranks(tmp_path, "traced"), counts)
    assert graph["split_reasons"] == {"collective": 8}
    captured = [p for p in graph["pieces"] if p["capturable"]]
    assert "aten::empty_like.default" not in captured[0]["ops"]
    assert [p["ops"][:2] for p in captured[1:]] == [["aten::empty_like.default", "aten::copy.default"]] * 4
    assert graph["cuda_graph"]["replays"] == BLOCKS * (CALLS - 2)


def test_ulysses_with_async_op_and_wait(tmp_path, counts):
    """Graph breaks at the collective: a graph makes the buffer and returns it unwritten
    (the collective fills it between graphs). It is made at each call, as eager makes it,
    and never compared."""
    graphs = check(run_ranks(tmp_path, "async"), counts)
    unwritten = [g for g in graphs if g["split_reasons"].get("unwritten_buffer")]
    assert unwritten and all(g["lowering_check"]["status"] == "not_lowered" for g in unwritten)
    assert sum(g["cuda_graph"]["replays"] for g in graphs) > 0


def test_kv_all_gather(tmp_path, counts):
    (graph,) = check(run_ranks(tmp_path, "allgather"), counts)
    assert graph["split_reasons"] == {"collective": 4}
    assert graph["cuda_graph"]["replays"] == BLOCKS * (CALLS - 2)


@pytest.mark.parametrize("scenario", ["ring", "ring_traced"])
def test_ring_attention_with_batch_isend_irecv(tmp_path, counts, scenario):
    """Dynamo runs the ring itself eagerly by default (a graph break in a loop skips its
    frame); with its P2P compilation on, the sends and receives are in the graph, run
    between pieces on gloo."""
    graphs = check(run_ranks(tmp_path, scenario), counts)
    if scenario == "ring_traced":
        assert [g["split_reasons"] for g in graphs] == [{"collective": 7}]
        assert graphs[0]["cuda_graph"]["replays"] == BLOCKS * (CALLS - 2)
    else:  # the block before the ring and the block after it, each a graph of its own
        assert sum(g["cuda_graph"]["replays"] for g in graphs) >= 2 * BLOCKS * (CALLS - 2)


def test_fastvideo_loader_shape_with_ulysses(tmp_path, counts):
    """FastVideo's regional compile (fastvideo/models/loader/fsdp_load.py): per block,
    `fullgraph=True`, options holding Inductor's `emulate_precision_casts`, attention
    through an AllToAll4D-style autograd.Function: no error, bitwise, replaying, and one
    WARNING naming the Inductor key."""
    results = run_ranks(tmp_path, "fastvideo")
    (graph,) = check(results, counts)
    assert graph["cuda_graph"]["replays"] == BLOCKS * (CALLS - 2)
    for result in results:
        assert result["options"]["inductor"] == {"emulate_precision_casts": True}
        named = [m for m in result["said"] if "Inductor settings" in m]
        assert len(named) == 1 and "emulate_precision_casts" in named[0], result["said"]


def test_collectives_of_an_nccl_group_stay_inside_the_captured_pieces(tmp_path, counts):
    """The group's backend decides (passes/ops.py `captured_collective`): taken for NCCL's,
    the all-to-alls are recorded inside the pieces, as a CUDA graph captures NCCL kernels,
    and every replay runs them on both ranks in step."""
    (graph,) = check(run_ranks(tmp_path, "nccl"), counts)
    assert graph["split_reasons"] == {}
    assert graph["cuda_graph"]["replays"] == BLOCKS * (CALLS - 2)


@pytest.mark.parametrize(("scenario", "suspect"), [
    ("traced_unplaced", "aten::empty_like (memory made uninitialized)"),
    ("async_unskipped", "torch.empty_like (memory made uninitialized)"),
])
def test_without_the_rules_the_unwritten_buffer_is_judged_nondeterministic(tmp_path, scenario, suspect):
    """The rules removed: the piece (or graph) that made the buffer returns it and its
    checks compare memory nobody wrote. The verdict names the allocation, the op whose
    bits differed, not the all-to-all and its wait (what it named before)."""
    results = run_ranks(tmp_path, scenario)
    for result in results:
        assert result["equal"] == [True] * CALLS  # slower, never wrong
        details = [d for g in result["graphs"] for d in (g["lowering_check"].get("detail") or "",
                                                         *g["cuda_graph"]["decline_details"].values())
                   if "eager disagrees with itself" in d]
        assert details and all(suspect in d and "all_to_all" not in d for d in details), details


# -- on GPUs (bench/gpu_check.sh runs these): NCCL captured inside, gloo split ---------------------

def _gpus() -> int:
    import torch

    return min(2, torch.cuda.device_count())


@pytest.mark.cuda
def test_nccl_collectives_are_captured_inside_the_pieces_on_a_gpu(tmp_path, counts):
    """One rank per GPU (one GPU: a group of one, NCCL all the same): the all-to-alls as
    people write them (`all_to_all_single` into `empty_like`) replay inside the captured
    CUDA graphs (ProcessGroupNCCL enqueues no watchdog work while capturing), bitwise. The
    functional form runs in bench/sequence_parallel.py --device cuda (bench/gpu_check.sh)."""
    results = [json.loads(run.out.read_text()) for run in _runs(tmp_path, "cuda_traced")]
    for result in results:
        assert result["equal"] == [True] * CALLS, result["equal"]
        (graph,) = result["graphs"]
        cg = graph["cuda_graph"]
        assert graph["split_reasons"] == {}, graph["split_reasons"]
        assert cg["mode"] == "cuda" and cg["declines"] == {}, cg
        assert cg["replays"] == BLOCKS * (CALLS - 2), cg
    counts["distributed_runs"] += 1


@pytest.mark.cuda
def test_a_gloo_group_on_a_gpu_splits_the_pieces(tmp_path, counts):
    results = [json.loads(run.out.read_text()) for run in _runs(tmp_path, "cuda_gloo")]
    for result in results:
        assert result["equal"] == [True] * CALLS, result["equal"]
        (graph,) = result["graphs"]
        assert graph["split_reasons"] == {"collective": 2}, graph["split_reasons"]  # the all-reduce and its wait
        assert graph["cuda_graph"]["replays"] == BLOCKS * (CALLS - 2), graph["cuda_graph"]
    counts["distributed_runs"] += 1


def _runs(tmp_path: Path, scenario: str) -> list[Any]:
    runs = forked.run_ranks(WORKER, tmp_path, scenario, _gpus(), TIMEOUT_S)
    for run in runs:
        assert run.returncode == 0, run.log
    return runs
