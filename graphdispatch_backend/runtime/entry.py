"""The records a GraphRunner keeps: one Entry per (shape key, parameter set), grouped in
Slots per shape key; and the small value helpers the runner's key and outputs use.

A Slot also notices parameters that never stay put. A graph shared by the blocks of a
stack sees a handful of parameter sets that come back every forward; FSDP2's reshard,
CPU offload or `weight.data = ...` on every step give a new set each call whose old
storage is freed or moved before it is ever seen again. After CHURN_LIMIT such dead sets
the slot declines (`parameter_moved`) instead of warming a new entry on every call.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.contract import LayoutIdentity, writable_layout
from graphdispatch_backend.runtime.engine import CapturedGraph

CHURN_LIMIT = 3  # dead parameter sets per shape key before it declines parameter_moved
TENSOR = object()  # marks a tensor output in an entry's template (None is a constant output)
CONSTANT_OUTPUTS = (type(None), bool, int, float)
_DOUBLE = struct.Struct("<d")


def scalar_key(value: Any) -> tuple[Any, ...]:
    """A non-tensor input's part of the shape key. A float goes by its bits: Python has
    -0.0 == 0.0 (a replay baked with 0.0 would flip signs that eager keeps) and
    NaN != NaN (every call would find a new key)."""
    if type(value) is float:
        return (float, _DOUBLE.pack(value))
    return (type(value), value)


def layout_key(values: Iterable[Any]) -> tuple[Any, ...]:
    """A shape key: each tensor by shape and strides, each scalar by type and value."""
    return tuple((v.shape, v.stride()) if isinstance(v, torch.Tensor) else scalar_key(v) for v in values)


def copy_like(t: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides as the static output (a chunk of a wider tensor keeps
    its row stride), so replayed outputs match eager's layout, not only its values."""
    if t.is_contiguous() or not writable_layout(t):
        return t.clone()
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)


class State(str, enum.Enum):
    EAGER = "eager"
    WARMING = "warming"
    CAPTURED = "captured"
    VERIFIED = "verified"


class _Storages:
    """Weak references to the parameters' storages and their addresses at first sight:
    dead once any storage is freed or moved (resized, reassigned)."""

    __slots__ = ("refs",)

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.refs = [(StorageWeakRef(s), s.data_ptr()) for s in (p.untyped_storage() for p in params)]

    def dead(self) -> bool:
        for ref, ptr in self.refs:
            if ref.expired() or torch.UntypedStorage._new_with_weak_ptr(ref.cdata).data_ptr() != ptr:
                return True
        return False


@dataclasses.dataclass
class Entry:
    key: tuple[Any, ...]
    storages: _Storages | None = None
    state: State = State.WARMING
    observations: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    # the storages the first warmup call saw: an input is pinned only if its storage stayed
    # alive through warmup (the same tensor passed again), not if a new tensor happened to
    # land at the same address after the last one was freed
    first_storages: list[StorageWeakRef | None] = dataclasses.field(default_factory=list)
    forced_moving: set[int] = dataclasses.field(default_factory=set)
    graph: CapturedGraph | None = None
    static_args: list[Any] = dataclasses.field(default_factory=list)
    moving: tuple[tuple[int, torch.Tensor], ...] = ()
    identity: LayoutIdentity | None = None
    template: tuple[Any, ...] = ()  # TENSOR for a tensor output, the value for a constant one
    gate_state: tuple[bool, ...] = ()
    verified: int = 0
    last_inputs: list[torch.Tensor] | None = None
    waits: int = 0
    recaptures: int = 0
    reason: Decline | None = None

    def release(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.static_args, self.moving, self.identity, self.last_inputs = None, [], (), None, None


class Slot:
    """The entries of one shape key, by parameter addresses. `last` is the (addresses,
    entry) pair found last, one reference so that threads never see half an update: a
    graph called for one module at a time finds its entry with one list comparison."""

    __slots__ = ("dead", "declined", "entries", "last")

    def __init__(self) -> None:
        self.entries: dict[tuple[int, ...], Entry] = {}
        self.last: tuple[Sequence[int], Entry | None] = ((), None)
        self.dead = 0  # parameter sets that died before they ever captured
        self.declined: str | None = None  # why this shape key runs eager for good

    def find(self, ptrs: Sequence[int]) -> Entry | None:
        last = self.last
        if ptrs == last[0]:
            return last[1]
        entry = self.entries.get(tuple(ptrs))
        if entry is not None:
            self.last = (ptrs, entry)
        return entry

    def prune(self) -> list[Entry]:
        """Drop entries whose parameters can never be seen again; return them (the caller
        releases captured ones under its replay lock). Warming ones count toward churn."""
        gone = [k for k, e in self.entries.items() if e.storages is not None and e.storages.dead()]
        dropped = [self.entries.pop(k) for k in gone]
        self.dead += sum(1 for e in dropped if e.state is State.WARMING)
        if self.last[1] in dropped:
            self.last = ((), None)
        return dropped
