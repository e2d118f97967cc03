"""World: a snapshot of what one run of a graph may change besides its outputs.

That is the regions of its inputs the graph writes (a KV cache's rows, a running buffer).
Every extra run graphdispatch adds (the eager check, a verification, a derived verification
set, a capture's own run, an artifact's gate) takes the world before it and puts it back
after, so the user's state advances exactly once per call, as in eager. Only
runtime/checks/ handles a World: a judge through its side-by-side comparison
(side_by_side.py), an extra run compared with nothing through `held`. The RNG is not
part of it: a captured piece draws nothing (random ops stay outside pieces,
passes/split_pieces.py), a region that draws is never substituted (artifacts/match.py),
and the eager check's extra runs of a graph that draws draw from private copies of the
generators (runtime/checks/draws.py); putting the global state back would rewind another
thread's draws.

What a call writes is located before it runs (passes/locate_writes.py): a snapshot copies
the rows `index_copy_` will write, the elements `index_put_` and `scatter_` will, the view
a `copy_` fills, never the whole cache around them. A write graphdispatch cannot locate
(an input written whole, or by a custom op that may write anywhere in its argument) is
snapshotted whole only up to `max_snapshot_bytes` for the whole call; past that, `regions`
raises SnapshotRefused, and what needed the snapshot (a check, a capture) does not run.

The regions are computed once per call, from its inputs before the first run, so every run
of that call (eager, compiled, replayed) is snapshotted, restored and compared over the same
places: where the graph should write. A run that writes elsewhere as well (a capture bug)
is caught where it should have written and did not, but what it wrote elsewhere is not put
back; the eager runs and the captures of graphs that locate_writes read are trusted that far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphdispatch_backend.errors import SnapshotRefused
from graphdispatch_backend.passes.locate_writes import INDEX, INDICES, SCATTER, WritePlan
from graphdispatch_backend.runtime.checks.parity import Mismatch, compare

aten = torch.ops.aten


class Region:
    """Part of one input a run writes: read (a copy) and written back."""

    __slots__ = ("dim", "index", "kind", "view")

    def __init__(self, view: torch.Tensor, kind: str = "whole", dim: int = 0, index: Any = None) -> None:
        self.view, self.kind, self.dim, self.index = view, kind, dim, index

    def read(self) -> torch.Tensor:
        v = self.view
        if self.kind == INDEX:
            return v.index_select(self.dim, self.index)
        if self.kind == INDICES:
            return aten.index.Tensor(v, self.index)
        if self.kind == SCATTER:
            return v.gather(self.dim, self.index)
        return v.clone()

    def write(self, values: torch.Tensor) -> None:
        v = self.view
        if self.kind == INDEX:
            v.index_copy_(self.dim, self.index, values)
        elif self.kind == INDICES:
            aten.index_put_(v, self.index, values)
        elif self.kind == SCATTER:
            v.scatter_(self.dim, self.index, values)
        else:
            v.copy_(values)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Writes:
    """Where one graph (or piece) writes its inputs, bound to its input names and the limit
    on whole snapshots (see module docstring). Without a plan (a graph aot told about, a
    test's piece) every written input is one whole region."""

    def __init__(self, positions: Sequence[int], plan: WritePlan | None = None, limit: int | None = None,
                 names: Sequence[str] = ()) -> None:
        self.positions = tuple(positions)
        self._plan = plan
        # written inputs the plan does not cover (aot's metadata said so): whole
        self._unplanned = tuple(p for p in self.positions if plan is None or p not in plan.positions)
        self._limit = limit
        self._names = tuple(names)

    def __bool__(self) -> bool:
        return bool(self.positions)

    def regions(self, args: Sequence[Any]) -> list[Region]:
        """This call's regions, from its inputs before any run (index tensors copied: a run
        may write the tensor an index was read from)."""
        if not self.positions:
            return []
        found = [(p, Region(args[p]), "graphdispatch does not know where the graph writes it")
                 for p in self._unplanned if isinstance(args[p], torch.Tensor)]
        plan = self._plan
        if plan is None:
            return self._bounded(found)
        values = plan.locate(*args)
        for site in plan.sites:
            view = values[site.view]
            index = [None if slot is None else values[slot].clone() for slot in site.index]
            region = Region(view, site.kind, site.dim, index if site.kind == INDICES else (index or [None])[0])
            found.append((site.position, region, site.why))
        return self._bounded(found)

    def located(self, args: Sequence[Any]) -> list[torch.Tensor]:
        """The inputs whose writes the plan locates (their rows, not the whole input), each once."""
        if self._plan is None:
            return []
        positions = dict.fromkeys(site.position for site in self._plan.sites)
        return [args[p] for p in positions if isinstance(args[p], torch.Tensor)]

    def _bounded(self, found: list[tuple[int, Region, str]]) -> list[Region]:
        unknown = [(p, r, why) for p, r, why in found if why]
        total = sum(_nbytes(r.view) for _, r, _ in unknown)
        if self._limit is not None and total > self._limit:
            p, r, why = max(unknown, key=lambda u: _nbytes(u[1].view))
            raise SnapshotRefused(
                f"input {self._name(p)} ({_mib(_nbytes(r.view))}) is written where graphdispatch cannot locate "
                f"({why}): a whole snapshot ({_mib(total)} in this call) is larger than max_snapshot_bytes "
                f"({_mib(self._limit)})")
        return [r for _, r, _ in found]

    def _name(self, position: int) -> str:
        name = self._names[position] if position < len(self._names) else ""
        return f"`{name}`" if name else str(position)


class World:
    __slots__ = ("_copies", "_regions")

    def __init__(self, regions: Sequence[Region], copies: list[torch.Tensor]) -> None:
        self._regions = tuple(regions)
        self._copies = copies

    @classmethod
    def take(cls, regions: Sequence[Region]) -> World:
        return cls(regions, [r.read() for r in regions])

    def restore(self) -> None:
        """Put the regions' values back as they were at `take`."""
        for region, copy in zip(self._regions, self._copies):
            region.write(copy)

    def now(self) -> World:
        """A snapshot of the same regions as they are now."""
        return World.take(self._regions)

    def swap(self) -> World:
        """Snapshot the world as it is now, put this one back, and return the snapshot."""
        now = World.take(self._regions)
        self.restore()
        return now

    def compare(self, tolerance: Any = None) -> Mismatch | None:
        """The regions now, against their values at `take`: bit for bit, or within a fused
        graph's declared tolerance (runtime/checks/tolerance.py)."""
        now = [r.read() for r in self._regions]
        if tolerance is not None:
            return tolerance.compare(self._copies, now, check_strides=False)
        return compare(self._copies, now, check_strides=False)

    def pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the regions' values at `take`, the regions now)."""
        return self._copies, [r.read() for r in self._regions]

    def compare_with(self, other: World, mode: str = "bitwise", rtol: float = 0.0,
                     atol: float = 0.0) -> Mismatch | None:
        """This snapshot's values against another snapshot's (`other`, the expected) of the
        same regions; bitwise, or allclose for an artifact with that parity."""
        return compare(other._copies, self._copies, mode, rtol, atol, check_strides=False)

    @property
    def values(self) -> list[torch.Tensor]:
        """The regions' values at `take`."""
        return self._copies

    @property
    def empty(self) -> bool:
        return not self._regions

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(c) for c in self._copies)
