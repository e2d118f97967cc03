"""The Region record: what `tag_regions` finds, what matching reads and `substitute` rewrites.

A region is the set of ATen nodes whose `nn_module_stack` contains one module instance
(DESIGN.md section 4). Its boundary (inputs in first-use order, outputs in node order)
and their tensor metadata are what an artifact author writes a manifest against.
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

        return {
            "name": self.name,
            "module": self.module,
            "instance": self.instance,
            "class": self.cls,
            "fingerprint": self.fingerprint,
            "inputs": boundary(self.input_names, self.input_specs),
            "outputs": boundary([f"output{i}" for i in range(len(self.outputs))], self.output_specs),
            "nodes": len(self.nodes),
            "ops": dict(sorted(self.ops.items())),
            "convex": self.convex,
            "deterministic": self.deterministic,
        }
