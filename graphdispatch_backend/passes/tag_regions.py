"""tag_regions: find every module instance's nodes and describe its boundary.

Each call node's `nn_module_stack` names the modules it ran inside, as Dynamo access paths
(`L['self'].blocks.0.ff`); a module called twice gets a second key (`<id>@1`). This pass
groups nodes by module instance into Regions with clean names (`blocks.0.ff`,
`blocks.0.ff#1`), their boundary in first-use order, fingerprint, op histogram and
convexity. The graph itself is not changed; each node gets `meta["gd_regions"]`.

Before::

    addmm = aten.addmm.default(b, x, t)   # nn_module_stack: L['self'].blocks.0.ff.net.0

After (same graph, annotated)::

    addmm.meta["gd_regions"] == ("blocks.0", "blocks.0.ff", "blocks.0.ff.net", "blocks.0.ff.net.0")
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch.fx as fx

from graphdispatch_backend.artifacts.fingerprint import fingerprint, node_key
from graphdispatch_backend.capture.names import clean_module_name, instance_of, region_name
from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.ops import draws_random
from graphdispatch_backend.passes.subgraph import boundary
from graphdispatch_backend.region import Region, TensorSpec


def _class_name(cls: Any) -> str:
    return getattr(cls, "__qualname__", None) or str(cls).rsplit(".", 1)[-1].strip("'>")


def tag_regions(gm: fx.GraphModule, ctx: PassContext) -> None:
    regions: dict[str, Region] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
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
    for region in regions.values():
        _describe(region, order, position, placeholders, ctx)
    ctx.regions = list(regions.values())


def _describe(
    region: Region,
    order: list[fx.Node],
    position: dict[fx.Node, int],
    placeholders: dict[fx.Node, int],
    ctx: PassContext,
) -> None:
    region.inputs, region.outputs = boundary(region.nodes)
    k = 0
    prefix = region.module + "."
    for node in region.inputs:
        origin = None
        if node in placeholders and placeholders[node] < len(ctx.input_origins):
            origin = ctx.input_origins[placeholders[node]]
        if origin is not None and origin.is_state and origin.name.startswith(prefix):
            region.input_names.append(origin.name[len(prefix) :])
        else:
            region.input_names.append(f"input{k}")
            k += 1
    region.input_specs = [TensorSpec.of(n.meta.get("val")) for n in region.inputs]
    region.output_specs = [TensorSpec.of(n.meta.get("val")) for n in region.outputs]
    region.ops = dict(Counter(node_key(n) for n in region.nodes))
    region.fingerprint = fingerprint(
        region.nodes, region.inputs, region.outputs, region.input_specs, region.output_specs
    )
    region.convex = is_convex(region.nodes, order, position)
    region.deterministic = not any(draws_random(n) for n in region.nodes)


def is_convex(nodes: list[fx.Node], order: list[fx.Node], position: dict[fx.Node, int]) -> bool:
    """No path leaves the node set and re-enters it.

    Only nodes between the first and last member (graph order is topological) can lie on
    such a path: walk them once, marking outsiders that depend on a member; a member that
    depends on a marked outsider closes a path out and back in.
    """
    members = set(nodes)
    first, last = min(position[n] for n in nodes), max(position[n] for n in nodes)
    span = order[first : last + 1]
    tainted: set[fx.Node] = set()
    for node in span:
        deps = node.all_input_nodes
        if node in members:
            if any(d in tainted for d in deps):
                return False
        elif any(d in members or d in tainted for d in deps):
            tainted.add(node)
    return True
