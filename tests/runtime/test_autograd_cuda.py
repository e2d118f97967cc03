"""Autograd graphs through real CUDA graphs (skipped without CUDA; bench/gpu_check.sh runs
them): a training loop with dropout replays its forward and backward, bitwise equal to the
same loop on the lowered graph without capture, and a second forward before the first
backward leaves the first's saved tensors alone."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import graphdispatch_backend

pytestmark = pytest.mark.cuda


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Dropout(0.1),
                         nn.Linear(256, 64)).cuda().train()


def _loop(base: nn.Module, options: dict[str, Any], steps: int = 10) -> list[torch.Tensor]:
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    model = copy.deepcopy(base)
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(steps):
        gen = torch.Generator(device="cuda").manual_seed(step)
        x = torch.randn(32, 64, device="cuda", generator=gen)
        torch.manual_seed(step)
        loss = compiled(x).square().mean()
        loss.backward()
        seen += [loss.detach().clone()] + [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return seen


def test_a_training_loop_replays_forward_and_backward_bitwise_on_cuda():
    base = _model()
    captured = _loop(base, {"cuda_graphs": True})
    (g,) = graphdispatch_backend.latest_report()["graphs"]
    lowered = _loop(base, {"cuda_graphs": False})
    assert all(torch.equal(a, b) for a, b in zip(captured, lowered))
    assert g["lowering_check"]["status"] == "bitwise"
    assert g["cuda_graph"]["replays"] > 0 and g["backward"]["cuda_graph"]["replays"] > 0


def test_two_forwards_before_their_backwards_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh()).cuda()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": True, "warmup": 1})
    for _ in range(6):
        xa, xb = torch.randn(16, 64, device="cuda"), torch.randn(16, 64, device="cuda")
        got, want = [compiled(xa), compiled(xb)], [reference(xa), reference(xb)]
        for out, ref in zip(got, want):
            out.sum().backward()
            ref.sum().backward()
            assert torch.equal(out, ref)
            for p, q in zip(model.parameters(), reference.parameters()):
                assert torch.equal(p.grad, q.grad)
                p.grad = q.grad = None
    (g,) = graphdispatch_backend.latest_report()["graphs"]
    assert g["cuda_graph"]["replays"] > 0 and g["backward"]["cuda_graph"]["replays"] > 0
