"""reinplace: a functional write into a graph input, copied back whole, becomes the write itself.

aot functionalizes every mutation. A KV-cache update `cache.index_copy_(0, pos, k)` reaches
the lowered graph as `index_copy` into a new cache-sized tensor plus an epilogue
`copy_(cache, index_copy)` (keep_inference_input_mutations keeps the write in the graph,
not in place): two whole-cache copies per token, where eager writes one row. A mutating
custom op (a vLLM-style cache write) arrives as `auto_functionalized_v2(op, _all_bases=
[cache])`, which clones the base the same way. This pass turns each chain of functional
writes that ends in an input's epilogue `copy_` back into the in-place writes, as Inductor
re-inplaces (`torch/_inductor/fx_passes/reinplace.py`: the same safety rule, below), and
drops the epilogue. The eager check still judges the result, bit for bit.

A chain `cache -> w1 -> w2 -> ... -> copy_(cache, wn)` is rewritten only whole, and only if
every write is one of the known functional writes (`index_copy`, `index_put`, `index_fill`,
`index_add`, `scatter*`, `masked_fill`, `copy`, or a pointwise op keeping its input's dtype
and shape, like a counter's `add`; each possibly under `slice_scatter`, `select_scatter`,
`diagonal_scatter` or `as_strided_scatter` of a view; or a mutating custom op under
auto_functionalized/_v2) and **nothing reads the old value afterwards**: no node
after a write reads its base or a view of it (size queries aside), and no argument of the
write is itself a view of that base (an overlapping `cache[:-1] = cache[1:]` would read
what it writes). A chain that fails stays functional and is recorded with why, so the
report can say which input is still copied whole.

Before::

    index_copy = aten.index_copy.default(cache, 0, pos, k)
    mul = aten.mul.Tensor(k, 2)
    copy_ = aten.copy_.default(cache, index_copy)

After::

    index_copy_ = aten.index_copy_.default(cache, 0, pos, k)
    mul = aten.mul.Tensor(k, 2)
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.passes.context import PassContext, WriteOutcome
from graphdispatch_backend.passes.functional_writes import Reads, Write, auto, blocked, parse, rewrite, rewrite_auto

aten = torch.ops.aten


class _Graph(Reads):
    """The graph's reads (passes/functional_writes.py) and the epilogue copies back into its inputs."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.epilogue: dict[fx.Node, fx.Node] = {}
        twice: set[fx.Node] = set()
        for node in gm.graph.find_nodes(op="call_function", target=aten.copy_.default):
            dst = node.args[0]
            if isinstance(dst, fx.Node) and dst.op == "placeholder":
                if dst in self.epilogue:
                    twice.add(dst)
                self.epilogue[dst] = node
        for dst in twice:  # not the one epilogue aot writes: leave it be
            del self.epilogue[dst]


def _chain(graph: _Graph, placeholder: fx.Node, copy: fx.Node) -> tuple[list[Any], str | None]:
    """The writes from `placeholder` to what its epilogue copies back, in order, or why
    they cannot be made in place."""
    steps: list[Any] = []
    value = copy.args[1]
    while value is not placeholder:
        if not isinstance(value, fx.Node):
            return [], "the epilogue copies back a value that is not a graph node"
        if value.target is operator.getitem and isinstance(value.args[0], fx.Node):
            custom = auto(value.args[0])
            k = value.args[1] - custom.n_out if custom is not None else -1
            if custom is None or not 0 <= k < len(custom.bases):
                return [], f"written by {value.args[0].name}, which has no in-place form here"
            steps.append((custom, k, value))
            value = custom.bases[k]
            continue
        base = value.args[0] if value.args else None
        write = parse(value, base)
        if write is None:
            target = getattr(value.target, "__name__", str(value.target))
            return [], f"written by {target} ({value.name}), which has no in-place form here"
        steps.append(write)
        value = base
    if not steps:
        return [], "the epilogue copies the input onto itself"
    steps.reverse()
    return steps, None


def reinplace(gm: fx.GraphModule, ctx: PassContext) -> None:
    graph = _Graph(gm)
    if not graph.epilogue:
        return
    positions = {ph: i for i, ph in enumerate(gm.graph.find_nodes(op="placeholder"))}
    chains: dict[fx.Node, list[Any]] = {}
    for placeholder, copy in graph.epilogue.items():
        steps, why = _chain(graph, placeholder, copy)
        why = why or blocked(graph, placeholder, steps, {copy})
        if why is None:
            chains[placeholder] = steps
        else:
            ctx.writes.append(WriteOutcome(positions[placeholder], False, why))
    # a custom op writing several inputs goes in place only if each of them does
    changed = True
    while changed:
        changed = False
        for placeholder, steps in list(chains.items()):
            for step in steps:
                if isinstance(step, tuple) and any(b not in chains for b in step[0].bases):
                    del chains[placeholder]
                    ctx.writes.append(WriteOutcome(positions[placeholder], False,
                                                   f"{step[0].node.name} also writes an input that stays copied"))
                    changed = True
                    break
    if not chains:
        return
    done: set[fx.Node] = set()
    for placeholder, steps in chains.items():
        for step in steps:
            if isinstance(step, Write):
                rewrite(gm, step, placeholder)
            elif step[0].node not in done:
                rewrite_auto(gm, step[0])
                done.add(step[0].node)
        epilogue = graph.epilogue[placeholder]
        epilogue.replace_all_uses_with(placeholder)  # copy_ returns what it wrote: the input
        gm.graph.erase_node(epilogue)
        ctx.writes.append(WriteOutcome(positions[placeholder], True, f"{len(steps)} write(s) in place"))
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
