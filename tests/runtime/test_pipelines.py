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
