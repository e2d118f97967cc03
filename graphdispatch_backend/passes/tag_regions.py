"""tag_regions: find every module instance's nodes and describe its boundary.

Each call node's `nn_module_stack` names the modules it ran inside: the clean names
capture resolved (`blocks.0.ff`; a Dynamo access path such as `L['self'].blocks.0.ff` is
cleaned as text); a module called twice gets a second key (`<id>@1`). This pass groups
nodes by module instance into Regions (`blocks.0.ff`, `blocks.0.ff#1`) with their
boundary in first-use order, fingerprint, op histogram and convexity. The graph itself is
not changed; each node gets `meta["gd_regions"]`.

Size computations (symbolic scalars computed from the graph's input sizes only, as
`s0 * 4` under dynamic shapes) belong to no region: aot shares one such node between all
the modules that need it, and a region holding it would hand a size to its neighbours.
They enter the regions that use them as size inputs, which a kernel never receives.

Before::

    addmm = aten.addmm.default(b, x, t)   # nn_module_stack: L['self'].blocks.0.ff.net.0

After (same graph, annotated)::

    addmm.meta["gd_regions"] == ("blocks.0", "blocks.0.ff", "blocks.0.ff.net", "blocks.0.ff.net.0")
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch.utils._sympy.printers import PythonPrinter

from graphdispatch_backend.artifacts.fingerprint import fingerprint, node_key
from graphdispatch_backend.capture.names import clean_module_name, instance_of, region_name
from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.ops import alias_root, draws_random, is_view, writes
from graphdispatch_backend.passes.subgraph import boundary
from graphdispatch_backend.region import Region, TensorSpec


def _class_name(cls: Any) -> str:
    return getattr(cls, "__qualname__", None) or str(cls).rsplit(".", 1)[-1].strip("'>")


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _size_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Call nodes whose value is a symbolic scalar computed from placeholders (and other
    such nodes) only: sizes of the graph's inputs, never data."""
    sizes: set[fx.Node] = set()
    for node in gm.graph.nodes:
        value = node.meta.get("val", node.meta.get("example_value"))
        if (node.op == "call_function" and isinstance(value, _SYMBOLIC)
                and all(a.op == "placeholder" or a in sizes for a in node.all_input_nodes)):
            sizes.add(node)
    return sizes


def tag_regions(gm: fx.GraphModule, ctx: PassContext) -> None:
    regions: dict[str, Region] = {}
    sizes = _size_nodes(gm)
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if node in sizes:
            node.meta["gd_regions"] = ()
            continue
        names = []
        for key, value in (node.meta.get("nn_module_stack") or {}).items():
            path, cls = value
            module = clean_module_name(path)
            if not module:  # the root module: that is the whole graph, not a region
                continue
            name = region_name(module, instance_of(key))
            region = regions.get(name)
            if region is None:
                region = regions[name] = Region(name, module, instance_of(key), _class_name(cls))
            region.nodes.append(node)
            names.append(name)
        node.meta["gd_regions"] = tuple(names)
    order = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    placeholders = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    kinds: set[str] = set()
    for region in regions.values():
        _describe(region, order, position, placeholders, ctx)
        if region.fingerprint not in kinds:  # one graph per kind, before substitute erases any node
            kinds.add(region.fingerprint)
            region.graph_data = region.graph()
    ctx.regions = list(regions.values())


def _describe(
    region: Region,
    order: list[fx.Node],
    position: dict[fx.Node, int],
    placeholders: dict[fx.Node, int],
    ctx: PassContext,
) -> None:
    region.inputs, region.outputs = boundary(region.nodes)
    region.input_specs = [TensorSpec.of(n.meta.get("val")) for n in region.inputs]
    k = j = 0
    prefix = region.module + "."
    for node, spec in zip(region.inputs, region.input_specs):
        origin = None
        if node in placeholders and placeholders[node] < len(ctx.input_origins):
            origin = ctx.input_origins[placeholders[node]]
        if spec is not None and spec.is_scalar:
            region.input_names.append(f"size{j}")
            j += 1
        elif origin is not None and origin.is_state and origin.name.startswith(prefix):
            region.input_names.append(origin.name[len(prefix) :])
        else:
            region.input_names.append(f"input{k}")
            k += 1
    region.size_exprs = _size_exprs(region)
    region.output_specs = [TensorSpec.of(n.meta.get("val")) for n in region.outputs]
    region.ops = dict(Counter(node_key(n) for n in region.nodes))
    region.fingerprint = fingerprint(
        region.nodes, region.inputs, region.outputs, region.input_specs, region.output_specs
    )
    region.convex = is_convex(region.nodes, order, position)
    region.deterministic = not any(draws_random(n) for n in region.nodes)
    written = {_region_input(w, region.inputs) for n in region.nodes for w in writes(n)}
    region.mutates = [name for node, name in zip(region.inputs, region.input_names) if node in written]


def _region_input(node: fx.Node, inputs: list[fx.Node]) -> fx.Node | None:
    """The region input whose memory `node` is (through views and in-place results)."""
    while node not in inputs:
        if not (is_view(node) or alias_root(node) is not node) or not node.args:
            return None
        node = node.args[0]
    return node


def _size_exprs(region: Region) -> dict[int, dict[str, Any]]:
    """For each size input: its expression (Python, over sympy symbols) and, per symbol, a
    tensor input and dim of that exact size, so a kernel can compute it from its inputs."""
    dims: dict[Any, tuple[str, int]] = {}
    for i in region.kernel_positions:
        value = region.inputs[i].meta.get("val")
        if isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(size.node.expr, (region.input_names[i], d))
    out: dict[int, dict[str, Any]] = {}
    for i, node in enumerate(region.inputs):
        value = node.meta.get("val")
        if i in region.kernel_positions or not isinstance(value, _SYMBOLIC):
            continue
        expr = value.node.expr
        symbols = {str(s): list(dims[s]) if s in dims else None for s in sorted(expr.free_symbols, key=str)}
        out[i] = {"expr": PythonPrinter().doprint(expr), "symbols": symbols}
    return out


def is_convex(nodes: list[fx.Node], order: list[fx.Node], position: dict[fx.Node, int]) -> bool:
    """No path leaves the node set and re-enters it, and no node between its members reads
    or writes the memory they write (or writes what they read): cutting the set out runs
    all its members at once, which must not reorder a write and a read of the same memory.

    Only nodes between the first and last member (graph order is topological) can lie on
    such a path: walk them once, marking outsiders that depend on a member; a member that
    depends on a marked outsider closes a path out and back in.
    """
    members = set(nodes)
    first, last = min(position[n] for n in nodes), max(position[n] for n in nodes)
    span = order[first : last + 1]
    written = {alias_root(w) for n in nodes for w in writes(n)}
    read = {alias_root(a) for n in nodes for a in n.all_input_nodes}
    tainted: set[fx.Node] = set()
    for node in span:
        deps = node.all_input_nodes
        if node in members:
            if any(d in tainted for d in deps):
                return False
            continue
        if any(d in members or d in tainted for d in deps):
            tainted.add(node)
        if written and any(alias_root(d) in written for d in deps):
            return False  # reads or writes memory a member writes
        if any(alias_root(w) in read for w in writes(node)):
            return False  # writes memory a member reads
    return True
