"""What a node's op is, read from its schema (shared by tag_regions and split_pieces)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import optimization_hint


def _argument(node: fx.Node, name: str) -> Any:
    """The value a call node passes for schema argument `name` (positional or keyword),
    the schema default if it passes none, or None if the op has no such argument."""
    schema = node.target._schema
    for index, arg in enumerate(schema.arguments):
        if arg.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            if index < len(node.args):
                return node.args[index]
            return arg.default_value if arg.has_default_value() else None
    return None


_UNINITIALIZED = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                            "aten::new_empty_strided", "aten::empty_permuted"})


def nbytes(node: fx.Node) -> int:
    """Bytes of a node's tensor value; a symbolic size counts at its hint (0 without one)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    return optimization_hint(val.numel(), fallback=0) * val.element_size()


def allocates_uninitialized(node: fx.Node) -> bool:
    """`empty` and its kin: memory whose values no two runs agree on."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.name in _UNINITIALIZED


def unwritten_outputs(gm: fx.GraphModule) -> tuple[int, ...]:
    """Positions of the outputs that are memory the graph made uninitialized (`empty`,
    `empty_like`, `new_empty`, ...; through views) and that no node of the graph writes:
    the values no two runs agree on, which the caller fills (a collective after a graph
    break, an `out=` write). Their metadata is the graph's; their values are nobody's.
    In a Dynamo graph (torch-level calls) an allocation counts only when the output is
    its one use: a call that takes it may write it."""
    output = gm.graph.output_node()
    outs = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
    written = {alias_root(w) for node in gm.graph.nodes for w in writes(node)}
    found = []
    for i, out in enumerate(outs):
        if not isinstance(out, fx.Node):
            continue
        root = alias_root(out)
        if (allocates_uninitialized(root) and root not in written) or (
                torch_allocation(out) and set(out.users) == {output}):
            found.append(i)
    return tuple(found)


def op_label(node: fx.Node) -> str:
    """How a report names a node's op: `aten::mul`, `mylib::noisy` (a schema's name), or a
    Dynamo graph's `torch.empty_like` and `Tensor.add_`."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.name
    if isinstance(node.target, torch._ops.OpOverloadPacket):  # a Dynamo graph's `torch.ops.ns.op`
        return node.target._qualified_op_name
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        return str(node.target)
    module = getattr(node.target, "__module__", None) or ""
    name = getattr(node.target, "__name__", None) or str(node.target)
    return f"{'torch' if module.startswith('torch') else module.lstrip('_')}.{name}".lstrip(".")


_TORCH_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                                "new_empty_strided"})


def torch_allocation(node: fx.Node) -> bool:
    """A Dynamo graph's `torch.empty_like(x)` or `x.new_empty(...)`."""
    if node.op == "call_method":
        return node.target in _TORCH_ALLOCATIONS
    if node.op != "call_function" or getattr(node.target, "_schema", None) is not None:
        return False
    return getattr(node.target, "__module__", None) in ("torch", "torch._C._VariableFunctions") and \
        getattr(node.target, "__name__", None) in _TORCH_ALLOCATIONS


def draws_random(node: fx.Node) -> bool:
    """True if the node consumes the RNG. Ops tagged `nondeterministic_seeded` for an
    optional dropout (attention, dropout with train=False or p=0) do not when it is off."""
    tags = getattr(node.target, "tags", ())
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in tags:
        return False
    names = {a.name for a in node.target._schema.arguments}
    if "dropout_p" in names:
        return _argument(node, "dropout_p") not in (0, 0.0, None)
    if {"p", "train"} <= names:
        train = _argument(node, "train")  # native_dropout's `bool? train`: None means training
        return (train is None or bool(train)) and _argument(node, "p") not in (0, 0.0)
    return True


def is_effectful(node: fx.Node) -> bool:
    """A `with_effects` call: an op whose side effect (a linalg error check that raises on a
    singular input, a print) must happen on every call, in order, threaded by a token."""
    return node.op == "call_function" and node.target is torch.ops.higher_order.with_effects


def effect_tokens(gm: fx.GraphModule) -> set[int]:
    """Placeholder positions that carry effect tokens. aot traces a token as an empty
    tensor but passes None for it at run time."""
    return {i for i, ph in enumerate(gm.graph.find_nodes(op="placeholder"))
            if ph.users and all(is_effectful(u) and u.args and u.args[0] is ph for u in ph.users)}


# Ops whose eager kernels may give different bits on the same inputs (atomics, unordered
# accumulation): the suspects named when eager disagrees with itself.
_NONDETERMINISTIC = {
    "aten::index_add", "aten::index_add_", "aten::scatter_add", "aten::scatter_add_", "aten::scatter_reduce",
    "aten::scatter_reduce_", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_", "aten::put",
    "aten::put_", "aten::index_reduce", "aten::index_reduce_", "aten::embedding_bag", "aten::_embedding_bag",
    "aten::embedding_dense_backward", "aten::bincount", "aten::histc", "aten::cumsum", "aten::kthvalue",
    "aten::median", "aten::nanmedian", "aten::mode", "aten::_segment_reduce",
}


