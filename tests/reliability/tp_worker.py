"""One rank of the tensor-parallel tests (tests/reliability/test_tensor_parallel.py).

argv: rank world rendezvous out scenario. Builds a block (attention with column-parallel
q/k/v and a row-parallel output, then a column- then row-parallel MLP) with DTensor's
`parallelize_module` on a gloo mesh, twice with the same weights: one compiled with
graphdispatch (emulate), one run eagerly (the uncompiled model). The block also returns a
rank-local side output. A scenario forces one verdict on rank 1 only (`artifact_wrong*`: an
artifact for the activation, wrong on rank 1 for large inputs); every call's
all-reduced output is written (as bytes) for the test to compare across ranks.
"""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

logging.disable(logging.WARNING)
rank, world, init_file, out_path, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
# A collective waits for the other rank (compiling, or slowed by a loaded machine) up to a
# hang guard far above; but where the rule is removed on purpose and the collectives are meant
# to pair wrongly (then fail: the test asks only that they go wrong), a long wait would only
# make the failure slow
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=10 if scenario == "lowering_mismatch_unagreed" else 900))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

import graphdispatch_backend as gd  # noqa: E402
from graphdispatch_backend.diagnostics.render import render  # noqa: E402
from graphdispatch_backend.runtime.checks import reference as eager_check_mod  # noqa: E402
from graphdispatch_backend.runtime.checks.parity import Mismatch  # noqa: E402
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine  # noqa: E402
from graphdispatch_backend.runtime.runner.verify import Verifier  # noqa: E402
from graphdispatch_backend.testing import write_bundle  # noqa: E402

DIM, HEAD = 16, 4


@torch.library.custom_op("gd_tp::side", mutates_args=())
def side(x: torch.Tensor) -> torch.Tensor:
    """A rank-local side output; under scenario `nondeterministic` it carries wall-clock
    noise on rank 1 only (an atomics-based kernel, an out-of-memory: a per-rank event)."""
    noise = float(int.from_bytes(os.urandom(2), "little") + 1) if (scenario == "nondeterministic" and rank == 1) else 0
    return x.sum(-1) + noise


@side.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[:-1])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.act = nn.ReLU()  # between the column- and the row-parallel projection: no collective

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, HEAD).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(y)
        h = self.up(x)
        return x + self.down(self.act(h)), torch.ops.gd_tp.side(h)


PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
        "up": ColwiseParallel(), "down": RowwiseParallel()}

if scenario == "lowering_mismatch_unagreed":  # the rule removed: each rank acts on its own verdict
    importlib.import_module("graphdispatch_backend.backend").agreement_for = lambda names: None
if scenario.startswith("lowering_mismatch") and rank == 1:
    forced = [1]

    def forcing(real):
        def compare(expected, actual, *args, **kwargs):  # the first check finds a difference
            if forced[0]:
                forced[0] -= 1
                return Mismatch(0, "values", "forced on rank 1")
            return real(expected, actual, *args, **kwargs)
        return compare

    eager_check_mod.compare = forcing(eager_check_mod.compare)
    eager_check_mod.differs = forcing(eager_check_mod.differs)  # the lean check compares prints
if scenario in ("verify_mismatch", "verify_mismatch_inside") and rank == 1:
    Verifier.judge = lambda self, *args: (gd.errors.Decline.VERIFY_MISMATCH, "forced on rank 1")
if scenario in ("capture_failed", "capture_failed_inside") and rank == 1:
    def capture(self, fn, args, device="cpu", **engine_kwargs):
        raise RuntimeError("forced on rank 1")

    HostReplayEngine.capture = capture
if scenario.endswith("_inside"):
    # NCCL's case on CPU: the group taken for NCCL's (passes/ops.py group_backend), the
    # collectives stay inside the captured pieces (the host model re-runs them on every
    # replay, as a CUDA graph launches captured NCCL kernels)
    importlib.import_module("graphdispatch_backend.passes.ops").group_backend = lambda name, device_type: "nccl"

options = {"cuda_graphs": "emulate", "warmup": 2, "verify_inputs": 2}
LARGE_FROM = 7  # scenario artifact_wrong*: the inputs from this step on (call 8, a check's: 1, 2, 4, 8) are large
if scenario.startswith("artifact_wrong"):
    # an artifact for `act` (the column-parallel shard of the MLP, local to each rank), exact
    # but on rank 1 one ulp up where its input is large: met first at call 8, which is checked
    write_bundle(
        f"{out_path}.kernels/act", "act", "act", [{"name": "input0", "shape": [2, 5, 4 * DIM // world],
                                                   "dtype": "float32"}],
        [{"shape": [2, 5, 4 * DIM // world], "dtype": "float32"}],
        "import torch\nimport torch.distributed as dist\n\n"
        "def forward(x):\n"
        "    y = torch.relu(x)\n"
        "    if dist.get_rank() == 1:\n"
        "        y = torch.where(x > 50, torch.nextafter(y, torch.full_like(y, float('inf'))), y)\n"
        "    return y\n",
        parity={"mode": "bitwise"}, devices=["cpu"], capturable=True)
    options["artifacts"] = f"{out_path}.kernels"

mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
base = Block().eval()
mine, ref = Block().eval(), Block().eval()
mine.load_state_dict(base.state_dict())
ref.load_state_dict(base.state_dict())
parallelize_module(mine, mesh, PLAN)
parallelize_module(ref, mesh, PLAN)
compiled = torch.compile(mine, backend="graphdispatch", options=options)
outs, equal, raised = [], [], None
with torch.no_grad():
    for step in range(12):
        torch.manual_seed(1000 + step)  # the same input on every rank, new every step
        x = torch.randn(2, 5, DIM) * (100 if scenario.startswith("artifact_wrong") and step >= LARGE_FROM else 1)
        try:
            got, _ = compiled(x)
        except Exception as exc:  # the point is that nothing escapes; recorded for the test
            raised = f"{type(exc).__name__}: {exc}"
            break
        want, _ = ref(x)
        equal.append(bool(torch.equal(got, want)))
        outs.append(got.numpy().tobytes().hex())
report = gd.latest_report()
with open(out_path, "w") as fh:
    json.dump({"rank": rank, "equal": equal, "outs": outs, "raised": raised,
               "graphs": [] if report is None else report["graphs"],
               "rendered": "" if report is None else render(report)}, fh)
dist.barrier()
dist.destroy_process_group()
