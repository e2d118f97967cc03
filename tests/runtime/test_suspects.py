"""Suspects: an eager that disagrees with itself names the op whose output bits differed
(runtime/checks/suspects.py), not every op of the graph that might, nor a later collective."""

from __future__ import annotations

import os

import torch
import torch.fx as fx

import graphdispatch_backend
from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.runtime.checks import suspects as suspects_mod
from graphdispatch_backend.runtime.checks.suspects import NONE_KNOWN, Suspects
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine
from graphdispatch_backend.runtime.runner import GraphRunner, RuntimeScope
from graphdispatch_backend.testing import uninitialized_memory


@torch.library.custom_op("gd_suspects::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    """An atomics-based kernel stand-in: other bits on every run."""
    return x + float(int.from_bytes(os.urandom(2), "little") + 1)


@noisy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("gd_suspects::steady", mutates_args=())
def steady(x: torch.Tensor) -> torch.Tensor:
    """A custom kernel that is deterministic: read from the graph alone, it is as suspect."""
    return x * 2


@steady.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def model(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.gd_suspects.steady(torch.ops.gd_suspects.noisy(x.sin())).relu()


def _lowering_detail(fn, *inputs) -> str:
    compiled = torch.compile(fn, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    with torch.no_grad():
        for x in inputs:
            compiled(x)
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    assert graph["lowering_check"]["status"] == "eager_nondeterministic", graph["lowering_check"]
    return graph["lowering_check"]["detail"]


def test_the_op_whose_bits_differed_is_named_not_every_custom_op():
    """The rule removed (no second look, the graph read alone), `steady` is named too: both
    are custom ops the output depends on."""
    detail = _lowering_detail(model, torch.randn(4), torch.randn(4))
    assert "gd_suspects::noisy (its output bits differed between two runs)" in detail, detail
    assert "steady" not in detail, detail


def test_read_from_the_graph_alone_every_custom_op_the_output_depends_on(monkeypatch):
    monkeypatch.setattr(suspects_mod.Suspects, "_differing", lambda self, run: None)
    detail = _lowering_detail(model, torch.randn(4), torch.randn(4))
    assert "gd_suspects::noisy" in detail and "gd_suspects::steady" in detail, detail


def test_an_op_reading_memory_nobody_wrote_is_named_with_the_allocation():
    def reads_garbage(x: torch.Tensor) -> torch.Tensor:
        return (x.new_empty(x.shape) + x).cos()

    with uninitialized_memory():
        detail = _lowering_detail(reads_garbage, torch.randn(4), torch.randn(4))
    assert "operator.add (its output bits differed between two runs; it reads memory made uninitialized by " \
           "Tensor.new_empty)" in detail, detail


def test_a_view_of_a_buffer_before_its_write_is_not_named():
    """The view is made before the buffer is written: its bytes are nobody's then, and
    only what is computed from the buffer is printed (the noisy op, named)."""
    def fills_then_noise(x: torch.Tensor) -> torch.Tensor:
        buf = x.new_empty(x.shape)
        flat = buf.view(-1)
        flat.copy_(x.reshape(-1))
        return torch.ops.gd_suspects.noisy(buf * 2)

    with uninitialized_memory():
        detail = _lowering_detail(fills_then_noise, torch.randn(4), torch.randn(4))
    assert "suspects: gd_suspects::noisy (its output bits differed between two runs)" in detail, detail


def test_a_piece_names_the_op_of_its_own_graph():
    """Verification (runtime/runner/verify.py) of a piece: its graph, run op by op."""
    gm = fx.symbolic_trace(lambda x: torch.ops.gd_suspects.steady(torch.ops.gd_suspects.noisy(x * 3)) + 1)
    scope = RuntimeScope(HostReplayEngine(), Timing(), Events(), make_contain(False))
    stats = CudaGraphStats()
    runner = GraphRunner(lambda x: (gm(x),), "piece", scope, stats, warmup=1, max_captures=8, verify_inputs=2,
                         state_names={}, suspects=Suspects(gm, rerun=True))
    for _ in range(4):
        runner(torch.randn(3))
    assert set(stats.declines) == {"eager_nondeterministic"}, stats.decline_details
    detail = stats.decline_details["eager_nondeterministic"]
    assert "gd_suspects::noisy (its output bits differed" in detail and "steady" not in detail, detail


def _graph_with_two_outputs() -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.gd_suspects.noisy.default, (x,))
    b = graph.call_function(torch.ops.aten.index_add.default, (x, 0, x, x))
    c = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    graph.output((a, b, c))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_without_running_again_the_ops_the_differing_output_depends_on():
    """A graph that may not run again on one rank alone (collectives) is read: only what the
    output that differed depends on."""
    named = Suspects(_graph_with_two_outputs(), rerun=False)
    assert named.name(0, None) == "gd_suspects::noisy"
    assert named.name(1, None) == "aten::index_add"
    assert named.name(2, None) == NONE_KNOWN
    assert named.name(-1, None) == "gd_suspects::noisy, aten::index_add"
    assert Suspects(listed=["aten::index_add"]).name(0, None) == "aten::index_add"


def test_read_from_the_graph_a_buffer_written_whole_first_is_no_suspect():
    """`out = torch.empty_like(h); dist.all_to_all_single(out, h)` as Dynamo traces it: the
    collective's result copied into `out`, its first use. Nobody reads `out` unwritten, so
    the op named is the one that may give other bits, not the allocation; a buffer read
    before it is written stays named."""
    def graph_of(write_first: bool) -> fx.GraphModule:
        graph = fx.Graph()
        x = graph.placeholder("x")
        out = graph.call_function(torch.empty_like, (x,))
        moved = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))  # stands in for the collective
        if not write_first:
            early = graph.call_function(torch.ops.aten.add.Tensor, (out, 1))
        graph.call_method("copy_", (out, moved))
        result = graph.call_function(torch.ops.gd_suspects.noisy, (out,))
        graph.output((result, early) if not write_first else (result,))
        return fx.GraphModule(torch.nn.Module(), graph)

    assert Suspects(graph_of(True), rerun=False).name(0, None) == "gd_suspects::noisy"
    read_unwritten = Suspects(graph_of(False), rerun=False).name(-1, None)
    assert read_unwritten == "torch.empty_like (memory made uninitialized), gd_suspects::noisy"
