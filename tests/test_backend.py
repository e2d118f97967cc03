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
    tensor-parallel model's decode step writes its static KV cache."""

    def __init__(self, mesh: object) -> None:
        super().__init__()
        from torch.distributed.tensor import Replicate, distribute_tensor

        self.w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]), requires_grad=False)
        self.register_buffer("cache", torch.zeros(2, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[0].copy_(x[0])
        return (self.w * 2).to_local() + self.cache.sum()


def test_a_graph_writing_an_input_beside_a_dtensor_runs_as_eager_and_says_why():
    """aot flattens a tensor subclass, and the written input's position, taken from aot's,
    was a sharded weight's in a trial (a DTensor Llama generating with a static cache): the
    contract's read of its storage raised in the user's call. A graph that writes an input
    and takes a subclass runs as Dynamo's, whether or not the positions happen to agree (in
    this toy they do): forced here on purpose, on a fake process group of 2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = _ShardedWithCache(mesh)
        torch.manual_seed(0)
        twin = _ShardedWithCache(mesh)
        compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate"})
        for i in range(4):
            x = torch.randn(2, 4)
            assert torch.equal(compiled(x), twin(x)), i
        assert torch.equal(model.cache, twin.cache)
        (graph,) = graphdispatch_backend.latest_report()["graphs"]
        cg, lowering = graph["cuda_graph"], graph["lowering_check"]
        assert lowering["status"] == "not_lowered" and "tensor subclass" in lowering["detail"]
        assert cg["eager_by_reason"] == {"subclass_writes": 4} and graph["calls"] == 4 == cg["eager_calls"]
    finally:
        dist.destroy_process_group()
