"""The Region record: what `tag_regions` finds, what matching reads and `substitute` rewrites.

A region is the set of ATen nodes whose `nn_module_stack` contains one module instance
(docs/design.md section 4). Its boundary (inputs in first-use order, outputs in node
order) and their tensor metadata are what an artifact author writes a manifest against.
Under dynamic shapes a region also takes size symbols (`size<k>`, SymInts computed from
the graph's input sizes): the native region needs them, a kernel never sees them, so the
report lists them apart (`sizes`, each with its expression over the tensor inputs' dims)
and a manifest names tensor inputs only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

SCALAR_KINDS = ("symint", "symfloat", "symbool")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dim(value: Any) -> int | None:
    """A concrete size, or None for a symbolic one (shown as `null` in reports)."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        return value.node.maybe_as_int()
    return None


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Metadata of one boundary value. Symbolic scalars have dtype symint/symfloat/symbool
    and shape ()."""

    shape: tuple[int | None, ...]
    stride: tuple[int | None, ...]
    dtype: str
    device: str

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    @property
    def is_scalar(self) -> bool:
        return self.dtype in SCALAR_KINDS

    @classmethod
    def of(cls, value: Any) -> TensorSpec | None:
        """From a node's `meta["val"]` (fake tensor or symbolic scalar); None if neither."""
        if isinstance(value, torch.Tensor):
            return cls(
                tuple(_dim(s) for s in value.shape),
                tuple(_dim(s) for s in value.stride()),
                dtype_name(value.dtype),
                str(value.device),
            )
        for kind, types in (("symbool", (bool, torch.SymBool)), ("symint", (int, torch.SymInt)),
                            ("symfloat", (float, torch.SymFloat))):
            if isinstance(value, types):
                return cls((), (), kind, "cpu")
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "stride": list(self.stride),
            "dtype": self.dtype,
            "device": self.device,
        }


@dataclasses.dataclass
class Region:
    """One module instance's nodes in a lowered graph, with its boundary."""

    name: str  # `blocks.0.ff`, or `blocks.0.ff#1` for the module's second call
    module: str  # the clean module name, as named_modules() spells it
    instance: int
    cls: str
    nodes: list[fx.Node] = dataclasses.field(default_factory=list)
    inputs: list[fx.Node] = dataclasses.field(default_factory=list)
    input_names: list[str] = dataclasses.field(default_factory=list)
    input_specs: list[TensorSpec | None] = dataclasses.field(default_factory=list)
    outputs: list[fx.Node] = dataclasses.field(default_factory=list)
    output_specs: list[TensorSpec | None] = dataclasses.field(default_factory=list)
    fingerprint: str = ""
    ops: dict[str, int] = dataclasses.field(default_factory=dict)
    convex: bool = True
    deterministic: bool = True
    collective: bool = False  # holds a collective (an all-reduce, an all-gather, their waits)
    # kernel inputs the region writes in place (a KV cache's rows, after passes/reinplace.py)
    mutates: list[str] = dataclasses.field(default_factory=list)
    # per size input (by position): its expression and where each symbol is a tensor input's dim
    size_exprs: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # graph() taken when the region was tagged (first region of its fingerprint only):
    # substitution erases the nodes of the regions it replaces, and of the regions inside them
    graph_data: dict[str, Any] | None = None

    @property
    def kernel_positions(self) -> tuple[int, ...]:
        """Positions of the inputs a kernel receives: every input but the size symbols."""
        return tuple(i for i, s in enumerate(self.input_specs) if s is None or not s.is_scalar)

    @property
    def kernel_names(self) -> list[str]:
        return [self.input_names[i] for i in self.kernel_positions]

    @property
    def kernel_specs(self) -> list[TensorSpec | None]:
        return [self.input_specs[i] for i in self.kernel_positions]

    @property
    def device_type(self) -> str:
        for spec in self.output_specs + self.input_specs:
            if spec is not None and not spec.is_scalar:
                return spec.device_type
        return "cpu"

    def to_dict(self) -> dict[str, Any]:
        def boundary(names: list[str], specs: list[TensorSpec | None]) -> list[dict[str, Any]]:
            return [
                {"name": n, **(s.to_dict() if s is not None else {"dtype": "unknown"})}
                for n, s in zip(names, specs)
            ]

        kernel = set(self.kernel_positions)
        sizes = [{"name": self.input_names[i], "dtype": self.input_specs[i].dtype,  # type: ignore[union-attr]
                  **self.size_exprs.get(i, {"expr": None, "symbols": {}})}
                 for i in range(len(self.inputs)) if i not in kernel]
        return {
            "name": self.name,
            "module": self.module,
            "instance": self.instance,
            "class": self.cls,
            "fingerprint": self.fingerprint,
            "inputs": boundary(self.kernel_names, self.kernel_specs),
            "sizes": sizes,
            "outputs": boundary([f"output{i}" for i in range(len(self.outputs))], self.output_specs),
            "nodes": len(self.nodes),
            "ops": dict(sorted(self.ops.items())),
            "convex": self.convex,
            "deterministic": self.deterministic,
            "mutates": list(self.mutates),
        }

    def graph(self) -> dict[str, Any]:
        """The region's nodes as JSON data (`artifacts scaffold` writes a kernel from it):
        per node its target (`aten.addmm.default`, `operator.getitem`), arguments with
        references to inputs and earlier nodes, and its value's dtype, shape and stride."""
        refs: dict[fx.Node, dict[str, int]] = {n: {"input": k} for k, n in enumerate(self.inputs)}
        nodes = []
        for i, node in enumerate(self.nodes):
            spec = TensorSpec.of(node.meta.get("val"))
            nodes.append({
                "name": node.name,
                "target": target_name(node.target) if node.op == "call_function" else None,
                "args": [encode_arg(a, refs) for a in node.args],
                "kwargs": {k: encode_arg(v, refs) for k, v in node.kwargs.items()},
                **({"dtype": spec.dtype, "shape": list(spec.shape), "stride": list(spec.stride)} if spec else {}),
            })
            refs[node] = {"node": i}
        return {"inputs": list(self.input_names), "nodes": nodes, "outputs": [refs[o] for o in self.outputs]}


def target_name(target: Any) -> str | None:
    """`aten.addmm.default` for an op overload (called as `torch.ops.<name>`), `operator.<f>`
    for Python's operators; None for anything a kernel could not call by name."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    if getattr(target, "__module__", None) in ("_operator", "operator"):
        return f"operator.{target.__name__}"
    return None


def encode_arg(value: Any, refs: dict[fx.Node, dict[str, int]]) -> Any:
    """One argument as JSON: references, exact floats and torch constants tagged, so that
    nothing read back can be mistaken for another type."""
    if isinstance(value, fx.Node):
        return refs.get(value, {"unsupported": f"node {value.name} outside the region"})
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": repr(value)}  # repr round-trips every float, -0.0, inf and nan included
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (torch.layout, torch.memory_format)):
        kind = "layout" if isinstance(value, torch.layout) else "memory_format"
        return {kind: str(value).replace("torch.", "")}
    if isinstance(value, list):
        return [encode_arg(v, refs) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [encode_arg(v, refs) for v in value]}
    return {"unsupported": type(value).__qualname__}
