"""Compile one segment with Inductor under a recipe, leaving every process-wide table alone.

Which nodes Inductor lowers is said per node, never through Inductor's tables: the recipe's
settings turn on `fallback_by_default` (thread-local, through torch's `config.patch`), and
each node the recipe allows and the graph has not learned to keep is annotated
`meta["custom"]["compile_with_inductor"]` (torch.fx.passes.regional_inductor's mark); every
other node becomes an ATen fallback call without entering `lowerings` or `fallbacks`
(graph.py's `fallback_handler(..., add_to_fallback_set=False)`). Inductor's FX graph cache
keys a graph by its code, not its annotations, so the annotation set enters the key through
a post-grad custom pass that does nothing and names it (`uuid`): a graph recompiled after
learning never gets the cached code of the set it learned from.

The compile runs in a tracing context of its own (Inductor appends to the ambient one: aot's,
while a graph is being built), under Dynamo's compile lock (a recompile after a check runs
in the user's call, on any thread).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.autograd.profiler as _profiler
import torch.fx as fx
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

from graphdispatch_backend.codegen import bound_call
from graphdispatch_backend.fusion.canonical import Composite, canonical, rewrite
from graphdispatch_backend.fusion.recipe import Recipe
from graphdispatch_backend.fusion.segments import op_name, recipe_allows
from graphdispatch_backend.fusion.statistics import STATISTIC
from graphdispatch_backend.passes.ops import is_view

aten = torch.ops.aten
MARK = "compile_with_inductor"
BARRIER = "low_precision_pointwise_barrier"  # read by Inductor's pointwise lowering
ANNOTATIONS = "mark+barrier/1"  # what the annotations say; part of Inductor's cache key (see _key_pass)
_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(", re.M)


@dataclasses.dataclass
class CompiledSegment:
    """One segment, compiled: `run(*args)` returns its outputs as a tuple."""

    run: Callable[..., tuple[Any, ...]]
    fused: Counter[str]  # op -> nodes Inductor lowered
    kernels: int  # kernels Inductor generated
    aten_calls: int  # nodes left to their ATen kernels
    seconds: float  # wall time of the compile (Inductor's own caches make repeats cheap)
    source: str = ""  # Inductor's generated code (for reading, never run from here)
    alone: Callable[[list[Any]], Any] | None = None  # a tolerance segment's graph past aot's wrapper (boxed)


def _view_tails(gm: fx.GraphModule) -> set[fx.Node]:
    """The views a segment's outputs are made of, back to the node that computed them: left
    to ATen, which sets their strides as eager does (a fake tensor's `view` may give a dim of
    size 1 another stride than eager's, and Inductor follows the fake tensor)."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    tails: set[fx.Node] = set()
    todo = [a for a in output.all_input_nodes]
    while todo:
        node = todo.pop()
        if is_view(node) and node not in tails:
            tails.add(node)
            todo.extend(node.all_input_nodes)
    return tails


def _eager_layouts(gm: fx.GraphModule, chosen: set[fx.Node]) -> set[fx.Node]:
    """Each tensor a fused node hands to an ATen call is laid out as eager laid it out:
    Inductor otherwise picks the layouts of its buffers, and an ATen kernel may compute
    otherwise on another layout (a matmul on a transposed operand, a convolution on another
    memory format). Returns the nodes added (Inductor's own `inductor_force_stride_order`)."""
    force = torch.ops.prims.inductor_force_stride_order.default
    pinned: dict[fx.Node, fx.Node] = {}  # one per fused value, however many ATen calls read it
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node in chosen or node in pinned.values():
            continue
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if arg not in chosen or not isinstance(val, torch.Tensor) or not is_non_overlapping_and_dense(val):
                continue  # (an expanded view is handed over as Inductor's view of its input)
            if arg not in pinned:
                with gm.graph.inserting_after(arg):
                    pinned[arg] = gm.graph.call_function(force, (arg, list(val.stride())))
                pinned[arg].meta = {"val": val}
            node.replace_input_with(arg, pinned[arg])
    gm.recompile()
    return set(pinned.values())


def _low_precision(node: fx.Node) -> bool:
    values = [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)]
    return any(isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16) for v in values)


