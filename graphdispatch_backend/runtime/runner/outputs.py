"""Outputs of a captured entry, returned as eager returns them.

Static outputs live in pool memory that the next replay (of this graph, or of another
graph sharing the pool) overwrites, so after every replay each output is copied out. The
plan, made once at capture from the static outputs:

- outputs that share a pool storage (`y` and `y.chunk(2)`, `unsafe_split`) form one group:
  one copy per group of the bytes its outputs reach, and each output rebuilt over the copy
  with its own sizes, strides and offset, so they alias each other as in eager. When they
  share a dtype they are views of one tensor, the first output dense over the group's
  reach when there is one (a group of one dense output is just that, `empty_strided`), so
  they share its version counter, as eager's views do: aot saves `detach(y)` for backward
  next to the output `y`, and writing into `y` must fail the backward's version check.
  Stride-0 and overlapping outputs (`expand`, `unfold`) keep their strides the same way.
- an output that views an input (a pinned tensor, or the static buffer of a moving one)
  is a view of the caller's tensor at the same place, never a copy; an output that is
  the whole input (same offset, sizes and strides) is the caller's tensor itself, as the
  graph run eagerly returns it (aot's forward hands parameters and inputs on to the
  backward so: a fresh view would differ in type, `Parameter`, and `requires_grad`);
- an output with a lazy conjugate or negative bit (`ihfft`, `x.conj().imag`) is copied
  as stored and given its bits back: a clone would resolve them, and eager returns them
  unresolved (a view, as eager's);
- a tensor the graph returns twice (aot's forward returns a tensor it saves for backward
  once as an output, once as a saved tensor; engines keep static outputs' identity) is one
  object, as eager returns it: autograd then knows the saved tensor is the output;
- None and Python scalars are constants.

Two ways to fill the destinations (runner/serve.py picks one): `allocate` makes every
destination before the replay (an allocation failure then leaves nothing half done: no
input was copied, no state written) and `copy_out` copies into them after it (a `copy_`,
or one `torch._foreach_copy_` for several); or `clones` copies each base right after the
replay, one op each (`late`: every base's clone keeps its layout). `assemble` returns the
outputs (the destinations themselves when every output is its own base, in order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphdispatch_backend.runtime.call.contract import writable_layout
from graphdispatch_backend.runtime.cudagraph.engine import storage_group, view_bits, with_view_bits

_CONSTANT, _GROUP, _VIEW, _SAME = 0, 1, 2, 3


def _bytes(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Bytes [lo, hi) of t's storage, as uint8."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), lo, (hi - lo,), (1,))


def _reach(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of its storage a tensor reads: [first element, one past the last)."""
    size = t.element_size()
    if t.numel() == 0:
        return t.storage_offset() * size, t.storage_offset() * size
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.storage_offset() * size, (last + 1) * size


def _dense(t: torch.Tensor) -> bool:
    lo, hi = _reach(t)
    return writable_layout(t) and hi - lo == t.numel() * t.element_size()


