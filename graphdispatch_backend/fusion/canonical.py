"""Ops Inductor lowers only after its own decompositions, written as the ops it lowers.

aot leaves `t`, `transpose`, `_to_copy`, `rsub`, `arange`, the constructors (`zeros`,
`ones`, `new_*`, `*_like`, `fill`), `masked_fill`, `clamp`, `index_select`, `narrow` and
`stack` in a graph; Inductor has no lowering of its own for them (its decomposition table
rewrites them before lowering, and a graph handed to it after aot gets no decomposition),
so they would run as ATen calls and cut the fused kernels around them. Each rewrite here
is exact: views stay views, a cast is the same cast, `c - x` is `-x + c` (negation is
exact, addition commutes), an `arange` of integers is `prims.iota` in int64, cast (the
recipe lets it in only where its dtype holds every value: fusion/recipe.py), a constructor
is `full` of its value (the same cast of one number; a `*_like` of a contiguous layout
only), `masked_fill` is `where` (a selection), `clamp` is `clamp_max(clamp_min(x))` (eager's
`min(max(x, lo), hi)`), `index_select` is `index` and `narrow` a `slice` (gathers and
views), `stack` a `cat` of `unsqueeze`s (copies), a `cat` of one tensor and empty ones a
contiguous `clone` (the same copy; see `_copy_of_one`). A rewritten node keeps the name of the op
it was (`ORIGIN`), so verdicts and reports name what the graph holds.

Before::   t = aten.t.default(w);  c = aten._to_copy.default(x, dtype=torch.bfloat16)
After::    t = aten.permute.default(w, [1, 0]);  c = prims.convert_element_type.default(x, torch.bfloat16)
"""

from __future__ import annotations

import enum
import math
from typing import Any

import torch
import torch.fx as fx
from torch._prims_common import make_contiguous_strides_for

aten = torch.ops.aten
ORIGIN = "gd_origin_op"


class Composite(enum.Enum):
    """The target of a canonical form that is more than one op: `rewrite` writes it as the
    nodes it says; `lowered_by` is the op whose lowering the form rests on (its other nodes
    are views, or ops as lowered), what `inductor_lowers` looks up."""

    RSUB = "rsub"  # c - x: add(neg(x), c)
    ARANGE = "arange"  # convert_element_type(iota(n, start, step, int64), dtype)
    CLAMP = "clamp"  # clamp_max(clamp_min(x, lo), hi)
    STACK = "stack"  # cat([unsqueeze(t, dim) for t in tensors], dim)

    @property
    def lowered_by(self) -> Any:
        return {Composite.RSUB: aten.add.Tensor, Composite.ARANGE: torch.ops.prims.iota.default,
                Composite.CLAMP: aten.clamp_max.default, Composite.STACK: aten.cat.default}[self]


def _ndim(node: Any) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def canonical(node: fx.Node) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """(target, args, kwargs) Inductor lowers, computing what `node` computes; None if none.
    The target is an op, or a Composite that `rewrite` writes as the ops it says."""
    target, args, kwargs = node.target, node.args, node.kwargs
    if target is aten.t.default:
        ndim = _ndim(args[0])
        return (aten.permute.default, (args[0], [1, 0]), {}) if ndim == 2 else None
    if target is aten.transpose.int:
        ndim = _ndim(args[0])
        if ndim is None or kwargs:
            return None
        d0, d1 = (d % ndim if ndim else 0 for d in args[1:3])
        perm = list(range(ndim))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return aten.permute.default, (args[0], perm), {}
    if target is aten._to_copy.default:
        extra = {k: v for k, v in kwargs.items() if k != "dtype"}
        val, src = node.meta.get("val"), args[0].meta.get("val") if isinstance(args[0], fx.Node) else None
        same_place = isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor) and val.device == src.device
        if not same_place or "dtype" not in kwargs or set(extra) - {"layout", "device"}:
            return None  # a move, a memory format or pinned memory: not a plain cast
        if val.stride() != src.stride():
            return None
        return torch.ops.prims.convert_element_type.default, (args[0], kwargs["dtype"]), {}
    if target is aten.rsub.Scalar and kwargs.get("alpha", 1) == 1 and len(args) == 2:
        val, src = node.meta.get("val"), args[0].meta.get("val") if isinstance(args[0], fx.Node) else None
        if isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor) and val.dtype == src.dtype \
                and val.is_floating_point():
            return Composite.RSUB, args, {}
    if target in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        val = node.meta.get("val")
        numbers = list(args) + [1] * (target is not aten.arange.start_step)
        start, end, step = ([0] if target is aten.arange.default else []) + numbers
        if not isinstance(val, torch.Tensor) or not all(type(a) is int for a in (start, end, step)) \
                or set(kwargs) - {"dtype", "layout", "device", "pin_memory"} or kwargs.get("pin_memory"):
            return None
        return Composite.ARANGE, (val.shape[0], start, step, val.dtype, val.device), {}
    return _constructor(node) or _selection(node)


