"""The functional writes aot leaves in a graph, read as writes, and their in-place forms.

aot functionalizes every mutation: `cache.index_copy_(0, pos, k)` becomes `index_copy` into
a new tensor, a write into a view (`cache[:, 1, 3] = k`) a `select_scatter` of a
`select_scatter` of the whole input, a mutating custom op an `auto_functionalized_v2` that
clones its bases. `parse` reads such a node as a Write: the base it builds its value from,
the views it writes through and the op that writes the innermost one; `auto` reads a
custom op's call; `rewrite` and `rewrite_auto` put the in-place form in their place.
`stamp` gives a node a pass makes the provenance and value metadata of the one it stands
for. `Reads` and `blocked` state the rule both reinplacing passes decide by (passes/
reinplace.py for inputs, passes/reinplace_buffers.py for tensors the graph makes): a chain
of writes may go in place only if nothing reads a value it overwrites.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._higher_order_ops.auto_functionalize import get_mutable_args, read_view_information_from_args
from torch.fx.passes.reinplace import _maybe_get_inplace_op

from graphdispatch_backend.passes.ops import alias_root, allocates_uninitialized, draws_random, is_view, nbytes, writes

aten = torch.ops.aten

# a functional write -> its in-place overload: same arguments, writes `self`
IN_PLACE = {
    aten.index_copy.default: aten.index_copy_.default,
    aten.index_put.default: aten.index_put_.default,
    aten.index_fill.int_Scalar: aten.index_fill_.int_Scalar,
    aten.index_fill.int_Tensor: aten.index_fill_.int_Tensor,
    aten.index_add.default: aten.index_add_.default,
    aten.scatter.src: aten.scatter_.src,
    aten.scatter.value: aten.scatter_.value,
    aten.scatter.reduce: aten.scatter_.reduce,
    aten.scatter.value_reduce: aten.scatter_.value_reduce,
    aten.scatter_add.default: aten.scatter_add_.default,
    aten.scatter_reduce.two: aten.scatter_reduce_.two,
    aten.masked_fill.Scalar: aten.masked_fill_.Scalar,
    aten.masked_fill.Tensor: aten.masked_fill_.Tensor,
    aten.copy.default: aten.copy_.default,
}
# scatter(base, src, *args) writes src into view(base, *args) of a copy of base
SCATTER_VIEW = {
    aten.slice_scatter.default: aten.slice.Tensor,
    aten.select_scatter.default: aten.select.int,
    aten.diagonal_scatter.default: aten.diagonal.default,
    aten.as_strided_scatter.default: aten.as_strided.default,
}
# writes that copy their whole base to change part of it: index and scatter writes (a
# masked fill or a copy may change every element: its value is not the base's, written)
ROW_WRITES = frozenset(IN_PLACE) - {aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.copy.default}
# ops that make a tensor from sizes and a fill value alone (a `*_like` or `new_*` reads only
# its template's metadata); `empty` and its kin are factories too (ops.allocates_uninitialized)
FILLED_FACTORIES = frozenset({f"aten::{name}" for name in (
    "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full")})
AUTO_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
_META_ONLY = frozenset({aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
                        aten.sym_storage_offset.default})


@dataclasses.dataclass
class Write:
    """How one functional write builds its value from `base`: `leaf` is the functional
    op applied to the innermost view (None: the innermost view is copied from `src`);
    `views` the view ops (target, args, kwargs) from base down; `parts` the nodes it is
    made of (erased with it once nothing else reads them)."""

    node: fx.Node
    base: fx.Node
    views: list[tuple[Any, tuple[Any, ...], dict[str, Any]]]
    leaf: fx.Node | None
    src: Any
    parts: list[fx.Node]


def in_place(node: fx.Node) -> Any:
    """The in-place overload that writes what `node` computes into its first argument: from
    the table above, or, for a pointwise aten op (`add`, `mul`, `where`, ...) whose value has
    its first argument's dtype and shape, its `_` variant with the same schema (as torch's
    functionalization reinplacing finds it). None if there is none."""
    if node.target in IN_PLACE:
        return IN_PLACE[node.target]
    target = node.target
    if (not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten"
            or torch.Tag.pointwise not in target.tags or draws_random(node) or not _same_meta(node, node.args[0])):
        return None
    try:
        return _maybe_get_inplace_op(target)
    except AssertionError:  # torch's lookup asserts on schemas it does not expect: no variant
        return None


def _same_meta(a: Any, b: Any) -> bool:
    va, vb = (n.meta.get("val") if isinstance(n, fx.Node) else None for n in (a, b))
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
            and va.shape == vb.shape)


def _same(a: Any, b: Any) -> bool:
    """The same node, or views computed the same way from the same node (functionalization
    takes a fresh view for each scatter it regenerates)."""
    if a is b:
        return True
    return (isinstance(a, fx.Node) and isinstance(b, fx.Node) and is_view(a) and is_view(b)
            and a.target is b.target and a.args[1:] == b.args[1:] and a.kwargs == b.kwargs
            and _same(a.args[0], b.args[0]))


def parse(node: Any, base: Any) -> Write | None:
    if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args or not _same(node.args[0], base):
        return None
    if in_place(node) is not None:
        return Write(node, base, [], node, None, [node])
    view = SCATTER_VIEW.get(node.target)
    if view is None:
        return None
    if node.target is aten.as_strided_scatter.default and not _plain(base):
        return None  # as_strided addresses the storage: a clone (offset 0) and base may differ
    args, kwargs = tuple(node.args[2:]), dict(node.kwargs)
    src = node.args[1]
    inner = _inner_view(src, base, view, args, kwargs)
    if inner is not None:
        nested = parse(src, inner)
        if nested is not None:
            return Write(node, base, [(view, args, kwargs), *nested.views], nested.leaf, nested.src,
                          [node, *nested.parts, inner])
    return Write(node, base, [(view, args, kwargs)], None, src, [node])


def _inner_view(src: Any, base: fx.Node, view: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> fx.Node | None:
    """`src` writes into `view(base, *args)` and is read by the scatter alone: the view node."""
    if not isinstance(src, fx.Node) or len(src.users) != 1 or not src.args:
        return None
    inner = src.args[0]
    if (isinstance(inner, fx.Node) and inner.target is view and _same(inner.args[0], base)
            and tuple(inner.args[1:]) == args and dict(inner.kwargs) == kwargs):
        return inner
    return None


def _plain(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.storage_offset() == 0 and val.is_contiguous()


def _n_outputs(op: Any) -> int:
    returns = len(op._schema.returns)
    return returns if returns >= 2 else 1


@dataclasses.dataclass
class Auto:
    """A mutating custom op under auto_functionalized(_v2): one write per base it mutates."""

    node: fx.Node
    bases: list[fx.Node]

    @property
    def n_out(self) -> int:
        return _n_outputs(self.node.args[0])


def auto(node: fx.Node) -> Auto | None:
    if node.target not in AUTO_FUNCTIONALIZED or not isinstance(node.args[0], torch._ops.OpOverload):
        return None
    op = node.args[0]
    if node.target is torch.ops.higher_order.auto_functionalized_v2:
        bases = list(node.kwargs.get("_all_bases", ()))
    else:
        names, _ = get_mutable_args(op)
        bases = [node.kwargs.get(name) for name in names]
    if not bases or not all(isinstance(b, fx.Node) and b.op == "placeholder" for b in bases):
        return None
    return Auto(node, bases)


def rewrite(gm: fx.GraphModule, write: Write, placeholder: fx.Node) -> None:
    graph, node = gm.graph, write.node
    with graph.inserting_before(node):
        target = placeholder
        for view, args, kwargs in write.views:
            target = stamp(graph.call_function(view, (target, *args), kwargs), node)
        if write.leaf is None:
            stamp(graph.call_function(aten.copy_.default, (target, write.src)), node, like=target)
        else:
            leaf = write.leaf
            stamp(graph.call_function(in_place(leaf), (target, *leaf.args[1:]), dict(leaf.kwargs)), node,
                  like=target)
    node.replace_all_uses_with(placeholder)
    for part in write.parts:
        if not part.users:
            graph.erase_node(part)


def rewrite_auto(gm: fx.GraphModule, auto: Auto) -> None:
    graph, node = gm.graph, auto.node
    op = node.args[0]
    kwargs = dict(node.kwargs)
    with graph.inserting_before(node):
        if node.target is torch.ops.higher_order.auto_functionalized_v2:
            bases = kwargs.pop("_all_bases")
            names, types = get_mutable_args(op)
            views = read_view_information_from_args(names, types, kwargs, bases)
            for name, info in views.items():
                kwargs[name] = None if info is None else _regenerate(graph, info, bases, node)
        call = stamp(graph.call_function(op, (), kwargs), node, value=_outputs(node, auto.n_out))
    n_out = auto.n_out
    for user in list(node.users):
        k = user.args[1]
        if k >= n_out:
            user.replace_all_uses_with(auto.bases[k - n_out])
        elif n_out == 1:
            user.replace_all_uses_with(call)
        else:
            user.args = (call, k)
            continue
        graph.erase_node(user)
    if not node.users:
        graph.erase_node(node)


def _regenerate(graph: fx.Graph, info: Any, bases: list[fx.Node], like: fx.Node) -> fx.Node:
    """The view of a base that a custom op's mutable argument was (see torch's ViewInfo)."""
    base = bases[info.base_index]
    kind = type(info).__name__
    if kind == "NotView":
        return base
    if kind == "AliasViewInfo":
        return stamp(graph.call_function(aten.alias.default, (base,)), like)
    if kind == "SliceViewInfo":
        return stamp(graph.call_function(aten.slice.Tensor, (base, info.dim, info.start, info.end)), like)
    return stamp(graph.call_function(aten.as_strided.default, (base, info.size, info.stride, info.storage_offset)),
                 like)


def _outputs(node: fx.Node, n_out: int) -> Any:
    val = node.meta.get("val")
    if not isinstance(val, (tuple, list)):
        return None
    return val[0] if n_out == 1 else tuple(val[:n_out])


_PROVENANCE = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node", "seq_nr")
_UNSET = object()


def stamp(node: fx.Node, origin: fx.Node, *, like: fx.Node | None = None, value: Any = _UNSET) -> fx.Node:
    """A node this pass made, given the provenance of the node it stands for (regions read
    the module stack) and its value's metadata: `value`, the value of `like` (an in-place
    write returns what it writes), or the op run on the fake values of its arguments."""
    for key in _PROVENANCE:
        if key in origin.meta:
            node.meta[key] = origin.meta[key]
    if value is not _UNSET:
        node.meta["val"] = value
    elif like is not None:
        node.meta["val"] = like.meta.get("val")
    else:
        node.meta["val"] = _fake_run(node)
    return node


def _fake_run(node: fx.Node) -> Any:
    """The node's op run on its arguments' recorded values, in their fake mode (views only
    here: no data is touched)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    mode = torch._guards.detect_fake_mode(tensors)
    with mode if mode is not None else contextlib.nullcontext():
        return node.target(*args, **kwargs)


