"""Prints: a run's outputs kept as metadata, digests and aliasing, compared as the outputs
would be; the eager check and verification free one run's outputs before the other runs,
so a check holds one call's outputs at a time, and a mismatch still says where."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.runtime.checks.eager_check import EagerCheck
from graphdispatch_backend.runtime.checks.parity import compare, compare_aliasing
from graphdispatch_backend.runtime.checks.prints import differs, take_print
from graphdispatch_backend.runtime.runner.verify import Verifier

X = torch.randn(4, 6)


def _cases() -> dict[str, tuple[list[Any], list[Any]]]:
    base = X * 2
    other = base.clone()
    other[3, 5] += 1
    return {
        "equal": ([base, 3, None], [base.clone(), 3, None]),
        "values": ([base], [other]),
        "negative zero": ([torch.zeros(3)], [-torch.zeros(3)]),
        "stride": ([base], [base.t().contiguous().t()]),
        "shape": ([base], [base.reshape(6, 4)]),
        "dtype": ([base], [base.double()]),
        "view bits": ([base.to(torch.complex64).conj()], [base.to(torch.complex64).conj().resolve_conj()]),
        "scalar": ([base, 3], [base, 4]),
        "aliasing": ([base, base[1]], [base, base[1].clone()]),
        "input view": ([X[0]], [X[0].clone()]),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_a_print_judges_as_the_outputs_would(case):
    expected, got = _cases()[case]
    full = compare(expected, got) or compare_aliasing(expected, got, [X])
    printed = differs(take_print(expected, [X]), got, [X])
    assert (printed is None) == (full is None), (printed, full)
    if full is not None:
        assert (printed.output, printed.what) == (full.output, full.what)


def test_the_eager_check_frees_eager_outputs_before_the_compiled_run():
    alive: list[weakref.ref[torch.Tensor]] = []

    def eager(x: torch.Tensor) -> tuple[torch.Tensor]:
        out = x * 2
        alive.append(weakref.ref(out))
        return (out,)

    def compiled(x: torch.Tensor) -> tuple[torch.Tensor]:
        assert alive and alive[-1]() is None, "eager's outputs are still held"
        return (x * 2,)

    check = EagerCheck(eager, compiled, GraphRecord(index=0), Events(), make_contain(True), strict=True, keyed=[0],
                       locate=lambda args: [], dynamic=False, timing=Timing())
    for _ in range(4):  # checked on calls 1, 2 and 4
        check(torch.randn(3))
    assert len(alive) == 3


def test_a_lean_lowering_mismatch_still_names_the_values():
    record = GraphRecord(index=0)
    check = EagerCheck(lambda x: (x * 2,), lambda x: (x * 2 + (x > 0),), record, Events(), make_contain(False),
                       strict=False, keyed=[0], locate=lambda args: [], dynamic=False, timing=Timing())
    x = torch.tensor([-1.0, 2.0])
    assert torch.equal(check(x)[0], x * 2)  # eager's answer, run again
    assert record.lowering["status"] == "lowering_mismatch"
    assert "max abs diff 1" in record.lowering["detail"] and "first at [1]" in record.lowering["detail"]


def test_verification_frees_the_replay_outputs_before_eager_runs():
    alive: list[weakref.ref[torch.Tensor]] = []

    def serve(args: Any) -> list[torch.Tensor]:
        out = args[0] * 2
        alive.append(weakref.ref(out))
        return [out]

    def eager(args: Any) -> list[torch.Tensor]:
        assert alive and alive[-1]() is None, "the replay's outputs are still held"
        return [args[0] * 2]

    verifier = Verifier(lambda x: [x * 2], make_contain(True))
    expected, verdict = verifier.live([torch.randn(3)], serve, eager)
    assert verdict is None and len(alive) == 1


def test_a_printed_replay_mismatch_replays_again_for_its_values():
    replays = []

    def serve(args: Any) -> list[torch.Tensor]:
        replays.append(1)
        return [args[0] * 2 + 1]

    verifier = Verifier(lambda x: [x * 2], make_contain(False))
    _, verdict = verifier.live([torch.zeros(3)], serve, lambda args: [args[0] * 2])
    assert verdict is not None and verdict[0].value == "verify_mismatch"
    assert "max abs diff 1" in verdict[1] and len(replays) == 2