_FILLS = {aten.zeros.default: 0, aten.ones.default: 1, aten.new_zeros.default: 0, aten.new_ones.default: 1,
          aten.zeros_like.default: 0, aten.ones_like.default: 1}


def _constructor(node: fx.Node) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """`full` of the value a constructor fills with (its meta value's dtype and device)."""
    target, args, val = node.target, node.args, node.meta.get("val")
    if not isinstance(val, torch.Tensor) or node.kwargs.get("pin_memory"):
        return None
    if target in _FILLS:
        value = _FILLS[target]
    elif target is aten.new_full.default or target is aten.full_like.default or target is aten.fill.Scalar:
        value = args[2] if target is aten.new_full.default else args[1]
    else:
        return None
    if not isinstance(value, (int, float, bool)):
        return None
    if list(val.stride()) != list(make_contiguous_strides_for(val.shape)):
        return None  # a *_like of another layout keeps it; full is contiguous
    return aten.full.default, (list(val.shape), value), {"dtype": val.dtype, "layout": torch.strided,
                                                          "device": val.device, "pin_memory": False}


def _selection(node: fx.Node) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """masked_fill, clamp, index_select, narrow, stack and a cat of one tensor, as ops Inductor lowers."""
    target, args, kwargs, val = node.target, node.args, node.kwargs, node.meta.get("val")
    if kwargs or not isinstance(val, torch.Tensor):
        return None
    if target is aten.masked_fill.Scalar:
        x, mask, value = args
        src = x.meta.get("val") if isinstance(x, fx.Node) else None
        kind = bool if val.dtype == torch.bool else float if val.is_floating_point() else int
        if not isinstance(src, torch.Tensor) or src.dtype != val.dtype or isinstance(value, bool) != (kind is bool) \
                or (kind is int and not isinstance(value, int)):
            return None  # where would promote what masked_fill casts
        return aten.where.ScalarSelf, (mask, value, x), {}
    if target is aten.clamp.default:
        bounds = [b for b in args[1:3] if b is not None] if len(args) > 1 else []
        if not bounds or not all(isinstance(b, (int, float)) and math.isfinite(b) for b in bounds):
            return None
        lo, hi = (list(args[1:3]) + [None])[:2]
        if lo is None:
            return aten.clamp_max.default, (args[0], hi), {}
        return (aten.clamp_min.default, (args[0], lo), {}) if hi is None else (Composite.CLAMP, (args[0], lo, hi), {})
    if target is aten.index_select.default:
        x, dim, index = args
        if _ndim(index) != 1 or _ndim(x) is None:
            return None
        return aten.index.Tensor, (x, [None] * (dim % max(_ndim(x), 1)) + [index]), {}
    if target is aten.narrow.default and all(type(a) is int for a in args[1:]):
        x, dim, start, length = args
        size = x.meta["val"].shape[dim] if isinstance(x, fx.Node) else None
        if size is None:
            return None
        start = start % size if start < 0 else start
        return aten.slice.Tensor, (x, dim, start, start + length), {}
    if target is aten.stack.default:
        tensors, dim = args[0], args[1] if len(args) > 1 else 0
        return Composite.STACK, (list(tensors), dim % val.dim()), {}
    if target is aten.cat.default:
        return _copy_of_one(args[0], val)
    return None


