"""Derived verification sets: input values a captured graph was never verified on, made
from the live ones, for callers that send the same values every call.

A replay can be right on the values it was captured with and wrong on any others (a
kernel that reads a stale address, a host-side cache): verification therefore needs a
second set of moving-input values. A fixed prompt, `torch.ones(...)` or a seeded
`torch.randn(...)` per call never supplies one, so the runner derives it:

1. each moving input's elements shifted cyclically (flattened) by a pseudo-random offset
   per salt, from a private generator (the user's RNG is untouched): token ids,
   positions, masks and indices stay valid, since every value stays one the input
   already held;
2. floating inputs that hold one repeated value are unchanged by any shift: they are
   doubled instead (exact in binary floating point, sign and zeros kept).

An input the graph reads with `as_strided` (which may reach outside the view's own extent:
its static buffer holds the whole storage, runner/inputs.py) is derived over its whole
storage and viewed as the caller's was, so eager on the derived set reads what it would
read on the live one.

Integer and bool inputs that hold one repeated value have no derived set: when every
moving input is like that, there is none, and the runner waits for distinct live values.
Candidates are made one at a time, when the one before would not do: a verification holds
one derived set at a time. Each lies in memory of its own with its input's strides and
alignment (mod 16 bytes), so eager on it takes the path the replay's static buffer does; an
expanded input (stride 0: a timestep `t.expand(batch)`) keeps its expanded layout where the
derived values repeat as its own do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from graphdispatch_backend.runtime.call.contract import writable_layout
from graphdispatch_backend.runtime.checks.parity import bitwise_equal
from graphdispatch_backend.runtime.runner.inputs import ALIGN, aligned_empty

_SEED = 0x5EED


def _like(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` (contiguous, t's shape) laid out with t's strides where that can be written,
    at t's alignment: kernels choose their path by it (vectorized loads, cuBLASLt), and the
    replay reads a static buffer that keeps the caller's alignment, so eager on the derived
    set must see the same one."""
    if writable_layout(t):
        stride = t.stride()
    else:
        expanded = _expanded_like(t, values)
        if expanded is not None:
            return expanded
        # an overlapping view whose new values would not repeat as its elements share memory
        stride = torch.empty(t.shape, device="meta").stride()
    return aligned_empty(t.shape, stride, t, t.data_ptr() % ALIGN).copy_(values)


def _expanded_like(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
    """`values` in t's expanded layout (stride 0 on the dims it broadcasts), where they
    repeat along those dims as t's elements do (a doubled timestep `t.expand(batch)`):
    compiled code may assume the layout (a fused graph's stride checks raised on a
    contiguous derived timestep, and the capture verified a call later). None otherwise."""
    zero = [d for d, (n, st) in enumerate(zip(t.shape, t.stride())) if st == 0 and n > 1]
    if not zero:
        return None
    first = values
    for d in zero:
        first = first.narrow(d, 0, 1)
    base_stride = [1 if d in zero else st for d, st in enumerate(t.stride())]
    base = torch.empty_strided(first.shape, base_stride, device="meta")
    if not writable_layout(base) or not torch.equal(first.expand(t.shape), values):
        return None
    out = aligned_empty(first.shape, base_stride, t, t.data_ptr() % ALIGN).copy_(first).expand(t.shape)
    return out if out.stride() == t.stride() else None


def permuted(t: torch.Tensor, salt: int) -> torch.Tensor:
    """`t`'s elements shifted cyclically (flattened) by a pseudo-random offset of `salt`."""
    n = t.numel()
    gen = torch.Generator().manual_seed(_SEED + salt)
    shift = 1 + int(torch.randint(max(n - 1, 1), (1,), generator=gen))
    rolled = torch.roll(t.detach().reshape(-1), shift).reshape(t.shape)
    if rolled.stride() == t.stride() and rolled.data_ptr() % ALIGN == t.data_ptr() % ALIGN:
        return rolled
    return _like(t, rolled)


def _doubled(t: torch.Tensor) -> torch.Tensor:
    if not (t.is_floating_point() or t.is_complex()):
        return t
    return _like(t, t.detach() * 2)


def _storage_of(t: torch.Tensor) -> torch.Tensor:
    """Every element of t's storage, as a 1-D tensor."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,), (1,))


def _over_storage(derivation: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """`derivation` applied to t's whole storage, viewed as t views its own."""
    whole = derivation(_storage_of(t))
    if whole.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():  # unchanged (an int doubled)
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        whole.untyped_storage(), whole.storage_offset() + t.storage_offset(), t.shape, t.stride())


def derive(moving: Sequence[torch.Tensor], salt: int,
           wide: Sequence[bool] | None = None) -> Iterator[list[torch.Tensor]]:
    """Candidate derived sets for the moving inputs, in order of preference, made one at a
    time: each differs from the live values in at least one input; none when no derivation
    changes anything. `wide`: per input, whether the graph reads it with `as_strided`."""
    wide = wide if wide is not None else [False] * len(moving)

    def changed(made: list[torch.Tensor]) -> bool:
        return any(m is not t and not bitwise_equal(_storage_of(m) if w else m, _storage_of(t) if w else t)
                   for m, t, w in zip(made, moving, wide))

    perm = [_over_storage(lambda s: permuted(s, salt), t) if w else permuted(t, salt) if t.numel() > 1 else t
            for t, w in zip(moving, wide)]
    if changed(perm):
        yield perm
    del perm
    doubled = [_over_storage(_doubled, t) if w else _doubled(t) for t, w in zip(moving, wide)]
    if changed(doubled):
        yield doubled
