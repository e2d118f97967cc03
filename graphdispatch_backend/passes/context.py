"""PassContext: what the passes read (inputs, injected factories) and what they record.

Passes are pure graph rewrites; anything they need from the runtime or the registry is
handed in here as a plain callable by backend.py, so no pass imports the runtime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from graphdispatch_backend.artifacts.match import MatchOutcome
from graphdispatch_backend.capture.lower import InputOrigin
from graphdispatch_backend.errors import SplitReason
from graphdispatch_backend.region import Region

# (region, outcome, native region graph) -> the callable the substituted node calls,
# or None when the artifact could not be loaded (the outcome then records why).
MakeCall = Callable[[Region, MatchOutcome, fx.GraphModule], Callable[..., Any] | None]


@dataclasses.dataclass(frozen=True)
class PieceSpec:
    """How split_pieces cuts a graph for piecewise capture."""

    graph_device: str  # device type the captured pieces run on ("cuda", or "cpu" in emulation)
    make_piece: Callable[[fx.GraphModule, PieceInfo], Callable[..., Any]]
    # a run returning a buffer the graph makes stays eager (`made_buffer`): an inference
    # graph's new cache. Not an autograd graph's: a gradient made by `zeros` and the rows an
    # index wrote (the backward of `w[idx]`) is an output as any, and its graph is captured
    made_buffers_eager: bool = True


@dataclasses.dataclass
class PieceInfo:
    """One capturable piece, or one run of nodes left eager, in graph order."""

    index: int
    capturable: bool
    nodes: int
    reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    ops: list[str] = dataclasses.field(default_factory=list)
    input_origins: tuple[InputOrigin | None, ...] = ()
    mutated: tuple[int, ...] = ()  # input positions the piece writes into
    wide: tuple[int, ...] = ()  # input positions the piece reads with as_strided (whole storage)
    collectives: bool = False  # the piece holds collectives (captured inside: NCCL)
    write_plan: Any = None  # where the piece writes its inputs (passes/locate_writes.py)
    # output positions that are memory the piece made uninitialized and never wrote: their
    # values are nobody's, so checks compare their metadata only (passes/ops.py unwritten_outputs)
    unwritten: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "capturable": self.capturable,
            "nodes": self.nodes,
            "split_reasons": dict(self.reasons),
            "ops": self.ops,
        }


@dataclasses.dataclass(frozen=True)
class WriteOutcome:
    """What passes/reinplace.py made of the writes into one input: in place, or still a
    whole copy back (and why)."""

    position: int  # the placeholder's position
    in_place: bool
    detail: str


@dataclasses.dataclass
class SubstitutionInfo:
    region: str
    artifact: str
    capturable: bool
    # the graph's inputs (placeholder positions) its region reads and its manifest does not
    # say it writes: a write into one is undeclared, looked for at a replayed call's check
    reads: tuple[int, ...] = ()


@dataclasses.dataclass
class PassContext:
    input_origins: tuple[InputOrigin, ...] = ()
    matcher: Callable[[Region], MatchOutcome] | None = None
    make_call: MakeCall | None = None
    pieces_spec: PieceSpec | None = None
    # the graph is fused (`fuse`): a write into a view of a buffer it made (slice or select
    # scatter) is left for Inductor, which lowers it into the buffer (passes/reinplace_buffers.py)
    fused: bool = False
    # results
    stripped_assertions: int = 0
    writes: list[WriteOutcome] = dataclasses.field(default_factory=list)
    buffer_writes: int = 0  # writes into tensors the graph makes, made in place (passes/reinplace_buffers.py)
    write_plan: Any = None  # passes/locate_writes.py's WritePlan of the whole graph (None: writes no input)
    regions: list[Region] = dataclasses.field(default_factory=list)
    outcomes: dict[str, MatchOutcome] = dataclasses.field(default_factory=dict)
    substitutions: list[SubstitutionInfo] = dataclasses.field(default_factory=list)
    pieces: list[PieceInfo] = dataclasses.field(default_factory=list)
    split_reasons: dict[SplitReason, int] = dataclasses.field(default_factory=dict)
