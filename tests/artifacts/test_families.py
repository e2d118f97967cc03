"""Real model families (transformers and diffusers, tiny random configs, nothing downloaded),
each the way a new user meets graphdispatch: compile once with `report_dir`, read the region
names, scaffold a bundle for the family's MLP from the report alone, verify it, compile
again with it. Every region name is a `named_modules()` name (`get_submodule` accepts it,
whichever way the model's forward reached Dynamo: Llama's is decorated as
`wrapper(*args, **kwargs)`), and the scaffolded artifact serves every MLP, parity passed,
output bitwise equal to eager."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.__main__ import main
from graphdispatch_backend.diagnostics.report_file import expand
from graphdispatch_backend.patterns import matches

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

Inputs = dict[str, Any]


def _ids(batch: int = 2, seq: int = 8) -> Inputs:
    return {"input_ids": torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(1))}


def llama() -> tuple[torch.nn.Module, Inputs]:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaModel(cfg), _ids()


def mistral() -> tuple[torch.nn.Module, Inputs]:
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.MistralModel(cfg), _ids()


def gpt2() -> tuple[torch.nn.Module, Inputs]:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Model(cfg), _ids()


def bert() -> tuple[torch.nn.Module, Inputs]:
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32)
    return transformers.BertModel(cfg), _ids()


def t5() -> tuple[torch.nn.Module, Inputs]:
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                decoder_start_token_id=0)
    return transformers.T5EncoderModel(cfg), _ids()


def ltx() -> tuple[torch.nn.Module, Inputs]:
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=2, caption_channels=16)
    g = torch.Generator().manual_seed(1)
    return model, {"hidden_states": torch.randn(1, 2 * 4 * 4, 8, generator=g),
                   "encoder_hidden_states": torch.randn(1, 5, 16, generator=g), "timestep": torch.tensor([3]),
                   "encoder_attention_mask": torch.ones(1, 5), "num_frames": 2, "height": 4, "width": 4,
                   "return_dict": False}


def flux() -> tuple[torch.nn.Module, Inputs]:
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    g = torch.Generator().manual_seed(1)
    return model, {"hidden_states": torch.randn(1, 16, 8, generator=g),
                   "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
                   "pooled_projections": torch.randn(1, 16, generator=g), "timestep": torch.tensor([1.0]),
                   "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(5, 3), "return_dict": False}


def wan() -> tuple[torch.nn.Module, Inputs]:
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
    g = torch.Generator().manual_seed(1)
    return model, {"hidden_states": torch.randn(1, 4, 2, 4, 4, generator=g), "timestep": torch.tensor([3]),
                   "encoder_hidden_states": torch.randn(1, 5, 16, generator=g), "return_dict": False}


# family -> (model and inputs, the family's MLP pattern, how many regions it names)
FAMILIES: dict[str, tuple[Callable[[], tuple[torch.nn.Module, Inputs]], str, int]] = {
    "llama": (llama, "layers.*.mlp", 2),
    "mistral": (mistral, "layers.*.mlp", 2),
    "gpt2": (gpt2, "h.*.mlp", 2),
    "bert": (bert, "encoder.layer.*.intermediate", 2),
    "t5": (t5, "encoder.block.*.layer.1.DenseReluDense", 2),
    "ltx": (ltx, "transformer_blocks.*.ff", 2),
    "flux": (flux, "transformer_blocks.*.ff", 2),
    "wan": (wan, "blocks.*.ffn", 2),
}


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first_tensor(out[0])
    return out.last_hidden_state


def _run(model: torch.nn.Module, inputs: Inputs, options: dict[str, Any], calls: int = 2) -> list[torch.Tensor]:
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    with torch.no_grad():
        outs = [_first_tensor(compiled(**inputs)) for _ in range(calls)]
    graphdispatch_backend.flush()
    return outs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_region_names_resolve_and_a_scaffolded_mlp_serves_bitwise(family, tmp_path, capsys):
    build, pattern, count = FAMILIES[family]
    torch.manual_seed(0)
    model, inputs = build()
    model = model.eval()
    with torch.no_grad():
        eager = _first_tensor(model(**inputs))

    # 1. compile once with report_dir: every region is a named_modules() name of the model
    first = tmp_path / "first"
    _run(model, inputs, {"report_dir": str(first)}, calls=1)
    report = expand(json.loads((first / "dispatch.json").read_text()))  # every region whole
    regions = [r for g in report["graphs"] for r in g["regions"]]
    assert regions, family
    for region in regions:
        module = model.get_submodule(region["module"])  # raises if the name is not the model's
        assert type(module).__qualname__ == region["class"]
        for entry in region["inputs"]:  # state inputs are named relative to the region
            if not entry["name"].startswith("input"):
                found = dict(module.named_parameters()) | dict(module.named_buffers())
                assert entry["name"] in found, (region["name"], entry["name"])
    named = sorted(r["name"] for r in regions if matches(pattern, r["module"]))
    assert len(named) == count, named

    # 2. scaffold the family's MLP from the report alone, and verify the bundle
    bundle = tmp_path / "kernels" / f"{family}-mlp"
    assert main(["artifacts", "scaffold", str(first), "--region", pattern, str(bundle)]) == 0
    assert main(["artifacts", "verify", str(tmp_path / "kernels")]) == 0
    assert f"{family}-mlp  ok" in capsys.readouterr().out

    # 3. compile with it: every MLP served by the scaffolded kernel, parity passed, bitwise
    second = tmp_path / "second"
    outs = _run(model, inputs, {"artifacts": str(tmp_path / "kernels"), "report_dir": str(second), "strict": True})
    assert all(torch.equal(out, eager) for out in outs), family
    report = json.loads((second / "dispatch.json").read_text())
    subs = [s for g in report["graphs"] for s in g["substitutions"]]
    assert sorted(s["region"] for s in subs) == named
    assert all(s["parity"] == "passed" and not s["demoted"] and s["calls"] + s["replays"] >= 1 for s in subs)
    assert report["artifacts"][f"{family}-mlp"]["status"] == "serving"
    assert report["authoring"] == [] and report["registry"]["errors"] == []


def test_the_scaffolded_kernel_is_the_regions_own_ops(tmp_path):
    """What the kernel calls is the region's op histogram, no more, no less."""
    torch.manual_seed(0)
    model, inputs = llama()
    _run(model.eval(), inputs, {"report_dir": str(tmp_path / "r")}, calls=1)
    assert main(["artifacts", "scaffold", str(tmp_path / "r"), "--region", "layers.*.mlp", str(tmp_path / "b")]) == 0
    report = expand(json.loads((tmp_path / "r" / "dispatch.json").read_text()))
    mlp = next(r for g in report["graphs"] for r in g["regions"] if r["name"] == "layers.0.mlp")
    source = (tmp_path / "b" / "kernel.py").read_text()
    called = {}
    for line in source.splitlines():
        if "torch.ops." in line:
            op = line.split("torch.ops.", 1)[1].split("(", 1)[0]
            namespace, name, overload = op.split(".")
            key = f"{namespace}::{name}.{overload}"
            called[key] = called.get(key, 0) + 1
    assert called == mlp["ops"]
