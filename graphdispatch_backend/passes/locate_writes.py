"""locate_writes: where in its inputs a graph writes, computable before it runs.

Every extra run graphdispatch adds (the eager check, a verification, a derived set, a
capture's own run) must leave the inputs the graph writes as it found them: it snapshots
what will be written and puts it back. A whole snapshot of a 40 GB KV cache to undo one
row is not a snapshot anyone can afford, so this analysis finds, for each write into an
input, the *region* it writes, as a small program over the graph's inputs (`locate`) that
the runtime (runtime/checks/world.py) runs before the extra runs:

- `index_copy_`/`index_fill_`/`index_add_` (dim, index): the rows `index` names;
- `index_put_` (indices): the elements the index list names;
- `scatter_`/`scatter_add_`/`scatter_reduce_` (dim, index): the elements `gather` reads;
- `copy_` and every other write into a view (`cache[:, :, 3] = x`): that view, whole;
- a write into the input itself, or by an op whose region is not one of the above (a
  mutating custom op): the whole input (`why` says so); the runtime bounds such snapshots.

The program copies the nodes that compute the written view and the index tensors. It may
read an input the graph writes only where the graph reads it before its first write (the
index of a static cache's row, `arange(1) + cumulative_length`, read before the counter's
`add_`); an index computed from written values, from random draws or through an artifact
cannot be known in advance, and its write is located as the whole input.

This is an analysis: the graph is not changed. `locate_writes` records the plan of the
whole graph in the PassContext (the eager check's); `plan_writes` makes one for any graph
(split_pieces uses it per piece).

Before (graph)::

    add = aten.add.Tensor(arange, cumulative_length)
    index_copy_ = aten.index_copy_.default(keys, 2, add, k)

After (its `locate`, returning the written view and the index; site: index, dim 2)::

    add = aten.add.Tensor(arange, cumulative_length)
    return (keys, add)
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.ops import alias_root, draws_random, is_collective, is_effectful, is_view, writes

aten = torch.ops.aten

WHOLE, INDEX, INDICES, SCATTER = "whole", "index", "indices", "scatter"
_INDEX_OPS = {"aten::index_copy_": 2, "aten::index_fill_": 2, "aten::index_add_": 2}  # -> index argument
_SCATTER_OPS = frozenset({"aten::scatter_", "aten::scatter_add_", "aten::scatter_reduce_"})
_INDICES_OPS = frozenset({"aten::index_put_", "aten::_index_put_impl_"})
MAX_LOCATE_NODES = 64  # a larger program to find an index is no cheap snapshot any more
WRITE_PLAN_META = "gd_write_plan"  # a substituted region's call: its native region's plan


@dataclasses.dataclass(frozen=True)
class WriteSite:
    """One write into an input: `position` (the placeholder), the region's `kind`, the
    `locate` output holding the written view (`view`), those holding the index tensors
    (`index`; None for a `:` in an index_put list), the dim, and the op that writes."""

    position: int
    kind: str
    view: int
    index: tuple[int | None, ...] = ()
    dim: int = 0
    op: str = ""
    why: str = ""  # a WHOLE site of the input itself: why no smaller region is known


@dataclasses.dataclass(frozen=True)
class WritePlan:
    sites: tuple[WriteSite, ...]
    locate: fx.GraphModule  # (*graph inputs) -> tuple of the views and indices the sites name

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(sorted({s.position for s in self.sites}))


def locate_writes(gm: fx.GraphModule, ctx: PassContext) -> None:
    ctx.write_plan = plan_writes(gm)


def plan_writes(gm: fx.GraphModule) -> WritePlan | None:
    """The write plan of `gm`, None if it writes no input."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    position = {ph: i for i, ph in enumerate(placeholders)}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found: list[tuple[fx.Node, fx.Node, fx.Node]] = []  # (writer, written node, placeholder)
    first_write: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        for written in writes(node):
            root = alias_root(written)
            if root in position:
                found.append((node, written, root))
                first_write.setdefault(root, order[node])
    if not found:
        return None
    program = _Program(placeholders, order, first_write)
    sites: dict[tuple[Any, ...], WriteSite] = {}
    for writer, written, root in found:
        region = writer.meta.get(WRITE_PLAN_META)
        for site in (_inlined(program, writer, written, position[root], region) if region is not None
                     else [_site(program, writer, written, position[root])]):
            _add(sites, site)
    return WritePlan(tuple(sites.values()), program.finish())


