"""Does a manifest's signature fit a region's boundary (pure, no torch: the command line
checks manifests against a report's regions with it, `artifacts verify --report DIR`)?

A region is given by its kernel inputs' names and specs, its outputs' specs and the inputs
it writes (`mutates`); a spec is anything with `dtype` and `shape` (region.TensorSpec, or a
report entry read back). The miss is said so an author can act on it ("input 1
'net.0.proj.weight': dtype bfloat16, region has float32").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from graphdispatch_backend.artifacts.manifest import Manifest, SignatureEntry


def manifest_miss(manifest: Manifest, names: Sequence[str], inputs: Sequence[Any], outputs: Sequence[Any],
                  mutates: Sequence[str]) -> str | None:
    """Why the manifest's signature does not fit the region, or None if it does."""
    return (_side_miss(manifest.inputs, names, inputs, "inputs")
            or _side_miss(manifest.outputs, None, outputs, "outputs") or _mutates_miss(manifest.mutates, mutates))


def fits_but_for_symbolic_dims(manifest: Manifest, names: Sequence[str], inputs: Sequence[Any],
                               outputs: Sequence[Any], mutates: Sequence[str]) -> bool:
    """Whether the manifest would fit with `null` written where the region's dims are
    symbolic: all that differs is the recompile with dynamic shapes that `null` is for."""
    def loosened(entries: Sequence[SignatureEntry], specs: Sequence[Any]) -> tuple[SignatureEntry, ...]:
        return tuple(dataclasses.replace(e, shape=tuple(None if got is None else want
                                                        for want, got in zip(e.shape, s.shape)))
                     if s is not None and len(e.shape) == len(s.shape) else e
                     for e, s in zip(entries, specs))

    if len(manifest.inputs) != len(inputs) or len(manifest.outputs) != len(outputs):
        return False
    loose = dataclasses.replace(manifest, inputs=loosened(manifest.inputs, inputs),
                                outputs=loosened(manifest.outputs, outputs))
    return manifest_miss(loose, names, inputs, outputs, mutates) is None


def _side_miss(entries: Sequence[SignatureEntry], names: Sequence[str] | None,
               specs: Sequence[Any], side: str) -> str | None:
    if len(entries) != len(specs):
        return f"{len(entries)} {side}, region has {len(specs)}"
    for i, (entry, spec) in enumerate(zip(entries, specs)):
        label = f"{side[:-1]} {i}" + (f" {names[i]!r}" if names else "")
        if spec is None:
            return f"{label}: region value is not a tensor or scalar"
        if names is not None and entry.name != names[i]:
            return f"{label}: manifest names it {entry.name!r}"
        if entry.dtype != spec.dtype:
            return f"{label}: dtype {entry.dtype}, region has {spec.dtype}"
        if len(entry.shape) != len(spec.shape) or any(
            want is not None and want != got for want, got in zip(entry.shape, spec.shape)
        ):
            hint = ""
            if len(entry.shape) == len(spec.shape):  # the sizes differ, not the rank
                dynamic = any(want is not None and got is None for want, got in zip(entry.shape, spec.shape))
                hint = (" (null: a dim Dynamo made dynamic, as when it recompiles for a new batch size;"
                        " write null there to match it)" if dynamic
                        else " (a size that varies between calls: write null there)")
            return f"{label}: shape {_shape(entry.shape)}, region has {_shape(spec.shape)}{hint}"
    return None


def _shape(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("null" if d is None else str(d) for d in shape) + "]"


def _mutates_miss(declared_names: Sequence[str], written_names: Sequence[str]) -> str | None:
    """The inputs the kernel writes in place must be the ones the region writes: a kernel
    that writes what the region only reads would corrupt it, one that skips a write would
    leave it stale."""
    declared, written = set(declared_names), set(written_names)
    if declared == written:
        return None
    if written - declared:
        names = ", ".join(repr(n) for n in sorted(written - declared))
        return (f"the region writes {names} in place (a cache update): declare it in signature.mutates "
                "and write it in place in the kernel")
    names = ", ".join(repr(n) for n in sorted(declared - written))
    return f"signature.mutates names {names}, which the region does not write"
