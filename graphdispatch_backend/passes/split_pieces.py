"""split_pieces: cut a graph into capturable pieces around nodes a CUDA graph cannot hold.

A node cannot be captured when it reads a scalar back to the host
(`aten._local_scalar_dense`), asserts on a scalar, is tagged `cudagraph_unsafe`, draws
random numbers (a replay would not advance the generator as eager does), is an effectful
op (`with_effects`: a linalg error check must raise on every singular input), has a
dynamic output shape (`nonzero`, `masked_select`, boolean indexing: its sizes are known only
after it ran; indexing by integer indices, `repeat_interleave` given its `output_size` and
`one_hot` given its classes are sized by their arguments and stay in: an MoE's
`weights[expert_ids]`), is a collective whose process group's backend a CUDA graph cannot
hold (gloo runs on the host; NCCL collectives stay inside, as vLLM captures them: decided by
the group, so the CPU model splits where a GPU would), produces a tensor on
another device than the graph's (a CPU tensor in a CUDA graph; in the CPU model of a GPU
also `x[mask] = 0`, whose one-element value a GPU keeps on the host), is an artifact call
whose manifest says `"capturable": false`, or makes a tensor out of a Python-number input
(marked by lift_scalars.py, which moved it to the top: the piece then takes its tensor).
Such nodes stay inline, in order; each maximal run of other nodes with real work becomes
one piece, called through `make_piece`.
A run that would return buffers it makes and writes less than half of (a factory and
writes into it: transformers' new static cache, `zeros` plus `index_copy_` of the prompt's
rows, at MADE_BUFFER_BYTES or more in all) stays inline too, counted `made_buffer` once
per buffer: a capture would keep a copy of each in the graph's pool for the graph's life
and copy it out on every replay, where eager's cost is one fill. At a 14B model's cache
that is gigabytes of device memory held twice. The attention that reads such a buffer reads it at
a new address on every call, so no smaller piece around it could replay without copying
it in; the run is left whole. A cache the caller passes in (one `StaticCache` per slot,
reused) is an input, written in place and captured; a buffer whose writes cover it (a
video decoded tile by tile into `zeros`) is a computed output, captured as any; so is an
autograd graph's (`PieceSpec.made_buffers_eager`: the backward of `w[idx]` makes `w`'s
gradient from `zeros` and the rows the index wrote).
A graph with no such node is left alone: it is captured whole. An allocation of
uninitialized memory (`empty`, `new_empty`, `empty_like`, ...) belongs to the piece that
fills it: it moves right before its first user, and goes inline with it when that user
stays inline (dropout2d's `new_empty` feeds `bernoulli`, rrelu's `empty_like` its noise).
The form people write a collective in, `out = torch.empty_like(x);
dist.all_to_all_single(out, x)`, traces to `empty_like`, the collective and a `copy` into
the buffer after it: the buffer goes to the piece of the copy, not the piece before the
collective, which would otherwise hand out memory no two runs agree on (its verification
would fail, `eager_nondeterministic`). One the graph returns unwritten (its caller fills
it: a collective after a graph break) stays inline (`unwritten_buffer`): made at each call
as eager makes it, never a pool copy of nothing.

Before::

    mm = aten.mm.default(x, w)
    item = aten._local_scalar_dense.default(s)
    mul = aten.mul.Tensor(mm, item)

After::

    piece_0 = gd_piece_0(x, w);  mm = piece_0[0]
    item = aten._local_scalar_dense.default(s)
    piece_1 = gd_piece_1(mm, item);  mul = piece_1[0]
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
import torch.fx as fx

from graphdispatch_backend.artifacts.fingerprint import op_key
from graphdispatch_backend.capture.lower import InputOrigin
from graphdispatch_backend.errors import SplitReason
from graphdispatch_backend.passes.context import PassContext, PieceInfo
from graphdispatch_backend.passes.functional_writes import made_buffer
from graphdispatch_backend.passes.lift_scalars import SCALAR_INPUT_META
from graphdispatch_backend.passes.locate_writes import plan_writes
from graphdispatch_backend.passes.ops import (
    allocates_uninitialized,
    captured_collective,
    draws_random,
    is_collective,
    is_effectful,
    nbytes,
    on_the_host_on_a_gpu,
    sized_by_arguments,
    storage_readers,
    unwritten_outputs,
    written_inputs,
)
from graphdispatch_backend.passes.subgraph import boundary, extract, replace_with_call

# made buffers a piece may return: below this, a counter or a mask, whose copy costs nothing
MADE_BUFFER_BYTES = 1 << 20

_SCHEMA_REASONS = {
    "aten::_local_scalar_dense": SplitReason.SCALAR_READ,
    "aten::_assert_scalar": SplitReason.ASSERT_SCALAR,
    "aten::_assert_async": SplitReason.ASSERT_SCALAR,
}


def split_reason(node: fx.Node, graph_device: str) -> SplitReason | None:
    """Why this node must stay outside a captured piece, or None."""
    if node.op != "call_function":
        return None
    if node.meta.get("gd_capturable") is False:
        return SplitReason.ARTIFACT_NOT_CAPTURABLE
    if node.meta.get(SCALAR_INPUT_META):
        return SplitReason.SCALAR_INPUT
    if is_effectful(node):
        return SplitReason.EFFECTFUL_OP
    if is_collective(node) and not captured_collective(node, graph_device):
        return SplitReason.COLLECTIVE
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.name in _SCHEMA_REASONS:
        return _SCHEMA_REASONS[schema.name]
    tags = getattr(node.target, "tags", ())
    if torch.Tag.cudagraph_unsafe in tags:
        return SplitReason.CUDAGRAPH_UNSAFE_TAG
    if torch.Tag.dynamic_output_shape in tags and not sized_by_arguments(schema.name, node.args, node.kwargs):
        return SplitReason.DYNAMIC_OUTPUT_SHAPE
    if draws_random(node):
        return SplitReason.RANDOM_OP
    # A tensor on another device, produced or read here: a CPU scalar would be baked into
    # the capture as a kernel argument and go stale on replay.
    for value in [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]:
        if isinstance(value, torch.Tensor) and value.device.type != graph_device:
            return SplitReason.FOREIGN_DEVICE
    return None


def inline_nodes(gm: fx.GraphModule, graph_device: str) -> dict[fx.Node, SplitReason]:
    """The nodes that stay outside captured pieces, with why (an output of one, too)."""
    reasons: dict[fx.Node, SplitReason] = {}
    for node in gm.graph.nodes:
        reason = split_reason(node, graph_device)
        if reason is None and graph_device == "cpu" and on_the_host_on_a_gpu(node):
            # the CPU model of a GPU's capture: there `x[mask] = 0` reads a CPU tensor (ops.py
            # fills_by_mask_from_host), split out as any; not a rule of fused segments on a CPU
            reason = SplitReason.FOREIGN_DEVICE
        if reason is None and node.target is operator.getitem:
            src = node.args[0]
            reason = reasons.get(src) if isinstance(src, fx.Node) else None
        if reason is not None:
            reasons[node] = reason
    return reasons


def _returned_unwritten(gm: fx.GraphModule, reasons: dict[fx.Node, SplitReason]) -> None:
    """Uninitialized allocations the graph only returns: inline, made at each call (module
    docstring)."""
    output = gm.graph.output_node()
    for node in gm.graph.nodes:
        if node not in reasons and allocates_uninitialized(node) and set(node.users) == {output}:
            reasons[node] = SplitReason.UNWRITTEN_BUFFER


def _place_allocations(gm: fx.GraphModule, reasons: dict[fx.Node, SplitReason]) -> set[fx.Node]:
    """Each uninitialized allocation moved right before its first user, so it belongs to the
    piece that fills it, and inline with that user when it stays inline (see module
    docstring); returns those inline ones (companions: not counted). Their arguments (sizes,
    a template tensor) are all defined earlier, so the move keeps the graph valid."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    companions = set()
    for node in list(gm.graph.nodes):
        if node in reasons or not node.users or not allocates_uninitialized(node):
            continue
        first = min(node.users, key=order.__getitem__)
        first.prepend(node)
        if first in reasons:
            reasons[node] = reasons[first]
            companions.add(node)
    return companions


