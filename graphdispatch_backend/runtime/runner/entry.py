"""The records a GraphRunner keeps: one Entry per (shape key, parameter set), grouped in
Slots per shape key. An entry's phase (warming, captured, verified, eager) is a typed
record of its own (runner/phase.py).

A Slot also notices parameters that never stay put. A graph shared by the blocks of a
stack sees a handful of parameter sets that come back every forward; FSDP2's reshard,
CPU offload or `weight.data = ...` on every step give a new set each call whose old
storage is freed or moved before it is ever seen again. After CHURN_LIMIT such dead sets
the slot declines (`parameter_moved`) instead of warming a new entry on every call.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.runner.inputs import InputPlan
from graphdispatch_backend.runtime.runner.outputs import OutputPlan
from graphdispatch_backend.runtime.runner.phase import Capture, Captured, Eager, Phase, State, Verified, Warming

CHURN_LIMIT = 3  # dead parameter sets per shape key before it declines parameter_moved


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
    """One shape key and parameter set: its phase (runner/phase.py, written only by
    runner/transitions.py) and what outlives a phase: the classification re-captures
    learned, their counts, the back-off, the captures parked for other addresses."""

    key: tuple[Any, ...]
    storages: _Storages | None = None
    phase: Phase = dataclasses.field(default_factory=Warming)
    forced_moving: set[int] = dataclasses.field(default_factory=set)  # moved under a capture: copied from now on
    held: set[int] = dataclasses.field(default_factory=set)  # never moving: pinned wherever warmup saw them
    recaptures: int = 0  # re-captures after an artifact was demoted
    repins: int = 0  # re-captures that kept a moved input pinned at its new address
    quick_moves: int = 0  # an input never copied whole moved before REPIN_AFTER replays, times in a row
    out_of_memory: int = 0  # failed allocations in a row; the next try waits 2**n calls
    skip: int = 0  # calls to answer eagerly before trying again (after an out-of-memory, a quick move)
    skip_reason: Decline = Decline.OUT_OF_MEMORY  # what those calls are counted as
    # captures of this entry for other addresses of its held inputs (runner/relocate.py), by
    # those addresses, least recently used first
    parked: OrderedDict[tuple[int, ...], Any] = dataclasses.field(default_factory=OrderedDict)

    def waiting(self) -> Decline | None:
        """Backing off: the reason this call is answered eagerly, counted down; else None."""
        if self.skip > 0:
            self.skip -= 1
            return self.skip_reason
        return None

    def release(self) -> None:
        """Free the graphs it holds (its phase's capture, the parked ones); the caller then
        gives it another phase (runner/transitions.py), under the device lock."""
        for parked in self.parked.values():
            parked.release()
        self.parked.clear()
        if isinstance(self.phase, (Captured, Verified)):
            self.phase.capture.release()

    # -- what readers outside the runner see (the report, tests, bench/memory.py) -------
    @property
    def state(self) -> State:
        return self.phase.state

    @property
    def reason(self) -> Decline | None:
        return self.phase.reason if isinstance(self.phase, Eager) else None

    @property
    def capture(self) -> Capture | None:
        """The capture of a captured or verified entry."""
        phase = self.phase
        return phase.capture if isinstance(phase, (Captured, Verified)) else None

    @property
    def graph(self) -> Any:
        return None if self.capture is None else self.capture.graph

    @property
    def inputs(self) -> InputPlan | None:
        return None if self.capture is None else self.capture.inputs

    @property
    def outputs(self) -> OutputPlan | None:
        return None if self.capture is None else self.capture.outputs

    @property
    def moving(self) -> tuple[tuple[int, torch.Tensor], ...]:
        return () if self.capture is None else self.capture.moving

    @property
    def pinned(self) -> tuple[int, ...]:
        return () if self.capture is None else self.capture.pinned

    @property
    def ptrs(self) -> list[int]:
        return [] if self.capture is None else self.capture.ptrs

    @property
    def copy_bytes(self) -> int:
        return 0 if self.capture is None else self.capture.copy_bytes


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
        return any(isinstance(e.phase, (Captured, Verified)) for e in list(self.entries.values()))

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
        self.dead += sum(1 for e in dropped if isinstance(e.phase, Warming))
        if self.last[1] in dropped:
            self.last = ((), None)
        return dropped
