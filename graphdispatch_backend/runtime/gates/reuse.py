"""OutputMemory: a kernel's outputs in memory that an earlier output, still held, is in.

The native region returns new memory on every call. A kernel that keeps a buffer and
returns it again (an `out=` workspace cached across calls) hands out one memory twice: the
output a caller kept from an earlier call, or the intermediate another region served by
the same kernel produced in this call, changes under its holder when the kernel runs
again, while each call's values, compared alone, are right (a trial: 34 of 40 outputs wrong
downstream, the report saying bitwise). So every call the kernel serves, its tensor
outputs' storages are compared with those of its last call's outputs that something still
holds (weak references: never kept alive here): one found again is a bad output. Kept per
loaded kernel, shared by every region it serves. An output in one of the call's inputs'
memory (a region returning a view of its input) is not the kernel's: not judged here.

It is met on the call that hands the memory out again, after the kernel wrote into it: the
earlier holder already holds this call's values, which the demotion says. Where that first
reuse falls on a checked call of the graph (its first call is one), eager's values answer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch


def reused_detail(index: int) -> str:
    """A demotion's detail for output `index` found in reused memory."""
    return (f"returned output {index} in the memory of an earlier output it returned, which something still "
            "holds (a buffer the kernel keeps and returns again): that holder now holds this call's values; the "
            "native region returns new memory on every call")


class OutputMemory:
    """The storages of one kernel's last outputs, each with a weak reference to its tensor."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[int, weakref.ref[torch.Tensor]] = {}  # storage address -> the output in it

    def reused(self, outs: Sequence[Any], inputs: Sequence[Any]) -> int | None:
        """The first of `outs` in memory an earlier output still holds (None: none), then
        `outs` remembered as the last outputs. About 0.3 us an output."""
        held, found, fresh = self._held, None, {}
        for i, out in enumerate(outs):
            if type(out) is not torch.Tensor and not isinstance(out, torch.Tensor):
                continue
            ptr = out.untyped_storage().data_ptr()
            earlier = held.get(ptr) if ptr else None
            if found is None and earlier is not None and earlier() is not None and not _in_inputs(ptr, inputs):
                found = i
            fresh[ptr] = weakref.ref(out)
        self._held = fresh
        return found


def _in_inputs(ptr: int, inputs: Sequence[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr for t in inputs)


_KERNELS: weakref.WeakKeyDictionary[Callable[..., Any], OutputMemory] = weakref.WeakKeyDictionary()


def memory_of(kernel: Callable[..., Any]) -> OutputMemory:
    """The OutputMemory of `kernel` (a loaded entry point: one per artifact, shared by the
    regions it serves); a kernel that takes no weak reference gets one of its own."""
    try:
        found = _KERNELS.get(kernel)
        if found is None:
            found = _KERNELS[kernel] = OutputMemory()
        return found
    except TypeError:
        return OutputMemory()
