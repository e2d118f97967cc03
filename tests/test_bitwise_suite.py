"""Bitwise equality with eager through torch.compile(backend="graphdispatch"), on a varied suite,
with every call accounted for in the report; plus training, contract fallbacks and the report file."""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import graphdispatch_backend
from graphdispatch_backend.backend import graphdispatch_backend as backend_fn
from graphdispatch_backend.diagnostics.report_file import expand
from graphdispatch_backend.examples.dit import make_model
from graphdispatch_backend.testing import aten_graph

CALLS = 5  # emulate with warmup=1: 1 warmup, 2 verifying, then replays
MODES = {
    "auto": {},  # the default: "auto" is eager on CPU (reason not_cuda)
    "emulate": {"cuda_graphs": "emulate", "warmup": 1},
}


# -- the suite -------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # 4-D (b, h, n, d/h)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Residual(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Views(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (2, 3, 4, 6)
        y = self.lin(x).permute(0, 2, 1, 3)  # (2, 4, 3, 6)
        a, b = y.chunk(2, dim=-1)
        z = (a * b.sigmoid()).transpose(1, 2).reshape(2, 3, 12)
        return z.view(6, 12).t().contiguous().unsqueeze(0).flatten(1) + y.sum(dim=(1, 2)).mean()


class InPlaceIntermediate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.add_(1.0)
        y.mul_(0.5)
        y[:, :2].zero_()  # in place through a view
        return torch.relu_(y) + x


class InPlaceInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0).add_(1.0)  # the caller sees this
        return self.lin(x)


class BufferRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(8, 8))
        self.register_buffer("shift", torch.linspace(-1, 1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.table + self.shift


class StepCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("step", torch.zeros((), dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step.add_(1)
        return self.lin(x) * self.step


class GraphBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.first(x))
        torch._dynamo.graph_break()
        return self.second(y) + x


class AutocastInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.second(F.gelu(self.first(x)))
        return y.float() + x


def _batchnorm() -> nn.Module:
    bn = nn.BatchNorm2d(8)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2.0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), bn)


def _dit_inputs(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return torch.randn(2, 4, 16, 16, generator=gen), torch.rand(2, generator=gen) * 999


@dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple[torch.Tensor, ...]]
    graphs: int = 1
    autocast_outside: bool = False
    mutates_input: bool = False


def _randn(*shape: int) -> Callable[[torch.Generator], tuple[torch.Tensor, ...]]:
    return lambda gen: (torch.randn(*shape, generator=gen),)


CASES = {
    "linear": Case(lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)), _randn(4, 16)),
    "conv2d": Case(lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2)),
                   _randn(2, 3, 8, 8)),
    "layernorm": Case(lambda: nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)), _randn(2, 5, 16)),
    "groupnorm": Case(lambda: nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(2, 8)), _randn(2, 3, 4, 4)),
    "batchnorm_eval": Case(_batchnorm, _randn(2, 3, 4, 4)),
    "sdpa": Case(lambda: Attention(causal=False), _randn(2, 6, 16)),
    "sdpa_causal": Case(lambda: Attention(causal=True), _randn(2, 6, 16)),
    "residual": Case(Residual, _randn(2, 6, 16)),
    "views": Case(Views, _randn(2, 3, 4, 6)),
    "inplace_intermediate": Case(InPlaceIntermediate, _randn(4, 8)),
    "inplace_input": Case(InPlaceInput, _randn(4, 8), mutates_input=True),
    "buffer_read": Case(BufferRead, _randn(4, 8)),
    "buffer_step": Case(StepCounter, _randn(4, 8)),
    "graph_break": Case(GraphBreak, _randn(4, 8), graphs=2),
    "autocast_outside": Case(lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), _randn(4, 8),
                             autocast_outside=True),
    "autocast_inside": Case(AutocastInside, _randn(4, 8)),
    "dit": Case(make_model, _dit_inputs, autocast_outside=True),
}


