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
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.codegen import deferred_forward, unrun
from graphdispatch_backend.diagnostics.fusion_report import FusionReport
from graphdispatch_backend.errors import Contain, KeptWhy, StrictModeError
from graphdispatch_backend.fusion.inductor import CompiledSegment, inductor_lowers
from graphdispatch_backend.fusion.recipe import Recipe
from graphdispatch_backend.fusion.segments import op_name, recipe_allows
from graphdispatch_backend.fusion.statistics import add_statistics
from graphdispatch_backend.fusion.verdicts import Verdicts, graph_key
from graphdispatch_backend.runtime.checks.posted import Posted
from graphdispatch_backend.runtime.checks.tolerance import Tolerance
from graphdispatch_backend.runtime.program.fused_unit import SERVING, FusedUnit, Keep

MAX_ROUNDS = 3  # checks that found a fused op differing, before the graph gives up fusion


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
        own = unrun(gm, copy.deepcopy(gm.graph))
        if not watched:
            unit = FusedUnit(self, native, own)
        else:
            taking = add_statistics(gm, watched)
            self.posted = Posted(watched)
            # unfused with its statistics: run only while isolating, or where every op is kept
            unit = FusedUnit(self, deferred_forward(taking), taking, self.posted, native, own)
        self.units.append(unit)
        return unit

    def on_change(self, listener: Callable[[str], None]) -> None:
        """`listener(detail)` runs after the units changed code (a runner re-captures)."""
        self._listeners.append(listener)

    def finish(self) -> None:
        """Compile every unit with what the graph keeps: from the verdict cache, this graph's
        own (`cache`), and the ops any graph on this device and recipe learned (`device`)."""
        own = [s for u in self.units for s in u.key_segments()]  # the graph's, without its statistics
        codes = [_code(s) for s in own]
        self._key = graph_key(codes, self._device, self.recipe.id)
        stored = self._verdicts.load(self._key, self._device, self.recipe.id)
        if stored is not None:
            self.learned = [{**k, "why": KeptWhy.CACHE.value} for k in stored["keep"]]
            self.keep = frozenset(k["op"] for k in stored["keep"])
            if stored["gave_up"]:
                self._give_up("the verdict cache says this graph gave up fusion", cached=True)
                return
        holds = {op_name(n) for s in own for n in s.graph.nodes
                 if n.op == "call_function" and recipe_allows(n, self.recipe)}
        for op, found in sorted(self._verdicts.load_ops(self._device, self.recipe.id).items()):
            if op in holds and op not in self.keep:
                self.learned.append({"op": op, "why": KeptWhy.DEVICE.value, "learned_in": found.get("graph", ""),
                                     "at_call": found.get("at_call"), "detail": found.get("detail", "")})
                self.keep |= {op}
        if not own:  # (the statistics alone are no reason to compile: the check takes them itself)
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
        SERVING (what they serve)."""
        return getattr(self._local, "keep", SERVING)

    @contextlib.contextmanager
    def trying(self, keep: Keep | None) -> Iterator[None]:
        """On this thread, units run with `keep` kept (None: unfused) while isolating."""
        self._local.keep = keep
        try:
            yield
        finally:
            self._local.keep = SERVING

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
    def learn(self, culprits: Sequence[str] | None, call: int, detail: str, layout: bool = False) -> None:
        """A check at `call` found `culprits` (None: none found; `layout`: an output laid out
        otherwise than eager, no op at fault) differing: keep them and recompile, or give up
        fusion after MAX_ROUNDS rounds."""
        with self._lock:
            self.rounds += 1
            if culprits is None or self.rounds > MAX_ROUNDS:
                if layout:
                    why = "the fused code lays an output out otherwise than eager"
                elif culprits is None:
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
