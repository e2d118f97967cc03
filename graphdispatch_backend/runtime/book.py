"""EntryBook: a runner's entries, by shape key and then by parameter set, with its bounds.

- `max_captures` bounds the shape keys; a further key runs eager (`max_captures`).
- MAX_PARAMETER_SETS bounds the parameter sets per shape key (the blocks sharing one graph).
- A new parameter set first forgets the sets whose storage was freed or moved (they can
  never come back); after CHURN_LIMIT of those that never captured, the shape key declines
  `parameter_moved`: parameters at a new address call after call would only warm up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.entry import CHURN_LIMIT, Entry, Slot, State, _Storages
from graphdispatch_backend.runtime.scope import RuntimeScope

# Parameter sets (blocks sharing one compiled graph, or parameters that moved) captured per
# shape key; more run eager as parameter_moved. Bounds the graphs a runner can hold.
MAX_PARAMETER_SETS = 256


class EntryBook:
    def __init__(self, max_captures: int, scope: RuntimeScope, report: Callable[[Decline, str], None]) -> None:
        self.slots: dict[tuple[Any, ...], Slot] = {}  # shape key -> its entries
        self.entries: dict[tuple[Any, ...], Entry] = {}  # (shape key, parameter addresses) -> entry
        self._max_captures = max_captures
        self._scope = scope
        self._report = report
        self._limits_hit: set[Decline] = set()
        self._lock = threading.Lock()  # held only to add or forget entries

    def states(self) -> list[State]:
        return [e.state for e in list(self.entries.values())]

    def add(self, key: tuple[Any, ...], ptrs: Sequence[int], params: Sequence[torch.Tensor],
            names: Sequence[str]) -> tuple[Entry | None, Decline]:
        """The entry for a shape key and parameter set not seen before, or None and why."""
        with self._lock:
            slot = self.slots.get(key)
            if slot is None:
                if len(self.slots) >= self._max_captures:
                    self._limit(Decline.MAX_CAPTURES, f"more than {self._max_captures} shape keys")
                    return None, Decline.MAX_CAPTURES
                slot = self.slots[key] = Slot()
            elif slot.declined is not None:
                return None, Decline.PARAMETER_MOVED
            entry = slot.entries.get(tuple(ptrs))
            if entry is not None:  # another thread added it meanwhile
                return entry, Decline.BUSY
            if params and slot.entries and not self._prune(slot, names):
                return None, Decline.PARAMETER_MOVED
            if len(slot.entries) >= MAX_PARAMETER_SETS:
                self._limit(Decline.PARAMETER_MOVED,
                            f"parameters seen at more than {MAX_PARAMETER_SETS} addresses for one shape key")
                return None, Decline.PARAMETER_MOVED
            entry = Entry((key, tuple(ptrs)), _Storages(params) if params else None)
            slot.entries[tuple(ptrs)] = self.entries[(key, tuple(ptrs))] = entry
            slot.last = (ptrs, entry)
            return entry, Decline.BUSY

    def _prune(self, slot: Slot, names: Sequence[str]) -> bool:
        """Forget parameter sets that can never come back; False when the shape key declines."""
        dropped = slot.prune()
        if slot.dead >= CHURN_LIMIT:
            slot.declined = (
                f"parameters ({', '.join(names[:3])}, ...) were at a new address on each call: {slot.dead} "
                "parameter sets were freed or moved before they were seen again (FSDP reshard, offload, or "
                "`.data` reassignment); captures would go stale")
            dropped += list(slot.entries.values())
            slot.entries.clear()
            slot.last = ((), None)
        with self._scope.replay_lock:  # no thread may be replaying what is released
            for entry in dropped:
                entry.release()
                self.entries.pop(entry.key, None)
        if slot.declined is None:
            return True
        self._report(Decline.PARAMETER_MOVED, slot.declined)
        return False

    def _limit(self, reason: Decline, detail: str) -> None:
        if reason not in self._limits_hit:  # counted once per runner; each call is counted as eager
            self._limits_hit.add(reason)
            self._report(reason, detail)
