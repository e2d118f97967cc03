"""Interpolation keeps eager's kernels in a lowered inference graph (capture/interpolate.py):
aot's decomposition of a bilinear upsampling rounds otherwise than the CPU kernel, so the
lowering was `lowering_mismatch` and the graph never replayed; through the custom op it
replays, bitwise, in every computing mode, sized or scaled, in either memory format."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from graphdispatch_backend.capture import interpolate as interpolate_mod
from graphdispatch_backend.capture import lower as lower_mod
from graphdispatch_backend.testing import accounted_graphs

EMULATE = {"cuda_graphs": "emulate"}
CASES = [
    {"size": (8, 8), "mode": "bilinear", "align_corners": False},
    {"scale_factor": 1.7, "mode": "bilinear"},
    {"scale_factor": 1.3, "mode": "bilinear", "align_corners": True, "recompute_scale_factor": True},
    {"scale_factor": 2.0, "mode": "bicubic"},
    {"scale_factor": 0.5, "mode": "bilinear", "antialias": True},
    {"size": 9, "mode": "bicubic", "align_corners": True},
]
LAYOUTS = {
    "contiguous": lambda: torch.randn(2, 6, 5, 7),
    "batch_of_one_transposed": lambda: torch.randn(1, 6, 7, 5).transpose(2, 3),
    "channels_last": lambda: torch.randn(2, 6, 5, 7).to(memory_format=torch.channels_last),
}


def _run(fn: Any, make: Any, options: dict[str, Any], calls: int = 5) -> dict[str, Any]:
    compiled = torch.compile(fn, backend="graphdispatch", options=options)
    with torch.no_grad():
        for _ in range(calls):
            x = make()
            got, want = compiled(x), fn(x)
            assert torch.equal(got, want) and got.stride() == want.stride()
    (graph,) = accounted_graphs()
    return graph


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_computing_modes_replay_bitwise(case: int, layout: str) -> None:
    kwargs = CASES[case]
    graph = _run(lambda x: F.interpolate(x * 2.0, **kwargs) + 1.0, LAYOUTS[layout], EMULATE)
    assert graph["lowering_check"]["status"] == "bitwise"
    assert graph["cuda_graph"]["replays"] == 3 and graph["cuda_graph"]["declines"] == {}


def test_without_it_the_decomposition_differs_from_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the custom op is for: aot's own bilinear decomposition is not eager's bits
    (the graph then runs as the Dynamo graph, and never replays)."""
    monkeypatch.setattr(lower_mod, "keep_eager_interpolation", lambda gm: gm)
    graph = _run(lambda x: F.interpolate(x, size=(8, 8), mode="bilinear"), lambda: torch.randn(2, 16, 4, 4), EMULATE)
    assert graph["lowering_check"]["status"] == "lowering_mismatch"
    assert graph["cuda_graph"]["replays"] == 0


def test_fused_graphs_keep_it_as_an_aten_call() -> None:
    graph = _run(lambda x: F.interpolate(x.sin() * 2.0, scale_factor=1.5, mode="bilinear").relu(),
                 lambda: torch.randn(2, 4, 6, 6), {**EMULATE, "fuse": True, "cache_dir": False})
    assert graph["lowering_check"]["status"] == "bitwise" and graph["fusion"]["status"] == "fused"
    assert graph["cuda_graph"]["replays"] == 3


def _dynamo_graph(fn: Any, x: torch.Tensor) -> torch.fx.GraphModule:
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=keep)(x)
    return graphs[0]


def test_the_dynamo_graph_stays_and_nearest_modes_are_left_alone() -> None:
    gm = _dynamo_graph(lambda x: (F.interpolate(x, scale_factor=2.0, mode="bilinear"),
                                  F.interpolate(x, scale_factor=2.0, mode="nearest")), torch.randn(1, 2, 3, 3))
    with torch.no_grad():
        kept = interpolate_mod.keep_eager_interpolation(gm)
    targets = [n.target for n in kept.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.graphdispatch.interpolate.default) == 1
    assert targets.count(F.interpolate) == 1  # nearest: exact as traced
    assert sum(n.target is F.interpolate for n in gm.graph.nodes) == 2  # the reference is what the user wrote


def test_a_graph_that_records_history_keeps_the_decomposition() -> None:
    gm = _dynamo_graph(lambda x: F.interpolate(x, scale_factor=2.0, mode="bilinear"), torch.randn(1, 2, 3, 3))
    with torch.enable_grad():
        assert interpolate_mod.keep_eager_interpolation(gm) is gm  # the custom op has no backward
