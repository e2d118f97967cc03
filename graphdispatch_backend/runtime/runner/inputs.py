"""Inputs of a captured entry: the session's static buffers, and the per-entry copy plan.

StaticBuffers hold the moving inputs a captured graph reads. They are shared by every
runner of a session by flat position, layout, alignment and grad mode, so 48 repeated
pieces with one signature hold one buffer set, not 48. The entries that captured with a
buffer own it; StaticBuffers only finds it for the next capture (a weak reference), so a
buffer is freed when the last entry using it is released (evicted, or gone with its
runner when the compiled model is), and a later capture at that layout makes a new one.
Each buffer keeps the caller's layout, gaps and all, and its alignment (the storage offset
modulo 16 bytes), so kernels that choose a path by alignment (cuBLASLt, cuDNN,
memory-efficient attention) see what eager saw; buffers made under inference mode are
kept apart from the others (an inference tensor cannot be written outside it). Two kinds
of input need more than their own elements (trees' `index_expanded_dims`, and
`as_strided`):
- an expanded input (stride 0 over a size > 1) keeps its strides: only the elements under
  the expansion are stored and copied;
- an input the graph reads with `as_strided` (which may reach outside the view's own
  extent) is copied with its whole storage.

InputPlan is one entry's copy-in (one `torch._foreach_copy_` over the plain moving inputs,
as cudagraph trees do; a plain `copy_` for a single one) and its copy-back: a moving input
the graph writes into gets the buffer's new values after the replay; pinned ones are
written by the graph itself (`writes_pinned`).
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.runtime.call.contract import writable_layout

ALIGN = 16  # bytes: the alignment cudagraph trees keep (GPU_ALIGN_BYTES)


def _expanded(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(d for d, (size, stride) in enumerate(zip(t.shape, t.stride())) if stride == 0 and size > 1)


def _collapse(t: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """t without the expansion over `dims` (size 1 there): the elements that are stored."""
    for d in dims:
        t = t.narrow(d, 0, 1)
    return t


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under t, as uint8."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def aligned_empty(shape: Sequence[int], stride: Sequence[int], like: torch.Tensor, align: int) -> torch.Tensor:
    """empty_strided(shape, stride) whose data pointer has `align` as remainder mod 16
    (padded by up to 16 bytes only when the allocator's own alignment differs)."""
    plain = torch.empty_strided(shape, stride, dtype=like.dtype, device=like.device)
    itemsize = like.element_size()
    if plain.data_ptr() % ALIGN == align or itemsize > ALIGN or align % itemsize:
        return plain
    extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)
    raw = torch.empty(extent + ALIGN // itemsize, dtype=like.dtype, device=like.device)
    shift = ((align - raw.data_ptr() % ALIGN) % ALIGN) // itemsize
    return torch.empty(0, dtype=like.dtype, device=like.device).set_(raw.untyped_storage(), shift, shape, stride)


def fixed_address(t: Any) -> bool:
    """Marked by its owner as living at one address (`torch._dynamo.mark_static_address`)."""
    return getattr(t, "_dynamo_static_input_type", None) is not None


class StaticBuffers:
    def __init__(self) -> None:
        # weak values: the captured entries hold their buffers (see module docstring)
        self._buffers: weakref.WeakValueDictionary[tuple[Any, ...], torch.Tensor] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    @staticmethod
    def key(position: int, like: torch.Tensor, wide: bool) -> tuple[Any, ...]:
        extra = (like.untyped_storage().nbytes(), like.storage_offset()) if wide else ()
        return (position, tuple(like.shape), like.stride(), like.dtype, like.device, like.data_ptr() % ALIGN,
                torch.is_inference_mode_enabled(), wide, *extra)

    def get(self, position: int, like: torch.Tensor, wide: bool = False) -> torch.Tensor:
        key = self.key(position, like, wide)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None:
                buf = self._buffers[key] = self._allocate(like, wide)
            return buf

    @staticmethod
    def _allocate(like: torch.Tensor, wide: bool) -> torch.Tensor:
        if wide:  # the whole storage, the view at the caller's offset
            storage = torch.empty(like.untyped_storage().nbytes(), dtype=torch.uint8, device=like.device)
            return torch.empty(0, dtype=like.dtype, device=like.device).set_(
                storage.untyped_storage(), like.storage_offset(), like.shape, like.stride())
        dims = _expanded(like)
        base = _collapse(like, dims)
        align = like.data_ptr() % ALIGN
        if writable_layout(base):  # the live layout, gaps and all: kernels see what eager saw
            buf = aligned_empty(base.shape, base.stride(), like, align)
        else:  # overlapping beyond expansion (unfold): no layout holds it; verification judges the copy
            buf = aligned_empty(base.shape, torch.empty(base.shape).stride(), like, align)
        return buf.expand(like.shape) if dims else buf

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers some captured entry still uses."""
        with self._lock:
            return sum(b.untyped_storage().nbytes() for b in self._buffers.values())

    def __len__(self) -> int:
        """Buffers some captured entry still uses."""
        with self._lock:
            return len(self._buffers)


class InputPlan:
    """One entry's copies: in before each replay, back after it (see module docstring)."""

    def __init__(self, moving: Sequence[tuple[int, torch.Tensor]], mutated: Sequence[int], wide: Sequence[int],
                 args: Sequence[Any]) -> None:
        self.moving = tuple(moving)
        plain, special = [], []
        for pos, buf in self.moving:
            if pos in wide:
                special.append((pos, _bytes_of(buf), _bytes_of))
            elif _expanded(args[pos]):
                dims = _expanded(args[pos])
                special.append((pos, _collapse(buf, dims), lambda t, dims=dims: _collapse(t, dims)))
            else:
                plain.append((pos, buf))
        self._positions = tuple(p for p, _ in plain)
        self._dsts = [b for _, b in plain]
        self._pick: Callable[[Sequence[Any]], Any] = picker(self._positions)
        self._one = (self._dsts[0], self._positions[0]) if len(plain) == 1 else None  # copy_, not a foreach
        self._special: tuple[tuple[int, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], ...] = tuple(special)
        back = [(pos, buf) for pos, buf in self.moving if pos in mutated]
        self._back_positions = tuple(p for p, _ in back)
        self._back_srcs = [b for _, b in back]
        self._back_pick = picker(self._back_positions)
        self.bytes_in = sum(d.nbytes for d in self._dsts) + sum(d.nbytes for _, d, _ in special)
        self.bytes_back = sum(b.nbytes for b in self._back_srcs)
        self.copies = bool(self._dsts or self._special)  # copy_in has work to do
        self.backs = bool(self._back_srcs)  # copy_back has work to do
        # the graph writes into an input it reads in place (not through a buffer)
        moving_positions = {p for p, _ in self.moving}
        self.writes_pinned = any(p not in moving_positions and p < len(args) and isinstance(args[p], torch.Tensor)
                                 for p in mutated)

    def fill(self, args: Sequence[Any]) -> None:
        """The buffers' first values, for the capture call."""
        self.copy_in(args)

    def copy_in(self, args: Sequence[Any]) -> None:
        """Before every replay."""
        one = self._one
        if one is not None:
            one[0].copy_(args[one[1]])
        elif self._dsts:
            torch._foreach_copy_(self._dsts, self._pick(args))
        if self._special:
            for pos, dst, view in self._special:
                dst.copy_(view(args[pos]))

    def copy_back(self, args: Sequence[Any]) -> None:
        if self._back_srcs:
            torch._foreach_copy_(self._back_pick(args), self._back_srcs)


def picker(positions: Sequence[int]) -> Callable[[Sequence[Any]], Any]:
    """The arguments at `positions`, in order, picked in C: one slice when they are a run
    (parameters come first in aot's argument list), else an itemgetter."""
    if len(positions) > 1 and list(positions) == list(range(positions[0], positions[0] + len(positions))):
        return operator.itemgetter(slice(positions[0], positions[0] + len(positions)))
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    if positions:
        only = positions[0]
        return lambda args: (args[only],)
    return lambda args: ()