def _is_work(node: fx.Node) -> bool:
    """Pieces made only of views, getitems and symbolic-int arithmetic (`sym_size`,
    `operator.ge` on sizes) launch no kernel: they are not worth a graph."""
    if node.target is operator.getitem:
        return False
    if getattr(getattr(node.target, "_schema", None), "is_view", False) or getattr(node.target, "is_view", False):
        return False
    return _has_tensor(node.meta.get("val"))


def _has_tensor(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(_has_tensor(v) for v in value)


def split_pieces(gm: fx.GraphModule, ctx: PassContext) -> None:
    spec = ctx.pieces_spec
    if spec is None:
        return
    reasons = inline_nodes(gm, spec.graph_device)
    _returned_unwritten(gm, reasons)
    companions = _place_allocations(gm, reasons) if reasons else set()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]  # in the order the moves left
    placeholders = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    if not reasons:
        made = _made_buffers(gm.graph.output_node().all_input_nodes) if spec.made_buffers_eager else []
        if made:  # the whole graph: it runs eager (module docstring)
            ctx.split_reasons[SplitReason.MADE_BUFFER] = len(made)
            ctx.pieces = [PieceInfo(0, False, len(calls), {SplitReason.MADE_BUFFER.value: len(made)}, _ops(calls))]
            return
        origins = tuple(_origin(ctx, placeholders, n) for n in placeholders)
        ctx.pieces = [PieceInfo(0, True, len(calls), {}, _ops(calls), origins, tuple(sorted(written_inputs(gm))),
                                tuple(sorted(storage_readers(gm))), any(is_collective(n) for n in calls),
                                plan_writes(gm), unwritten_outputs(gm))]
        return
    runs: list[tuple[bool, list[fx.Node]]] = []
    for node in calls:
        capturable = node not in reasons
        if runs and runs[-1][0] == capturable:
            runs[-1][1].append(node)
        else:
            runs.append((capturable, [node]))
    counted = [n for n in reasons if n.target is not operator.getitem and n not in companions]
    for node in counted:  # a multi-output op counts once, not per output; a companion not at all
        ctx.split_reasons[reasons[node]] = ctx.split_reasons.get(reasons[node], 0) + 1
    pieces: list[PieceInfo] = []
    for capturable, nodes in runs:
        info = PieceInfo(len(pieces), capturable, len(nodes), ops=_ops(nodes))
        if not capturable:
            info.reasons = dict(Counter(reasons[n].value for n in nodes
                                        if n.target is not operator.getitem and n not in companions))
            pieces.append(info)
            continue
        if not any(_is_work(n) for n in nodes):
            continue  # left inline, uncounted: no work to capture
        inputs, outputs = boundary(nodes)
        if not outputs:
            continue
        made = _made_buffers(outputs) if spec.made_buffers_eager else []
        if made:
            info.capturable, info.reasons = False, {SplitReason.MADE_BUFFER.value: len(made)}
            ctx.split_reasons[SplitReason.MADE_BUFFER] = ctx.split_reasons.get(SplitReason.MADE_BUFFER, 0) + len(made)
            pieces.append(info)
            continue
        info.input_origins = tuple(_origin(ctx, placeholders, n) for n in inputs)
        piece_gm = extract(nodes, inputs, outputs)
        info.mutated = tuple(sorted(written_inputs(piece_gm)))
        info.write_plan = plan_writes(piece_gm)
        info.wide = tuple(sorted(storage_readers(piece_gm)))
        info.collectives = any(is_collective(n) for n in nodes)
        info.unwritten = unwritten_outputs(piece_gm)
        target = spec.make_piece(piece_gm, info)
        replace_with_call(gm, nodes, inputs, outputs, target, {"gd_piece": info.index})
        pieces.append(info)
    ctx.pieces = pieces


def _made_buffers(outputs: list[fx.Node]) -> list[fx.Node]:
    """The buffers among `outputs` the graph makes and writes less than half of (a cache and
    its new rows; passes/functional_writes.py `made_buffer`), when they hold
    MADE_BUFFER_BYTES or more in all; else none. A buffer assembled in place from values
    that cover it (a video decoded tile by tile into `zeros`) is a computed output."""
    made: dict[fx.Node, int] = {}
    for out in outputs:
        found = made_buffer(out)
        if found is not None:
            root, values = found
            made[root] = nbytes(root) if 2 * sum(nbytes(v) for v in values) < nbytes(root) else 0
    return [root for root, size in made.items() if size] if sum(made.values()) >= MADE_BUFFER_BYTES else []


def _origin(ctx: PassContext, placeholders: dict[fx.Node, int], node: fx.Node) -> InputOrigin | None:
    index = placeholders.get(node)
    return ctx.input_origins[index] if index is not None and index < len(ctx.input_origins) else None


def _ops(nodes: list[fx.Node], limit: int = 6) -> list[str]:
    return [op_key(n.target) for n in nodes[:limit]] + (["..."] if len(nodes) > limit else [])
