"""digest: a 128-bit fingerprint of a tensor's values, in bounded memory, without a copy.

Verification needs to know whether a call repeats the values it was verified on (then it
derives a distinct set, runtime/runner/derive.py), and compares a replay's outputs with
eager's without holding both (runtime/checks/prints.py). Keeping a copy of every moving
input until the next call holds one hidden state per compiled block: 40 blocks of a 14B
video DiT at 75k tokens are ~31 GB of copies. A fingerprint is enough: equal values give
equal digests, always; different values give equal digests with a chance of about 2**-64
per pair, and then the only cost is that a derived set is verified instead of the live
one.

The tensor's elements, in row-major order, are read as a stream of bytes cut into 64-bit
words (the last one padded with zeros): the plain sum of the words and a position-weighted
sum, both wrapping in int64, in one (2,) tensor on the tensor's device. The weight of word
p is w[p mod SPAN] * m(p div SPAN): w a pseudo-random table of SPAN weights (a
multiplicative hash of the position, never 0), made once per device and kept (8 MiB), m an
odd multiplier per block of SPAN. Words, not elements: a float32 tensor is read as half as
many int64 words, in place, with no widening copy, so a digest costs about one read of the
tensor (16 MiB of new KV cache: 1.75 ms on one CPU thread, the weighted sum a dot product;
every element widened to int64 first cost about ten times that, and it was what the
verification of a graph that creates its caches spent most on). The digest depends on the
positions only, not on how the tensor is laid out or on CHUNK: a non-contiguous tensor is
read in contiguous slices (of its first dimensions, in steps of whole words of rows where
a chunk allows) of at most CHUNK elements; bytes that straddle two slices are joined, and
a slice whose memory is not 8-byte aligned is copied, in bounded pieces. Floats are
compared by bits, as everything else in graphdispatch: `-0.0` is not `0.0`, and a NaN
equals the same NaN.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

CHUNK = 1 << 20  # elements per slice, words per step: 8 MiB of int64 temporaries
SPAN = 1 << 20  # word positions the weight table covers (fixed: the digest never depends on CHUNK)
WORD = 8  # bytes
_MULT, _MOD = 48271, 2147483647  # MINSTD: a position's weight, never 0
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def digest(t: torch.Tensor) -> torch.Tensor:
    """The fingerprint of `t`'s values (shape and dtype are the caller's to compare)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    whole = _whole_words(t)
    if whole is not None:  # the usual small tensor (a weight, an activation): one piece, no stream
        return _one_piece(whole)
    words = _Words(t.device)
    for part in _parts(t):
        words.feed(_as_bytes(part))
    return words.finish()


class _Words:
    """The running sums over a stream of bytes, fed in contiguous pieces."""

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros(2, dtype=torch.int64, device=device)
        self.weights = _weights(device)
        self.position = 0  # words summed so far
        self.carry: torch.Tensor | None = None  # fewer than WORD bytes waiting for the next piece

    def feed(self, data: torch.Tensor) -> None:
        if self.carry is not None:  # complete the word the piece before began
            need = WORD - self.carry.numel()
            joined = torch.cat([self.carry, data[:need]])
            data, self.carry = data[need:], None
            if joined.numel() < WORD:
                self.carry = joined
                return
            self._add(joined)
        whole = data.numel() // WORD * WORD
        if whole < data.numel():
            self.carry = data[whole:].clone()
        for i in range(0, whole, CHUNK * WORD):
            self._add(data[i : min(whole, i + CHUNK * WORD)])

    def finish(self) -> torch.Tensor:
        if self.carry is not None:
            pad = torch.zeros(WORD - self.carry.numel(), dtype=torch.uint8, device=self.carry.device)
            self._add(torch.cat([self.carry, pad]))
        return self.total

    def _add(self, data: torch.Tensor) -> None:
        """The words of `data` (a multiple of WORD bytes, at most CHUNK words)."""
        try:
            ints = data.view(torch.int64)  # the tensor's own memory: read only
        except RuntimeError:  # not 8-byte aligned in its storage: a bounded copy
            ints = data.clone().view(torch.int64)
        n, i = ints.numel(), 0
        while i < n:
            block, offset = divmod(self.position + i, SPAN)
            size = min(n - i, SPAN - offset)
            piece = ints[i : i + size]
            self.total[0] += piece.sum()
            self.total[1] += weighted_sum(self.weights[offset : offset + size], piece) * _block_multiplier(block)
            i += size
        self.position += n


