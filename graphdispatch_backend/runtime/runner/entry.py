"""The records a GraphRunner keeps: one Entry per (shape key, parameter set), grouped in
Slots per shape key.

A Slot also notices parameters that never stay put. A graph shared by the blocks of a
stack sees a handful of parameter sets that come back every forward; FSDP2's reshard,
CPU offload or `weight.data = ...` on every step give a new set each call whose old
storage is freed or moved before it is ever seen again. After CHURN_LIMIT such dead sets
the slot declines (`parameter_moved`) instead of warming a new entry on every call.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.call.contract import LayoutIdentity
from graphdispatch_backend.runtime.cudagraph.engine import CapturedGraph
from graphdispatch_backend.runtime.runner.inputs import InputPlan
from graphdispatch_backend.runtime.runner.outputs import OutputPlan

CHURN_LIMIT = 3  # dead parameter sets per shape key before it declines parameter_moved


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


@dataclasses.dataclass(eq=False)
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
    held: set[int] = dataclasses.field(default_factory=set)  # never moving: pinned wherever warmup saw them
    graph: CapturedGraph | None = None
    static_args: list[Any] = dataclasses.field(default_factory=list)
    moving: tuple[tuple[int, torch.Tensor], ...] = ()
    inputs: InputPlan | None = None
    outputs: OutputPlan | None = None
    # the one check per replay: the addresses of the pinned inputs and parameters
    pinned: tuple[int, ...] = ()
    pick_pinned: Callable[[Sequence[Any]], Any] = lambda args: ()
    ptrs: list[int] = dataclasses.field(default_factory=list)
    identity: LayoutIdentity | None = None  # their layouts too, where no Dynamo guard ensures them
    gate_state: tuple[bool, ...] = ()
    verified: int = 0
    last_inputs: list[torch.Tensor] | None = None  # digests of the moving inputs last verified on
    waits: int = 0
    recaptures: int = 0
    repins: int = 0  # re-captures that kept a moved input pinned at its new address
    replays_at_capture: int = 0  # the runner's replay count when this entry was captured
    out_of_memory: int = 0  # failed allocations in a row; the next try waits 2**n calls
    skip: int = 0  # calls to answer eagerly before trying again (after an out-of-memory, a quick move)
    skip_reason: Decline = Decline.OUT_OF_MEMORY  # what those calls are counted as
    quick_moves: int = 0  # an input never copied whole moved before REPIN_AFTER replays, times in a row
    reason: Decline | None = None
    # captures of this entry for other addresses of its held inputs (runner/relocate.py), by
    # those addresses, least recently used first
    parked: OrderedDict[tuple[int, ...], Any] = dataclasses.field(default_factory=OrderedDict)

    @property
    def copy_bytes(self) -> int:
        """Bytes one replay copies: moving inputs in, mutated moving inputs back, outputs out."""
        if self.inputs is None or self.outputs is None:
            return 0
        return self.inputs.bytes_in + self.inputs.bytes_back + self.outputs.bytes_out

    def gates_changed(self, gates: Sequence[Any]) -> bool:
        """An artifact of the piece was demoted or promoted since this entry was captured."""
        return bool(gates) and tuple(g.demoted for g in gates) != self.gate_state

    def gates_replayed(self, gates: Sequence[Any]) -> None:
        for gate, demoted in zip(gates, self.gate_state):
            gate.replayed(native=demoted)  # captured with the artifact's kernels in it, or the native region's

    def release(self) -> None:
        for parked in self.parked.values():
            parked.release()
        self.parked.clear()
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.static_args, self.moving, self.identity, self.last_inputs = None, [], (), None, None
        self.inputs = self.outputs = None


class Slot:
    """The entries of one shape key, by parameter addresses. `last` is the (addresses,
    entry) pair found last, one reference so that threads never see half an update: a
    graph called for one module at a time finds its entry with one list comparison.
    `used` orders slots for least-recently-used eviction."""

    __slots__ = ("dead", "declined", "entries", "last", "used")

    def __init__(self) -> None:
        self.entries: dict[tuple[int, ...], Entry] = {}
        self.last: tuple[Sequence[int], Entry | None] = ((), None)
        self.dead = 0  # parameter sets that died before they ever captured
        self.declined: str | None = None  # why this shape key runs eager for good
        self.used = 0

    @property
    def captured(self) -> bool:
        return any(e.graph is not None for e in list(self.entries.values()))

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
        releases captured ones under its device lock). Warming ones count toward churn."""
        gone = [k for k, e in self.entries.items() if e.storages is not None and e.storages.dead()]
        dropped = [self.entries.pop(k) for k in gone]
        self.dead += sum(1 for e in dropped if e.state is State.WARMING)
        if self.last[1] in dropped:
            self.last = ((), None)
        return dropped
