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
    learned): an exact op on the recipe's device, writing nothing in place."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    if target._opname not in recipe.fusable:
        return False
    if _writes(target):
        return False  # an in-place write (a cache's rows) stays the ATen write
    if target._opname in ("add", "sub", "rsub") and node.kwargs.get("alpha", 1) != 1:
        return False  # eager's a + alpha * b is one fused multiply-add
    if target._opname == "div" and node.kwargs.get("rounding_mode") is not None:
        return False  # floor/trunc division: eager's formula, not a / b
    for value in [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)]:
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor) and (t.device.type != recipe.device or t.is_complex()):
                return False
    return True


def cut(gm: fx.GraphModule, recipe: Recipe,
        make_segment: Callable[[int, fx.GraphModule], Callable[..., Any]]) -> int:
    """Replace each segment of `gm` (in place) by a call of `make_segment(index, segment)`;
    return how many there are. A segment's nodes keep their metadata (fake values)."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if _opaque(node, recipe.device):
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
        segment = extract(nodes, inputs, outputs)
        replace_with_call(gm, nodes, inputs, outputs, make_segment(count, segment), {SEGMENT_META: count})
        count += 1
    return count
