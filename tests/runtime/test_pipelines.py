"""Pipelines as users run them, request after request: what the second request costs.

A diffusers pipeline encodes each request's prompt anew and concatenates the negative and
positive embeddings and attention masks for classifier-free guidance: the compiled
transformer sees new tensors of one layout per request, which it only reads. The graph
only moved (runner/relocate.py): the second request relocates at its first step (about
one run) and every step replays, instead of answering three of its steps eagerly to warm
up, capture and verify again.
"""

from __future__ import annotations

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.examples.families import pixart_pipeline
from graphdispatch_backend.testing import accounted_graphs

pytest.importorskip("diffusers")


@pytest.mark.parametrize("steps", [6, 20])  # fewer replays than REPIN_AFTER per request; more
def test_a_pixart_pipeline_relocates_for_each_new_request(steps):
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    torch.manual_seed(0)
    pipe, request = pixart_pipeline(steps)
    with torch.no_grad():
        eager = [pipe(**request(i)).images for i in range(3)]
        pipe.transformer = torch.compile(pipe.transformer, backend="graphdispatch",
                                         options={"cuda_graphs": "emulate"})
        seen = []
        for i in range(3):
            assert torch.equal(pipe(**request(i)).images, eager[i]), i  # latents bitwise, every request
            (graph,) = accounted_graphs()
            seen.append(dict(graph["cuda_graph"]))
    first, second, third = seen
    assert first["eager_calls"] == 2 and first["replays"] == steps - 2  # warmup; capture and verification
    assert second["eager_calls"] == 2 and second["replays"] == 2 * steps - 2  # every step of request 2 replays
    assert third["eager_calls"] == 2 and third["replays"] == 3 * steps - 2
    assert second["relocations"] == 1 and second["recaptures"] == 0 and not second["declines"]
    # 6 steps: the embeddings moved before REPIN_AFTER replays: copied in from then on, no
    # capture per request; 20 steps: read in place at each request's address, a relocation each
    assert third["relocations"] == (1 if steps == 6 else 2)


def _decode_step(x: torch.Tensor, pos: torch.Tensor, enc: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, pos, x * 2)  # written in place, as a KV cache
    return (cache.sum(0, keepdim=True) + enc.mean(0, keepdim=True)) * x


@pytest.mark.parametrize("aliased", [False, True], ids=["own_memory", "enc_in_the_cache"])
def test_an_encoder_output_moving_with_its_cache_relocates(aliased):
    """An encoder-decoder's decode step (T5, Whisper: `model.forward` compiled) gets a new
    encoder output and a new cache per request: an input it only reads moved with one it
    writes. Request 2 on relocates at its first call and replays every call (it used to
    answer every call of request 2 eagerly: warmup, verifying, backing off). An encoder
    output lying in the cache's own memory (a copy would miss the graph's writes) takes
    the usual paths: captured and verified again, never a stale value."""
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    compiled = torch.compile(_decode_step, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    seen = []
    with torch.no_grad():
        for request in range(3):
            store = torch.randn(70, 8)
            enc_ref = store[64:].clone()
            cache_ref, cache = torch.zeros(64, 8), store[:64] if aliased else torch.zeros(64, 8)
            cache.zero_()
            enc = store[64:] if aliased else enc_ref.clone()
            for t in range(6):
                x, pos = torch.randn(1, 8), torch.tensor([t])
                want = _decode_step(x, pos, enc_ref, cache_ref)
                assert torch.equal(compiled(x, pos, enc, cache), want) and torch.equal(cache, cache_ref), (request, t)
            (graph,) = accounted_graphs()
            seen.append(dict(graph["cuda_graph"]))
            pieces = [p["cuda_graph"] for p in graph["pieces"] if "cuda_graph" in p]
            per_replay = sum(p["copy_bytes"] for p in pieces) / sum(p["replays"] for p in pieces)
    second, third = seen[1], seen[2]
    if aliased:
        assert second["relocations"] == 0 and second["eager_calls"] > seen[0]["eager_calls"]
    else:
        assert second["relocations"] == 1 and second["eager_calls"] == seen[0]["eager_calls"] == 2
        assert third["relocations"] == 2 and third["replays"] == 3 * 6 - 2 and not third["declines"]
        assert per_replay < enc.nbytes, per_replay  # the encoder output, moving with the cache, is read in place
