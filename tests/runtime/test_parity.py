"""parity.compare's allclose mode (runtime/checks/parity.py): the shortcut a passing output
takes (`_within`: finite and within, in a third of the operations) decides as the full
comparison does on every pair of special values, in every floating dtype; and a check under
a tolerance holds a bounded chunk of float64, whatever the output's size."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphdispatch_backend.diagnostics.fusion_report import FusionReport
from graphdispatch_backend.runtime.checks import parity
from graphdispatch_backend.runtime.checks import tolerance as tolerance_mod
from graphdispatch_backend.runtime.checks.parity import compare

RTOL, ATOL = 1e-3, 1e-5
SPECIAL = [0.0, -0.0, 1.0, 1.0 + 1e-3, 1.0 + 2e-3, -1.0, 1e-5, 2e-5, 1e-30, 3.0e38, -3.0e38, 1e308, -1e308,
           5e-324, float("inf"), float("-inf"), float("nan")]


def _full(expected: torch.Tensor, actual: torch.Tensor) -> object:
    with mock.patch.object(parity, "_within", lambda *a: False):
        return compare([expected], [actual], "allclose", RTOL, ATOL)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_the_allclose_shortcut_decides_as_the_full_comparison(dtype):
    pairs = list(itertools.product(SPECIAL, repeat=2))
    for e, a in pairs:  # each pair alone, and inside a vector of values that pass
        for pad in (0, 5):
            want = torch.tensor([e] + [2.0] * pad, dtype=dtype)
            got = torch.tensor([a] + [2.0] * pad, dtype=dtype)
            fast, full = compare([want], [got], "allclose", RTOL, ATOL), _full(want, got)
            assert (fast is None) == (full is None), (dtype, e, a, fast, full)
            assert fast == full, (dtype, e, a)  # a mismatch is said by the full comparison alone


def test_the_shortcut_leaves_both_outputs_as_they_were():
    """Its float64 chunks are copies, also of a float64 output (`.to` would return it)."""
    e = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    a = e + 1e-9
    before = (e.clone(), a.clone())
    assert compare([e], [a], "allclose", RTOL, ATOL) is None
    assert torch.equal(e, before[0]) and torch.equal(a, before[1])


def test_the_shortcut_reads_chunks_of_a_large_output(monkeypatch):
    monkeypatch.setattr(parity, "_CHUNK", 7)
    e = torch.linspace(-3, 3, 50, dtype=torch.float32)
    a = e.clone()
    assert compare([e], [a + 1e-6], "allclose", RTOL, ATOL) is None
    a[43] += 1.0  # in the 7th chunk
    mismatch = compare([e], [a], "allclose", RTOL, ATOL)
    assert mismatch is not None and mismatch.first_index == (43,)


class _Widest(TorchDispatchMode):
    """The most elements of any float64 tensor an op made."""

    def __init__(self) -> None:
        super().__init__()
        self.widest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.widest = max(self.widest, t.numel())
        return out


@pytest.mark.parametrize("case", ["within", "beyond", "nan and inf in place"])
def test_a_large_output_is_compared_and_measured_in_bounded_float64_chunks(case, monkeypatch):
    """A check of a graph fused under a tolerance compares (and measures the errors of) an
    output of any size in float64 chunks, passing or not: no float64 tensor larger than
    three chunks (the three errors of a chunk, stacked for one reduction)."""
    chunk = 64
    monkeypatch.setattr(parity, "_CHUNK", chunk)
    monkeypatch.setattr(tolerance_mod, "_CHUNK", chunk)
    e = torch.linspace(-4, 4, 1000)
    a = e * (1 + 1e-6)
    if case == "beyond":
        a[900] += 1.0
    if case == "nan and inf in place":
        e[10] = a[10] = float("nan")
        e[500] = a[500] = float("inf")
    tol = tolerance_mod.Tolerance(RTOL, ATOL, FusionReport({}))
    with _Widest() as mode:
        mismatch = tol.compare([e], [a])
        tol.observe(1, [e], [a])
    assert (mismatch is None) == (case != "beyond") and (mismatch is None or mismatch.first_index == (900,))
    assert 0 < mode.widest <= 3 * chunk, mode.widest
