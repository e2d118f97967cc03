"""Cut a set of nodes out of a graph into its own GraphModule, and put a call in its place.

Shared by `substitute` (a region becomes one artifact call) and `split_pieces` (a run of
capturable nodes becomes one piece). The cut keeps graph order valid: outside nodes that
sat between the members and depend on them move after the call.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.codegen import unrun


def boundary(nodes: Sequence[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(inputs in first-use order, outputs in node order) of a node set."""
    members = set(nodes)
    inputs: dict[fx.Node, None] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in members:
                inputs.setdefault(arg, None)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    return list(inputs), outputs


def extract(nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[fx.Node],
            names: Sequence[str] | None = None, run: bool = True) -> fx.GraphModule:
    """A GraphModule computing `outputs` (always returned as a tuple) from `inputs`.
    `run=False`: one that is compiled or read, not run as it is (a fused segment, which
    Inductor compiles from a copy): its Python code is generated only if something asks
    for it (codegen.py `unrun`), not here (tens of ms for a graph of a thousand nodes)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        label = "".join(c if c.isalnum() else "_" for c in (names[i] if names else node.name))
        ph = graph.placeholder(label if label.isidentifier() else f"in_{label}")
        ph.meta = {k: v for k, v in node.meta.items() if k == "val"}
        env[node] = ph
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(torch.nn.Module(), graph) if run else unrun(torch.nn.Module(), graph)


def replace_with_call(
    gm: fx.GraphModule,
    nodes: Sequence[fx.Node],
    inputs: Sequence[fx.Node],
    outputs: Sequence[fx.Node],
    target: Callable[..., Any],
    meta: dict[str, Any],
) -> list[fx.Node]:
    """Replace `nodes` by `target(*inputs)` (returning a tuple) plus one getitem per output;
    return the getitems, in output order."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    members = set(nodes)
    first, last = min(order[n] for n in nodes), max(order[n] for n in nodes)
    later: list[fx.Node] = []  # outsiders in the span that depend on members: they move
    tainted = set(members)
    for node in list(graph.nodes)[first : last + 1]:
        if node not in members and any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
            later.append(node)
    anchor = max(nodes, key=order.__getitem__)
    with graph.inserting_after(anchor):
        call = graph.call_function(target, tuple(inputs))
    call.meta.update(meta)
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    cursor = call
    items = []
    for i, out in enumerate(outputs):
        with graph.inserting_after(cursor):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta["val"] = out.meta.get("val")
        if "gd_regions" in out.meta:
            item.meta["gd_regions"] = ()
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
        cursor = item
        items.append(item)
    for node in later:
        cursor.append(node)
        cursor = node
    for node in reversed(nodes):
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return items
