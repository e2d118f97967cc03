"""The compile-side plan of one lowered graph: what serves it, decided before anything is built.

`plan_graph` reads one of aot's graphs (an inference graph, an autograd graph's forward or
its backward) and the options, and decides: the graph's role, the engine that captures its
pieces or the Decline that says why none does, the device its pieces run on, and whether it
is fused, with its recipe, or the FusionOff that says why not. Once the pass pipeline has
cut the graph into pieces (passes/split_pieces.py), `GraphPlan.serving` decides how it is
served (one runner for the whole graph, captured pieces, or nothing captured) and the
graph-level decline in the words the report and the warning say. backend.py assembles the
callables from the plan; diagnostics/record_fields.py writes it into the graph's record.
Nothing here builds a callable or imports the runtime (tests/test_layout.py).

Before::   gm (aot's inference graph, inputs on CPU), options cuda_graphs="auto", fuse=True
After::    GraphPlan(role=INFERENCE, engine=OFF, decline=NOT_CUDA, device="cpu",
                     fusion=FusionPlan(device_type="cpu", off=None, tolerance=None), ...)
           .serving(pieces, {}) -> Serving(how=UNCAPTURED, decline=NOT_CUDA, fused=True, ...)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.errors import Decline, Engine, FusionOff, GraphKind, SplitReason
from graphdispatch_backend.options import FuseTolerance, Options
from graphdispatch_backend.passes.context import PieceInfo
from graphdispatch_backend.passes.ops import draws_random, effect_tokens


class Role(enum.Enum):
    """Which of aot's graphs is planned."""

    INFERENCE = "inference"
    FORWARD = "forward"  # an autograd graph's forward
    BACKWARD = "backward"  # an autograd graph's backward

    @property
    def kind(self) -> GraphKind:
        return {Role.INFERENCE: GraphKind.INFERENCE, Role.FORWARD: GraphKind.AUTOGRAD}.get(self, GraphKind.BACKWARD)

    @property
    def training(self) -> bool:
        return self is not Role.INFERENCE


class Serve(enum.Enum):
    """How a graph's calls are served once its pieces are known."""

    WHOLE = "whole"  # one runner captures the whole graph (no node split it)
    PIECES = "pieces"  # captured pieces, with the runs of nodes between them
    UNCAPTURED = "uncaptured"  # nothing captured (no engine, or no capturable piece)


_DETAILS = {
    Decline.DISABLED: "cuda_graphs=False",
    Decline.NOT_CUDA: "the graph's inputs are not all on CUDA; cuda_graphs='emulate' shows what a GPU would do",
    Decline.NO_CUDA_DEVICE: "cuda_graphs=True but this machine has no CUDA device",
    Decline.NO_CAPTURABLE_PIECE: "every node of the graph must stay outside a CUDA graph",
    Decline.MULTI_DEVICE: "the graph's tensors are on several CUDA devices; a CUDA graph captures one device",
}

_FUSION_OFF = {
    FusionOff.AUTOGRAD: ("autograd graphs are not fused: their checks compare gradients and blame the lowering "
                         "as a whole"),
    FusionOff.UNCHECKABLE: "the graph cannot be checked against eager (aot did not say which inputs it writes)",
    FusionOff.COLLECTIVES: "the graph holds collectives: every rank would have to agree on each recompile",
    FusionOff.DYNAMIC_SHAPES: "dynamic shapes: only graphs whose input shapes Dynamo fixed are fused",
    FusionOff.DYNAMIC_SCALARS: (
        "dynamic Python numbers: every tensor shape is fixed, but Dynamo made a Python number input symbolic (a "
        "transformers sliding-window or hybrid cache counts its tokens in an int); fused code is compiled for fixed "
        "inputs only, so such a graph is not fused (with dynamic=False each value would be a graph of its own, past "
        "Dynamo's recompile_limit): it runs unfused, captured and checked as any other"),
    FusionOff.DYNAMIC_STRIDES: (
        "dynamic strides: Dynamo fixed every input size but left strides symbolic (it recompiled for an input "
        "of the same shape laid out otherwise, such as a slice of a wider tensor); only graphs whose input shapes "
        "and strides Dynamo fixed are fused. Compile with dynamic=False (one graph per input layout; "
        "compile_repeated_blocks(..., dynamic=False) passes it on), or mark the input with "
        "torch._dynamo.mark_static(tensor) before the call"),
}


