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
"""

from __future__ import annotations

from collections.abc import Sequence

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


def permuted(t: torch.Tensor, salt: int) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    gen = torch.Generator().manual_seed(_SEED + salt)
    order = torch.randperm(flat.numel(), generator=gen).to(flat.device)
    return _like(t, flat[order].reshape(t.shape))


def derive(moving: Sequence[torch.Tensor], salt: int) -> list[list[torch.Tensor]]:
    """Candidate derived sets for the moving inputs, in order of preference: each differs
    from the live values in at least one input. Empty when no derivation changes anything."""
    candidates: list[list[torch.Tensor]] = []
    perm = [permuted(t, salt) if t.numel() > 1 else t for t in moving]
    if any(p is not t and not bitwise_equal(p, t) for p, t in zip(perm, moving)):
        candidates.append(perm)
    doubled = [t.detach() * 2 if t.is_floating_point() or t.is_complex() else t for t in moving]
    doubled = [_like(t, d) if d is not t else t for t, d in zip(moving, doubled)]
    if any(d is not t and not bitwise_equal(d, t) for d, t in zip(doubled, moving)):
        candidates.append(doubled)
    return candidates
