"""reinplace_buffers: a functional write into a tensor the graph made itself becomes the write.

aot functionalizes a write into a buffer the graph allocates as it does one into an input:
transformers' static cache is made at its first forward (`torch.zeros` per layer, then
`index_copy_` of the prompt's rows), and reaches the lowered graph as `zeros` plus an
`index_copy` that copies the whole new buffer to write 8 rows into it. At max_cache_len
4096 that is 16 MiB copied per prefill, more than the prefill's own work on a small model,
where eager writes the rows into its zeros. As Inductor re-inplaces
(`torch/_inductor/fx_passes/reinplace.py`), a chain of such writes that starts at a tensor
this graph allocated (an ATen op whose schema returns a new tensor, not a view) is made in
place when:

- nothing reads a value it overwrites (`blocked`, passes/functional_writes.py: the rule
  passes/reinplace.py applies to inputs), so the buffer is neither an output nor read
  after its write;
- each write keeps the layout of the buffer it writes (shape, dtype, strides), so what the
  graph returns is laid out as before;
- the chain lies inside one captured piece (no node between its buffer and its last write
  that split_pieces keeps out of pieces): otherwise the later piece would write into its
  own input.

Only writes that copy a whole tensor to change part of it: index and scatter writes and
writes into a view (`slice_scatter`, `select_scatter`, ...). A pointwise op on a buffer
stays functional: verified fusion fuses it (runtime/program/fused.py), and an in-place
write is a wall between fused segments (fusion/segments.py). For the same reason, in a
fused graph (`fuse`) a `slice_scatter` or `select_scatter` stays functional too: Inductor
lowers it as a store into the buffer it made, where in place it would cut the graph's
fusion in two (HunyuanVideo's attention mask, a `select_scatter` into a [1, 1, 6] buffer,
made its fused graph two segments: 1.25x default Inductor a call, 1.17x in one segment,
interleaved in one process); row writes (a new cache's rows) still go in place, the copy
they save grows with the cache. The eager check judges the
result, bit for bit. The report's `buffer_writes_in_place` counts the writes.

Before::

    zeros = aten.zeros.default([1, 4, 4096, 64])
    index_copy = aten.index_copy.default(zeros, 2, pos, k)
    return (index_copy,)

After::

    zeros = aten.zeros.default([1, 4, 4096, 64])
    index_copy_ = aten.index_copy_.default(zeros, 2, pos, k)
    return (zeros,)
"""

from __future__ import annotations

import bisect

import torch
import torch.fx as fx
from torch._prims_common import is_non_overlapping_and_dense_or_false

from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.functional_writes import (
    ROW_WRITES,
    SCATTER_VIEW,
    Reads,
    Write,
    blocked,
    parse,
    rewrite,
)
from graphdispatch_backend.passes.ops import is_view
from graphdispatch_backend.passes.split_pieces import inline_nodes

aten = torch.ops.aten

# ops whose schema declares a new tensor where the result shares its input's memory
# (aot's `_unsafe_view` after a matmul): never a buffer of the graph's own
UNDECLARED_VIEWS = frozenset({aten._unsafe_view.default, aten._reshape_alias.default})


def _fresh(node: fx.Node) -> bool:
    """`node` is a tensor this graph allocates: an ATen op returning new memory, dense."""
    target = node.target
    if (node.op != "call_function" or not isinstance(target, torch._ops.OpOverload)
            or target.namespace not in ("aten", "prims") or is_view(node) or target in UNDECLARED_VIEWS
            or "gd_substitution" in node.meta):
        return False
    returns = target._schema.returns
    val = node.meta.get("val")
    return (len(returns) == 1 and returns[0].alias_info is None and isinstance(val, torch.Tensor)
            and is_non_overlapping_and_dense_or_false(val))


def _same_layout(node: fx.Node, root: fx.Node) -> bool:
    a, b = node.meta.get("val"), root.meta.get("val")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype):
        return False
    sizes = [*zip(a.shape, b.shape), *zip(a.stride(), b.stride()), (a.storage_offset(), b.storage_offset())]
    # a symbolic size is compared as its expression: comparing values would add a guard
    return a.dim() == b.dim() and all(x == y if isinstance(x, int) and isinstance(y, int) else str(x) == str(y)
                                      for x, y in sizes)


# view writes Inductor lowers as a store into its own buffer: left functional in a fused graph
FUSED_VIEW_WRITES = frozenset({aten.slice_scatter.default, aten.select_scatter.default})


def _next_write(base: fx.Node, fused: bool) -> Write | None:
    """The one row write that builds a new value from `base` (two: neither goes in place);
    `fused`: not a view write Inductor stores into the buffer itself."""
    found = None
    for user in base.users:
        write = parse(user, base)
        if write is not None and (user.target in ROW_WRITES or user.target in SCATTER_VIEW):
            if fused and user.target in FUSED_VIEW_WRITES:
                return None
            if found is not None:
                return None
            found = write
    return found


def reinplace_buffers(gm: fx.GraphModule, ctx: PassContext) -> None:
    reads = Reads(gm)
    device = ctx.pieces_spec.graph_device if ctx.pieces_spec is not None else None
    splits: list[int] = []  # positions of the nodes split_pieces keeps out of pieces, found at the first chain

    def one_piece(root: fx.Node, last: fx.Node) -> bool:
        if device is None:
            return True
        if not splits:
            splits.extend(sorted(reads.order[n] for n in inline_nodes(gm, device)) or [len(reads.order)])
        i = bisect.bisect_left(splits, reads.order[root])
        return i == len(splits) or splits[i] > reads.order[last]

    chains: list[tuple[fx.Node, list[Write]]] = []
    claimed: set[fx.Node] = set()
    for root in gm.graph.nodes:
        if root in claimed or not _fresh(root):
            continue
        steps: list[Write] = []
        base = root
        while True:
            write = _next_write(base, ctx.fused)
            if (write is None or not _same_layout(write.node, root) or not one_piece(root, write.node)
                    or blocked(reads, base, [write], set()) is not None):
                break
            steps.append(write)
            base = write.node
        if steps:
            chains.append((root, steps))
            claimed.update(step.node for step in steps)
    for root, steps in chains:
        for step in steps:
            rewrite(gm, step, root)
        ctx.buffer_writes += len(steps)
    if chains:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