def _add(sites: dict[tuple[Any, ...], WriteSite], site: WriteSite) -> None:
    if site.kind == WHOLE and site.why:  # the whole input: every other site of it is inside
        for key in [k for k, s in sites.items() if s.position == site.position]:
            del sites[key]
        sites[(site.position,)] = site
    elif (site.position,) not in sites:
        sites.setdefault((site.position, site.kind, site.view, site.index, site.dim), site)


def _inlined(program: _Program, writer: fx.Node, written: fx.Node, position: int, region: WritePlan) -> list[WriteSite]:
    """The sites of a substituted region's call: its native region's plan, with the
    region's inputs bound to the call's arguments (the kernel writes where the region does;
    its gate checks that)."""
    op = f"the artifact call {writer.name}"
    mine = [s for s in region.sites if writer.args[s.position] is written]
    outputs = program.inline(region.locate, writer) if mine else None
    if outputs is None:
        return [WriteSite(position, WHOLE, program.whole(position), op=op,
                          why=f"where {op} writes cannot be computed in advance")]
    view = program.view(written)
    found = []
    for s in mine:
        index = tuple(None if slot is None else program.slot(outputs[slot]) for slot in s.index)
        if s.why or view is None:  # the whole argument: a view of the input, or the input itself
            found.append(_whole(program, position, op, written, view) if view is not None else
                         WriteSite(position, WHOLE, program.whole(position), op=op, why=s.why))
        else:
            found.append(WriteSite(position, s.kind, program.slot(outputs[s.view]), index, s.dim, s.op))
    return found


def _site(program: _Program, writer: fx.Node, written: fx.Node, position: int) -> WriteSite:
    name = getattr(getattr(writer.target, "_schema", None), "name", "")
    op = name or getattr(writer.target, "__name__", str(writer.target))
    view = program.view(written)
    if view is None:
        return WriteSite(position, WHOLE, program.whole(position), op=op,
                         why=f"the view {op} writes cannot be computed in advance")
    if not name.startswith("aten::") or not writer.args or written is not writer.args[0]:
        # a custom op writes its mutable arguments, anywhere in them (their schema says no more)
        return _whole(program, position, op, written, view)
    if name in _INDEX_OPS:
        index = program.value(_arg(writer, _INDEX_OPS[name]), writer)
        if index is not None:
            return WriteSite(position, INDEX, view, (index,), _arg(writer, 1), op)
    elif name in _SCATTER_OPS:
        index = program.value(_arg(writer, 2), writer)
        if index is not None:
            return WriteSite(position, SCATTER, view, (index,), _arg(writer, 1), op)
    elif name in _INDICES_OPS:
        indices = _arg(writer, 1)
        slots = [None if i is None else program.value(i, writer) for i in indices]
        if all(s is not None for s, i in zip(slots, indices) if i is not None):
            return WriteSite(position, INDICES, view, tuple(slots), 0, op)
    else:  # copy_, fill_, add_, ...: the written view, whole
        return _whole(program, position, op, written, view)
    return WriteSite(position, WHOLE, program.whole(position), op=op,
                     why=f"the index {op} writes at cannot be computed in advance")


def _whole(program: _Program, position: int, op: str, written: fx.Node, view: int) -> WriteSite:
    if alias_root(written) is written:  # the input itself
        return WriteSite(position, WHOLE, view, op=op, why=f"{op} may write all of it")
    return WriteSite(position, WHOLE, view, op=op)


def _chain_of_placeholder(node: fx.Node) -> bool:
    while node.op == "call_function" and (is_view(node) or alias_root(node) is not node) and node.args:
        node = node.args[0]
    return node.op == "placeholder"


def _arg(node: fx.Node, index: int) -> Any:
    schema = node.target._schema
    name = schema.arguments[index].name
    return node.kwargs[name] if name in node.kwargs else node.args[index]


