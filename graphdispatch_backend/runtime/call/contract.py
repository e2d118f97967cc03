"""Per-call input checks, frozen once, in O(number of inputs), never by walking a graph.

- PlaceholderContract: what the lowered graph was traced for (tensor dtype, device, rank
  and static sizes; scalar types; None for effect tokens). A mismatch runs the original
  graph eagerly, counted.
- WrittenApart: that an input the graph writes shares no memory with another of its
  tensor inputs, as none did where it was traced.
- LayoutIdentity: that the tensors at some positions are exactly the ones recorded
  (data_ptr, shape, stride, dtype, device); what a captured graph relies on for pinned
  inputs and parameters. data_ptr alone misses a restrided view of the same block. Each
  property is checked once per call: addresses the caller keys on are left out.

Both check in C++ where torch offers it (Dynamo's TensorGuards); the Python fallback
only runs to explain a failure.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._C._dynamo.guards import TensorGuards

_data_ptr = torch.Tensor.data_ptr


def layout_identity(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t.storage_offset())


def _modes_active() -> bool:
    """A TorchDispatchMode is on (aot runs a graph's first call under one; profilers and
    FlopCounterMode use them): TensorGuards built now would expect its dispatch keys."""
    return torch._C._len_torch_dispatch_stack() > 0


def writable_layout(t: torch.Tensor) -> bool:
    """True when a tensor of t's sizes and strides can be allocated and written: no two
    elements share memory (gaps are fine: a chunk of a wider tensor, a slice)."""
    reach = 0  # the farthest offset the smaller-stride dims cover
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


def _static_dims(value: Any) -> list[int | None]:
    return [s if isinstance(s, int) else None for s in value.shape]


class PlaceholderContract:
    """Frozen from the placeholders' metadata; tensor checks compile to TensorGuards on
    the first call that satisfies the metadata (guards need real tensors, not fakes)."""

    def __init__(self, metas: Sequence[Any], tokens: frozenset[int] = frozenset()) -> None:
        self._metas = tuple(metas)
        # effect tokens are traced as empty tensors, but aot passes None for them
        self._tokens = tuple(sorted(tokens))
        self._tensor_pos = tuple(i for i, m in enumerate(metas) if isinstance(m, torch.Tensor) and i not in tokens)
        self._scalar_pos = tuple(
            (i, bool if isinstance(m, (bool, torch.SymBool)) else int if isinstance(m, (int, torch.SymInt)) else float)
            for i, m in enumerate(metas)
            if isinstance(m, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))
        )
        self._pick = operator.itemgetter(*self._tensor_pos) if len(self._tensor_pos) > 1 else None
        self._guards: TensorGuards | None = None

    @classmethod
    def of(cls, gm: fx.GraphModule, tokens: frozenset[int] = frozenset()) -> PlaceholderContract:
        return cls([n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")], tokens)

    def _tensors(self, args: Sequence[Any]) -> tuple[Any, ...]:
        if self._pick is not None:
            return self._pick(args)
        return tuple(args[i] for i in self._tensor_pos)

    def check(self, args: Sequence[Any]) -> bool:
        if len(args) != len(self._metas):
            return False
        for i, kind in self._scalar_pos:
            if not isinstance(args[i], kind):
                return False
        for i in self._tokens:
            if args[i] is not None:
                return False
        guards = self._guards
        if guards is not None:
            return guards.check(*self._tensors(args))
        if self.explain(args) is not None:
            return False
        if _modes_active():  # guards would bake in the mode's dispatch keys: build them on a later call
            return True
        tensors = self._tensors(args)
        self._guards = TensorGuards(
            *tensors,
            dynamic_dims_sizes=[_static_dims(self._metas[i]) for i in self._tensor_pos],
            dynamic_dims_strides=[[None] * t.dim() for t in tensors],
        )
        return True

    def explain(self, args: Sequence[Any]) -> str | None:
        """The first reason `args` break the contract, in words; None if they keep it."""
        if len(args) != len(self._metas):
            return f"{len(args)} inputs, the graph takes {len(self._metas)}"
        for i, kind in self._scalar_pos:
            if not isinstance(args[i], kind):
                return f"input {i}: {type(args[i]).__name__}, expected {kind.__name__}"
        for i in self._tokens:
            if args[i] is not None:
                return f"input {i}: {type(args[i]).__name__}, expected None (an effect token)"
        for i in self._tensor_pos:
            meta, arg = self._metas[i], args[i]
            if not isinstance(arg, torch.Tensor):
                return f"input {i}: {type(arg).__name__}, expected a tensor"
            if arg.dtype != meta.dtype or arg.device.type != meta.device.type or arg.dim() != meta.dim():
                return (f"input {i}: {arg.dtype} {arg.device} rank {arg.dim()}, expected "
                        f"{meta.dtype} {meta.device} rank {meta.dim()}")
            for d, (want, got) in enumerate(zip(_static_dims(meta), arg.shape)):
                if want is not None and want != got:
                    return f"input {i}: size {tuple(arg.shape)}, expected {want} at dim {d}"
        if self._guards is not None and not self._guards.check(*self._tensors(args)):
            # check_verbose dereferences the names: without them it segfaults (torch 2.13)
            names = [f"input {i}" for i in self._tensor_pos]
            return "tensor properties differ from the first call (strides aside): " + str(
                self._guards.check_verbose(*self._tensors(args), tensor_check_names=names)
            )
        return None


class WrittenApart:
    """The inputs a graph writes (`written`, positions of the call's arguments), against its
    other tensor inputs that are no parameter or buffer (`others`): aot traced them apart, so its graph, and a
    replay that reads each input from its own copy or address, compute as if a write into
    one never reached another, where eager's write is seen through an overlapping view (a
    trial: `a.add_(1)` on one of two overlapping views of one tensor, 24 replays off). A call
    passing overlapping ones runs the Dynamo graph (`contract_mismatch`). Views of one
    storage that do not overlap (a cache's K and V planes of one buffer) stay apart: their
    byte ranges are compared only where two share a storage. Memory shared by two storages
    (a tensor made from another's pointer: DLPack, `from_blob`) is not seen. About 0.2 us an
    input per call, for graphs that write an input only."""

    def __init__(self, written: Sequence[int], others: Sequence[int], names: Sequence[str] = ()) -> None:
        self._written = tuple(written)
        self._all = tuple(dict.fromkeys((*written, *others)))
        self._names = tuple(names)  # per position, what the message calls the input

    def overlap(self, args: Sequence[Any]) -> str | None:
        """Which written input overlaps which other input on this call, or None."""
        storages: dict[int, list[int]] = {}
        for p in self._all:
            t = args[p]
            if isinstance(t, torch.Tensor) and t.layout is torch.strided and t.numel():
                storages.setdefault(t.untyped_storage().data_ptr(), []).append(p)
        for shared in storages.values():
            if len(shared) < 2:
                continue
            for w in shared:
                if w not in self._written:
                    continue
                lo, hi = _span(args[w])
                for o in shared:
                    if o != w:
                        olo, ohi = _span(args[o])
                        if lo < ohi and olo < hi:
                            return (f"{self._name(w)}, which the graph writes, overlaps {self._name(o)} in memory "
                                    "(traced apart: the graph and its replays would not see the write through it)")
        return None

    def _name(self, position: int) -> str:
        name = self._names[position] if position < len(self._names) else ""
        return f"input {position} ({name})" if name else f"input {position}"


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes `t` reaches: [first, last + 1) (non-negative strides, as torch's)."""
    first = t.data_ptr()
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1)
    return first, first + (reach + 1) * t.element_size()


class LayoutIdentity:
    """The exact tensors at `positions`, as recorded; `mismatch(args)` names the first
    position whose tensor is not the recorded one, or returns None.

    `addressed` (default: all positions) are the positions whose addresses are compared;
    a caller that already keys on some tensors' addresses (the runner keys parameters by
    address) leaves them out, and only their layout is checked here."""

    def __init__(self, positions: Sequence[int], args: Sequence[Any], addressed: Sequence[int] | None = None) -> None:
        self.positions = tuple(positions)
        if addressed is None or set(self.positions) <= set(addressed):
            self.addressed = self.positions
        else:
            self.addressed = tuple(p for p in self.positions if p in addressed)
        tensors = [args[p] for p in self.positions]
        self.identities = tuple(layout_identity(t) for t in tensors)
        self._ptrs = [_data_ptr(args[p]) for p in self.addressed]
        self._pick = operator.itemgetter(*self.positions) if len(self.positions) > 1 else None
        self._pick_addressed = operator.itemgetter(*self.addressed) if len(self.addressed) > 1 else None
        self._guards = self._build(tensors) if tensors and not _modes_active() else None
        self._pending = bool(tensors) and self._guards is None  # built on the first check outside a mode

    @staticmethod
    def _build(tensors: Sequence[torch.Tensor]) -> TensorGuards:
        return TensorGuards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )

    def _tensors(self, args: Sequence[Any]) -> Sequence[Any]:
        if self._pick is not None:
            return self._pick(args)
        return [args[p] for p in self.positions]

    def _addressed_tensors(self, args: Sequence[Any]) -> Sequence[Any]:
        if self._pick_addressed is not None:
            return self._pick_addressed(args)
        return [args[p] for p in self.addressed]

    def addresses_match(self, tensors: Sequence[Any]) -> bool:
        """`tensors`: the ones at the addressed positions, in order."""
        return list(map(_data_ptr, tensors)) == self._ptrs

    def layouts_match(self, tensors: Sequence[Any]) -> bool:
        """`tensors`: the ones at all positions, in order."""
        if self._pending:
            if _modes_active() or [layout_identity(t) for t in tensors] != list(self.identities):
                return [layout_identity(t) for t in tensors] == list(self.identities)
            self._guards, self._pending = self._build(tensors), False
        return self._guards is None or self._guards.check(*tensors)

    def mismatch(self, args: Sequence[Any]) -> int | None:
        if not self.positions:
            return None
        tensors = self._tensors(args)
        if self.addressed is self.positions:
            addressed = tensors
        else:
            addressed = self._addressed_tensors(args) if self.addressed else ()
        if (not addressed or self.addresses_match(addressed)) and self.layouts_match(tensors):
            return None
        for p, ident in zip(self.positions, self.identities):
            if layout_identity(args[p]) != ident:
                return p
        # guards also cover requires_grad and dispatch keys, which identities do not
        return self.positions[0]
