"""Fused graphs at run time: one graph's fusion, the callables of its units, what it learned.

With `fuse` each unit of an inference graph (the graph, each captured piece, and the graph
around its pieces) runs its segments (fusion/segments.py) compiled by Inductor under the
device's recipe (fusion/recipe.py, fusion/inductor.py), with the ops the graph keeps as
ATen calls left to their ATen kernels. A fused graph is a lowering like any other: the
eager check judges it against the Dynamo graph on the `recheck` schedule, bit for bit
(`fuse=True`) or within the declared tolerance (`fuse={"rtol": r, "atol": a}`,
runtime/checks/tolerance.py). When a check finds a difference that the same graph run
unfused does not show (runtime/checks/isolate.py), `isolate` finds the ops whose fused result
differs by running (bisection over the fused ops, each step a compile and a run on the
call's inputs), `learn` keeps them as ATen calls for this graph and recompiles, the verdict
goes to the cache (fusion/verdicts.py: for this graph, and for every later graph on this
device and recipe), and the runners capture the graph again. After MAX_ROUNDS rounds, or
when no set of ops explains the difference, the graph gives up fusion (`fusion_mismatch`)
and runs its ATen kernels. A graph whose compile generated no kernel runs its ATen graph
(`nothing_fused`).

While a thread isolates (runtime/checks/isolate.py), that thread's units run the ops it tries
(`trial`) or their ATen graph (`unfused`); other threads are served as usual.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.codegen import entry, generated_forward, module_of
from graphdispatch_backend.diagnostics.fusion_report import FusionReport
from graphdispatch_backend.errors import Contain, KeptWhy, StrictModeError
from graphdispatch_backend.fusion.inductor import CompiledSegment, compile_segment, inductor_lowers
from graphdispatch_backend.fusion.recipe import Recipe
from graphdispatch_backend.fusion.segments import SEGMENT_META, cut, op_name, recipe_allows
from graphdispatch_backend.fusion.statistics import add_statistics
from graphdispatch_backend.fusion.verdicts import Verdicts, graph_key
from graphdispatch_backend.runtime.checks.isolate import Isolation, isolating_here
from graphdispatch_backend.runtime.checks.posted import Posted
from graphdispatch_backend.runtime.checks.tolerance import Tolerance
from graphdispatch_backend.runtime.cudagraph.tape import opaque
from graphdispatch_backend.runtime.program.direct import Direct
from graphdispatch_backend.runtime.program.fused_views import chain_views

MAX_ROUNDS = 3  # checks that found a fused op differing, before the graph gives up fusion
_SERVING = object()  # Fusion.tried: the thread tries nothing, its units run what they serve

Keep = frozenset[str]


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

            def segment(*args: Any, _run: Callable[..., Any] = run) -> Any:
                return opaque(_run, args)

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

    def __init__(self, fusion: Fusion, native: Callable[..., Any], gm: fx.GraphModule,
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
        self.compiled: list[CompiledSegment] = []

    def __call__(self, *args: Any) -> Any:
        if Isolation.active and isolating_here():  # runtime/checks/isolate.py: what this thread tries
            run, posts = self._isolated()
        else:
            run, posts = self._forward, self._posts
        out = run(*args)
        if not posts:
            return out
        self._posted.put(out[-1])  # type: ignore[union-attr]
        return out[:-1]  # a slice: the graph's own container type

    def _isolated(self) -> tuple[Callable[..., Any], bool]:
        """On a thread that isolates: the ops it tries kept (`Fusion.trying`), or unfused;
        and whether it returns the statistics."""
        keep = self._fusion.tried()
        if keep is _SERVING:
            return self._forward, self._posts
        return (self.native if keep is None else self.trial(keep)), self._posted is not None

    def cut(self, keep: Keep = frozenset()) -> tuple[fx.GraphModule, list[fx.GraphModule]]:
        """(the unit's graph with a call per segment, the segments) with `keep` kept as ATen
        calls: the exact recipe keeps them inside its segments (one cut serves every keep
        set), a tolerance recipe between them (fusion/segments.py `cut`)."""
        keep = keep if not self._fusion.recipe.exact else frozenset()
        found = self._cuts.get(keep)
        if found is None:
            outer = fx.GraphModule(self._gm, copy.deepcopy(self._gm.graph))
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
        outer = fx.GraphModule(self._keyed, copy.deepcopy(self._keyed.graph))
        segments: list[fx.GraphModule] = []
        cut(outer, self._fusion.recipe, lambda i, segment: segments.append(segment) or _unbound)
        return segments

    def build(self, keep: Keep) -> tuple[Callable[..., Any], list[CompiledSegment]]:
        """(forward, compiled segments) with `keep` kept as ATen calls (no segment: unfused)."""
        outer, segments = self.cut(keep)
        if not segments:
            return self.native, []
        compiled = [compile_segment(s, self._fusion.recipe, keep) for s in segments]
        return _bind(outer, compiled), compiled

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
        self._cuts = {k: v for k, v in self._cuts.items() if not k}  # the cuts of tried keep sets


class Fusion:
    """One graph's fusion: its units, the ops it keeps as ATen calls, its rounds."""

    def __init__(self, recipe: Recipe, device: str, verdicts: Verdicts, report: FusionReport, contain: Contain,
                 warn: Callable[[str, str], None], strict: bool, name: str = "") -> None:
        self.recipe = recipe
        self._name = name  # the graph's, as the report names it (where an op was learned)
        # fuse={"rtol": r, "atol": a}: how the eager check judges this graph while it serves fused code
        self.tolerance = Tolerance(*recipe.tolerance, report) if recipe.tolerance is not None else None
        self._device = device  # fusion/verdicts.py device_identity
        self._verdicts = verdicts
        self._entry = report  # the graph record's `fusion` entry (diagnostics/fusion_report.py)
        self._contain = contain
        self._warn = warn
        self._strict = strict
        self.units: list[FusedUnit] = []
        self.keep: Keep = frozenset()
        self.learned: list[dict[str, Any]] = []  # one per kept op: op, why (learned | cache), at_call, detail
        self.rounds = 0
        self.active = False  # serving fused code (False before `finish`, after giving up or failing)
        self._key = ""
        self._listeners: list[Callable[[str], None]] = []
        self.posted: Posted | None = None  # the statistics a unit's graph takes itself (`unit`)
        self._local = threading.local()
        self._lock = threading.Lock()

    # -- building ----------------------------------------------------------------------
    def unit(self, gm: fx.GraphModule, native: Callable[..., Any], watched: Sequence[int] = ()) -> FusedUnit:
        """A unit for `gm` (a lowered graph or piece, after the passes; or the graph around
        its pieces, whose piece calls stay as they are), cut into segments; compiled by
        `finish`. `watched`: the inputs whose novelty statistics the graph takes itself
        (fusion/statistics.py), posted to `self.posted` for the eager check."""
        own = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        if not watched:
            unit = FusedUnit(self, native, own)
        else:
            taking = add_statistics(gm, watched)
            self.posted = Posted(watched)
            unit = FusedUnit(self, generated_forward(taking), taking, self.posted, native, own)
        self.units.append(unit)
        return unit

    def on_change(self, listener: Callable[[str], None]) -> None:
        """`listener(detail)` runs after the units changed code (a runner re-captures)."""
        self._listeners.append(listener)

    def finish(self) -> None:
        """Compile every unit with what the graph keeps: from the verdict cache, this graph's
        own (`cache`), and the ops any graph on this device and recipe learned (`device`)."""
        codes = [_code(s) for u in self.units for s in u.key_segments()]
        self._key = graph_key(codes, self._device, self.recipe.id)
        stored = self._verdicts.load(self._key, self._device, self.recipe.id)
        if stored is not None:
            self.learned = [{**k, "why": KeptWhy.CACHE.value} for k in stored["keep"]]
            self.keep = frozenset(k["op"] for k in stored["keep"])
            if stored["gave_up"]:
                self._give_up("the verdict cache says this graph gave up fusion", cached=True)
                return
        holds = {op_name(n) for u in self.units for s in u.segments for n in s.graph.nodes
                 if n.op == "call_function" and recipe_allows(n, self.recipe)}
        for op, found in sorted(self._verdicts.load_ops(self._device, self.recipe.id).items()):
            if op in holds and op not in self.keep:
                self.learned.append({"op": op, "why": KeptWhy.DEVICE.value, "learned_in": found.get("graph", ""),
                                     "at_call": found.get("at_call"), "detail": found.get("detail", "")})
                self.keep |= {op}
        segments = sum(len(u.segments) for u in self.units)
        if not segments:
            self._entry.nothing_to_fuse()
            return
        self._entry.compiling(self._key, self.recipe.id)
        self._compile(self.keep)

    def _compile(self, keep: Keep) -> bool:
        start = time.perf_counter()
        built, exc = self._contain(lambda: [u.build(keep) for u in self.units])
        if exc is not None:
            if isinstance(exc, StrictModeError):
                raise exc
            self._fail(f"compiling the fused graph raised {type(exc).__name__}: {exc}")
            return False
        for unit, (forward, compiled) in zip(self.units, built):
            unit.adopt(forward, compiled)
        kernels = sum(c.kernels for u in self.units for c in u.compiled)
        # a graph that takes its statistics (fusion/statistics.py) has a kernel for them even
        # where Inductor would make none of its own (views only): it fuses something if it holds
        # an op that computes
        self.active = kernels > 0 and (self.posted is None or any(
            _computes(op) for u in self.units for c in u.compiled for op in c.fused))
        if not self.active:  # Inductor's wrapper would only call the ATen kernels: they run as the graph
            for unit in self.units:
                unit.adopt(unit.plain, [])
        self._entry.compiled(kernels if self.active else 0)
        self._report(time.perf_counter() - start, built)
        return True

    # -- isolation (runtime/checks/isolate.py) -------------------------------------------------
    def tried(self) -> Keep | None | object:
        """What this thread's units run while it isolates: a keep set, None (unfused), or
        _SERVING (what they serve)."""
        return getattr(self._local, "keep", _SERVING)

    @contextlib.contextmanager
    def trying(self, keep: Keep | None) -> Iterator[None]:
        """On this thread, units run with `keep` kept (None: unfused) while isolating."""
        self._local.keep = keep
        try:
            yield
        finally:
            self._local.keep = _SERVING

    def fused_ops(self) -> list[str]:
        return sorted({op for u in self.units for c in u.compiled for op in c.fused})

    def isolate(self, matches: Callable[[Keep | None], bool]) -> tuple[list[str] | None, int]:
        """(the ops whose fused result differs, None if no set of them explains the
        difference; runs made). `matches(keep)` runs the call again with `keep` kept."""
        ops = self.fused_ops()
        runs = [0]

        def ok(extra: Sequence[str]) -> bool:
            runs[0] += 1
            return matches(self.keep | frozenset(extra))

        try:
            if not ops or not ok(ops):
                return None, runs[0]
            return sorted(_minimal(ops, (), ok)), runs[0]
        finally:
            for unit in self.units:
                unit.forget_trials()

    # -- learning -------------------------------------------------------------------------
    def learn(self, culprits: Sequence[str] | None, call: int, detail: str) -> None:
        """A check at `call` found `culprits` (None: none found) differing: keep them and
        recompile, or give up fusion after MAX_ROUNDS rounds."""
        with self._lock:
            self.rounds += 1
            if culprits is None or self.rounds > MAX_ROUNDS:
                if culprits is None:
                    why = "no set of fused ops explains the difference"
                else:
                    ops = ", ".join(sorted({*(k["op"] for k in self.learned), *culprits}))
                    why = f"fused ops differed on {self.rounds} checks ({ops})"
                self._give_up(f"{why} (call {call}: {detail})")
                self._notify(f"fusion given up: {why}")
                self._raise_if_strict(f"a graph gave up fusion: {why}")
                return
            new = [{"op": op, "why": KeptWhy.LEARNED.value, "at_call": call, "detail": detail} for op in culprits]
            self.learned.extend(new)
            self.keep |= frozenset(culprits)
            self._verdicts.save(self._key, self._device, self.recipe.id, new, gave_up=False)
            self._verdicts.save_ops(self._device, self.recipe.id, [{"op": op, "graph": self._name, "key": self._key,
                                                                    "at_call": call, "detail": detail}
                                                                   for op in culprits])
            message = (f"a fused op differed from eager at call {call} of a graph: {', '.join(culprits)} now "
                       f"run(s) as ATen calls there ({detail})")
            self._warn(f"fusion:{','.join(culprits)}", f"graphdispatch: {message}")
            if self._compile(self.keep):
                self._notify(f"recompiled keeping {', '.join(culprits)} as ATen calls")
            self._raise_if_strict(message)

    def _raise_if_strict(self, message: str) -> None:
        """Under `strict` a learned op is a fallback like any other: raised from the call
        that found it (after it was learned, so the verdict is kept)."""
        if self._strict:
            raise StrictModeError(message)

    def _give_up(self, detail: str, cached: bool = False) -> None:
        for unit in self.units:
            unit.adopt(unit.plain, [])
        self.active = False
        self._entry.gave_up(detail, self._key)
        if not cached:
            self._verdicts.save(self._key, self._device, self.recipe.id, [], gave_up=True)
            self._warn(f"fusion_mismatch:{detail[:60]}", f"graphdispatch: a graph gave up fusion and runs its "
                       f"ATen kernels (fusion_mismatch): {detail}")
        self._report(0.0, [])

    def _fail(self, detail: str) -> None:
        for unit in self.units:
            unit.adopt(unit.plain, [])
        self.active = False
        self._entry.failed(detail)
        self._warn("fusion_failed", f"graphdispatch: a graph runs unfused: {detail}")

    def _notify(self, detail: str) -> None:
        for listener in self._listeners:
            listener(detail)

    def _report(self, seconds: float, built: Sequence[tuple[Any, list[CompiledSegment]]]) -> None:
        """What the graph serves (its units' compiled segments) and what it keeps, into the
        report; `built`: the last compile (what it made, served or not)."""
        fused: Counter[str] = Counter()
        calls = 0
        for unit in self.units:
            for c in unit.compiled:
                fused.update(c.fused)
                calls += c.aten_calls
        self._entry.figures(
            seconds, rounds=self.rounds, kernels=sum(c.kernels for u in self.units for c in u.compiled),
            aten_calls=calls, fused_ops=dict(sorted(fused.items())), segments=sum(len(c) for _, c in built),
            kept=[*({"op": op, "why": KeptWhy.RECIPE.value} for op in _recipe_kept(self.units, self.recipe)),
                  *(dict(k) for k in self.learned)])


def _computes(name: str) -> bool:
    """A fused op (by its name, `aten.t.default`) computes values: it is not a view."""
    op: Any = torch.ops
    for part in name.split("."):
        op = getattr(op, part, None)
        if op is None:
            return True
    return not getattr(op, "is_view", False)


def _unbound(*args: Any) -> Any:
    raise AssertionError("a segment called before its unit was compiled")


def _code(segment: fx.GraphModule) -> str:
    """A segment's code and input layouts: what its verdict is keyed by."""
    layouts = [(tuple(v.shape), tuple(v.stride()), str(v.dtype)) if hasattr(v, "stride") else repr(v)
               for v in (n.meta.get("val") for n in segment.graph.find_nodes(op="placeholder"))]
    return f"{segment.code}\n{layouts}"


def _recipe_kept(units: Sequence[FusedUnit], recipe: Recipe) -> list[str]:
    """The ops of the graph's segments the exact recipe leaves to ATen (by their names); a
    tolerance recipe hands every op to Inductor, which says in its code what it calls."""
    if not recipe.exact:
        return []
    names = set()
    for unit in units:
        for segment in unit.segments:
            for node in segment.graph.nodes:
                if node.op == "call_function" and not (recipe_allows(node, recipe) and inductor_lowers(node)):
                    names.add(op_name(node))
    return sorted(n for n in names if n.startswith(("aten.", "prims.")))


def _minimal(ops: Sequence[str], kept: Sequence[str], ok: Callable[[Sequence[str]], bool]) -> list[str]:
    """A small subset of `ops` that, kept with `kept`, makes the call match (given that
    keeping all of `ops` does): bisection, each step a run."""
    if len(ops) == 1:
        return list(ops)
    half = len(ops) // 2
    first, second = ops[:half], ops[half:]
    if ok([*kept, *first]):
        return _minimal(first, kept, ok)
    if ok([*kept, *second]):
        return _minimal(second, kept, ok)
    found = _minimal(first, [*kept, *second], ok)  # each half holds a culprit
    return found + _minimal(second, [*kept, *found], ok)
