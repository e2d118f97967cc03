"""`fuse=True` as a new user meets it: third-party families from tiny random configs (a
diffusers video DiT, a diffusers image DiT no other test uses, a transformers LLM) and the
built-in example, fp32 and bf16, with and without the CPU model of CUDA graphs. Every call,
on fresh values, is bitwise equal to eager, and the recipe needed no op learned."""

from __future__ import annotations

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.examples.families import FAMILIES, first_tensor
from graphdispatch_backend.testing import accounted_graphs

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_is_bitwise_with_eager_on_every_call(family, dtype):
    torch.manual_seed(0)
    model, inputs = FAMILIES[family](**({"depth": 2} if family == "demo" else {}))
    # the built-in example runs bf16 as its users would: fp32 weights under autocast
    autocast = family == "demo" and dtype == torch.bfloat16
    model = model.to(torch.float32 if autocast else dtype).eval()
    dtype = torch.float32 if autocast else dtype
    for cuda_graphs in (False, "emulate"):
        torch._dynamo.reset()
        graphdispatch_backend.reset()
        compiled = torch.compile(model, backend="graphdispatch",
                                 options={"fuse": True, "cuda_graphs": cuda_graphs, "cache_dir": False})
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            for i in range(5):
                want, got = first_tensor(model(**inputs(i, dtype))), first_tensor(compiled(**inputs(i, dtype)))
                assert torch.equal(want, got), (family, cuda_graphs, i)
        graphs = [g for g in accounted_graphs() if g["calls"]]
        fusions = [g["fusion"] for g in graphs]
        assert all(f["status"] == "fused" and f["rounds"] == 0 and f["kernels"] > 0 for f in fusions), fusions
        assert all(g["lowering_check"]["status"] == "bitwise" for g in graphs)
        if cuda_graphs == "emulate":
            assert sum(g["cuda_graph"]["replays"] for g in graphs) > 0