def nondeterministic_suspects(gm: fx.GraphModule) -> list[str]:
    """Ops of `gm` that may make eager disagree with itself: known atomics-based aten ops,
    and every op outside aten (custom kernels), by schema name, first seen first."""
    return nondeterministic_ops(gm.graph.nodes)


def nondeterministic_ops(nodes: Iterable[fx.Node]) -> list[str]:
    """nondeterministic_suspects of these nodes (a graph's, or the ones an output depends on)."""
    seen: dict[str, None] = {}
    for node in nodes:
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        name = schema.name if schema is not None else None
        if isinstance(node.target, torch._ops.OpOverloadPacket):  # a Dynamo graph's `torch.ops.ns.op`
            name = node.target._qualified_op_name
        if name is not None and (name in _NONDETERMINISTIC or not name.startswith(("aten::", "prims::"))):
            seen.setdefault(name)
    return list(seen)


WRITES_META = "gd_writes"  # a substituted region's call: the positions of the arguments it writes


def writes(node: fx.Node) -> list[fx.Node]:
    """The nodes a call writes into (schema arguments marked `(a!)`; for an artifact's call,
    the region inputs its manifest says it mutates)."""
    if WRITES_META in node.meta:
        return [node.args[i] for i in node.meta[WRITES_META] if isinstance(node.args[i], fx.Node)]
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    written = []
    for index, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.kwargs.get(arg.name, node.args[index] if index < len(node.args) else None)
            written += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node)]
    return written


def is_view(node: fx.Node) -> bool:
    """A call whose result is a view of its first argument (`slice`, `select`, `view`, ...)."""
    return node.op == "call_function" and bool(getattr(node.target, "is_view", False))


def _returns_self(node: fx.Node) -> bool:
    """An in-place call (`index_copy_`, `copy_`, ...): its result is its written first argument."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.returns or not schema.arguments:
        return False
    first, ret = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and first.is_write and ret is not None and ret.is_write


def alias_root(node: fx.Node) -> fx.Node:
    """The node whose memory `node` is: through views and the results of in-place writes."""
    while (is_view(node) or _returns_self(node)) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def written_inputs(gm: fx.GraphModule) -> set[int]:
    """Placeholder positions the graph writes into, directly (aot's in-graph `copy_` of a
    mutated input, kept with keep_inference_input_mutations) or through a view (a write
    made in place by passes/reinplace.py: `index_copy_(select(cache, 0, 1), ...)`)."""
    position = {ph: i for i, ph in enumerate(gm.graph.find_nodes(op="placeholder"))}
    return {position[root] for node in gm.graph.nodes for n in writes(node)
            if (root := alias_root(n)) in position}


_STORAGE_READERS = {"aten::as_strided", "aten::as_strided_copy", "aten::as_strided_scatter", "aten::set_"}


def storage_readers(gm: fx.GraphModule) -> set[int]:
    """Placeholder positions read through `as_strided` (directly or through views), which
    may reach outside the view's own extent into the rest of its storage."""
    found = set()
    for i, ph in enumerate(gm.graph.find_nodes(op="placeholder")):
        frontier, seen = [ph], set()
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if user in seen or user.op != "call_function":
                    continue
                seen.add(user)
                schema = getattr(user.target, "_schema", None)
                if schema is not None and schema.name in _STORAGE_READERS:
                    found.add(i)
                elif schema is not None and is_view(user):
                    frontier.append(user)
    return found


