"""One rank of the sequence-parallel tests (tests/reliability/test_sequence_parallel.py).

argv: rank world rendezvous out scenario. A 3-block DiT whose attention is sequence
parallel on a gloo group, in the forms people write it (SCENARIOS), each block compiled on
its own with graphdispatch (`cuda_graphs="emulate"`) as FastVideo's regional compile
compiles them, next to the same blocks run eagerly: every call's output is compared bit
for bit on the rank, and written (as bytes) for the test to compare across ranks. The run
holds `testing.uninitialized_memory()`: every `empty_like` and `new_empty` returns memory
holding a new value, as uninitialized memory may, so a check that compares memory nobody
wrote fails every time instead of by the allocator's chance.

Scenarios:
- `functional`: Ulysses with torch.distributed._functional_collectives.all_to_all_single;
- `traced`: Ulysses as yunchang and FastVideo write it, `out = torch.empty_like(x);
  dist.all_to_all_single(out, x)` (Dynamo traces it into the graph);
- `async`: the same with `async_op=True` and `work.wait()` (a graph break: the buffer is
  made by one graph and filled between graphs);
- `allgather`: K/V all-gathered along the sequence (`dist.all_gather_into_tensor` into
  `torch.empty`);
- `ring`: ring attention, `dist.batch_isend_irecv` in a loop (Dynamo runs the ring itself
  eagerly: a graph break in a loop skips its frame), an online softmax merging the blocks;
- `ring_traced`: the same with Dynamo's P2P compilation on (the ring in the graph);
- `fastvideo`: FastVideo's loader shape: an AllToAll4D-style `torch.autograd.Function`
  (transpose, `empty_like`, `dist.all_to_all_single`), each block's `forward` replaced by
  `torch.compile(forward, fullgraph=True, options={"emulate_precision_casts": True,
  "cuda_graphs": "emulate"})`;
- `nccl`: `functional` with the group taken for NCCL (passes/ops.py `group_backend`): the
  collectives stay inside the captured pieces, as on a GPU, and replay in lockstep;
- `traced_unplaced`, `async_unskipped`: the rules removed (the buffer placed with the
  piece that fills it, its values not compared where nobody wrote them);
- on GPUs (`cuda_` + an idiom, `cuda_graphs=True`, one rank per GPU): `cuda_traced` on an
  NCCL group (the collectives captured inside the pieces; any other idiom runs the same), and
  `cuda_gloo`: attention local, the MLP's output all-reduced on a gloo group over CUDA
  tensors (gloo runs on the host: the piece splits around it).
"""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

said: list[str] = []  # graphdispatch's WARNINGs, for the test (kept off the console)


class _Said(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        said.append(record.getMessage())


logging.getLogger("graphdispatch_backend").addHandler(_Said())
logging.getLogger("graphdispatch_backend").propagate = False
rank, world, init_file, out_path, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
CUDA = scenario.startswith("cuda_")
if CUDA:
    torch.cuda.set_device(rank)
dist.init_process_group("nccl" if CUDA else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=900))  # a hang guard: a loaded machine's compile is slow

import torch.distributed._functional_collectives as funcol  # noqa: E402

import graphdispatch_backend as gd  # noqa: E402
from graphdispatch_backend import testing  # noqa: E402
from graphdispatch_backend.examples.sequence_parallel import SPBlock  # noqa: E402

DIM, HEADS, BLOCKS, CALLS = 32, 4, 3, 8
GROUP = dist.group.WORLD
IDIOM = scenario.removeprefix("cuda_").split("_")[0] if scenario != "ring_traced" else "ring"
DEVICE = torch.device("cuda", rank) if CUDA else torch.device("cpu")
GLOO = dist.new_group(backend="gloo") if IDIOM == "gloo" else None

if scenario == "ring_traced":
    torch._dynamo.config.enable_p2p_compilation = True
if scenario == "nccl":  # the group's backend read as NCCL's: what a GPU would capture
    ops_mod = importlib.import_module("graphdispatch_backend.passes.ops")
    ops_mod.group_backend = lambda name, device_type: "nccl"
if scenario == "traced_unplaced":
    split_mod = importlib.import_module("graphdispatch_backend.passes.split_pieces")
    split_mod._place_allocations = lambda gm, reasons: set()
    split_mod.unwritten_outputs = lambda gm: ()
if scenario == "async_unskipped":
    split_mod = importlib.import_module("graphdispatch_backend.passes.split_pieces")
    split_mod._returned_unwritten = lambda gm, reasons: None
    importlib.import_module("graphdispatch_backend.backend").unwritten_outputs = lambda gm: ()


# -- the idioms ------------------------------------------------------------------------------

def all_to_all(x: torch.Tensor) -> torch.Tensor:
    """x: [world * c, ...], contiguous; chunk p goes to rank p."""
    if IDIOM in ("functional", "nccl"):
        return funcol.all_to_all_single(x, None, None, GROUP)
    out = torch.empty_like(x)
    if IDIOM == "async":
        work = dist.all_to_all_single(out, x, group=GROUP, async_op=True)
        work.wait()
    else:
        dist.all_to_all_single(out, x, group=GROUP)
    return out


