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
The nodes aot makes to use a number input in tensor math (under `dynamic=True`, a float
attribute such as an RMSNorm's `eps` is a 0-dim input, and `mean + eps` carries no module
stack) join the regions all their users are in: the number is then the region's input,
named after the attribute (`variance_epsilon`), and the kernel receives it.

Before::

    addmm = aten.addmm.default(b, x, t)   # nn_module_stack: L['self'].blocks.0.ff.net.0

After (same graph, annotated)::

    addmm.meta["gd_regions"] == ("blocks.0", "blocks.0.ff", "blocks.0.ff.net", "blocks.0.ff.net.0")
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._sympy.printers import PythonPrinter

from graphdispatch_backend.artifacts.fingerprint import fingerprint, node_key
from graphdispatch_backend.capture.names import clean_module_name, instance_of, region_name
from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.ops import alias_root, draws_random, is_collective, is_view, writes
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


def _scalar_glue(gm: fx.GraphModule, sizes: set[fx.Node],
                 origins: Sequence[Any]) -> list[tuple[fx.Node, tuple[str, ...]]]:
    """The nodes aot makes to use a module's number attribute in tensor math, with the
    regions they join. Under `dynamic=True` a float attribute (an RMSNorm's `eps`) is a
    graph input (a 0-dim tensor), and `variance + eps` becomes `add(mean,
    convert_element_type(eps))` with no `nn_module_stack`: left out, it split the norm in two
    (its mean an output, `mean + eps` an input: a trial's manifest fit no region). Such a
    node (no module stack, no write) reads an attribute input, or another such node, and
    region nodes; it joins the regions all its users are in that own every attribute it
    reads (root code on a number the caller passes, `t * 1000`, has no stack either, and
    stays out)."""
    attributes: dict[fx.Node, set[str]] = {}  # a node of the glue -> the attribute paths it reads
    for pos, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        origin = origins[pos] if pos < len(origins) else None
        if origin is not None and "." in origin.name and _scalar_input(node.meta.get("val")):
            attributes[node] = {f".{origin.name}."}
    glue: list[fx.Node] = []
    for node in gm.graph.nodes:
        if (node.op == "call_function" and not node.meta.get("gd_regions") and node not in sizes
                and not writes(node) and node.users
                and any(a in attributes for a in node.all_input_nodes)
                and all(a in attributes or a.meta.get("gd_regions") for a in node.all_input_nodes)):
            attributes[node] = set().union(*(attributes.get(a, set()) for a in node.all_input_nodes))
            glue.append(node)
    joined: dict[fx.Node, tuple[str, ...]] = {}
    for node in reversed(glue):  # users first: a chain of glue takes its last link's regions
        stacks = [joined.get(u, u.meta.get("gd_regions") or ()) for u in node.users]
        shared = stacks[0]
        for stack in stacks[1:]:
            shared = tuple(a for a, b in zip(shared, stack) if a == b)
        shared = tuple(r for r in shared  # the regions whose module owns what it reads
                       if all(f".{r.split('#', 1)[0]}." in path for path in attributes[node]))
        if shared:
            joined[node] = shared
    return [(n, joined[n]) for n in glue if n in joined]


def _scalar_input(value: Any) -> bool:
    """A graph input that is one number: a symbolic scalar, or a 0-dim tensor (a float
    attribute Dynamo passes as an input under dynamic shapes)."""
    return isinstance(value, _SYMBOLIC) or isinstance(value, torch.Tensor) and value.dim() == 0


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
    joined: set[str] = set()
    for node, names in _scalar_glue(gm, sizes, ctx.input_origins):
        node.meta["gd_regions"] = names
        joined.update(names)
        for name in names:
            region = regions[name]
            region.nodes.append(node)
    order = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    for name in joined:  # the glue in its place
        regions[name].nodes.sort(key=position.__getitem__)
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
        elif origin is not None and f".{prefix}" in f".{origin.name}" and _scalar_input(node.meta.get("val")):
            # a number attribute of the module's, passed as an input (`self.norm.variance_epsilon`)
            region.input_names.append(f".{origin.name}".rsplit(f".{prefix}", 1)[1])
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
    region.collective = any(is_collective(n) for n in region.nodes)
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