class OutputPlan:
    def __init__(self, outputs: Sequence[Any], static_args: Sequence[Any], views: dict[int, int]) -> None:
        """`views`: storage pointer -> position, for the arguments an output may view
        (pinned tensors, and the static buffers of moving inputs that keep the caller's layout)."""
        self._items: list[tuple[Any, ...]] = [(_CONSTANT, out) for out in outputs]
        bits = [view_bits(o) if isinstance(o, torch.Tensor) else 0 for o in outputs]
        # copied as stored (a clone would resolve the bits), the bits given back in assemble
        phys = [with_view_bits(o, b) if b else o for o, b in zip(outputs, bits)]
        groups: dict[Any, list[int]] = {}  # pool storage -> indices of the outputs on it
        for i, out in enumerate(phys):
            if not isinstance(out, torch.Tensor):
                continue
            key = storage_group(out, i)
            pos = views.get(key) if isinstance(key, int) else None
            if pos is not None and static_args[pos].dtype == out.dtype:
                base = static_args[pos]
                delta = out.storage_offset() - base.storage_offset()
                flip = bits[i] ^ view_bits(base)  # as_strided keeps the argument's own bits
                whole = delta == 0 and out.shape == base.shape and out.stride() == base.stride() and not flip
                self._items[i] = (_VIEW, pos, tuple(out.shape), out.stride(), None if whole else delta, flip)
            else:
                groups.setdefault(key, []).append(i)
        self._srcs: list[torch.Tensor] = []
        self._makers: list[tuple[Any, ...]] = []  # per group: how to allocate its destination
        self._like: list[bool] = []  # per group: empty_like / clone give its exact layout
        for g, indices in enumerate(groups.values()):
            members = [phys[i] for i in indices]
            lo = min(_reach(t)[0] for t in members)
            hi = max(_reach(t)[1] for t in members)
            # the first member dense over the group's whole reach is the base, as in eager
            # (`y` before `y.chunk(2)`, `tanh` before the `detach(tanh)` aot saves): copied
            # into a tensor of its own layout, and the others views of it
            base = next((t for t in members if _dense(t) and _reach(t) == (lo, hi)), None)
            if base is not None and all(t.dtype == base.dtype for t in members):
                self._srcs.append(base)
                self._makers.append((tuple(base.shape), base.stride(), base.dtype, base.device))
                self._like.append(torch.empty_like(base).stride() == base.stride())
                for i, t in zip(indices, members):
                    self._items[i] = (_GROUP, g, -1, (), (), t.dtype, bits[i]) if t is base else (
                        _GROUP, g, t.storage_offset() - base.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
                        bits[i])
                continue
            lo -= lo % 64  # keep every member's element offset whole in its dtype
            src = _bytes(members[0], lo, hi)
            if len({t.dtype for t in members}) == 1:  # one dtype: the copy in it, members views of it
                # (of a base eager did not return)
                src = src.view(members[0].dtype)
            self._srcs.append(src)
            self._makers.append(((src.numel(),), (1,), src.dtype, members[0].device))
            self._like.append(True)  # one dense run
            for i, t in zip(indices, members):
                offset = (t.storage_offset() * t.element_size() - lo) // t.element_size()
                self._items[i] = (_GROUP, g, offset, tuple(t.shape), t.stride(), t.dtype, bits[i])
        first: dict[int, int] = {}
        for i, out in enumerate(outputs):
            if isinstance(out, torch.Tensor) and first.setdefault(id(out), i) != i:
                self._items[i] = (_SAME, first[id(out)])
        self.bytes_out = sum(s.nbytes for s in self._srcs)
        self.late = all(self._like)  # every base may be cloned after the replay
        self.one = self._srcs[0] if self.late and len(self._srcs) == 1 else None  # the only base, to clone
        # every output is its own base, in order: the destinations are the outputs
        self.plain = all(item[:3] == (_GROUP, i, -1) and not item[-1] for i, item in enumerate(self._items))

    def allocate(self) -> list[torch.Tensor]:
        if self.late:  # the same layouts, without parsing them again on every call
            return [torch.empty_like(s) for s in self._srcs]
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in self._makers]

    def copy_out(self, dsts: list[torch.Tensor]) -> None:
        if len(dsts) == 1:
            dsts[0].copy_(self._srcs[0])
        elif dsts:
            torch._foreach_copy_(dsts, self._srcs)

    def clones(self) -> list[torch.Tensor]:
        """Each base copied now (after the replay): one op per base, no separate allocation."""
        one = self.one
        if one is not None:
            return [one.clone()]
        return [s.clone() for s in self._srcs]

    def assemble(self, dsts: list[torch.Tensor], args: Sequence[Any]) -> list[Any]:
        if self.plain:
            return dsts
        out: list[Any] = []
        for item in self._items:
            kind = item[0]
            if kind == _GROUP:
                _, g, offset, shape, stride, dtype, bits = item
                dst = dsts[g]
                if offset < 0:
                    made = dst
                elif dst.dtype == dtype:
                    made = dst.as_strided(shape, stride, offset)
                else:
                    made = torch.empty(0, dtype=dtype, device=dst.device).set_(dst.untyped_storage(), offset, shape,
                                                                              stride)
                out.append(with_view_bits(made, bits) if bits else made)
            elif kind == _VIEW:
                _, pos, shape, stride, delta, bits = item
                base = args[pos]
                made = base if delta is None else base.as_strided(shape, stride, base.storage_offset() + delta)
                out.append(with_view_bits(made, bits) if bits else made)
            elif kind == _SAME:
                out.append(out[item[1]])
            else:
                out.append(item[1])
        return out