def inductor_lowers(node: fx.Node) -> bool:
    """Inductor has a lowering of its own for this op, or for its canonical form
    (fusion/canonical.py): a lookup, never a registration."""
    from torch._inductor.lowering import fallbacks, lowerings

    found = canonical(node)
    target = node.target if found is None else found[0].lowered_by if isinstance(found[0], Composite) else found[0]
    return target in lowerings and target not in fallbacks


def _key_pass(digest: str) -> Any:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _AnnotationKey(CustomGraphPass):
        """Does nothing; its uuid puts the annotation set into Inductor's cache key."""

        def __call__(self, graph: fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return digest

    return _AnnotationKey()


def _strides_pass(strides: list[tuple[int, ...] | None]) -> Any:
    """A post-grad pass that has Inductor lay each output out with `strides` (the segment's,
    which are eager's): Inductor keeps an output's strides as traced after its own
    decompositions, which may lay a value out otherwise (a `cat` of rotary outputs came out
    contiguous where eager's was a transposed layout). It sets what Inductor reads
    (`original_output_strides`, recorded before the post-grad passes), composes with a
    post-grad pass of the user's config, and names the strides in its uuid (Inductor's cache key)."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    ambient = config.post_grad_custom_post_pass

    class _EagerStrides(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            if ambient is not None:
                ambient(graph)
            output = next(iter(graph.find_nodes(op="output")))
            recorded = output.meta.get("original_output_strides")
            if recorded is not None and len(recorded) == len(strides):
                output.meta["original_output_strides"] = [w if w is not None else r for w, r in zip(strides, recorded)]

        def uuid(self) -> str:
            own = hashlib.sha256(repr(strides).encode()).hexdigest()
            return own if ambient is None else f"{own}+{ambient.uuid()}"

    return _EagerStrides()


@contextlib.contextmanager
def _own_context(example: Sequence[Any]) -> Iterator[None]:
    from torch._dynamo.convert_frame import compile_lock
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = detect_fake_mode(example) or FakeTensorMode()
    with compile_lock, tracing(TracingContext(fake_mode)):
        yield


def segment_key(segment: fx.GraphModule, recipe: Recipe, keep: frozenset[str]) -> str:
    """What `compile_segment` makes of `segment` depends on, and nothing else: the recipe,
    the segment's nodes in order (each by its op, its target, its arguments as positions of
    earlier nodes, its op name and role; never by its name: a cut for another keep set
    names the same nodes otherwise), its inputs' layouts, the tensors it reads as
    attributes, and the kept ops it holds (a tolerance recipe holds none: they were cut
    out). A bisection's keep sets leave most segments as they were: equal keys, one compile
    (the Gemma 2 bisection of tests/test_fusion_families.py: 183 compiles keyed by code, 71
    by structure)."""
    def layout(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (str(value.dtype), str(value.device), tuple(value.shape), tuple(value.stride()))
        return repr(value)

    index = {n: i for i, n in enumerate(segment.graph.nodes)}

    def at(node: fx.Node) -> str:
        return f"%{index[node]}"

    nodes: list[Any] = []
    ops: set[str] = set()
    for n in segment.graph.nodes:
        if n.op == "placeholder":
            nodes.append(("input", layout(n.meta.get("val"))))
        elif n.op == "get_attr":  # a tensor attribute by identity (its unit's graph holds it for the unit's life)
            v = getattr(segment, n.target, None)
            nodes.append(("attribute", id(v), layout(v)) if isinstance(v, torch.Tensor) else ("attribute", repr(v)))
        else:
            args = repr(fx.node.map_arg((n.args, n.kwargs), at))
            named = (op_name(n), STATISTIC in n.meta) if n.op == "call_function" else None
            nodes.append((n.op, str(n.target), args, named))
            if named is not None:
                ops.add(named[0])
    held = sorted(keep & ops) if recipe.exact else []
    return repr((recipe.id, nodes, held))


def compile_segment(segment: fx.GraphModule, recipe: Recipe, keep: frozenset[str]) -> CompiledSegment:
    """Compile `segment` (its placeholders carry fake values) with the nodes the recipe
    allows, bar the ops in `keep`, lowered by Inductor; the rest run as ATen calls. With
    nothing to lower, the segment runs its own generated code (no Inductor). Under a
    tolerance recipe the segment holds no kept op (segments.py cut them out) and Inductor
    compiles it as it compiles any graph (`_as_inductor_compiles`)."""
    if not recipe.exact:
        return _as_inductor_compiles(segment, recipe)
    gm = copy.deepcopy(segment)
    fused: Counter[str] = Counter()
    calls = 0
    chosen = set()
    tails = _view_tails(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node)
        if name not in keep and node not in tails and recipe_allows(node, recipe) and inductor_lowers(node):
            chosen.add(node)
            if STATISTIC not in node.meta:  # fusion/statistics.py: not an op of the graph's
                fused[name] += 1
        elif isinstance(node.target, torch._ops.OpOverload):
            calls += 1
    chosen = rewrite(gm, chosen)
    chosen |= _eager_layouts(gm, chosen)
    marks = []
    for node in gm.graph.nodes:
        if node in chosen:
            node.meta["custom"] = {**node.meta.get("custom", {}), MARK: {}}
            # every node of an aot graph is an op eager runs: its bf16/fp16 results are rounded
            # as eager rounds them (what make_fx marks under emulate_precision_casts, which aot
            # did not trace with)
            node.meta[BARRIER] = _low_precision(node)
            marks.append(f"{node.name}{'*' if node.meta[BARRIER] else ''}")
    start = time.perf_counter()
    if not fused:
        gm.recompile()
        forward = gm.forward
        return CompiledSegment(lambda *args: tuple(forward(*args)), fused, 0, calls, time.perf_counter() - start)
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    example = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    digest = hashlib.sha256(" ".join([recipe.id, ANNOTATIONS, *marks]).encode()).hexdigest()
    with _own_context(example), config.patch({**recipe.patches, "post_grad_custom_post_pass": _key_pass(digest)}):
        compiled = compile_fx_inner(gm, example, is_inference=True)
    seconds = time.perf_counter() - start
    source = getattr(compiled, "source_code", "") or ""

    boxed = _Boxed(compiled)

    def run(*args: Any) -> tuple[Any, ...]:
        return tuple(boxed(list(args)))  # Inductor's boxed call empties the list it is given

    return CompiledSegment(run, fused, len(_KERNEL_DEF.findall(source or "")), calls, seconds, source or "")


class _Boxed:
    """Inductor's compiled graph, called as its own `__call__` calls it once its first call
    ran. `CompiledFxGraph.__call__` (torch/_inductor/output_code.py) ends the autotune cache
    bundler's compile at the first call (its cache writes happen then), names the call in a
    profiler's trace, and otherwise calls `current_callable`, which its post-compile set
    (input alignment; on CUDA a backward's cudagraph manager). Its contexts cost 4-5 us per
    call inside a model's call (PixArt, HunyuanVideo: one segment, ~1% of a call). So the
    first call, and every call while a profiler records, go through `__call__`; the others
    call `current_callable` with its ATen calls bound to their C++ entries
    (codegen.bound_call), made again should Inductor ever set another."""

    __slots__ = ("_bound", "_graph", "_own", "_plain", "_source")

    def __init__(self, graph: Any) -> None:
        from torch._inductor.output_code import CompiledFxGraph

        self._graph = graph
        self._plain = type(graph) is CompiledFxGraph  # a subclass, or another output: its own call, always
        self._own = True  # until the first call ran
        self._source: Any = None  # the current_callable `_bound` was made from
        self._bound: Any = None

    def __call__(self, args: list[Any]) -> Any:
        if self._own or _profiler._is_profiler_enabled:
            out = self._graph(args)
            self._own = not self._plain or self._graph.current_callable is None
            return out
        source = self._graph.current_callable
        if source is not self._source:
            self._bound, self._source = bound_call(source), source
        return self._bound(args)


def _output_code(compiled: Any, depth: int = 8) -> Any:
    """The CompiledFxGraph behind what `compile_fx` returned (its code says the kernels
    Inductor made), found by reading (never changing) the wrappers aot put around it: on a
    hit of aot's cache no inner compile runs to hand it over. None if not found."""
    from torch._inductor.output_code import CompiledFxGraph

    seen: set[int] = set()
    todo = [(compiled, 0)]
    while todo:
        item, level = todo.pop()
        if id(item) in seen or level > depth:
            continue
        seen.add(id(item))
        if isinstance(item, CompiledFxGraph):
            return item
        inside = [c.cell_contents for c in getattr(item, "__closure__", None) or () if c.cell_contents is not None]
        if hasattr(item, "__dict__") and not isinstance(item, type):
            inside += list(vars(item).values())
        if isinstance(item, (list, tuple)):
            inside += list(item)
        todo += [(x, level + 1) for x in inside
                 if callable(x) or hasattr(x, "__dict__") or isinstance(x, (list, tuple))]
    return None


def _as_inductor_compiles(segment: fx.GraphModule, recipe: Recipe) -> CompiledSegment:
    """The segment compiled as `backend="inductor"` compiles a graph (`compile_fx`: its
    decompositions, joint- and post-grad pattern rewrites, fusions, reductions and math
    library), under the recipe's settings only (no CUDA graphs of Inductor's own). Every
    ATen node is handed to Inductor; Inductor itself still calls ATen for what it does not
    lower (matmuls, attention), which its generated code says."""
    from torch._functorch import config as aot_config
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    gm = copy.deepcopy(segment)
    nodes = {n for n in gm.graph.nodes if n.op == "call_function" and recipe_allows(n, recipe)}
    fused = Counter(op_name(n) for n in nodes if STATISTIC not in n.meta)
    calls = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n not in nodes
                and isinstance(n.target, torch._ops.OpOverload))
    rewrite(gm, nodes)  # exact rewrites Inductor's decompositions make anyway (the seam testing.perturbed patches)
    example = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    strides = [tuple(v.stride()) if isinstance(v := getattr(o, "meta", {}).get("val"), torch.Tensor) else None
               for o in outputs]
    patches = {**recipe.patches, "post_grad_custom_post_pass": _strides_pass(strides)}
    start = time.perf_counter()

    def compile_it(cached: bool) -> tuple[Callable[..., Any], str | None]:
        """(the compiled callable, Inductor's code; None where it cannot be read)."""
        inner: list[Any] = []

        def keep_inner(*args: Any, **kwargs: Any) -> Any:
            inner.append(compile_fx_inner(*args, **kwargs))
            return inner[-1]

        # an inference graph: no autograd state is traced (Dynamo gave aot the same), whatever
        # the grad mode of the call that compiles it (a recompile runs in the user's call)
        with _own_context(example), config.patch(patches), aot_config.patch(enable_autograd_cache=cached), \
                torch.no_grad():
            compiled = compile_fx(gm, example, inner_compile=keep_inner)
        graph = inner[0] if inner else _output_code(compiled)  # aot's cache hit skips the inner compile
        return compiled, getattr(graph, "source_code", None) if graph is not None else None

    compiled, source = compile_it(cached=True)
    if source is None:  # the cached compile's code not found: compiled again past aot's cache (thread-local)
        compiled, source = compile_it(cached=False)
    seconds = time.perf_counter() - start

    def run(*args: Any) -> tuple[Any, ...]:
        return tuple(compiled(*args))

    # Inductor's graph without aot's runtime wrapper: the runtime calls it alone once a first
    # call showed the wrapper changes nothing (runtime/program/direct.py)
    graph = _output_code(compiled)
    return CompiledSegment(run, fused, len(_KERNEL_DEF.findall(source or "")), calls, seconds, source or "",
                           None if graph is None else _Boxed(graph))
