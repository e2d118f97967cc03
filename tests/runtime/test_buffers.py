"""Static input buffers are shared per compile session by flat position and layout.

A 48-block stack with a graph break per block must hold ONE static buffer set (one block's
moving-input bytes), not 48. Measured two ways: the session scope's `buffers.nbytes`, and
the `static_bytes` every captured piece reports.

Dynamo gives two shapes of this on torch 2.13:
- by default the 48 blocks run through ONE compiled graph (nn modules are always inlined,
  so a block's parameters are graph inputs, not constants), and the runner holds one capture
  per block, keyed by the block's parameter addresses;
- a block with a Python constant Dynamo guards on (here a name string) compiles once per
  block: 48 graphs, 48 runners, one shared scope.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import graphdispatch_backend
from graphdispatch_backend import session as session_mod
from graphdispatch_backend.runtime.runner import RuntimeScope
from graphdispatch_backend.runtime.runner.inputs import StaticBuffers

DEPTH = 48
DIM = 8
CALLS = 6  # 1 warmup, the capture call verifies its inputs and a set derived from them, 4 replays per block


class Block(nn.Module):
    def __init__(self, name: str, dim: int = DIM) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.lin(x))


class NamedBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Dynamo guards on the string, so every block compiles to its own graph
        return x + torch.relu(self.lin(x)) if self.name.startswith("block") else x


class Stack(nn.Module):
    def __init__(self, block: type[Block], depth: int = DEPTH, dim: int = DIM) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(block(f"block{i}", dim) for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A graph break inside this loop makes Dynamo skip this frame and compile each
        # block's forward as its own frame: that is where the pieces come from.
        for block in self.blocks:
            x = block(x)
            torch._dynamo.graph_break()
        return x


def run(model: nn.Module, dim: int = DIM) -> tuple[list[torch.Tensor], dict[str, Any]]:
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    inputs = [torch.randn(2, dim) for _ in range(CALLS)]  # kept alive: the input moves every call
    with torch.no_grad():
        for x in inputs:
            assert torch.equal(compiled(x), model(x))
    report = graphdispatch_backend.latest_report()
    assert report is not None
    for graph in report["graphs"]:
        cg = graph["cuda_graph"]
        assert graph["calls"] == cg["replays"] + cg["eager_calls"]
        assert sum(cg["eager_by_reason"].values()) == cg["eager_calls"]
    return inputs, report


def scope() -> RuntimeScope:
    (session,) = session_mod._SESSIONS.values()
    return session.scope("host")


def one_piece_moving_bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()  # the block's only moving input; its parameters are pinned


def test_48_blocks_through_one_graph_hold_one_buffer_set():
    inputs, report = run(Stack(Block))
    (graph,) = report["graphs"]  # one compiled graph serves all 48 blocks
    cg = graph["cuda_graph"]
    assert graph["calls"] == DEPTH * CALLS
    assert cg["captures"] == DEPTH and cg["declines"] == {}
    assert cg["replays"] == DEPTH * (CALLS - 2)
    buffers = scope().buffers
    assert len(buffers) == 1
    assert buffers.nbytes == one_piece_moving_bytes(inputs[0]) == cg["static_bytes"]


def test_48_graphs_hold_one_buffer_set():
    # Each NamedBlock is its own graph; the default recompile limit (8) would stop Dynamo
    # compiling after 8 of them and run the other 40 blocks uncompiled, so raise it.
    with torch._dynamo.config.patch(recompile_limit=DEPTH + 8, accumulated_recompile_limit=4 * DEPTH):
        inputs, report = run(Stack(NamedBlock))
    graphs = report["graphs"]
    assert len(graphs) == DEPTH
    assert all(g["cuda_graph"]["captures"] == 1 and g["cuda_graph"]["replays"] == CALLS - 2 for g in graphs)
    buffers = scope().buffers
    assert len(buffers) == 1
    assert buffers.nbytes == one_piece_moving_bytes(inputs[0])
    # each piece reports the bytes it holds (the one shared set); the session counts it once
    assert {g["cuda_graph"]["static_bytes"] for g in graphs} == {one_piece_moving_bytes(inputs[0])}
    assert report["totals"]["static_buffers"] == {"host": {"count": 1, "bytes": one_piece_moving_bytes(inputs[0])}}


def test_blocks_of_two_widths_hold_one_buffer_per_layout():
    narrow, _ = run(Stack(Block, depth=4))
    wide, report = run(Stack(Block, depth=4, dim=2 * DIM), dim=2 * DIM)  # same options: the same session
    assert len(report["graphs"]) == 2
    buffers = scope().buffers
    assert len(buffers) == 2
    assert buffers.nbytes == one_piece_moving_bytes(narrow[0]) + one_piece_moving_bytes(wide[0])
    # each graph reports only the buffer it holds, not the session's total
    assert [g["cuda_graph"]["static_bytes"] for g in report["graphs"]] == [
        one_piece_moving_bytes(narrow[0]), one_piece_moving_bytes(wide[0])]


def test_static_buffers_are_keyed_by_position_and_layout():
    buffers = StaticBuffers()
    a = buffers.get(0, torch.empty(2, DIM))
    assert buffers.get(0, torch.empty(2, DIM)) is a
    # held, as the captured entries that use them hold them
    held = [buffers.get(1, torch.empty(2, DIM)), buffers.get(0, torch.empty(DIM, 2).t()),
            buffers.get(0, torch.empty(2, DIM, dtype=torch.float64))]
    assert all(b is not a for b in held)
    assert len(buffers) == 4
    assert buffers.nbytes == 3 * 2 * DIM * 4 + 2 * DIM * 8
    del held
    assert len(buffers) == 1 and buffers.get(0, torch.empty(2, DIM)) is a  # a buffer no entry uses is gone


def test_buffer_keeps_layout_and_expanded_inputs_keep_their_strides():
    buffers = StaticBuffers()
    strided = torch.empty(DIM, 4).t()
    buf = buffers.get(0, strided)
    assert buf.stride() == strided.stride() and buf.shape == strided.shape
    expanded = torch.randn(1, DIM).expand(3, DIM)  # stride 0: only one row is stored
    kept = buffers.get(1, expanded)
    assert kept.stride() == expanded.stride() and kept.shape == expanded.shape
    assert kept.untyped_storage().nbytes() == DIM * 4
    kept.narrow(0, 0, 1).copy_(expanded.narrow(0, 0, 1))
    assert torch.equal(kept, expanded)
