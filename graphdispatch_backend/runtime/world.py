"""World: a snapshot of what one run of a graph may change besides its outputs.

That is the tensors the graph writes into (a KV cache, a running buffer) and the RNG
state. Every extra run graphdispatch adds (the eager check, a verification, a derived
verification set) takes the world before it and puts it back after, so the user's state
advances exactly once per call, as in eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphdispatch_backend.runtime.parity import Mismatch, compare


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


class World:
    __slots__ = ("_copies", "_rng", "_tensors")

    def __init__(self, tensors: Sequence[torch.Tensor], copies: list[torch.Tensor], rng: Any) -> None:
        self._tensors = tuple(tensors)
        self._copies = copies
        self._rng = rng

    @classmethod
    def take(cls, tensors: Sequence[torch.Tensor]) -> World:
        return cls(tensors, [t.clone() for t in tensors], _rng_state())

    def restore(self) -> None:
        """Put the tensors' values and the RNG state back as they were at `take`."""
        for t, c in zip(self._tensors, self._copies):
            t.copy_(c)
        torch.set_rng_state(self._rng[0])
        if self._rng[1] is not None:
            torch.cuda.set_rng_state_all(self._rng[1])

    def swap(self) -> World:
        """Snapshot the world as it is now, put this one back, and return the snapshot."""
        now = World.take(self._tensors)
        self.restore()
        return now

    def compare(self) -> Mismatch | None:
        """The tensors now, against their values at `take` (bit for bit)."""
        return compare(self._copies, list(self._tensors), check_strides=False)

    def compare_with(self, other: World) -> Mismatch | None:
        """This snapshot's values against another snapshot's of the same tensors."""
        return compare(other._copies, self._copies, check_strides=False)

    @property
    def empty(self) -> bool:
        return not self._tensors