class AllToAll4D(torch.autograd.Function):
    """FastVideo's shape (fastvideo/distributed/device_communicators/base_device_communicator.py):
    transpose, `empty_like`, `dist.all_to_all_single` into it."""

    @staticmethod
    def forward(ctx, group, input_, world_size, scatter_dim, gather_dim):
        if scatter_dim == 2 and gather_dim == 1:
            shard_hn = input_.shape[2] // world_size
            input_ = input_.transpose(0, 2).contiguous()  # hn, shard_seqlen, bs, hd
            output = torch.empty_like(input_)
            dist.all_to_all_single(output, input_, group=group)
            output = torch.cat(output.split(shard_hn), dim=1)  # shard_hn, seqlen, bs, hd
            return output.transpose(0, 2).contiguous()
        shard_hn, seqlen = input_.shape[2], input_.shape[1]
        bs, hd = input_.shape[0], input_.shape[3]
        input_ = input_.transpose(0, 2).contiguous()  # shard_hn, seqlen, bs, hd
        input_ = input_.reshape(shard_hn, world_size, seqlen // world_size, bs, hd).transpose(0, 1).reshape(
            shard_hn * world_size, seqlen // world_size, bs, hd).contiguous()
        output = torch.empty_like(input_)
        dist.all_to_all_single(output, input_, group=group)
        return output.transpose(0, 2).contiguous()  # bs, shard_seqlen, hn, hd

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("inference only")


def gather_seq(t: torch.Tensor) -> torch.Tensor:
    """K/V all-gather: [B, S/P, H, D] -> [B, S, H, D]."""
    full = torch.empty((world * t.shape[1], t.shape[0], *t.shape[2:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(full, t.transpose(0, 1).contiguous(), group=GROUP)
    return full.transpose(0, 1)


def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Ring attention over [B, H, S/P, D] shards: K/V pass to the next rank while this one
    attends to the block it holds; blocks merged by their log-sum-exp."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    out = lse = None
    for step in range(world):
        if step < world - 1:
            k_next, v_next = torch.empty_like(k), torch.empty_like(v)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, k, nxt, GROUP), dist.P2POp(dist.isend, v, nxt, GROUP),
                                           dist.P2POp(dist.irecv, k_next, prv, GROUP),
                                           dist.P2POp(dist.irecv, v_next, prv, GROUP)])
        s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        total = p.sum(-1, keepdim=True)
        o, blk = (p @ v) / total, m + torch.log(total)
        if out is None:
            out, lse = o, blk
        else:
            new = torch.logaddexp(lse, blk)
            out, lse = out * torch.exp(lse - new) + o * torch.exp(blk - new), new
        if step < world - 1:
            for req in reqs:
                req.wait()
            k, v = k_next, v_next
    return out


# -- the model -------------------------------------------------------------------------------

class Block(SPBlock):
    """Ulysses through `all_to_all` (sp_worker's idioms), or another parallel form."""

    def __init__(self) -> None:
        super().__init__(DIM, HEADS, world, all_to_all, mlp_ratio=2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = q.shape[:2]
        if IDIOM == "allgather":
            k, v = gather_seq(k), gather_seq(v)
        elif IDIOM == "ring":
            q, k, v = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
            return ring(q, k, v).transpose(1, 2).reshape(b, s, DIM)
        elif IDIOM == "fastvideo":
            q = AllToAll4D.apply(GROUP, q, world, 2, 1)
            k = AllToAll4D.apply(GROUP, k, world, 2, 1)
            v = AllToAll4D.apply(GROUP, v, world, 2, 1)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return AllToAll4D.apply(GROUP, y.transpose(1, 2), world, 1, 2).reshape(b, s, DIM)
        elif IDIOM != "gloo":  # Ulysses (gloo: attention on this rank's own sequence)
            return super().attend(q, k, v)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return y.transpose(1, 2).reshape(b, s, DIM)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = super().mlp(x)
        if IDIOM == "gloo":  # a row-parallel layer's all-reduce, on a gloo group over CUDA tensors
            h = funcol.all_reduce(h, "sum", GLOO)
        return h


def run() -> dict:
    torch.manual_seed(0)  # the same weights on every rank
    eager = nn.ModuleList(Block() for _ in range(BLOCKS)).eval().to(DEVICE)
    mine = nn.ModuleList(Block() for _ in range(BLOCKS)).eval().to(DEVICE)
    mine.load_state_dict(eager.state_dict())
    breaks = IDIOM in ("async", "ring") and scenario != "ring_traced"
    options: dict = {"cuda_graphs": True if CUDA else "emulate"}
    if IDIOM == "fastvideo":  # fastvideo/models/loader/fsdp_load.py `_compile_model_regions`
        options = {"emulate_precision_casts": True, **options}
    for block in mine:
        block.forward = torch.compile(block.forward, backend="graphdispatch", fullgraph=not breaks, options=options)
    equal, outs = [], []
    with torch.no_grad(), testing.uninitialized_memory():
        for step in range(CALLS):
            x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(1000 * step + rank))  # this rank's shard
            want = got = x.to(DEVICE)
            for e, m in zip(eager, mine):
                want, got = e(want), m(got)
            equal.append(bool(torch.equal(got, want)))
            outs.append(got.cpu().numpy().tobytes().hex())
    report = gd.latest_report()
    return {"rank": rank, "equal": equal, "outs": outs, "said": said,
            "options": None if report is None else report["options"],
            "graphs": [] if report is None else report["graphs"]}


result = run()
with open(out_path, "w") as fh:
    json.dump(result, fh)
dist.barrier()
dist.destroy_process_group()
