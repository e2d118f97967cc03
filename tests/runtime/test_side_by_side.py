"""SideBySide: one comparison of a reference and a candidate from one world, each typed
result forced on purpose, and the world each step leaves."""

from __future__ import annotations

from typing import Any

import torch

from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.errors import SnapshotRefused
from graphdispatch_backend.runtime.checks.parity import compare
from graphdispatch_backend.runtime.checks.side_by_side import (
    CANDIDATE,
    REFERENCE,
    Kind,
    SideBySide,
    by_parity,
    held,
    within,
)
from graphdispatch_backend.runtime.checks.suspects import NONE_KNOWN, Suspects
from graphdispatch_backend.runtime.checks.world import Region, Writes

contain = make_contain(False)


def reference(cache: torch.Tensor, bump: float = 0.0) -> list[torch.Tensor]:
    """Writes row 0 of the cache; returns a value computed from it."""
    cache[0].add_(1.0 + bump)
    return [cache[0] * 2]


def side_by_side(cache: torch.Tensor, candidate_bump: float = 0.0, reference_bumps: tuple[float, ...] = (0.0,)
                 ) -> tuple[SideBySide, list[torch.Tensor], list[torch.Tensor], Any]:
    """The eager check's order: the reference first, set aside; the candidate second."""
    bumps = iter(reference_bumps + (reference_bumps[-1],) * 8)
    side = SideBySide.take([Region(cache[0])], contain)
    expected = reference(cache, next(bumps))
    side.set_aside(REFERENCE)
    got = reference(cache, candidate_bump)
    return side, expected, got, lambda: reference(cache, next(bumps))


def test_equal_and_the_world_as_either_party_left_it():
    cache = torch.zeros(3, 2)
    side, expected, got, _ = side_by_side(cache)
    assert side.compare(lambda: compare(expected, got)).kind is Kind.EQUAL
    side.back()
    assert torch.equal(cache, torch.zeros(3, 2))
    side.back(REFERENCE)
    assert torch.equal(cache[0], torch.ones(2))


def test_a_mismatch_in_the_writes_alone_carries_its_detail():
    cache = torch.zeros(3, 2)
    side, expected, got, _ = side_by_side(cache, candidate_bump=0.5)
    compared = side.compare(lambda: None)  # outputs judged equal: the writes still differ
    assert compared.kind is Kind.MISMATCH and compared.mismatch is not None and "max abs diff 0.5" in compared.detail


def test_a_tolerance_or_a_parity_judges_the_writes():
    cache = torch.zeros(3, 2)
    side, *_ = side_by_side(cache, candidate_bump=1e-6)
    assert side.writes() is not None
    assert side.writes(by_parity("allclose", 1e-3, 1e-5)) is None

    class Tolerance:
        def compare(self, expected: Any, actual: Any, check_strides: bool = True) -> Any:
            return compare(expected, actual, "allclose", 1e-3, 1e-5, check_strides)

    assert side.writes(within(Tolerance())) is None and within(None)([torch.ones(1)], [torch.ones(1)]) is None


def test_a_reference_that_disagrees_with_itself_is_nondeterministic_and_the_world_is_its_first_run():
    cache = torch.zeros(3, 2)
    side, expected, got, again = side_by_side(cache, candidate_bump=0.5, reference_bumps=(0.0, 0.25))
    compared = side.judge(lambda: compare(expected, got), lambda fn: fn(), lambda: again(),
                          lambda second: compare(expected, second), Suspects())
    assert compared.kind is Kind.NONDETERMINISTIC
    assert compared.detail.startswith("eager disagrees with itself (") and compared.detail.endswith(NONE_KNOWN)
    assert torch.equal(cache[0], torch.ones(2))  # as the reference's first run left it


def test_a_reference_that_agrees_with_itself_leaves_the_mismatch():
    cache = torch.zeros(3, 2)
    side, expected, got, again = side_by_side(cache, candidate_bump=0.5)
    compared = side.judge(lambda: compare(expected, got), lambda fn: fn(), lambda: again(),
                          lambda second: compare(expected, second), Suspects())
    assert compared.kind is Kind.MISMATCH
    assert torch.equal(cache[0], torch.ones(2))


def test_the_candidate_raising_and_a_comparison_raising_are_raised():
    cache = torch.zeros(3, 2)
    side = SideBySide.take([Region(cache[0])], contain)
    out, failed = side.run(lambda: 1 / 0)
    assert out is None and failed is not None and failed.kind is Kind.RAISED and failed.party == CANDIDATE
    assert isinstance(failed.raised, ZeroDivisionError)
    side.set_aside(REFERENCE)
    compared = side.compare(lambda: [][0])
    assert compared.kind is Kind.RAISED and compared.party == "graphdispatch"


def test_a_refused_snapshot_is_refused_before_anything_ran():
    big = torch.zeros(1024)
    opened = SideBySide.open(lambda: Writes((0,), limit=16).regions([big]), contain)
    assert not isinstance(opened, SideBySide) and opened.kind is Kind.REFUSED
    assert isinstance(opened.raised, SnapshotRefused)


def test_the_candidate_first_and_its_world_kept():
    """A capture's live verification: the replay first, then the user's eager run."""
    cache = torch.zeros(3, 2)
    side = SideBySide.take([Region(cache[0])], contain)
    reference(cache, 0.5)  # the candidate
    side.set_aside(CANDIDATE)
    reference(cache)  # the reference, whose world stays
    side.keep(REFERENCE)
    assert side.compare(lambda: None).kind is Kind.MISMATCH
    assert torch.equal(cache[0], torch.ones(2))


def test_held_puts_the_regions_back():
    cache = torch.zeros(3, 2)
    rewind = held([Region(cache[0])])
    cache[0].fill_(5)
    rewind()
    assert torch.equal(cache, torch.zeros(3, 2))
