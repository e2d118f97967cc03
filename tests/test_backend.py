"""End to end through torch.compile(backend="graphdispatch"): entry point, options, eager path."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

import graphdispatch_backend
from graphdispatch_backend.examples.dit import denoise, example_inputs, make_model


def test_entry_point_needs_no_import_of_the_package():
    script = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
        x = torch.randn(2, 8)
        assert "graphdispatch_backend" not in sys.modules
        with torch.no_grad():
            out = torch.compile(m, backend="graphdispatch")(x)
        assert torch.equal(out, m(x))
        print("ok", "graphdispatch_backend" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", "True"]  # loaded by torch through the entry point


def test_unknown_option_names_the_key_and_the_valid_ones():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(model, backend="graphdispatch", options={"no_such_key": 1})(torch.randn(2, 4))
    inner = info.value.inner_exception
    assert isinstance(inner, ValueError)
    assert "no_such_key" in str(inner) and "cuda_graphs" in str(inner) and "report_dir" in str(inner)


def test_demo_model_is_bitwise_equal_to_eager_and_accounted():
    model = make_model()
    x, _ = example_inputs()
    compiled = torch.compile(model, backend="graphdispatch")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours, ref = denoise(compiled, x, 3), denoise(model, x, 3)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    report = graphdispatch_backend.latest_report()
    (graph,) = report["graphs"]
    assert graph["calls"] == 3 == graph["cuda_graph"]["eager_calls"]
    assert graph["cuda_graph"]["eager_by_reason"] == {"not_cuda": 3}


class _ShardedWithCache(torch.nn.Module):
    """A replicated DTensor weight and a plain cache the forward writes in place, as a
    tensor-parallel model's decode step writes its static KV cache (`into_weight`: the
    forward writes the weight itself, inside the subclass)."""

    def __init__(self, mesh: object, into_weight: bool = False) -> None:
        super().__init__()
        from torch.distributed.tensor import Replicate, distribute_tensor

        self.w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]), requires_grad=False)
        self.register_buffer("cache", torch.zeros(2, 4))
        self.into_weight = into_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.into_weight:
            self.w.mul_(1.0)
        y = (self.w * 2).to_local()  # the weight first: the call's inputs are x, w, cache; aot's x, w's local
        self.cache[0].copy_(x[0])  # tensor, w's mesh, cache
        return y + self.cache.sum()


def _calls(into_weight: bool) -> dict:
    """4 calls of the compiled model against its twin, bitwise (outputs and the cache); the graph's report."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = _ShardedWithCache(mesh, into_weight)
    torch.manual_seed(0)
    twin = _ShardedWithCache(mesh, into_weight)
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    for i in range(6):
        x = torch.randn(2, 4)
        assert torch.equal(compiled(x), twin(x)), i
    assert torch.equal(model.cache, twin.cache)
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    return graph


def test_a_graph_writing_its_cache_beside_a_dtensor_weight_replays(two_fake_ranks):
    """aot flattens a tensor subclass (a DTensor: its local tensor, its mesh's object), and
    graphdispatch took aot's positions for the call's: a trial's DTensor Llama put its
    static cache's position on a sharded weight (the contract's read of its storage raised
    in the call), and compiled block by block took activations for its parameters (new
    addresses on every call: parameter_moved, never a replay). The lowered graph names its
    inputs in aot's numbering, the checks around it in the call's (capture/lower.py FlatInputs)."""
    graph = _calls(into_weight=False)
    cg = graph["cuda_graph"]
    assert graph["lowering_check"]["status"] == "bitwise" and cg["replays"] == 4, graph
    assert [w["input"] for w in graph["input_writes"]] == ["cache"], graph["input_writes"]


def test_a_graph_writing_inside_a_dtensor_runs_as_eager_and_says_why(two_fake_ranks):
    """A write into the subclass's own inner tensor has no input of the call to copy and
    compare: the Dynamo graph runs, said in lowering_check (forced here on purpose)."""
    graph = _calls(into_weight=True)
    cg, lowering = graph["cuda_graph"], graph["lowering_check"]
    assert lowering["status"] == "not_lowered" and "inside a tensor subclass" in lowering["detail"]
    assert cg["eager_by_reason"] == {"subclass_writes": 6} and graph["calls"] == 6 == cg["eager_calls"]
