"""FusedUnit: the callable of one fused graph or piece, and its forms.

A unit (runtime/program/fused.py `Fusion.unit`) serves its graph's segments compiled by
Inductor (fusion/segments.py, fusion/inductor.py) bound into the graph around them
(`_bind`), or its ATen graph unfused; while its thread isolates (runtime/checks/isolate.py)
it runs the keep set that thread tries. With `posted` every form also returns the
statistics the graph takes of its watched inputs (fusion/statistics.py), which the unit
posts for the eager check (runtime/checks/posted.py) and strips.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.fx as fx

from graphdispatch_backend.codegen import entry, module_of, unrun
from graphdispatch_backend.fusion.inductor import CompiledSegment, compile_segment, segment_key
from graphdispatch_backend.fusion.recipe import Recipe
from graphdispatch_backend.fusion.segments import SEGMENT_META, cut
from graphdispatch_backend.runtime.checks.isolate import Isolation, isolating_here
from graphdispatch_backend.runtime.checks.posted import Posted
from graphdispatch_backend.runtime.cudagraph.tape import opaque
from graphdispatch_backend.runtime.program.direct import Direct
from graphdispatch_backend.runtime.program.fused_views import chain_views

SERVING = object()  # Fusion.tried: the thread tries nothing, its units run what they serve

Keep = frozenset[str]


class Owner(Protocol):
    """What a unit reads of its graph's fusion (runtime/program/fused.py `Fusion`)."""

    recipe: Recipe

    def tried(self) -> Keep | None | object:
        """What this thread's units run while it isolates: a keep set, None, or SERVING."""
        ...


def _bind(outer: fx.GraphModule, compiled: Sequence[CompiledSegment]) -> Callable[..., Any]:
    """`outer`'s forward with each segment call bound to its compiled code (and the ATen
    calls between segments to their C++ entries, as codegen.py binds every graph's); each
    chain of views of a segment's output made one alias (runtime/program/fused_views.py); the tensors it reads
    as attributes (lifted constants) read from the module's own dict, not through
    nn.Module's `__getattr__` (a Python call per read, per call)."""
    graph = copy.deepcopy(outer.graph)
    chain_views(graph, {u for n in graph.nodes if SEGMENT_META in n.meta for u in n.users
                         if u.target is operator.getitem})
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            node.target = entry(node.target)
        elif SEGMENT_META in node.meta:
            done = compiled[node.meta[SEGMENT_META]]
            # past aot's runtime wrapper once a first call showed it changes nothing
            run = done.run if done.alone is None else Direct(done.run, done.alone)

            segment = opaque(run)
            segment.__name__ = segment.__qualname__ = f"gd_segment_{node.meta[SEGMENT_META]}"
            node.target = segment
    gm = module_of(outer, graph)
    for node in graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target, None)
        if isinstance(value, torch.Tensor) and "." not in node.target:
            object.__setattr__(gm, node.target, value)  # found in the instance dict first (the same tensor)
    return gm.forward


