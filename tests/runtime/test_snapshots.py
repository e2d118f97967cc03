"""What the extra runs snapshot is what the call writes: a KV cache's rows, never the cache.
A write that cannot be located is snapshotted whole only up to `max_snapshot_bytes`; past
it, or when the snapshot's own allocation fails, the check is skipped (named in the report)
and the call is still answered right: nothing raises, no value differs from eager's."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from graphdispatch_backend.passes import locate_writes as _locate_writes_pass
from graphdispatch_backend.passes import split_pieces as _split_pieces_pass
from graphdispatch_backend.runtime.checks.world import Region, World
from graphdispatch_backend.testing import only_graph

ROWS, DIM = 4096, 64
ROW_BYTES = DIM * 4


def decode(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, pos, k)
    return k * 2


@torch.library.custom_op("gd_test_snapshots::scramble", mutates_args=("cache",))
def scramble(cache: torch.Tensor, k: torch.Tensor) -> None:
    cache.add_(k.sum())  # writes all of it: no region to locate


@scramble.register_fake
def _(cache: torch.Tensor, k: torch.Tensor) -> None:
    return None


def opaque(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    torch.ops.gd_test_snapshots.scramble(cache, k)
    return k * 2


def _run(fn: Any, options: dict[str, Any], calls: int = 12) -> dict[str, Any]:
    """`calls` decode steps, compiled and eager side by side: outputs and cache bit for bit."""
    compiled = torch.compile(fn, backend="graphdispatch", options={"warmup": 1, **options})
    cache, ref = torch.zeros(ROWS, DIM), torch.zeros(ROWS, DIM)
    with torch.no_grad():
        for i in range(calls):
            pos, k = torch.tensor([i * 7 % ROWS]), torch.randn(1, DIM)
            assert torch.equal(compiled(cache, pos, k), fn(ref, pos, k)), i
            assert torch.equal(cache, ref), i
    return only_graph()


def _snapshot_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    take = World.take.__func__

    def recording(cls: type[World], regions: Any) -> World:
        world = take(cls, regions)
        sizes.append(world.nbytes)
        return world

    monkeypatch.setattr(World, "take", classmethod(recording))
    return sizes


@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
def test_every_snapshot_is_the_row_the_call_writes(monkeypatch, cuda_graphs):
    sizes = _snapshot_sizes(monkeypatch)
    graph = _run(decode, {"cuda_graphs": cuda_graphs})
    assert graph["lowering_check"]["checked"] >= 4 and len(sizes) >= 4
    assert max(sizes) <= ROW_BYTES, sizes  # eager checks, the capture, verification: one row each
    if cuda_graphs:
        assert graph["cuda_graph"]["replays"] >= 8


def test_without_locating_the_writes_every_snapshot_is_the_whole_cache(monkeypatch):
    for module in (_locate_writes_pass, _split_pieces_pass):
        monkeypatch.setattr(sys.modules[module.__module__], "plan_writes", lambda gm: None)
    sizes = _snapshot_sizes(monkeypatch)
    _run(decode, {"cuda_graphs": "emulate"})
    assert min(sizes) >= ROWS * ROW_BYTES, sizes


def test_an_allocation_failure_while_snapshotting_skips_that_check(monkeypatch):
    read, failed = Region.read, []

    def failing(self: Region) -> torch.Tensor:
        if not failed:
            failed.append(True)
            raise torch.OutOfMemoryError("injected: no memory for the snapshot")
        return read(self)

    monkeypatch.setattr(Region, "read", failing)
    graph = _run(decode, {"cuda_graphs": False})  # every value bit for bit, nothing raised
    check = graph["lowering_check"]
    assert check["skipped"] == 1 and "out of memory" in check["skipped_detail"], check
    assert check["status"] == "bitwise" and check["checked"] >= 3  # the later checks ran
    assert graph["cuda_graph"]["eager_by_reason"]["out_of_memory"] == 1  # that call: the Dynamo graph


def test_a_write_that_cannot_be_located_nor_snapshotted_is_named_and_never_captured():
    graph = _run(opaque, {"cuda_graphs": "emulate", "max_snapshot_bytes": ROWS * ROW_BYTES // 2})
    check = graph["lowering_check"]
    assert check["status"] == "unchecked" and check["skipped"] >= 4, check
    assert "input `cache` (1.0 MiB) is written where graphdispatch cannot locate" in check["skipped_detail"]
    assert "gd_test_snapshots::scramble may write all of it" in check["skipped_detail"]
    cg = graph["cuda_graph"]
    assert cg["replays"] == 0 and cg["declines"] == {"snapshot_too_large": 1}, cg
    assert "max_snapshot_bytes" in cg["decline_details"]["snapshot_too_large"]


def test_the_same_write_within_the_bound_is_checked_whole_and_replays():
    graph = _run(opaque, {"cuda_graphs": "emulate"})
    assert graph["lowering_check"]["status"] == "bitwise" and "skipped" not in graph["lowering_check"]
    assert graph["cuda_graph"]["replays"] >= 8
