"""`fuse=True` as a new user meets it: third-party families from tiny random configs (a
diffusers video DiT, a diffusers image DiT no other test uses, a transformers LLM) and the
built-in example, fp32 and bf16, with and without the CPU model of CUDA graphs. Every call,
on fresh values, is bitwise equal to eager, and the recipe needed no op learned."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.examples import dit
from graphdispatch_backend.testing import accounted_graphs

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

Inputs = Callable[[int, torch.dtype], dict[str, Any]]


def _g(i: int) -> torch.Generator:
    return torch.Generator().manual_seed(i)


def demo() -> tuple[torch.nn.Module, Inputs]:
    cfg = dit.DiTConfig(depth=2)
    return dit.TinyDiT(cfg), lambda i, dt: {"x": torch.randn(2, 4, 16, 16, generator=_g(i)).to(dt),
                                            "t": torch.full((2,), 999.0 - i)}


def ltx() -> tuple[torch.nn.Module, Inputs]:
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=2, caption_channels=16)
    return model, lambda i, dt: {
        "hidden_states": torch.randn(1, 32, 8, generator=_g(i)).to(dt),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=_g(i + 100)).to(dt), "timestep": torch.tensor([3]),
        "encoder_attention_mask": torch.ones(1, 5), "num_frames": 2, "height": 4, "width": 4, "return_dict": False}


def sd3() -> tuple[torch.nn.Module, Inputs]:
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16)
    return model, lambda i, dt: {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=_g(i)).to(dt),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=_g(i + 100)).to(dt),
        "pooled_projections": torch.randn(1, 16, generator=_g(i + 200)).to(dt), "timestep": torch.tensor([3]),
        "return_dict": False}


def llama() -> tuple[torch.nn.Module, Inputs]:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaModel(cfg), lambda i, dt: {"input_ids": torch.randint(0, 64, (2, 8), generator=_g(i))}


FAMILIES = {"demo": demo, "ltx": ltx, "sd3": sd3, "llama": llama}


def _first(out: Any) -> torch.Tensor:
    while not isinstance(out, torch.Tensor):
        out = out.to_tuple()[0] if hasattr(out, "to_tuple") else out[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_is_bitwise_with_eager_on_every_call(family, dtype):
    torch.manual_seed(0)
    model, inputs = FAMILIES[family]()
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
                want, got = _first(model(**inputs(i, dtype))), _first(compiled(**inputs(i, dtype)))
                assert torch.equal(want, got), (family, cuda_graphs, i)
        graphs = [g for g in accounted_graphs() if g["calls"]]
        fusions = [g["fusion"] for g in graphs]
        assert all(f["status"] == "fused" and f["rounds"] == 0 and f["kernels"] > 0 for f in fusions), fusions
        assert all(g["lowering_check"]["status"] == "bitwise" for g in graphs)
        if cuda_graphs == "emulate":
            assert sum(g["cuda_graph"]["replays"] for g in graphs) > 0
