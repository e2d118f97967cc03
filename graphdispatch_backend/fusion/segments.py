"""Segments: the runs of a graph Inductor may compile, cut out around the nodes it may not.

Inductor lowers ATen ops. It cannot hold an artifact's call (a Python callable behind a
parity gate), nor should it hold what the runtime keeps out of captured pieces for the same
reasons (random draws, host reads, data-dependent shapes, effectful ops, collectives:
passes/split_pieces.py `split_reason`), which reach a graph that is not captured, nor the
writes into inputs the graph makes in place (a KV cache's rows). Those nodes stay in the
outer graph, in order; each maximal run of other ATen nodes that holds at
least one op the recipe may fuse becomes one segment, called through `make_segment`.

Pure: a graph rewrite, no Inductor, no runtime.

Before::

    mul = aten.mul.Tensor(x, 2);  add = aten.add.Tensor(mul, b)
    art = gd_artifact_0(add);  y = art[0]
    relu = aten.relu.default(y)

After::

    seg = gd_segment_0(x, b);  add = seg[0]
    art = gd_artifact_0(add);  y = art[0]
    seg_1 = gd_segment_1(y);  relu = seg_1[0]
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.fusion.canonical import ORIGIN
from graphdispatch_backend.fusion.recipe import Recipe
from graphdispatch_backend.passes.ops import is_view
from graphdispatch_backend.passes.split_pieces import split_reason
from graphdispatch_backend.passes.subgraph import boundary, extract, replace_with_call

SEGMENT_META = "gd_segment"


def op_name(node: fx.Node) -> str:
    """How a fused op is named in verdicts and reports: its overload (`aten.mul.Tensor`), the
    one the graph held before a canonical rewrite (fusion/canonical.py)."""
    return node.meta.get(ORIGIN) or str(node.target)


def _writes(target: torch._ops.OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def _opaque(node: fx.Node, device: str) -> bool:
    """Stays outside every segment: not an ATen op (an artifact's call, a piece's), kept out
    of captured pieces (random draws, host reads, ...), or a write in place (a cache's rows,
    passes/reinplace.py): Inductor orders its fused reads of a graph input against an ATen
    call that writes it otherwise than the graph does (a decode step read the cache after
    its own write: measured), so writes run between segments, in order."""
    if node.target is operator.getitem:
        src = node.args[0]
        return not isinstance(src, fx.Node) or _opaque(src, device)
    if not isinstance(node.target, torch._ops.OpOverload):
        return True
    return "gd_substitution" in node.meta or split_reason(node, device) is not None or _writes(node.target)


def recipe_allows(node: fx.Node, recipe: Recipe) -> bool:
    """The recipe's own rule for one node (before what Inductor can lower, and what a graph
    learned): an ATen op on the recipe's device, writing nothing in place, that the recipe
    fuses there (fusion/recipe.py: every op under a tolerance; an exact one, on its
    arguments, otherwise)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    if _writes(target):
        return False  # an in-place write (a cache's rows) stays the ATen write
    for value in [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)]:
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor) and (t.device.type != recipe.device or t.is_complex()):
                return False
    return recipe.allows(node)


def _views_out(gm: fx.GraphModule, device: str) -> set[fx.Node]:
    """The views the graph's outputs (and what stays outside every segment) are made of,
    back to the value they view, where nothing a segment computes reads them: under a
    tolerance recipe they run as ATen calls after the segment, which hands over the value
    with eager's layout (fusion/inductor.py `_strides_pass`), so each view has eager's
    strides (Inductor would view its own layout of the value, and a fake tensor's view may
    give a dim of size 1 another stride than eager's; the exact recipe leaves them to ATen
    inside its segments instead). They split no segment. A chunk of a `split` or `unbind`
    goes where its op goes (`_left_behind`)."""
    def view_like(node: fx.Node) -> bool:
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            return is_view(node.args[0])
        return is_view(node)

    roots = [a for n in gm.graph.nodes if n.op == "output" or (n.op == "call_function" and _opaque(n, device))
             for a in n.all_input_nodes]
    tails: set[fx.Node] = set()
    while roots:
        node = roots.pop()
        if view_like(node) and node not in tails:
            tails.add(node)
            roots.extend(node.all_input_nodes)
    changed = True
    while changed:  # a view a segment's node reads stays in the segment, and the views it is made of
        inside = {n for n in tails if any(u.op == "call_function" and u not in tails and not _opaque(u, device)
                                          for u in n.users) or _left_behind(n, tails)}
        tails -= inside
        changed = bool(inside)
    return tails


def _left_behind(node: fx.Node, tails: set[fx.Node]) -> bool:
    """One output of a multi-output view (a `split`'s, `unbind`'s chunk) whose op stays in a
    segment (another of its outputs is read there): it goes where its op goes, as `cut`
    puts it. Left outside, the segment would return the op's list of views itself, which no
    compiled graph returns (aot's output spec check fails and the graph runs unfused).
    Returned by the segment, a chunk is Inductor's view of the value, laid out as the fake
    tensor's: a `split` or `unbind` moves the offset or drops a dim, computing no stride of
    a dim of size 1 (measured equal to eager's, transposed inputs too; the check judges
    strides exactly)."""
    return node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0] not in tails


def cut(gm: fx.GraphModule, recipe: Recipe,
        make_segment: Callable[[int, fx.GraphModule], Callable[..., Any]], keep: frozenset[str] = frozenset()) -> int:
    """Replace each segment of `gm` (in place) by a call of `make_segment(index, segment)`;
    return how many there are. A segment's nodes keep their metadata (fake values). Under a
    tolerance recipe the ops in `keep` stay outside too (Inductor lowers all it holds: an op
    kept as its ATen kernel runs between segments); the exact recipe keeps them inside, as
    ATen calls of Inductor's wrapper (fusion/inductor.py)."""
    tails = set() if recipe.exact else _views_out(gm, recipe.device)

    def outside(node: fx.Node) -> bool:
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            return outside(node.args[0])  # an output of a multi-output op goes where the op goes
        return _opaque(node, recipe.device) or (not recipe.exact and op_name(node) in keep)

    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in tails:
            continue  # (a tail moves after its segment's call: passes/subgraph.py replace_with_call)
        if outside(node):
            if current:
                runs.append(current)
            current = []
        else:
            current.append(node)
    if current:
        runs.append(current)
    count = 0
    for nodes in runs:
        if not any(recipe_allows(n, recipe) for n in nodes):
            continue  # nothing to fuse: the ATen calls stay inline
        inputs, outputs = boundary(nodes)
        if not outputs:
            continue
        segment = extract(nodes, inputs, outputs, run=False)  # compiled by Inductor from a copy
        replace_with_call(gm, nodes, inputs, outputs, make_segment(count, segment), {SEGMENT_META: count})
        count += 1
    return count