def _decline_detail(reason: Decline, split_reasons: Mapping[str, int]) -> str | None:
    """What a graph-level decline says; no capturable piece names its nodes' split reasons."""
    detail = _DETAILS.get(reason)
    if reason is not Decline.NO_CAPTURABLE_PIECE or not split_reasons:
        return detail
    detail = f"{detail} ({', '.join(f'{k}: {v}' for k, v in split_reasons.items())})"
    if SplitReason.MADE_BUFFER.value in split_reasons:
        detail += ("; it makes and returns a buffer (a new cache): pass one in (a transformers StaticCache per "
                   "slot, reused) and the graph is captured, writing into it")
    if SplitReason.UNWRITTEN_BUFFER.value in split_reasons:
        detail += ("; it returns memory it made and never wrote, for its caller to fill (a collective after a "
                   "graph break): made at each call, as eager makes it")
    return detail


def fixed_shapes(gm: fx.GraphModule) -> bool:
    """No tensor input of the graph (or piece) has a symbolic size or stride, so Dynamo's
    guards fix its shapes: true of every piece of a static graph, and of a piece in a graph
    with symbols whose tensors do not depend on them (a Python int lifted out of the piece)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not all(type(d) is int for d in (*val.shape, *val.stride())):
            return False
    return True


def _strides_only(gm: fx.GraphModule) -> bool:
    """Every tensor input's sizes are ints, and every symbolic input is a stride's symbol:
    what automatic dynamic leaves after a recompile for a stride alone (a Flux single block
    fed a slice of a wider tensor)."""
    strides: set[Any] = set()  # the symbols the tensor inputs' strides are made of
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            if not all(type(d) is int for d in val.shape):
                return False
            strides |= {x for s in val.stride() if isinstance(s, torch.SymInt) for x in s.node.expr.free_symbols}
    symbolic = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")
                if isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))]
    return all(isinstance(s, torch.SymInt) and s.node.expr.free_symbols <= strides for s in symbolic)


def _dynamic(gm: fx.GraphModule) -> FusionOff:
    """What Dynamo left symbolic in a graph that is not static: strides alone, Python
    numbers alone (every tensor shape fixed), or shapes."""
    if _strides_only(gm):
        return FusionOff.DYNAMIC_STRIDES
    return FusionOff.DYNAMIC_SCALARS if fixed_shapes(gm) else FusionOff.DYNAMIC_SHAPES


def _static(gm: fx.GraphModule) -> bool:
    """Every input is a tensor of fixed shape and strides or a plain Python value."""
    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
    return fixed_shapes(gm) and not any(isinstance(n.meta.get("val"), symbolic)
                                        for n in gm.graph.find_nodes(op="placeholder"))


@dataclasses.dataclass(frozen=True)
class FusionPlan:
    """`fuse` for one graph: fused (the device's recipe, fusion/recipe.py: exact, or within a
    tolerance), or off with the reason (and the report's words)."""

    device_type: str
    off: FusionOff | None = None
    detail: str | None = None  # why it is off
    # fuse={"rtol": r, "atol": a}: fused within it, by Inductor as it compiles; None: the exact recipe
    tolerance: FuseTolerance | None = None


@dataclasses.dataclass(frozen=True)
class Serving:
    """How a graph is served, once its pieces are known; the graph-level decline with its words."""

    how: Serve
    decline: Decline | None
    detail: str | None  # the report's cuda_graph detail
    warning: str | None  # what the user is told, where they asked for graphs or a piece could have had one
    fused: bool  # a fusion unit serves the graph around its pieces (or the whole graph, uncaptured)
    without_history: bool  # an autograd graph whose replays must not run with grad mode on


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """What one of aot's graphs is served by, decided from the graph and the options."""

    role: Role
    engine: Engine
    decline: Decline | None  # why the graph has no engine (None: it has one)
    device: str  # what its pieces run on: `cuda:N`, or a device type
    nodes: int
    inputs: int
    tokens: frozenset[int]  # placeholder positions of effect tokens
    draws: bool  # some node draws random numbers
    fusion: FusionPlan | None  # None: `fuse` is off
    asked: bool  # the user asked for CUDA graphs (True or "emulate"): a decline is told

    @property
    def fused(self) -> bool:
        return self.fusion is not None and self.fusion.off is None

    def serving(self, pieces: Sequence[PieceInfo], split_reasons: Mapping[SplitReason, int]) -> Serving:
        """How the graph is served, given the pieces the pass pipeline cut it into."""
        decline = self.decline
        if self.engine is Engine.OFF:
            how = Serve.UNCAPTURED
        elif not split_reasons and pieces:
            how = Serve.WHOLE
        elif not any(p.capturable for p in pieces):
            how, decline = Serve.UNCAPTURED, Decline.NO_CAPTURABLE_PIECE
        else:
            how = Serve.PIECES
        if decline is None:
            return Serving(how, None, None, None, self.fused and how is not Serve.WHOLE, self.role.training)
        words = _decline_detail(decline, {k.value: v for k, v in split_reasons.items()})
        # what runs instead: an autograd graph's lowered forward and backward, not the Dynamo graph
        runs = "the lowered forward and backward run, not captured" if self.role.training else "it runs eager"
        told = self.asked or decline is Decline.NO_CAPTURABLE_PIECE
        return Serving(how, decline, f"{words}; {runs}" if self.role.training else words,
                       f"{words}; {runs}" if told else None, self.fused, False)

    def serves_nothing(self, serving: Serving, substituted: bool) -> bool:
        """An inference graph with no capturable piece, no artifact substituted and nothing
        fused: its lowered form adds nothing to eager."""
        return (self.role is Role.INFERENCE and serving.decline is Decline.NO_CAPTURABLE_PIECE
                and not substituted and not self.fused)

    def recheck(self, options: Options) -> str | int:
        """The graph's `recheck` schedule: a graph fused under a declared tolerance, whose
        kernels are not exact by construction (an intermittent fault served unchecked is its
        risk), is checked on the "dense" schedule where `recheck` is left "doubling"."""
        if self.fused and self.fusion is not None and self.fusion.tolerance is not None \
                and options.recheck == "doubling":
            return "dense"
        return options.recheck


def plan_graph(gm: fx.GraphModule, role: Role, options: Options, writes_known: bool, ranked: bool) -> GraphPlan:
    """The plan of `gm`, aot's graph in `role`, before any pass ran. `writes_known`: aot said
    which inputs the graph writes (it can be checked against eager); `ranked`: its collectives
    run over initialized process groups (verdicts are agreed between ranks)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    tokens = frozenset(effect_tokens(gm))
    engine, decline, device = _engine_for(options, [p for i, p in enumerate(placeholders) if i not in tokens])
    fusion = _fusion_for(gm, role, options, device, writes_known, ranked) if options.fuse else None
    return GraphPlan(role, engine, decline, device, len(gm.graph.nodes), len(placeholders), tokens,
                     any(map(draws_random, gm.graph.nodes)), fusion, options.cuda_graphs in (True, "emulate"))


def _engine_for(options: Options, placeholders: list[fx.Node]) -> tuple[Engine, Decline | None, str]:
    """(engine, why there is none, the device the pieces run on: `cuda:N` or a type)."""
    mode = options.cuda_graphs
    devices = {n.meta["val"].device for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)}
    types = {d.type for d in devices}
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    device = f"cuda:{cuda[0]}" if cuda else (sorted(types)[0] if types else "cpu")
    if mode is False:
        return Engine.OFF, Decline.DISABLED, device
    if len(cuda) > 1:  # one graph, one device: a capture cannot span devices
        return Engine.OFF, Decline.MULTI_DEVICE, device
    if mode == "emulate":
        return Engine.HOST, None, device
    if mode is True and not torch.cuda.is_available():
        return Engine.OFF, Decline.NO_CUDA_DEVICE, device
    # "auto" captures where every input is on CUDA; True where any is
    on_cuda = types == {"cuda"} if mode == "auto" else "cuda" in types
    return (Engine.CUDA, None, device) if on_cuda else (Engine.OFF, Decline.NOT_CUDA, device)


def _fusion_for(gm: fx.GraphModule, role: Role, options: Options, device: str, writes_known: bool,
                ranked: bool) -> FusionPlan:
    kind = torch.device(device).type
    off = (FusionOff.AUTOGRAD if role.training else FusionOff.UNCHECKABLE if not writes_known
           else FusionOff.COLLECTIVES if ranked
           else _dynamic(gm) if not _static(gm)
           else FusionOff.NO_RECIPE if kind not in ("cpu", "cuda") else None)
    if off is not None:
        return FusionPlan(kind, off, _FUSION_OFF.get(off, f"no eager-numerics recipe for {kind}"))
    return FusionPlan(kind, tolerance=options.fuse if isinstance(options.fuse, FuseTolerance) else None)