class Reads:
    """Positions and alias classes of one graph: who reads a value after a given node."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def aliases(self, node: fx.Node) -> set[fx.Node]:
        """`node` and every view taken of it, transitively."""
        found, frontier = {node}, [node]
        while frontier:
            for user in frontier.pop().users:
                if user not in found and is_view(user) and user.args and user.args[0] in found:
                    found.add(user)
                    frontier.append(user)
        return found

    def read_after(self, base: fx.Node, at: fx.Node, allowed: set[fx.Node]) -> fx.Node | None:
        """A node after `at` that reads `base`'s value (itself or through a view), or None."""
        where = self.order[at]
        for alias in self.aliases(base):
            for user in alias.users:
                if user in allowed or self.order[user] <= where or user.target in _META_ONLY:
                    continue
                if is_view(user) and all(u.target in _META_ONLY for u in user.users):
                    continue
                return user
        return None


def _arguments(write: Write) -> list[Any]:
    """What the in-place form reads besides its base and views: the leaf's other arguments
    or the copied source."""
    if write.leaf is None:
        return [write.src]
    return [*write.leaf.args[1:], *write.leaf.kwargs.values()]


def _flat_nodes(values: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(values, found.append)
    return found


def blocked(reads: Reads, root: fx.Node, steps: list[Any], allowed: set[fx.Node]) -> str | None:
    """Why the chain of writes `steps` from `root` (each a Write, or a custom op's
    (Auto, base index, getitem)) cannot be made in place, or None: a write reads a view of
    what it writes (an overlapping `cache[:-1] = cache[1:]`), or a node after a write reads
    the value it overwrites (`allowed` aside)."""
    base = root
    for step in steps:
        if isinstance(step, Write):
            node, parts, read = step.node, set(step.parts), _flat_nodes(_arguments(step))
        else:
            custom, k, _ = step
            mutable = set(get_mutable_args(custom.node.args[0])[0]) | {"_all_bases"}
            node, parts, read = custom.node, {custom.node}, [
                n for name, v in custom.node.kwargs.items() if name not in mutable for n in _flat_nodes(v)]
            base = custom.bases[k]  # a placeholder: `auto` takes no other base
        mine = reads.aliases(base)
        if any(n in mine for n in read):
            return f"{node.name} reads a view of what it writes"
        reader = reads.read_after(base, node, parts | allowed)
        if reader is not None:
            return f"{reader.name} reads the value {node.name} overwrites"
        base = node if isinstance(step, Write) else step[2]
    return None


def made_buffer(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the factory, the values written into it) when `node`'s value is a buffer the graph
    makes and only writes into (views of it, index and scatter writes, functional or in
    place, and any in-place write): a new KV cache is `zeros` plus `index_copy_` of the
    prompt's rows. None for a value computed from its inputs. A write's value is its
    largest tensor operand other than the buffer (an `index_copy_`'s rows, a
    `slice_scatter`'s source)."""
    chain: list[fx.Node] = []
    while True:
        node = alias_root(node)
        if (node.op == "call_function" and (node.target in ROW_WRITES or node.target in SCATTER_VIEW)
                and node.args and isinstance(node.args[0], fx.Node)):
            chain.append(node)
            node = node.args[0]
            continue
        schema = getattr(node.target, "_schema", None)
        if not allocates_uninitialized(node) and (node.op != "call_function" or schema is None
                                                  or schema.name not in FILLED_FACTORIES):
            return None
        break
    root = node
    values = [_value(n, {n.args[0]}) for n in chain]
    for n in root.graph.nodes:
        written = [w for w in writes(n) if alias_root(w) is root]
        if written:
            values.append(_value(n, set(written)))
    return root, [v for v in values if v is not None]


def _value(write: fx.Node, into: set[fx.Node]) -> fx.Node | None:
    """The largest tensor operand of `write` other than what it writes `into`."""
    operands = [a for a in write.all_input_nodes if a not in into and isinstance(a.meta.get("val"), torch.Tensor)]
    return max(operands, key=nbytes, default=None)
