"""Region fingerprints: a canonical, name-free and value-free hash of a subgraph.

The hash covers op schemas (`aten::addmm.default`, never `str(OpOverload)`, which differs
between builds), the wiring between nodes (by position, not by name), constant arguments,
and the boundary's shape/stride/dtype/device type. It never covers module names, node
names or tensor values, so the 48 blocks of a stack share one fingerprint, and the same
region has the same fingerprint in every process.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.region import TensorSpec


def op_key(target: Any) -> str:
    """A build-independent name for a call target."""
    if isinstance(target, str):
        # a call_method target is the method's name (Dynamo graphs: `x.reshape(...)`); without
        # this every method call hashed alike as "str", so relu() and sigmoid() collided
        return f"Tensor.{target}"
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return f"{schema.name}.{schema.overload_name or 'default'}"
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop::{target.name()}"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return f"{module}.{name}" if name else type(target).__qualname__


def _constant(value: Any, refs: dict[fx.Node, Any]) -> Any:
    if isinstance(value, fx.Node):
        return refs.get(value, {"external": True})
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        # repr keeps -0.0, inf and nan apart; json cannot encode the last two as numbers
        return {"f": repr(value) if math.isfinite(value) else str(value)}
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return {"t": str(value)}
    if isinstance(value, (list, tuple)):
        return [_constant(v, refs) for v in value]
    if isinstance(value, dict):
        return {str(k): _constant(v, refs) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, slice):
        return {"slice": [_constant(v, refs) for v in (value.start, value.stop, value.step)]}
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return {"sym": type(value).__name__}
    return {"type": type(value).__qualname__}  # value-free on purpose


def node_key(node: fx.Node) -> str:
    """op_key of a node; a call_module node is keyed by its module's class, because its
    target is the module's (name-bearing) path."""
    if node.op == "call_module":
        owner = node.graph.owning_module
        try:
            module = owner.get_submodule(node.target) if owner is not None else None
        except AttributeError:
            module = None
        return f"module::{type(module).__qualname__}" if module is not None else "module::?"
    return op_key(node.target)


def _spec(spec: TensorSpec | None) -> Any:
    if spec is None:
        return None
    return [list(spec.shape), list(spec.stride), spec.dtype, spec.device_type]


def fingerprint(
    nodes: Sequence[fx.Node],
    inputs: Sequence[fx.Node],
    outputs: Sequence[fx.Node],
    input_specs: Sequence[TensorSpec | None],
    output_specs: Sequence[TensorSpec | None],
) -> str:
    """32 hex characters of the sha256 of the region's canonical form."""
    refs: dict[fx.Node, Any] = {n: {"i": k} for k, n in enumerate(inputs)}
    body = []
    for idx, node in enumerate(nodes):
        refs[node] = {"n": idx}
    for node in nodes:
        body.append(
            [
                node.op,
                node_key(node),
                _constant(list(node.args), refs),
                _constant(dict(node.kwargs), refs),
            ]
        )
    canonical = {
        "nodes": body,
        "inputs": [_spec(s) for s in input_specs],
        "outputs": [_spec(s) for s in output_specs],
        "returns": [refs[o] for o in outputs],
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]