def _copy_of_one(tensors: Any, val: torch.Tensor) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """A `cat` whose other tensors are empty (transformers' cache, first filled: `cat([empty,
    k])`) as a contiguous `clone` of the one that is not: Inductor drops such a cat and hands
    its readers that tensor's own layout (a transposed key), so a graph that returns the cat
    with eager's contiguous strides wrote the same values twice per layer."""
    vals = [t.meta.get("val") if isinstance(t, fx.Node) else None for t in tensors]
    if not all(isinstance(v, torch.Tensor) and all(type(d) is int for d in v.shape) for v in [*vals, val]) \
            or not val.is_contiguous():
        return None  # (a size Dynamo left symbolic: whether it is empty is not known here)
    full = [(t, v) for t, v in zip(tensors, vals) if v.numel() > 0]
    if len(full) != 1 or len(tensors) < 2:
        return None
    one, v = full[0]
    if v.shape != val.shape or v.dtype != val.dtype or v.device != val.device:
        return None  # (cat promotes dtypes over every tensor, empty ones too)
    return aten.clone.default, (one,), {"memory_format": torch.contiguous_format}


def rewrite(gm: fx.GraphModule, nodes: set[fx.Node]) -> set[fx.Node]:
    """Rewrite each of `nodes` that has a canonical form, in place; return `nodes` with the
    nodes a rewrite added."""
    nodes = set(nodes)
    for node in list(gm.graph.nodes):
        if node not in nodes:
            continue
        found = canonical(node)
        if found is None:
            continue
        target, args, kwargs = found
        origin = str(node.target)
        if target is Composite.RSUB:  # c - x == -x + c, exactly
            with gm.graph.inserting_before(node):
                neg = gm.graph.call_function(aten.neg.default, (args[0],))
            neg.meta = {**node.meta, "val": args[0].meta.get("val"), ORIGIN: origin}
            nodes.add(neg)
            node.target, node.args, node.kwargs = aten.add.Tensor, (neg, args[1]), {}
        elif target is Composite.CLAMP:  # min(max(x, lo), hi), as eager's kernel
            with gm.graph.inserting_before(node):
                low = gm.graph.call_function(aten.clamp_min.default, (args[0], args[1]))
            low.meta = {**node.meta, ORIGIN: origin}
            nodes.add(low)
            node.target, node.args, node.kwargs = aten.clamp_max.default, (low, args[2]), {}
        elif target is Composite.STACK:  # cat of the tensors, each unsqueezed at dim
            parts = []
            for t in args[0]:
                with gm.graph.inserting_before(node):
                    part = gm.graph.call_function(aten.unsqueeze.default, (t, args[1]))
                part.meta = {**node.meta, "val": t.meta["val"].unsqueeze(args[1]), ORIGIN: origin}
                parts.append(part)
            nodes.update(parts)
            node.target, node.args, node.kwargs = aten.cat.default, (parts, args[1]), {}
        elif target is Composite.ARANGE:  # start + step * i, counted in int64 and cast once
            length, start, step, dtype, device = args
            with gm.graph.inserting_before(node):
                iota = gm.graph.call_function(torch.ops.prims.iota.default, (length,), {
                    "start": start, "step": step, "dtype": torch.int64, "device": device, "requires_grad": False})
            iota.meta = {**node.meta, "val": node.meta["val"].to(torch.int64), ORIGIN: origin}
            nodes.add(iota)
            node.target, node.args, node.kwargs = torch.ops.prims.convert_element_type.default, (iota, dtype), {}
        else:
            node.target, node.args, node.kwargs = target, args, kwargs
        node.meta[ORIGIN] = origin
    gm.recompile()
    return nodes