class _Program:
    """The `locate` graph under construction: copies of the nodes that compute views and
    indices, from the original graph's placeholders."""

    def __init__(self, placeholders: list[fx.Node], order: dict[fx.Node, int], first_write: dict[fx.Node, int]):
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        for ph in placeholders:
            self.env[ph] = new = self.graph.placeholder(ph.name)
            new.meta = {k: v for k, v in ph.meta.items() if k == "val"}
        self.placeholders = placeholders
        self.order = order
        self.first_write = first_write
        self.outputs: list[fx.Node] = []
        self.slots: dict[fx.Node, int] = {}

    def _slot(self, node: fx.Node) -> int:
        if node not in self.slots:
            self.slots[node] = len(self.outputs)
            self.outputs.append(node)
        return self.slots[node]

    def slot(self, node: fx.Node) -> int:
        return self._slot(node)

    def inline(self, locate: fx.GraphModule, reader: fx.Node) -> list[fx.Node] | None:
        """`locate`'s nodes copied in, its placeholders bound to `reader`'s arguments; its
        outputs, or None when an argument it reads cannot be computed in advance."""
        env: dict[fx.Node, Any] = {}
        for ph, arg in zip(locate.graph.find_nodes(op="placeholder"), reader.args):
            if not ph.users:
                continue
            if not isinstance(arg, fx.Node):
                env[ph] = arg
                continue
            copied = self._copy(arg, view_chain=True) if _chain_of_placeholder(arg) else None
            if copied is None:
                root = alias_root(arg)
                if root in self.first_write and self.order[reader] > self.first_write[root]:
                    return None  # read after it was written
                copied = self._copy(arg, view_chain=False)
            if copied is None:
                return None
            env[ph] = copied
        outputs: list[fx.Node] = []
        for node in locate.graph.nodes:
            if node.op == "call_function":
                env[node] = self.graph.node_copy(node, env.__getitem__)
            elif node.op == "output":
                outputs = [env[o] if isinstance(o, fx.Node) else o for o in node.args[0]]
        return outputs

    def whole(self, position: int) -> int:
        return self._slot(self.env[self.placeholders[position]])

    def view(self, node: fx.Node) -> int | None:
        """The written view, through views and in-place results (which keep its metadata)."""
        copied = self._copy(node, view_chain=True)
        return None if copied is None else self._slot(copied)

    def value(self, node: Any, reader: fx.Node) -> int | None:
        """An index tensor's value as `reader` reads it, if that is its value before the
        graph's writes."""
        if not isinstance(node, fx.Node):
            return None
        root = alias_root(node)
        if root in self.first_write and self.order[reader] > self.first_write[root]:
            return None  # read after it was written
        copied = self._copy(node, view_chain=False)
        return None if copied is None else self._slot(copied)

    def _copy(self, node: fx.Node, view_chain: bool) -> fx.Node | None:
        values: list[fx.Node] = []  # nodes computed as data (index math): read before any write
        members: list[fx.Node] = []
        if not self._collect(node, view_chain, members, values, set()) or len(members) > MAX_LOCATE_NODES:
            return None
        if not self._before_writes(values):
            return None
        for n in sorted(members, key=self.order.__getitem__):
            if n not in values and not is_view(n):  # an in-place result: the memory it wrote
                self.env[n] = self.env[n.args[0]]
            else:
                self.env[n] = self.graph.node_copy(n, self.env.__getitem__)
        return self.env[node]

    def _collect(self, node: fx.Node, chain: bool, members: list[fx.Node], values: list[fx.Node],
                 seen: set[fx.Node]) -> bool:
        """Gather what computes `node`: along a written view's chain (`chain`), views and
        in-place results (standing for the memory they wrote); elsewhere pure values."""
        if node in self.env or node in seen:
            return True
        seen.add(node)
        if node.op != "call_function" or len(seen) > MAX_LOCATE_NODES:
            return False
        base = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if chain and base is not None and (is_view(node) or alias_root(node) is not node):
            others = [] if not is_view(node) else [a for a in node.all_input_nodes if a is not base]
            ok = self._collect(base, True, members, values, seen) and all(
                self._collect(a, False, members, values, seen) for a in others)
        elif self._pure(node):
            values.append(node)
            ok = all(self._collect(a, False, members, values, seen) for a in node.all_input_nodes)
        else:
            return False
        members.append(node)
        return ok

    def _pure(self, node: fx.Node) -> bool:
        if node.target is operator.getitem or "gd_substitution" in node.meta or "gd_piece" in node.meta:
            return False
        schema = getattr(node.target, "_schema", None)
        if schema is None:  # SymInt arithmetic on sizes (operator.mul, ...)
            return not isinstance(node.meta.get("val"), torch.Tensor)
        return not (schema.is_mutable or draws_random(node) or is_effectful(node) or is_collective(node))

    def _before_writes(self, values: list[fx.Node]) -> bool:
        """The values read no written input after the graph first writes it."""
        for n in values:
            for arg in n.all_input_nodes:
                root = alias_root(arg)
                if root in self.first_write and self.order[n] > self.first_write[root]:
                    return False
        return True

    def finish(self) -> fx.GraphModule:
        self.graph.output(tuple(self.outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)
