"""Lower a Dynamo FX graph to an ATen inference graph with aot_module_simplified.

Lowering runs inside the replayed autocast state (`AutocastState.replay`), so a lowering
that happens later, or on another thread, traces the dtypes the user's call had.

Why aot and not `torch.export(...).run_decompositions()`: on torch 2.13 the export route
decomposes scaled_dot_product_attention into math ops (not bitwise equal to eager on
diffusers' LTX transformer) and fails on transformers' GPT-2 (`view` of a non-contiguous
tensor); the aot route is bitwise equal on both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._functorch.aot_autograd import aot_module_simplified

from graphdispatch_backend.capture.autocast import AutocastState
from graphdispatch_backend.capture.interpolate import keep_eager_interpolation
from graphdispatch_backend.capture.names import access_name, resolve_graph_names

Compiler = Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[..., Any]]

STATE_KINDS = ("parameter", "buffer")


@dataclasses.dataclass(frozen=True)
class InputOrigin:
    """Where one flat input of the lowered graph comes from.

    kind: parameter | buffer (module state, named by path as manifests name them), input
    (a call argument, or a plain tensor attribute such as a cached table: `self.freqs`), or
    symbol (a SymInt/SymFloat Dynamo passes for a dynamic size).
    name: the clean dotted path for module state (`blocks.0.ff.net.0.weight`), the
    access path for inputs (`x`, `inputs.0`, `self.freqs`).
    """

    kind: str
    name: str

    @property
    def is_state(self) -> bool:
        return self.kind in STATE_KINDS


def input_origins(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[InputOrigin, ...]:
    """Origins of aot's flat inputs: the Dynamo graph's own parameters and buffers
    (which aot lifts first), then the Dynamo graph's placeholders in order.

    Module state is named as the compiled root module's named_modules() spells it, and the
    graph's nn_module_stack is rewritten to those names in place (capture/names.py): call
    this before lowering, so regions and parameters share one spelling."""
    to_source = getattr(gm, "_param_name_to_source", None) or {}
    fqn = gm.meta.get("dynamo_flat_name_to_original_fqn", {})
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    sources = [_source_of(node) for node in placeholders]
    paths = [s.name for s in to_source.values()] + [s.name for s in sources if s is not None]
    names = resolve_graph_names(gm, paths)
    origins: list[InputOrigin] = []
    for name, _ in list(gm.named_parameters(remove_duplicate=False)):
        origins.append(_state_origin(name, to_source, fqn, "parameter", names))
    for name, _ in list(gm.named_buffers(remove_duplicate=False)):
        origins.append(_state_origin(name, to_source, fqn, "buffer", names))
    for pos, (node, source) in enumerate(zip(placeholders, sources)):
        example = example_inputs[pos] if pos < len(example_inputs) else node.meta.get("example_value")
        origins.append(_placeholder_origin(node.name, source, example, names))
    return tuple(origins)


def _source_of(node: torch.fx.Node) -> Any:
    source = getattr(node, "_dynamo_source", None)
    if source is None and "grapharg" in node.meta:
        source = node.meta["grapharg"].source
    return source


def _state_origin(name: str, to_source: dict, fqn: dict, kind: str, names: dict[str, tuple[str, str]]) -> InputOrigin:
    if name in to_source:
        path, found = names[to_source[name].name]
        return InputOrigin(found if found in STATE_KINDS else kind, path)
    return InputOrigin(kind, fqn.get(name, name))


def _placeholder_origin(node_name: str, source: Any, example: Any, names: dict[str, tuple[str, str]]) -> InputOrigin:
    if isinstance(example, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return InputOrigin("symbol", (access_name(source.name) or source.name) if source is not None else node_name)
    if source is None:
        return InputOrigin("input", node_name)
    path, kind = names[source.name]
    if kind in ("parameter", "buffer"):
        return InputOrigin(kind, path)
    if isinstance(example, torch.nn.Parameter):
        return InputOrigin("parameter", path)
    return InputOrigin("input", access_name(source.name) or node_name)


def lower(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    autocast: AutocastState,
    *,
    inference_compiler: Compiler,
    forward_compiler: Compiler,
    backward_compiler: Compiler,
) -> Callable[..., Any]:
    """aot_module_simplified inside the replayed autocast state.

    aot calls `inference_compiler` for graphs that need no autograd, and the forward and
    backward compilers (partitioned joint graph) for training graphs. Inputs an inference
    graph writes into stay written in the graph (`copy_`, keep_inference_input_mutations,
    as Inductor lowers): a captured graph then updates a KV cache in place, instead of
    returning the whole cache for a copy back. An inference graph's interpolations keep
    eager's kernels (capture/interpolate.py).
    """
    with autocast.replay():
        return aot_module_simplified(
            keep_eager_interpolation(gm),  # eager's upsampling kernels, not their decompositions
            example_inputs,
            fw_compiler=forward_compiler,
            bw_compiler=backward_compiler,
            inference_compiler=inference_compiler,
            keep_inference_input_mutations=True,
        )


@dataclasses.dataclass(frozen=True)
class FlatInputs:
    """aot's inputs where a tensor subclass (a DTensor) among the user's is flattened into
    its inner inputs (its local tensor, its mesh's opaque object): per flat input, the user
    input (aot's order: lifted state, then the Dynamo graph's placeholders) it is or belongs
    to (`owner`; None: one of aot's own, an effect token), and which flat inputs are a user
    input whole (`whole`)."""

    owner: tuple[int | None, ...]
    whole: dict[int, int]  # flat position -> user position

    def origins(self, origins: Sequence[InputOrigin]) -> tuple[InputOrigin | None, ...]:
        """`origins` in the flat numbering: a subclass's inner inputs carry its origin."""
        return tuple(None if u is None or u >= len(origins) else origins[u] for u in self.owner)


def outer_positions(flat: FlatInputs | None, positions: Sequence[int]) -> tuple[list[int], bool]:
    """Positions among aot's inputs (what the graph writes, what artifacts read) as the
    user's, which the checks around the lowered graph index (lifted state, then the call's
    arguments), and whether each is a user input whole (not inside a tensor subclass)."""
    if flat is None:
        return list(positions), True
    return [flat.whole[p] for p in positions if p in flat.whole], all(p in flat.whole for p in positions)


def flat_inputs(gm: torch.fx.GraphModule) -> FlatInputs | None:
    """How the aot graph `gm`'s inputs map onto the user's, from the descriptor aot puts on
    each placeholder (a subclass's inner input, `SubclassGetAttrAOTInput`, has its user
    input as `base`); None where no subclass is flattened (one to one, as ever). The user
    inputs come in order, each as one flat input or as its subclass's consecutive ones;
    aot's own (an effect token, a seed) belong to none."""
    from torch._functorch._aot_autograd.descriptors import BufferAOTInput, ParamAOTInput, PlainAOTInput

    descs = [node.meta.get("desc") for node in gm.graph.find_nodes(op="placeholder")]
    if not any(hasattr(d, "base") for d in descs):
        return None
    owner: list[int | None] = []
    whole: dict[int, int] = {}
    users, last = -1, None
    for k, desc in enumerate(descs):
        root = desc
        while hasattr(root, "base"):
            root = root.base
        if not isinstance(root, (PlainAOTInput, ParamAOTInput, BufferAOTInput)):
            owner.append(None)
            continue
        if root is not last and root != last:
            users, last = users + 1, root
        owner.append(users)
        if root is desc:
            whole[k] = users
    return FlatInputs(tuple(owner), whole)


def mutated_inputs() -> list[int] | None:
    """Inside an aot compiler: the inputs (aot positions) the graph writes into, from aot's
    metadata; None when the graph cannot be checked against eager (an input's metadata is
    mutated, or aot did not say)."""
    tracing = torch._guards.TracingContext.try_get()
    meta = getattr(tracing, "fw_metadata", None) if tracing is not None else None
    if meta is None or any(info.mutates_metadata for info in meta.input_info):
        return None
    return [i for i, info in enumerate(meta.input_info) if info.mutates_data]