def is_collective(node: fx.Node) -> bool:
    """A c10d functional collective (all_reduce, all_gather_into_tensor, ..., wait_tensor)."""
    return node.op == "call_function" and getattr(node.target, "namespace", None) in (
        "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def _group_name(node: fx.Node) -> str | None:
    """The process group (by name) a collective node runs on; a `wait_tensor`'s is its
    collective's."""
    for _ in range(8):  # wait_tensor(all_reduce(...)): one step back, a few at most
        if not is_collective(node):
            return None
        value = _argument(node, "group_name")
        if isinstance(value, str):
            return value
        if not node.args or not isinstance(node.args[0], fx.Node):
            return None
        node = node.args[0]
    return None


def collective_groups(gm: fx.GraphModule) -> list[str]:
    """The process groups (by name) the graph's collectives run on, sorted."""
    return sorted({name for node in gm.graph.nodes if is_collective(node) and (name := _group_name(node))})


# Process-group backends whose collectives a CUDA graph holds: ProcessGroupNCCL enqueues no
# watchdog work while the stream captures (`collective()` in
# torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: `enqueue = ... && capture_status ==
# CaptureStatus::None`), and torch's test/distributed/test_c10d_nccl.py
# (`test_allreduce_in_cudagraph`) captures an all-reduce and replays it; vLLM captures its
# all-reduce the same way (pynccl on the capture stream, vllm/distributed/device_communicators/
# pynccl.py). gloo runs on the host: nothing a CUDA graph could record.
CAPTURABLE_BACKENDS = frozenset({"nccl"})


def group_backend(group_name: str, device_type: str) -> str | None:
    """The name of the backend (`gloo`, `nccl`, ...) that process group `group_name` runs a
    collective on `device_type` tensors with; None when it cannot be told (not
    initialized, an unknown group)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        backend = _resolve_process_group(group_name)._get_backend(torch.device(device_type))
        return str(backend.name()).lower()
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return None


def captured_collective(node: fx.Node, device_type: str) -> bool:
    """A collective a CUDA graph holds: its group runs it with a backend of
    CAPTURABLE_BACKENDS on the graph's device type. Decided by the group, not the device,
    so the CPU model (`cuda_graphs="emulate"`) splits and captures as a GPU would."""
    name = _group_name(node)
    return name is not None and group_backend(name, device_type) in CAPTURABLE_BACKENDS


_UNKNOWN = object()  # a node without a recorded value
_SIZED_BY_ARGUMENTS = {"aten::index", "aten::repeat_interleave", "aten::one_hot"}


def sized_by_arguments(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    """An op tagged `dynamic_output_shape` whose output size follows from its arguments:
    `index` by integer indices (an MoE's `weights[expert_ids]`), `repeat_interleave` given
    its `output_size`, `one_hot` given its number of classes. A CUDA capture holds these
    (no host sync); it refuses the rest. `args` may hold tensors, or FX nodes (their
    `meta["val"]` is read)."""
    if name not in _SIZED_BY_ARGUMENTS:
        return False
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val", _UNKNOWN), (args, kwargs))
    if name == "aten::index":
        return not indexes_by_mask(args[1] if len(args) > 1 else kwargs.get("indices"))
    if name == "aten::one_hot":
        classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return classes != -1
    return kwargs.get("output_size") is not None


def indexes_by_mask(indices: Any) -> bool:
    """Boolean (or byte) masks among an `index`/`index_put` call's indices: their
    selection's size is known only after it ran (an index not known here counts as one)."""
    leaves = [i for i in pytree.tree_leaves(indices) if i is not None]
    return any(not isinstance(i, torch.Tensor) or i.dtype in (torch.bool, torch.uint8) for i in leaves)


_INDEX_PUTS = frozenset({"aten::index_put", "aten::index_put_"})


def fills_by_mask_from_host(node: fx.Node) -> bool:
    """`x[mask] = 0` as aot traces it: `index_put` by one boolean mask, matching `x`'s sizes
    where it stands, of a one-element constant of the module (aot's `lift_fresh_copy` of
    it), not accumulating. On a CUDA tensor PyTorch makes such a value on the CPU, and
    CUDA's `index_put_` then runs it as `masked_fill_` (ATen's canDispatchToMaskedFill: a
    one-element CPU value, one mask of the indexed sizes): no host sync, where an
    `index_put` by a mask otherwise reads the mask's count back to the host."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or schema.name not in _INDEX_PUTS or _argument(
            node, "accumulate"):
        return False
    indices, value = _argument(node, "indices"), _argument(node, "values")
    masks = [(at, i) for at, i in enumerate(indices or ()) if i is not None]
    if len(masks) != 1 or not isinstance(masks[0][1], fx.Node) or not _one_element_constant(value):
        return False
    at, mask = masks[0]
    target, selector = _argument(node, "self"), mask.meta.get("val")
    target = target.meta.get("val") if isinstance(target, fx.Node) else None
    if not isinstance(target, torch.Tensor) or not isinstance(selector, torch.Tensor):
        return False
    return selector.dtype in (torch.bool, torch.uint8) and tuple(selector.shape) == tuple(
        target.shape[at:at + selector.dim()])


def on_the_host_on_a_gpu(node: fx.Node) -> bool:
    """What a GPU graph of `x[mask] = 0` holds on the host: the fill (`fills_by_mask_from_host`),
    and aot's copy of its constant where only such fills read it."""
    if fills_by_mask_from_host(node):
        return True
    return node.target is torch.ops.aten.lift_fresh_copy.default and bool(node.users) and all(
        fills_by_mask_from_host(user) and _argument(user, "values") is node for user in node.users)


def _one_element_constant(node: Any) -> bool:
    if isinstance(node, fx.Node) and node.target is torch.ops.aten.lift_fresh_copy.default:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr" or node.graph.owning_module is None:
        return False
    value = getattr(node.graph.owning_module, str(node.target), None)
    return isinstance(value, torch.Tensor) and value.numel() == 1
