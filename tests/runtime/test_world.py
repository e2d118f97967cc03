"""World: snapshots of what a call writes, region by region (rows, elements, views), put
back exactly; whole snapshots of writes that cannot be located are bounded."""

from __future__ import annotations

import pytest
import torch

from graphdispatch_backend.errors import SnapshotRefused
from graphdispatch_backend.passes.locate_writes import INDEX, INDICES, SCATTER
from graphdispatch_backend.runtime.checks.world import Region, World, Writes


def _regions(cache: torch.Tensor) -> dict[str, Region]:
    return {
        "whole": Region(cache[2:4]),
        "index": Region(cache, INDEX, 0, torch.tensor([5, 1, 5])),  # a repeated row: one original value
        "indices": Region(cache, INDICES, 0, [None, torch.tensor([0, 3])]),
        "scatter": Region(cache, SCATTER, 1, torch.tensor([[1], [2], [3], [0], [1], [2], [3], [0]])),
    }


def _write(kind: str, cache: torch.Tensor) -> None:
    {"whole": lambda: cache[2:4].fill_(7),
     "index": lambda: cache.index_copy_(0, torch.tensor([5, 1]), torch.full((2, 4), 9.0)),
     "indices": lambda: cache.__setitem__((slice(None), torch.tensor([0, 3])), -1.0),
     "scatter": lambda: cache.scatter_(1, torch.tensor([[1], [2], [3], [0], [1], [2], [3], [0]]),
                                       torch.full((8, 1), 3.0))}[kind]()


@pytest.mark.parametrize("kind", ["whole", "index", "indices", "scatter"])
def test_a_region_snapshot_restores_exactly_what_was_written(kind):
    cache = torch.randn(8, 4)
    original = cache.clone()
    world = World.take([_regions(cache)[kind]])
    assert world.nbytes < cache.numel() * 4  # the region, not the cache
    _write(kind, cache)
    assert world.compare() is not None  # the region changed
    after = world.swap()  # keeps the written values aside, puts the old ones back
    assert torch.equal(cache, original)
    assert after.compare_with(world) is not None
    after.restore()
    _write(kind, original)
    assert torch.equal(cache, original)  # the written values, back as the write left them


def test_the_world_leaves_the_rng_alone():
    """Putting the global RNG back would rewind another thread's draws: extra runs that
    draw draw from private copies instead (runtime/checks/draws.py)."""
    world = World.take([])
    drawn = torch.rand(3)
    world.restore()
    assert not torch.equal(torch.rand(3), drawn)


def test_writes_without_a_plan_are_whole_and_bounded():
    big, small = torch.zeros(1024), torch.zeros(4)
    regions = Writes((0, 1), limit=4096 + 16).regions([big, small])
    assert [r.view for r in regions] == [big, small]
    with pytest.raises(SnapshotRefused, match=r"input `cache` \(0.0 MiB\) is written where graphdispatch cannot "
                                              r"locate .* larger than max_snapshot_bytes"):
        Writes((0, 1), limit=4096, names=["cache", "state"]).regions([big, small])
    assert Writes((), limit=0).regions([big]) == []