def _equal(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


def _check_accounting(report: dict[str, Any], graphs: int, calls: int, mode: str) -> None:
    assert len(report["graphs"]) == graphs, [g["name"] for g in report["graphs"]]
    for graph in report["graphs"]:
        cg = graph["cuda_graph"]
        assert graph["kind"] == "inference" and graph["error"] is None, graph["error"]
        assert graph["calls"] == calls
        assert graph["calls"] == cg["replays"] + cg["eager_calls"]
        assert sum(cg["eager_by_reason"].values()) == cg["eager_calls"]
        assert graph["contract_mismatches"] == 0
        if mode == "auto":
            assert cg["eager_by_reason"] == {"not_cuda": calls}
        else:
            assert cg["mode"] == "host"
            assert cg["replays"] > 0, cg
            assert cg["declines"] == {}, cg


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_bitwise_equal_to_eager(name: str, mode: str) -> None:
    case = CASES[name]
    torch.manual_seed(0)
    model = case.make().eval()
    reference = copy.deepcopy(model)  # stateful models (step counter) evolve separately
    compiled = torch.compile(model, backend="graphdispatch", options=MODES[mode])
    gen = torch.Generator().manual_seed(1)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if case.autocast_outside else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        for call in range(CALLS):
            args = case.inputs(gen)  # fresh values every call, so replays see changed inputs
            ours_args, ref_args = [a.clone() for a in args], [a.clone() for a in args]
            ours, ref = compiled(*ours_args), reference(*ref_args)
            assert _equal(ours, ref), f"call {call}: max diff {(ours.float() - ref.float()).abs().max()}"
            assert all(_equal(a, b) for a, b in zip(ours_args, ref_args))  # input mutations too
            assert case.mutates_input == any(not torch.equal(a, b) for a, b in zip(ours_args, args))
    if case.autocast_outside:
        assert ours.dtype == torch.bfloat16  # autocast really was on
    for (key, ours_state), ref_state in zip(model.state_dict().items(), reference.state_dict().values()):
        assert _equal(ours_state, ref_state), key  # buffers updated in place match eager's
    _check_accounting(graphdispatch_backend.latest_report(), case.graphs, CALLS, mode)


def test_autocast_inside_lowers_to_bfloat16_matmuls() -> None:
    # guards the autocast_inside case: the autocast region is in the graph, not ambient
    lowered = aten_graph(AutocastInside().eval(), torch.randn(4, 8))
    dtypes = [n.meta["val"].dtype for n in lowered.gm.graph.nodes if n.target is torch.ops.aten.addmm.default]
    assert dtypes == [torch.bfloat16, torch.bfloat16]


def test_step_counter_really_advanced() -> None:
    # guards the buffer_step case above: the buffer is mutated through the compiled model
    model = StepCounter().eval()
    compiled = torch.compile(model, backend="graphdispatch", options=MODES["emulate"])
    with torch.no_grad():
        for _ in range(CALLS):
            compiled(torch.randn(4, 8))
    assert model.step.item() == CALLS


# -- training -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(MODES))
def test_training_step_gradients_match_eager(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="graphdispatch", options=MODES[mode])
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    steps = 2
    for _ in range(steps):
        x, target = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        loss = F.mse_loss(compiled(x), target)
        ref_loss = F.mse_loss(reference(x), target)
        loss.backward()
        ref_loss.backward()
        assert _equal(loss, ref_loss)
        for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
            assert p.grad is not None and _equal(p.grad, q.grad), pname
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    assert graph["kind"] == "autograd"
    assert graph["calls"] == steps
    assert graph["lowering_check"] == {"checked": steps, "status": "bitwise"}
    if mode == "auto":  # eager on CPU: the lowered forward and backward, not captured
        assert graph["cuda_graph"]["eager_by_reason"] == {"not_cuda": steps}
        assert graph["backward"]["cuda_graph"]["eager_by_reason"] == {"not_cuda": 2 * steps}  # the check's, the user's
    else:  # warmup 1: the second step captures and verifies
        assert graph["cuda_graph"]["eager_by_reason"] == {"warmup": 1, "verifying": 1}
    assert graph["cuda_graph"]["replays"] == 0


# -- contract mismatch ----------------------------------------------------------------------------

def _dynamo_graph(fn: Callable[..., Any], *args: Any) -> tuple[fx.GraphModule, list[Any]]:
    seen: list[tuple[fx.GraphModule, list[Any]]] = []

    def recording(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=recording)(*args)
    torch._dynamo.reset()
    (captured,) = seen
    return captured


def _affine(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


@pytest.mark.parametrize("mode", list(MODES))
def test_contract_mismatch_runs_the_original_graph_eagerly_and_is_counted(mode: str) -> None:
    # Dynamo's guards never hand a compiled graph inputs it was not traced for, so the
    # backend is called the way Dynamo calls it, and its result is then called directly.
    gm, example = _dynamo_graph(_affine, torch.randn(2, 4))
    run = backend_fn(gm, example, options=MODES[mode])
    with torch.no_grad():
        first = torch.randn(2, 4)
        assert _equal(run(first)[0], _affine(first))
        for bad in (torch.randn(3, 4), torch.randn(2, 4, dtype=torch.float64)):  # other size; other dtype
            assert _equal(run(bad)[0], _affine(bad))
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    assert graph["contract_mismatches"] == 2
    assert "size" in graph["contract_detail"]  # the first mismatch, in words
    cg = graph["cuda_graph"]
    assert cg["eager_by_reason"]["contract_mismatch"] == 2
    assert graph["calls"] == 3 == cg["replays"] + cg["eager_calls"]


# -- the report file --------------------------------------------------------------------------------

def test_report_is_written_atomically_to_report_dir(tmp_path, monkeypatch) -> None:
    out = tmp_path / "gd_out"
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"report_dir": str(out)})
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(2, 8))
    graphdispatch_backend.flush()
    report = json.loads((out / "dispatch.json").read_text())
    assert report["schema_version"] == 2
    assert report["options"]["report_dir"] == str(out)
    (graph,) = report["graphs"]
    assert graph["calls"] == 3
    assert graph["nodes"] > 0
    assert graph["stripped_assertions"] == 0
    assert graph["cuda_graph"]["eager_calls"] == 3
    assert graph["calls"] == graph["cuda_graph"]["replays"] + graph["cuda_graph"]["eager_calls"]
    latest = json.loads(json.dumps(graphdispatch_backend.latest_report(), default=str))
    whole = expand(report)  # schema 2 keeps a region's detail once per kind (diagnostics/report.py)
    assert (whole["options"], whole["graphs"]) == (latest["options"], latest["graphs"])  # the same session
    assert sorted(os.listdir(out)) == ["dispatch.json", "timing.json"]  # no temp files left behind

    # A write that fails before its rename leaves the previous report whole.
    before = (out / "dispatch.json").read_bytes()
    with torch.no_grad():
        compiled(torch.randn(2, 8))

    def refuse(src: Any, dst: Any) -> None:
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", refuse)
        graphdispatch_backend.flush()  # a report that cannot be written is a warning, never an error
    assert (out / "dispatch.json").read_bytes() == before
    assert sorted(os.listdir(out)) == ["dispatch.json", "timing.json"]  # the failed temp file is gone too
    graphdispatch_backend.flush()
    assert json.loads((out / "dispatch.json").read_text())["graphs"][0]["calls"] == 4
