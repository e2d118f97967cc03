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
from graphdispatch_backend.capture.names import clean_path, root_name

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
    (which aot lifts first), then the Dynamo graph's placeholders in order."""
    origins: list[InputOrigin] = []
    to_source = getattr(gm, "_param_name_to_source", None) or {}
    fqn = gm.meta.get("dynamo_flat_name_to_original_fqn", {})
    for name, _ in list(gm.named_parameters(remove_duplicate=False)):
        origins.append(_state_origin(name, to_source, fqn, "parameter"))
    for name, _ in list(gm.named_buffers(remove_duplicate=False)):
        origins.append(_state_origin(name, to_source, fqn, "buffer"))
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for pos, node in enumerate(placeholders):
        example = example_inputs[pos] if pos < len(example_inputs) else node.meta.get("example_value")
        source = getattr(node, "_dynamo_source", None)
        if source is None and "grapharg" in node.meta:
            source = node.meta["grapharg"].source
        origins.append(_placeholder_origin(node.name, source, example))
    return tuple(origins)


def _state_origin(name: str, to_source: dict, fqn: dict, kind: str) -> InputOrigin:
    if name in to_source:
        path, found = clean_path(to_source[name].name)
        return InputOrigin(found if found in STATE_KINDS else kind, path)
    return InputOrigin(kind, fqn.get(name, name))


def _placeholder_origin(node_name: str, source: Any, example: Any) -> InputOrigin:
    if isinstance(example, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return InputOrigin("symbol", source.name if source is not None else node_name)
    if source is None:
        return InputOrigin("input", node_name)
    text = source.name
    path, kind = clean_path(text)
    if kind in ("parameter", "buffer"):
        return InputOrigin(kind, path)
    if isinstance(example, torch.nn.Parameter):
        return InputOrigin("parameter", path)
    root = root_name(text) or node_name
    return InputOrigin("input", f"{root}.{path}" if path else root)


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
    returning the whole cache for a copy back.
    """
    with autocast.replay():
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=forward_compiler,
            bw_compiler=backward_compiler,
            inference_compiler=inference_compiler,
            keep_inference_input_mutations=True,
        )
