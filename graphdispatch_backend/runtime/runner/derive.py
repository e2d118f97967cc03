"""Derived verification sets: input values a captured graph was never verified on, made
from the live ones, for callers that send the same values every call.

A replay can be right on the values it was captured with and wrong on any others (a
kernel that reads a stale address, a host-side cache): verification therefore needs a
second set of moving-input values. A fixed prompt, `torch.ones(...)` or a seeded
`torch.randn(...)` per call never supplies one, so the runner derives it:

1. a permutation of each moving input's elements (a fixed pseudo-random one per salt, from
   a private generator: the user's RNG is untouched): token ids, positions, masks and
   indices stay valid, since every value stays one the input already held;
2. floating inputs that hold one repeated value are unchanged by any permutation: they are
   doubled instead (exact in binary floating point, sign and zeros kept).

Integer and bool inputs that hold one repeated value have no derived set: when every
moving input is like that, there is none, and the runner waits for distinct live values.
Candidates are made one at a time, when the one before would not do: a verification holds
one derived set at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from graphdispatch_backend.runtime.contract import writable_layout
from graphdispatch_backend.runtime.parity import bitwise_equal

_SEED = 0x5EED


def _like(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` (contiguous, t's shape) laid out with t's strides where that can be written."""
    if writable_layout(t):
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    else:  # an expanded view: its elements share memory, so no new values fit its strides
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
    return out.copy_(values)


def _fits(t: torch.Tensor, out: torch.Tensor | None) -> bool:
    """`out` (a static buffer) can take derived values of `t` in place, element for element."""
    return (out is not None and out.shape == t.shape and out.dtype == t.dtype and out.is_contiguous()
            and t.is_contiguous() and out.data_ptr() != t.data_ptr())


def permuted(t: torch.Tensor, salt: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """`t`'s elements shifted cyclically (flattened) by a pseudo-random offset of `salt`,
    written into `out` where it fits (no copy besides), else into new memory."""
    n = t.numel()
    gen = torch.Generator().manual_seed(_SEED + salt)
    shift = 1 + int(torch.randint(max(n - 1, 1), (1,), generator=gen))
    if out is not None and _fits(t, out):
        flat, dst = t.detach().reshape(-1), out.view(-1)
        shift %= n
        dst[shift:].copy_(flat[: n - shift])
        dst[:shift].copy_(flat[n - shift :])
        return out
    rolled = torch.roll(t.detach().reshape(-1), shift).reshape(t.shape)
    return rolled if rolled.stride() == t.stride() else _like(t, rolled)


def _doubled(t: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if not (t.is_floating_point() or t.is_complex()):
        return t
    if out is not None and _fits(t, out):
        return torch.mul(t.detach(), 2, out=out)
    return _like(t, t.detach() * 2)


def derive(moving: Sequence[torch.Tensor], salt: int,
           into: Sequence[torch.Tensor | None] | None = None) -> Iterator[list[torch.Tensor]]:
    """Candidate derived sets for the moving inputs, in order of preference, made one at a
    time: each differs from the live values in at least one input; none when no derivation
    changes anything. `into`: the capture's static buffers, which take the derived values
    where they fit (the verification then holds no copy of the inputs of its own)."""
    outs = list(into) if into is not None else [None] * len(moving)
    perm = [permuted(t, salt, o) if t.numel() > 1 else t for t, o in zip(moving, outs)]
    if any(p is not t and not bitwise_equal(p, t) for p, t in zip(perm, moving)):
        yield perm
    del perm
    doubled = [_doubled(t, o) for t, o in zip(moving, outs)]
    if any(d is not t and not bitwise_equal(d, t) for d, t in zip(doubled, moving)):
        yield doubled
