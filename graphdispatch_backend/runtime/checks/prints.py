"""Printed: what a run returned, kept as metadata, digests and aliasing instead of values.

A check compares two runs of one call: eager and compiled (runtime/checks/eager_check.py), a
replay and eager (runtime/runner/verify.py). Holding the first run's outputs while the
second runs is a second set of outputs on top of the call's own: one more hidden state
per block of a video DiT while it verifies. The first run's outputs are printed instead
(per output its type, shape, dtype, device, strides, lazy view bits, a 128-bit digest of
its values, runtime/checks/digest.py, and what it shares memory with) and freed; the second
run's outputs are compared with the print. Equal prints mean the same bits (a digest
collision aside, about 2**-64); a mismatch says which output differs and how, and the
caller, on that rare path, runs again for the values (the max abs diff, the first index).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import torch

from graphdispatch_backend.runtime.checks.digest import digest
from graphdispatch_backend.runtime.checks.parity import Mismatch, aliasing, compare, compare_aliasing, say_alias


@dataclasses.dataclass(frozen=True)
class Printed:
    meta: tuple[Any, ...]  # per output: tensor metadata, or the plain value
    digests: tuple[torch.Tensor | None, ...]
    aliases: tuple[Any, ...]


def _meta(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return ("value", type(t), t)
    return ("tensor", tuple(t.shape), t.dtype, t.device, tuple(t.stride()), t.is_conj(), t.is_neg())


def take_print(outputs: Sequence[Any], inputs: Sequence[Any], skip: Collection[int] = ()) -> Printed:
    """`skip`: outputs whose values are nobody's (uninitialized memory never written): no
    digest, so no comparison with the print reads their values."""
    return Printed(tuple(_meta(o) for o in outputs),
                   tuple(digest(o) if isinstance(o, torch.Tensor) and o.numel() and i not in skip else None
                         for i, o in enumerate(outputs)),
                   tuple(aliasing(outputs, inputs)))


def differs(printed: Printed, outputs: Sequence[Any], inputs: Sequence[Any]) -> Mismatch | None:
    """`outputs` against the print of the expected ones (values, strides, views, aliasing),
    as parity.compare and compare_aliasing judge them, without the index of a value."""
    if len(printed.meta) != len(outputs):
        return Mismatch(-1, "count", f"{len(outputs)} outputs, expected {len(printed.meta)}")
    for i, (want, out) in enumerate(zip(printed.meta, outputs)):
        got = _meta(out)
        if want[0] == "value" or got[0] == "value":
            if want[0] != got[0] or want[1] is not got[1] or want[2] != got[2]:
                return Mismatch(i, "type", f"{type(out).__name__} {out!r:.40}, expected {want[1].__name__}")
            continue
        for what, k in (("shape", 1), ("dtype", 2), ("device", 3)):
            if want[k] != got[k]:
                return Mismatch(i, what, f"{got[k]}, expected {want[k]}")
        if out.numel() > 1 and want[4] != got[4]:
            return Mismatch(i, "stride", f"{got[4]}, expected {want[4]}")
        if want[5:] != got[5:]:
            return Mismatch(i, "view", f"conj={got[5]} neg={got[6]}, expected conj={want[5]} neg={want[6]}")
        expected = printed.digests[i]
        if expected is not None and not torch.equal(digest(out), expected):
            return Mismatch(i, "values", "bits differ")
    for i, (w, g) in enumerate(zip(printed.aliases, aliasing(outputs, inputs))):
        if w is not None and g is not None and w != g:
            return Mismatch(i, "aliasing", f"{say_alias(g)}, expected {say_alias(w)}")
    return None


PRINTED = Mismatch(-1, "values", "the replay's outputs differ from eager's")  # values: run again for them


def outputs_differ(expected: Sequence[Any] | Printed, replayed: Sequence[Any] | Printed,
                   inputs: Sequence[Any], skip: Collection[int] = ()) -> Mismatch | None:
    """Eager's outputs against the replay's (runtime/runner/verify.py); either may be a
    print (taken with the same `skip`). A printed replay that differs is PRINTED, a mismatch
    without values: the caller runs again for those."""
    if isinstance(replayed, Printed) or isinstance(expected, Printed):
        printed, other = (replayed, expected) if isinstance(replayed, Printed) else (expected, replayed)
        found = differs(printed, list(other), inputs)  # type: ignore[arg-type]
        return found if printed is expected or found is None else PRINTED
    return compare(list(expected), list(replayed), skip=skip) or compare_aliasing(expected, replayed, inputs)
