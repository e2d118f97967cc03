"""EntryBook: a runner's entries, by shape key and then by parameter set, with its bounds.

- `max_captures` bounds the shape keys holding a capture. A key that is about to capture
  when that many hold one evicts the least recently used of them (its graphs reset, its
  pool memory released): a server cycling over sizes keeps replaying its hot ones instead
  of running eager for good after the max_captures-th. Keys still warming hold no memory;
  at most WARMING_FACTOR * max_captures of them are kept, further keys run eager
  (`max_captures`).
- Eviction pays only where a key replays before it is evicted. When THRASH_LIMIT captures
  in a row were evicted before they verified (keys cycling through more values than
  max_captures holds, one call each: a denoising loop over Python-int timesteps), every
  call would capture and none replay; from then on a key that would evict declines
  `max_captures` instead, and the captured keys go on replaying.
- MAX_PARAMETER_SETS bounds the parameter sets per shape key (the blocks sharing one graph).
- A new parameter set first forgets the sets whose storage was freed or moved (they can
  never come back); after CHURN_LIMIT of those that never captured, the shape key declines
  `parameter_moved`: parameters at a new address call after call would only warm up.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.runner.entry import CHURN_LIMIT, Entry, Slot, _Storages
from graphdispatch_backend.runtime.runner.phase import State, Verified

# Parameter sets (blocks sharing one compiled graph, or parameters that moved) captured per
# shape key; more run eager as parameter_moved. Bounds the graphs a runner can hold.
MAX_PARAMETER_SETS = 256
WARMING_FACTOR = 8
THRASH_LIMIT = 8  # captures in a row evicted before they verified: evicting stops


class EntryBook:
    def __init__(self, max_captures: int, lock: threading.RLock, report: Callable[..., None],
                 evict: Callable[[Entry], None]) -> None:
        self.slots: dict[tuple[Any, ...], Slot] = {}  # shape key -> its entries
        self.entries: dict[tuple[Any, ...], Entry] = {}  # (shape key, parameter addresses) -> entry
        self.evictions = 0
        self.wasted = 0  # captures in a row evicted before they verified
        self.max_captures = max_captures
        self._device_lock = lock  # released graphs must not be mid-replay
        self._report = report
        self._evict = evict  # an entry dropped: freed and out of its phase (runner/transitions.py)
        self._limits_hit: set[tuple[Decline, str]] = set()
        self._lock = threading.Lock()  # held only to add or forget entries
        self._tick = itertools.count(1)

    def states(self) -> list[State]:
        return [e.state for e in list(self.entries.values())]

    def touch(self, slot: Slot) -> None:
        slot.used = next(self._tick)

    def add(self, key: tuple[Any, ...], ptrs: Sequence[int], params: Sequence[torch.Tensor],
            names: Sequence[str]) -> tuple[Entry | None, Decline]:
        """The entry for a shape key and parameter set not seen before, or None and why."""
        with self._lock:
            slot = self.slots.get(key)
            if slot is None:
                if len(self.slots) >= WARMING_FACTOR * self.max_captures and not self._forget_warming():
                    self.limit(Decline.MAX_CAPTURES,
                               f"more than {WARMING_FACTOR * self.max_captures} shape keys at once")
                    return None, Decline.MAX_CAPTURES
                slot = self.slots[key] = Slot()
            elif slot.declined is not None:
                return None, Decline.PARAMETER_MOVED
            self.touch(slot)
            entry = slot.entries.get(tuple(ptrs))
            if entry is not None:  # another thread added it meanwhile
                return entry, Decline.BUSY
            if params and slot.entries and not self._prune(slot, names):
                return None, Decline.PARAMETER_MOVED
            if len(slot.entries) >= MAX_PARAMETER_SETS:
                self.limit(Decline.PARAMETER_MOVED,
                           f"parameters seen at more than {MAX_PARAMETER_SETS} addresses for one shape key")
                return None, Decline.PARAMETER_MOVED
            entry = Entry((key, tuple(ptrs)), _Storages(params) if params else None)
            slot.entries[tuple(ptrs)] = self.entries[(key, tuple(ptrs))] = entry
            slot.last = (ptrs, entry)
            return entry, Decline.BUSY

    def thrashing(self, key: tuple[Any, ...]) -> bool:
        """Whether `key` capturing would evict after THRASH_LIMIT evictions in a row that
        were wasted (see module docstring): it declines instead."""
        with self._lock:
            return self.wasted >= THRASH_LIMIT and len(self._holding(key)) >= self.max_captures

    def make_room(self, key: tuple[Any, ...]) -> Slot | None:
        """Before `key` captures: evict the least recently used other key holding a capture
        when max_captures already do; return the evicted slot."""
        with self._lock:
            holding = self._holding(key)
            if len(holding) < self.max_captures:
                return None
            _, victim = min(holding)
            slot = self.slots.pop(victim)
            verified = any(isinstance(e.phase, Verified) for e in list(slot.entries.values()))
            self.wasted = 0 if verified else self.wasted + 1
            self._release(list(slot.entries.values()))
            self.evictions += 1
            return slot

    def _holding(self, key: tuple[Any, ...]) -> list[tuple[int, tuple[Any, ...]]]:
        return [(s.used, k) for k, s in self.slots.items() if k != key and s.captured]

    def _forget_warming(self) -> bool:
        """Make room for a new key by forgetting the least recently used key that holds no
        capture (its warmup observations only)."""
        idle = [(s.used, k) for k, s in self.slots.items() if not s.captured and s.declined is None]
        if not idle:
            return False
        _, victim = min(idle)
        slot = self.slots.pop(victim)
        self._release(list(slot.entries.values()))
        return True

    def _release(self, entries: list[Entry]) -> None:
        with self._device_lock:  # no thread may be replaying what is released
            for entry in entries:
                self._evict(entry)
                self.entries.pop(entry.key, None)

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
        self._release(dropped)
        if slot.declined is None:
            return True
        self._report(Decline.PARAMETER_MOVED, slot.declined)
        return False

    def limit(self, reason: Decline, detail: str, kind: str = "", then: str | None = None) -> None:
        """A bound reached: reported once per runner and kind (`then`: what happens to the
        calls, for the log); each call is counted as eager."""
        if (reason, kind) not in self._limits_hit:
            self._limits_hit.add((reason, kind))
            self._report(reason, detail, then)