def weighted_sum(weights: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """sum(weights * words), wrapping in int64. int64 arithmetic wraps, so the dot product
    is the same number; on the CPU `dot` reads both once and makes no temporary (8 MiB of
    words: 0.6 ms against 1.2-2.3 ms for the products and their sum, one thread). CUDA has
    no integer dot."""
    if words.device.type == "cpu":
        return torch.dot(weights, words)
    return (weights * words).sum()


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


_FIRST = _block_multiplier(0)


SMALL = 1 << 16  # words: a tensor up to this size is summed with others of its device in one pass (`digests`)
_SEGMENTS: dict[tuple[torch.device, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}


def digests(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`digest` of each tensor. The small ones of one device (a model's norms, biases and
    small weights: a replaying check fingerprints every weight its kernels read, twice) are
    read as one stream of words, each tensor's words weighted from position 0 as its own
    digest weighs them, and summed per tensor with `index_add_` (int64 addition wraps as
    `dot`'s does, in any order): a few dispatches for them all, where one each was most of
    such a check's time (bench/recheck.py part 3). They are copied once into that stream,
    at most SMALL words each."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        words = _whole_words(t.detach()) if not (t.is_conj() or t.is_neg()) else None
        if words is not None and words.numel() <= SMALL:
            groups.setdefault(words.device, []).append((i, words))
        else:
            out[i] = digest(t)
    for device, members in groups.items():
        if len(members) == 1:
            (i, words), = members
            out[i] = _one_piece(words)
            continue
        sizes = tuple(w.numel() for _, w in members)
        segment, positions = _segments(device, sizes)
        stream = torch.cat([w for _, w in members])
        totals = torch.zeros(2, len(sizes), dtype=torch.int64, device=device)
        totals[0].index_add_(0, segment, stream)
        totals[1].index_add_(0, segment, stream * _weights(device)[positions])
        totals[1] *= _FIRST
        for (i, _), row in zip(members, totals.t().unbind(0)):
            out[i] = row
    return out  # type: ignore[return-value]


def _one_piece(words: torch.Tensor) -> torch.Tensor:
    """The digest of `_whole_words`' words: the stream's first `_add`, alone."""
    return torch.stack((words.sum(), weighted_sum(_weights(words.device)[: words.numel()], words) * _FIRST))


def _segments(device: torch.device, sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """For a stream of tensors of `sizes` words: each word's tensor, and its position in it
    (made once per layout: a check fingerprints the same weights every time)."""
    found = _SEGMENTS.get((device, sizes))
    if found is None:
        lengths = torch.tensor(sizes, device=device)
        segment = torch.repeat_interleave(torch.arange(len(sizes), device=device), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        positions = torch.arange(int(lengths.sum()), device=device) - starts[segment]
        if len(_SEGMENTS) >= 64:  # bounded: a process with many layouts makes them again
            _SEGMENTS.clear()
        found = _SEGMENTS[(device, sizes)] = (segment, positions)
    return found


def _whole_words(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s memory as int64 words, where it is one contiguous, 8-byte-aligned run of whole
    words within one chunk and one block of the weights (the stream's first `_add`, alone:
    the same sums), else None. A check of a replaying stack of artifacts fingerprints each
    weight the kernels read, 68 small tensors a call in bench/recheck.py: the stream's
    Python was most of a check's time (2.8 of 3.3 ms)."""
    if t.numel() < 2 or not t.is_contiguous() or t.dtype == torch.bool or t.is_complex() or t.data_ptr() % WORD:
        return None  # (one element may have any stride: _as_bytes's)
    size = t.numel() * t.element_size()
    if not size or size % WORD or size // WORD > min(CHUNK, SPAN):
        return None
    return t.view(-1).view(torch.int64)  # contiguous, whole words: the dtype view takes it as is


def _parts(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """`t`'s elements in row-major order, as flat contiguous tensors of bounded size."""
    if t.is_contiguous() or t.dim() == 0 or t.numel() <= CHUNK:
        yield t.contiguous().reshape(-1)
        return
    row = max(1, t[0].numel())
    step = max(1, CHUNK // row)
    if step >= WORD:
        step -= step % WORD  # WORD rows are whole words: no bytes to join between slices
    for i in range(0, t.shape[0], step):
        part = t[i : i + step]
        if part.numel() <= CHUNK or part.dim() == 1:
            yield part.contiguous().reshape(-1)
        else:  # one row larger than a chunk: its own rows
            yield from _parts(part[0])


def _as_bytes(flat: torch.Tensor) -> torch.Tensor:
    if flat.numel() <= 1 and flat.dim() and flat.stride(-1) != 1:  # one element expanded (stride 0): no
        flat = flat.as_strided(flat.shape, (1,))  # view across element sizes takes it; it is one element
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)


def same_values(a: torch.Tensor, digest_b: torch.Tensor) -> bool:
    """`a`'s values have the digest `digest_b` (one device-to-host read)."""
    return bool(torch.equal(digest(a), digest_b))
