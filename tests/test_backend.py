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
