"""digest: a 128-bit fingerprint of a tensor's values, in bounded memory, without a copy.

Verification needs to know whether a call repeats the values it was verified on (then it
derives a distinct set, runtime/runner/derive.py). Keeping a copy of every moving input
until the next call holds one hidden state per compiled block: 40 blocks of a 14B video
DiT at 75k tokens are ~31 GB of copies. A fingerprint is enough: equal values give equal
digests, always; different values give equal digests with a chance of about 2**-64 per
pair, and then the only cost is that a derived set is verified instead of the live one.

The bytes of the tensor are read as integers (of its element size) in chunks of at most
CHUNK elements, so the temporaries stay a few MiB whatever the tensor's size: the plain
sum and a position-weighted sum, both wrapping in int64, in one (2,) tensor on the
tensor's device. The weight of element p (row-major) is w[p mod SPAN] * m(p div SPAN):
w a pseudo-random table of SPAN weights (a multiplicative hash of the position, never
0), made once per device and kept (8 MiB), m an odd multiplier per block of SPAN. So a
chunk costs one multiply and two sums, no weights made anew, and the digest depends on
the positions only, not on how the tensor is laid out or on CHUNK: a non-contiguous
tensor is read in contiguous slices (of its first dimensions) of at most CHUNK elements,
cut again where they cross a block's boundary. Floats are compared by bits, as everything else in
graphdispatch: `-0.0` is not `0.0`, and a NaN equals the same NaN.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

CHUNK = 1 << 20  # elements per step: 8 MiB of int64 temporaries
SPAN = 1 << 20  # positions the weight table covers (fixed: the digest never depends on CHUNK)
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MULT, _MOD = 48271, 2147483647  # MINSTD: a position's weight, never 0
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def digest(t: torch.Tensor) -> torch.Tensor:
    """The fingerprint of `t`'s values (shape and dtype are the caller's to compare)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    weights = _weights(t.device)
    start = 0
    for part in _parts(t):
        ints = _as_int(part)  # the tensor's own memory (int64 data is not copied): read only
        n, i = ints.numel(), 0
        while i < n:
            block, offset = divmod(start + i, SPAN)
            size = min(n - i, SPAN - offset, CHUNK)
            piece = ints[i : i + size]
            total[0] += piece.sum(dtype=torch.int64)
            total[1] += (weights[offset : offset + size] * piece).sum() * _block_multiplier(block)
            i += size
        start += n
    return total


def _weights(device: torch.device) -> torch.Tensor:
    """The weights of a chunk's positions on `device`, made once (module docstring)."""
    weights = _WEIGHTS.get(device)
    if weights is None:  # two threads making it at once make equal tables
        weights = torch.arange(SPAN, dtype=torch.int64, device=device).mul_(_MULT).remainder_(_MOD).add_(1)
        _WEIGHTS[device] = weights
    return weights


def _block_multiplier(block: int) -> int:
    """An odd multiplier per block of SPAN positions, below 2**63 (a hash of its index)."""
    return ((block * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % (1 << 63)) | 1


def _parts(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """`t`'s elements in row-major order, as flat contiguous tensors of bounded size."""
    if t.is_contiguous() or t.dim() == 0 or t.numel() <= CHUNK:
        yield t.contiguous().reshape(-1)
        return
    row = max(1, t[0].numel())
    step = max(1, CHUNK // row)
    for i in range(0, t.shape[0], step):
        part = t[i : i + step]
        if part.numel() <= CHUNK or part.dim() == 1:
            yield part.contiguous().reshape(-1)
        else:  # one row larger than a chunk: its own rows
            yield from _parts(part[0])


def _as_int(flat: torch.Tensor) -> torch.Tensor:
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_AS_INT[flat.element_size()])


def same_values(a: torch.Tensor, digest_b: torch.Tensor) -> bool:
    """`a`'s values have the digest `digest_b` (one device-to-host read)."""
    return bool(torch.equal(digest(a), digest_b))