class FusedUnit:
    """The callable of one fused graph or piece. With `posted`, every form of it (fused,
    tried, unfused) also returns its watched inputs' statistics last (fusion/statistics.py),
    which the unit posts for the eager check and strips."""

    def __init__(self, fusion: Owner, native: Callable[..., Any], gm: fx.GraphModule,
                 posted: Posted | None = None, plain: Callable[..., Any] | None = None,
                 keyed: fx.GraphModule | None = None) -> None:
        self._fusion = fusion
        self.native = native  # the unit's ATen graph, unfused (with `posted`: taking the statistics)
        # what an unfused unit serves: its ATen graph as it was (a statistic taken by ATen ops
        # costs more than the check's own reduction, which then takes it)
        self.plain = plain if plain is not None else native
        self._gm = gm
        self._keyed = keyed if keyed is not None else gm  # what its verdicts are keyed by: the graph's own
        self._posted = posted
        self._posts = False  # the forward served returns the statistics last
        self._cuts: dict[Keep, tuple[fx.GraphModule, list[fx.GraphModule]]] = {}
        self._forward: Callable[..., Any] = self.plain
        self._trials: dict[Keep, Callable[..., Any]] = {}
        # segments compiled for any keep set, by what their compile depends on: a bisection's
        # tries recompile only the segments a kept op changed
        self._built: dict[str, CompiledSegment] = {}
        self.compiled: list[CompiledSegment] = []

    def __call__(self, *args: Any) -> Any:
        if Isolation.active and isolating_here():  # runtime/checks/isolate.py: what this thread tries
            run, posts = self._isolated()
        else:
            run, posts = self._forward, self._posts
        out = run(*args)
        if not posts:
            return out
        self._posted.stats = out[-1]  # type: ignore[union-attr]
        return out[:-1]  # a slice: the graph's own container type

    def _isolated(self) -> tuple[Callable[..., Any], bool]:
        """On a thread that isolates: the ops it tries kept (`Fusion.trying`), or unfused;
        and whether it returns the statistics."""
        keep = self._fusion.tried()
        if keep is SERVING:
            return self._forward, self._posts
        return (self.native if keep is None else self.trial(keep)), self._posted is not None

    def cut(self, keep: Keep = frozenset()) -> tuple[fx.GraphModule, list[fx.GraphModule]]:
        """(the unit's graph with a call per segment, the segments) with `keep` kept as ATen
        calls: the exact recipe keeps them inside its segments (one cut serves every keep
        set), a tolerance recipe between them (fusion/segments.py `cut`)."""
        keep = keep if not self._fusion.recipe.exact else frozenset()
        found = self._cuts.get(keep)
        if found is None:
            outer = unrun(self._gm, copy.deepcopy(self._gm.graph))
            segments: list[fx.GraphModule] = []
            cut(outer, self._fusion.recipe, lambda i, segment: segments.append(segment) or _unbound, keep)
            found = self._cuts[keep] = (outer, segments)
        return found

    @property
    def segments(self) -> list[fx.GraphModule]:
        """The segments with nothing kept: what the graph is (the ops it holds, the report)."""
        return self.cut()[1]

    def key_segments(self) -> list[fx.GraphModule]:
        """The segments of the graph without the statistics it takes: its verdict key, the
        same whether it takes them or the check does (a graph captured, or not)."""
        if self._keyed is self._gm:
            return self.segments
        outer = unrun(self._keyed, copy.deepcopy(self._keyed.graph))
        segments: list[fx.GraphModule] = []
        cut(outer, self._fusion.recipe, lambda i, segment: segments.append(segment) or _unbound)
        return segments

    def build(self, keep: Keep) -> tuple[Callable[..., Any], list[CompiledSegment]]:
        """(forward, compiled segments) with `keep` kept as ATen calls (no segment: unfused)."""
        outer, segments = self.cut(keep)
        if not segments:
            return self.native, []
        compiled = [self._compile(s, keep) for s in segments]
        return _bind(outer, compiled), compiled

    def _compile(self, segment: fx.GraphModule, keep: Keep) -> CompiledSegment:
        key = segment_key(segment, self._fusion.recipe, keep)
        found = self._built.get(key)
        if found is None:
            found = self._built[key] = compile_segment(segment, self._fusion.recipe, keep)
        return found

    def adopt(self, forward: Callable[..., Any], compiled: list[CompiledSegment]) -> None:
        self._forward, self.compiled = forward, compiled
        self._posts = self._posted is not None and forward is not self.plain

    def trial(self, keep: Keep) -> Callable[..., Any]:
        found = self._trials.get(keep)
        if found is None:
            found = self._trials[keep] = self.build(keep)[0]
        return found

    def forget_trials(self) -> None:
        self._trials.clear()
        self._built = {k: c for k, c in self._built.items() if any(c is s for s in self.compiled)}
        self._cuts = {k: v for k, v in self._cuts.items() if not k}  # the cuts of tried keep sets


def _unbound(*args: Any) -> Any:
    raise AssertionError("a segment called before its unit was compiled")
