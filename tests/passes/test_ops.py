"""passes/ops.py: the readings of a node the passes share, for collectives as people write
them: where a collective runs (its group's backend decides whether a CUDA graph holds it)
and which outputs are memory a graph made and never wrote."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.passes import ops

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _graph(build: Any) -> fx.GraphModule:  # build(graph, x) -> the outputs
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(build(graph, x))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_memory_made_and_returned_unwritten_is_an_unwritten_output():
    gm = _graph(lambda g, x: (g.call_function(aten.empty_like.default, (x,)),
                              g.call_function(aten.view.default, (g.call_function(aten.empty_like.default, (x,)),
                                                                  [-1])),
                              g.call_function(aten.mul.Tensor, (x, 2))))
    assert ops.unwritten_outputs(gm) == (0, 1)  # through a view too


def test_memory_written_or_filled_is_not():
    def build(g: fx.Graph, x: fx.Node) -> tuple[fx.Node, ...]:
        written = g.call_function(aten.empty_like.default, (x,))
        g.call_function(aten.copy_.default, (written, x))  # an in-place write (an `out=`)
        filled = g.call_function(aten.copy.default, (g.call_function(aten.empty_like.default, (x,)), x))
        return written, filled

    assert ops.unwritten_outputs(_graph(build)) == ()


def test_a_dynamo_graphs_allocation_counts_only_when_the_output_is_its_one_use():
    def build(g: fx.Graph, x: fx.Node) -> tuple[fx.Node, ...]:
        returned = g.call_function(torch.empty_like, (x,))
        passed = g.call_method("new_empty", (x, [3]))
        g.call_function(torch.add, (passed, 1), {"out": passed})  # a call that takes it may write it
        return returned, passed

    assert ops.unwritten_outputs(_graph(build)) == (0,)


def _collectives() -> tuple[fx.Node, fx.Node, fx.Node]:
    graph = fx.Graph()
    x = graph.placeholder("x")
    reduced = graph.call_function(c10d.all_reduce.default, (x, "sum", "7"))
    waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
    other = graph.call_function(aten.mul.Tensor, (waited, 2))
    return reduced, waited, other


def test_a_collective_is_captured_only_on_a_backend_a_cuda_graph_holds(monkeypatch):
    reduced, waited, other = _collectives()
    assert not ops.captured_collective(reduced, "cuda")  # torch.distributed not initialized: split
    seen = []
    monkeypatch.setattr(ops, "group_backend", lambda name, device: seen.append((name, device)) or "nccl")
    assert ops.captured_collective(reduced, "cpu") and ops.captured_collective(waited, "cpu")  # the wait: its group's
    assert seen == [("7", "cpu"), ("7", "cpu")]
    assert not ops.captured_collective(other, "cpu")
    monkeypatch.setattr(ops, "group_backend", lambda name, device: "gloo")
    assert not ops.captured_collective(reduced, "cuda")


def test_op_labels_name_aten_custom_and_dynamo_calls():
    gm = _graph(lambda g, x: (g.call_function(aten.mul.Tensor, (x, 2)), g.call_method("add_", (x, 1)),
                              g.call_function(torch.empty_like, (x,))))
    labels = [ops.op_label(n) for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert labels == ["aten::mul", "Tensor.add_", "torch.empty_like"]
