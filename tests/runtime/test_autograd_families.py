"""Real model families with autograd on (transformers and diffusers, tiny random configs,
nothing downloaded), in emulate mode:

- eval-mode calls without `torch.no_grad()` (how most scripts call a model): every graph
  is an autograd graph; outputs bitwise equal to eager, the lowering checked (outputs and
  the gradients of one backward), the forward replayed;
- a training loop (forward, backward, AdamW step) on GPT-2 with dropout: losses and
  gradients bitwise equal to the same loop on the lowered graph without capture and to
  eager, forward and backward replayed after warmup, every call accounted for;
- diffusers' AutoencoderKL on a batch of one with grad on: aot's lowered forward raises at
  run time; eager answers, the graph runs as the Dynamo graph, `lowering_failed`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.testing import accounted_graphs

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

EMULATE = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 2}
CALLS = 6  # checks on calls 1, 2 and 4; warmup, the capture call verifies live and derived sets, then replays


def _ids(seed: int) -> dict[str, Any]:
    return {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))}


def _randn(*shape: int) -> Callable[[int], torch.Tensor]:
    return lambda seed: torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def gpt2() -> tuple[torch.nn.Module, Callable[[int], dict[str, Any]]]:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Model(cfg), _ids


def bert() -> tuple[torch.nn.Module, Callable[[int], dict[str, Any]]]:
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32)
    return transformers.BertModel(cfg), _ids


def t5() -> tuple[torch.nn.Module, Callable[[int], dict[str, Any]]]:
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                decoder_start_token_id=0)
    return transformers.T5EncoderModel(cfg), _ids


def llama() -> tuple[torch.nn.Module, Callable[[int], dict[str, Any]]]:
    """Grouped-query attention (2 key/value heads for 4 query heads)."""
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaModel(cfg), _ids


def wan() -> tuple[torch.nn.Module, Callable[[int], dict[str, Any]]]:
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
    hidden, text = _randn(1, 4, 2, 4, 4), _randn(1, 5, 16)
    return model, lambda seed: {"hidden_states": hidden(seed), "timestep": torch.tensor([3]),
                                "encoder_hidden_states": text(seed + 1000), "return_dict": False}


def conv_bn() -> tuple[torch.nn.Module, Callable[[int], dict[str, Any]]]:
    """Batch norm in eval mode with grad on: its saved statistics are empty tensors, whose
    storages of no bytes share an address without viewing each other."""
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
    image = _randn(2, 3, 8, 8)
    return model, lambda seed: {"input": image(seed)}


def resnet() -> tuple[torch.nn.Module, Callable[[int], dict[str, Any]]]:
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    layer_type="basic")
    image = _randn(1, 3, 32, 32)
    return transformers.ResNetModel(cfg), lambda seed: {"pixel_values": image(seed)}


FAMILIES = {"gpt2": gpt2, "bert": bert, "t5": t5, "llama": llama, "wan": wan, "conv_bn": conv_bn,
            "resnet": resnet}


def _first(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first(out[0])
    return out.last_hidden_state




@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eval_calls_without_no_grad_are_checked_replayed_and_bitwise(family):
    torch.manual_seed(0)
    model, make = FAMILIES[family]()
    model.eval()
    compiled = torch.compile(model, backend="graphdispatch", options=EMULATE)
    for seed in range(CALLS):
        inputs = make(seed)
        out, want = _first(compiled(**inputs)), _first(model(**inputs))
        assert out.requires_grad and torch.equal(out, want), (family, seed)
    report = graphdispatch_backend.latest_report()
    accounted_graphs(report)
    (g,) = report["graphs"]
    assert g["kind"] == "autograd" and g["calls"] == CALLS
    assert g["lowering_check"] == {"checked": 3, "status": "bitwise"}
    assert g["cuda_graph"]["replays"] == CALLS - 2 and g["cuda_graph"]["declines"] == {}
    assert g["backward"]["calls"] == g["backward"]["checks"] == 3  # the checks' backwards, none of the user's


def test_a_gpt2_training_loop_is_bitwise_with_the_lowered_graph_and_replays_forward_and_backward():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=64,
                                  bos_token_id=0, eos_token_id=0)
    base = transformers.GPT2LMHeadModel(cfg).train()  # dropout 0.1 in embeddings, attention, residuals
    steps = CALLS

    def loop(options: dict[str, Any] | None) -> tuple[list[list[torch.Tensor]], dict[str, Any] | None]:
        torch._dynamo.reset()
        graphdispatch_backend.reset()
        model = copy.deepcopy(base)
        run = model if options is None else torch.compile(model, backend="graphdispatch", options=options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        seen = []
        for step in range(steps):
            ids = _ids(100 + step)["input_ids"]
            torch.manual_seed(step)
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            seen.append([loss.detach().clone()] + [p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        return seen, graphdispatch_backend.latest_report() if options is not None else None

    captured, report = loop(EMULATE)
    lowered, _ = loop({"cuda_graphs": False})
    eager, _ = loop(None)
    for other in (lowered, eager):
        assert all(torch.equal(a, b) for sa, sb in zip(captured, other) for a, b in zip(sa, sb))
    assert report is not None
    accounted_graphs(report)
    for g in report["graphs"]:  # the model, and the loss after a graph break
        assert g["kind"] == "autograd" and g["calls"] == steps
        assert g["lowering_check"] == {"checked": 3, "status": "bitwise"}
        assert g["cuda_graph"]["eager_by_reason"] == {"warmup": 1, "verifying": 1}
        assert g["cuda_graph"]["replays"] == steps - 2
        backward = g["backward"]
        assert backward["calls"] == steps + backward["checks"] and backward["checks"] == 3
        assert backward["cuda_graph"]["replays"] > 0 and backward["cuda_graph"]["declines"] == {}
    assert any(g["split_reasons"].get("random_op") for g in report["graphs"])  # dropout between pieces
    totals = report["totals"]
    assert totals["calls"] == 2 * steps and totals["backward_calls"] == 2 * (steps + 3)


def test_autoencoder_kl_with_grad_on_is_contained_bitwise_and_reported():
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=16).eval()
    reference = copy.deepcopy(vae)
    compiled = torch.compile(vae, backend="graphdispatch", options=EMULATE)
    for seed in range(3):
        x = _randn(1, 3, 16, 16)(seed)  # a batch of one: aot's group_norm input has another memory format
        out, want = compiled(x).sample, reference(x).sample
        out.square().mean().backward()
        want.square().mean().backward()
        assert torch.equal(out, want)
    for p, q in zip(vae.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    report = graphdispatch_backend.latest_report()
    accounted_graphs(report)
    (g,) = report["graphs"]
    assert g["kind"] == "autograd" and g["lowering_check"]["status"] == "lowering_failed"
    assert "is_contiguous" in g["lowering_check"]["detail"]
    assert g["cuda_graph"]["eager_by_reason"] == {"lowering_failed": 3}  # the first raised before it counted
