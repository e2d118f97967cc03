"""Lookup: which entry of a runner's book answers a call.

    args --(the non-parameter inputs' shapes and strides, scalars by type and value)--> shape key
         --(the parameters' and buffers' addresses)--> parameter set --> Entry, or none yet

The positions are fixed at the first call: parameters and buffers (told by name) are told
apart by address, so each block that shares one compiled graph gets its own entry; every
other input is part of the shape key. A graph whose shapes Dynamo guards and that takes
no scalar has one shape key for good: no key is computed per call (`keyless`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.call.keys import layout_key
from graphdispatch_backend.runtime.runner.book import EntryBook
from graphdispatch_backend.runtime.runner.entry import Entry, Slot

_data_ptr = torch.Tensor.data_ptr
NO_KEY: tuple[Any, ...] = ()


class Lookup:
    def __init__(self, book: EntryBook, stats: Any, state_names: dict[int, str], static_shapes: bool) -> None:
        self._book = book
        self._slots = book.slots  # shape key -> its entries (read on every call)
        self._stats = stats
        self.state = state_names  # position -> parameter/buffer name
        self._static_shapes = static_shapes
        self.key_positions: tuple[int, ...] | None = None
        self.keyless = False  # one shape key for good: no key is computed per call
        self.param_positions: tuple[int, ...] = ()
        self._pick_params: Callable[[Sequence[Any]], Sequence[Any]] = lambda args: ()
        self.fresh = 0  # calls in a row that brought a new shape key

    def key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        if self.keyless:
            return NO_KEY
        positions = self.key_positions
        if positions is None:
            positions = self._positions(args)
            if self.keyless:
                return NO_KEY
        return layout_key(map(args.__getitem__, positions))

    def slot(self, key: tuple[Any, ...]) -> Slot | None:
        slot = self._slots.get(key)
        self.fresh = self.fresh + 1 if slot is None else 0
        return slot

    def find(self, slot: Slot, args: Sequence[Any]) -> Entry | None:
        """The slot's entry for the call's parameter set, or None (not seen yet)."""
        if self.param_positions:
            return slot.find(self.state_key(args))
        return slot.last[1]  # one entry per shape key

    def add(self, key: tuple[Any, ...], args: Sequence[Any]) -> tuple[Entry | None, Decline]:
        """The new entry for the call (EntryBook.add), or None and why."""
        params = self._pick_params(args) if self.param_positions else ()
        entry, why = self._book.add(key, self.state_key(args), params, list(self.state.values()))
        record_fields.shape_keys(self._stats, len(self._slots))
        return entry, why

    def state_key(self, args: Sequence[Any]) -> Sequence[int]:
        """Parameters and buffers are told apart by address: each block that shares this
        graph gets its own entry."""
        return list(map(_data_ptr, self._pick_params(args)))

    def _positions(self, args: Sequence[Any]) -> tuple[int, ...]:
        self.state = {p: n for p, n in self.state.items() if p < len(args) and isinstance(args[p], torch.Tensor)}
        params = self.param_positions = tuple(sorted(self.state))
        self._pick_params = operator.itemgetter(*params) if len(params) > 1 else lambda a: [a[i] for i in params]
        positions = self.key_positions = tuple(i for i in range(len(args)) if i not in self.state)
        # shapes Dynamo guards, and no scalar among the inputs: one shape key, never computed
        self.keyless = self._static_shapes and all(isinstance(args[i], torch.Tensor) for i in positions)
        return positions
