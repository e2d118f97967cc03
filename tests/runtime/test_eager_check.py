"""The eager check (runtime/checks/eager_check.py): the lowering against real eager, on the 1st,
2nd, 4th, 8th, ... call per shape key; a mismatch blamed on eager's own nondeterminism when
eager disagrees with itself; nothing the check adds raising into the user's call."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import graphdispatch_backend
from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.runtime.checks import eager_check as eager_check_mod
from graphdispatch_backend.runtime.checks import reference as reference_mod
from graphdispatch_backend.runtime.checks.eager_check import EagerCheck
from graphdispatch_backend.runtime.checks.suspects import Suspects


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


def checked(eager: Callable[..., Any], compiled: Callable[..., Any],
            suspects: tuple[str, ...] = ()) -> tuple[EagerCheck, GraphRecord]:
    record = GraphRecord(index=0)

    def counted(*args: Any) -> Any:  # what CompiledGraph does: every call that returns is counted
        out = compiled(*args)
        record.called(False, "disabled")
        return out

    check = EagerCheck(eager, counted, record, Events(), make_contain(False), strict=False, keyed=[0],
                       locate=lambda args: [], dynamic=False, timing=Timing(), suspects=Suspects(listed=suspects))
    return check, record


def test_a_value_dependent_lowering_is_caught_at_the_next_recheck():
    """Right on calls 1 and 2, wrong from call 3 on: call 3 falls between re-checks and is
    served as computed (the documented gap), call 4 is re-checked, caught and answered by
    eager, and every later call runs the Dynamo graph."""
    eager = lambda x: (x * 2,)
    lowered = lambda x: (x * 2 + (x.sum() > 100).to(x.dtype),)
    check, record = checked(eager, lowered)
    small, big = torch.ones(4), torch.full((4,), 50.0)
    served = [check(x)[0] for x in (small, small, big, big, big)]
    assert torch.equal(served[2], lowered(big)[0])  # call 3: not a re-check
    assert all(torch.equal(s, eager(big)[0]) for s in served[3:])
    assert record.lowering["status"] == "lowering_mismatch"
    assert record.eager_checks == 3  # calls 1, 2, 4


def test_a_lowering_that_raises_after_drawing_on_an_unchecked_call_leaves_eager_its_draws():
    """Call 3 is not checked: the compiled run draws a dropout mask from the user's
    generator, then raises; the Dynamo graph that answers must draw what eager draws, from
    where the generator stood as the call began."""
    eager = lambda x: (F.dropout(x, 0.5, training=True) * 2,)
    calls = []

    def lowered(x: torch.Tensor) -> tuple[torch.Tensor]:
        calls.append(1)
        out = eager(x)
        if len(calls) == 3:
            raise RuntimeError("the lowered graph gave up half-way")
        return out

    record = GraphRecord(index=0)

    def counted(*args: Any) -> Any:
        out = lowered(*args)
        record.called(False, "disabled")
        return out

    check = EagerCheck(eager, counted, record, Events(), make_contain(False), strict=False, keyed=[0],
                       locate=lambda args: [], dynamic=False, timing=Timing(), draws=True)
    x = torch.ones(64)
    torch.manual_seed(0)
    served = [check(x)[0] for _ in range(4)]
    after = torch.get_rng_state()
    torch.manual_seed(0)
    want = [eager(x)[0] for _ in range(4)]
    assert all(torch.equal(s, w) for s, w in zip(served, want))
    assert torch.equal(after, torch.get_rng_state())
    assert record.lowering["status"] == "lowering_failed"


def test_rechecks_follow_the_doubling_schedule():
    calls: list[int] = []
    n = [0]

    def eager(x: torch.Tensor) -> tuple[torch.Tensor]:
        calls.append(n[0])
        return (x + 1,)

    check, record = checked(eager, lambda x: (x + 1,))
    for i in range(1, 20):
        n[0] = i
        check(torch.ones(2))
    assert calls == [1, 2, 4, 8, 16] and record.eager_checks == 5 and record.lowering is None


def test_eager_disagreeing_with_itself_is_nondeterminism_not_a_lowering_mismatch():
    noisy = lambda x: (x + float(int.from_bytes(os.urandom(2), "little")),)
    check, record = checked(noisy, noisy, suspects=("aten::index_add",))
    out = check(torch.zeros(3))
    assert record.lowering["status"] == "eager_nondeterministic"
    assert "aten::index_add" in record.lowering["detail"]
    assert out[0].shape == (3,)


def test_a_comparison_that_raises_is_a_counted_fallback(monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("comparison exploded")

    monkeypatch.setattr(reference_mod, "compare", broken)
    monkeypatch.setattr(reference_mod, "differs", broken)  # the lean check compares prints
    check, record = checked(lambda x: (x * 3,), lambda x: (x * 3,))
    for _ in range(3):
        assert torch.equal(check(torch.ones(2))[0], torch.full((2,), 3.0))
    assert record.lowering["status"] == "check_failed" and "comparison exploded" in record.lowering["detail"]
    assert record.calls == 3 and record.eager_by_reason == {"check_failed": 2, "disabled": 1}


def test_check_off_means_no_eager_runs(monkeypatch):
    monkeypatch.setattr(eager_check_mod, "MAX_KEYS", 0)
    runs = []
    check, record = checked(lambda x: runs.append(1) or (x,), lambda x: (x,))
    check(torch.ones(1))
    assert runs == [] and record.eager_checks == 0


# -- through torch.compile ------------------------------------------------------------------------


EMULATE = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 2}


@pytest.mark.parametrize("name, fn, make", [
    ("conj", lambda a: a.conj(), lambda: torch.randn(6, dtype=torch.complex64)),
    ("neg of conj", lambda a: (a * 2).conj().imag, lambda: torch.randn(6, dtype=torch.complex64)),
    ("ifft of real", torch.fft.ifft, lambda: torch.randn(8)),
    ("ihfft", torch.fft.ihfft, lambda: torch.randn(8)),
    ("ihfftn", torch.fft.ihfftn, lambda: torch.randn(4, 6)),
])
def test_lazily_conjugated_outputs_do_not_crash_the_call(name, fn, make):
    compiled = torch.compile(fn, backend="graphdispatch", options=EMULATE)
    for _ in range(6):
        x = make()
        got, want = compiled(x), fn(x)
        assert same_bits(got, want) and got.is_conj() == want.is_conj(), name
    graph = graphdispatch_backend.latest_report()["graphs"][0]
    assert graph["calls"] == graph["cuda_graph"]["replays"] + graph["cuda_graph"]["eager_calls"]
    assert graph["lowering_check"]["status"] == "bitwise"


@pytest.mark.parametrize("name, fn, make", [
    ("cholesky", torch.linalg.cholesky, lambda: (lambda a: a @ a.mT + 4 * torch.eye(4))(torch.randn(4, 4))),
    ("inv", torch.linalg.inv, lambda: torch.randn(4, 4) + 4 * torch.eye(4)),
    ("solve", lambda a, b: torch.linalg.solve(a, b), lambda: (torch.randn(4, 4) + 4 * torch.eye(4), torch.randn(4, 2))),
    ("lu_factor", lambda a: torch.linalg.lu_factor(a)[0], lambda: torch.randn(4, 4) + 4 * torch.eye(4)),
    ("ldl_factor", lambda a: torch.linalg.ldl_factor(a)[0], lambda: (lambda a: a + a.mT + 8 * torch.eye(4))(
        torch.randn(4, 4))),
    ("tensorinv", lambda a: torch.linalg.tensorinv(a, ind=1), lambda: torch.randn(4, 4) + 4 * torch.eye(4)),
    ("tensorsolve", lambda a, b: torch.linalg.tensorsolve(a, b),
     lambda: (torch.randn(4, 4) + 4 * torch.eye(4), torch.randn(4))),
])
def test_linalg_with_error_checks_replays(name, fn, make):
    """aot threads an effect token (None at run time) through the error check; the check
    stays outside the captured piece, so it still raises on a singular input as eager does."""
    compiled = torch.compile(fn, backend="graphdispatch", options=EMULATE)
    for _ in range(8):
        args = make()
        args = args if isinstance(args, tuple) else (args,)
        assert same_bits(compiled(*args), fn(*args)), name
    graph = graphdispatch_backend.latest_report()["graphs"][0]
    cg = graph["cuda_graph"]
    assert graph["contract_mismatches"] == 0 and cg["replays"] > 0, cg
    assert graph["split_reasons"] == {"effectful_op": 1}


def test_linalg_error_check_still_raises_after_replays():
    compiled = torch.compile(torch.linalg.inv, backend="graphdispatch", options=EMULATE)
    for _ in range(6):
        compiled(torch.randn(3, 3) + 3 * torch.eye(3))
    with pytest.raises(torch.linalg.LinAlgError):
        compiled(torch.zeros(3, 3))


def _write_row(cache: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, pos, x)  # a static cache's row: a position past its end raises, eagerly too
    return cache.sum(0) * 2


@pytest.mark.parametrize("positions", [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3] * 3 + [9] + [0, 1] * 3])
def test_a_call_past_a_static_cache_raises_eagers_error_is_counted_and_the_graph_goes_on(positions):
    """A request run past its static cache's end raises the IndexError eager raises. Where
    that call was checked (its new position made it novel) the rows to snapshot are located
    first, and that raised: it used to decline the lowering for good (`check_failed`, the
    caller's error blamed on graphdispatch) and every later call ran eagerly. Now the
    error is the caller's, each raising call is counted (`raised`), and the calls after it
    replay, bitwise."""
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    compiled = torch.compile(_write_row, backend="graphdispatch", options=EMULATE, dynamic=False)
    cache, twin = torch.zeros(4, 8), torch.zeros(4, 8)
    raised = []
    with torch.no_grad():
        for i, p in enumerate(positions):
            x = torch.randn(1, 8)
            try:
                out = compiled(cache, torch.tensor([p]), x)
            except IndexError:
                raised.append(i)
                with pytest.raises(IndexError):
                    _write_row(twin, torch.tensor([p]), x)
                continue
            assert torch.equal(out, _write_row(twin, torch.tensor([p]), x)) and torch.equal(cache, twin), i
    assert raised == [i for i, p in enumerate(positions) if p >= 4]
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    cg = graph["cuda_graph"]
    assert graph["calls"] == len(positions) == cg["replays"] + cg["eager_calls"], cg
    assert cg["eager_by_reason"]["raised"] == len(raised) and graph["lowering_check"]["status"] == "bitwise", graph
    assert cg["replays"] >= len(positions) - len(raised) - 2 - 2  # warmup, verifying, one check each side


def test_a_call_eager_refuses_to_write_is_the_callers_error_and_no_verdict():
    """An inference tensor passed outside inference mode to a graph that writes its input:
    eager raises, and so does putting the input back around the check; the call is counted
    `raised`, the graph keeps its lowering."""

    class InplaceNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.sub_(0.5)
            return self.lin(x)

    compiled = torch.compile(InplaceNorm().eval(), backend="graphdispatch", options={"cuda_graphs": "emulate"})
    with torch.inference_mode():
        frozen = torch.rand(4, 16)
    with torch.no_grad(), pytest.raises(RuntimeError, match="[Ii]nplace update to inference tensor"):
        compiled(frozen)
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    assert graph["cuda_graph"]["eager_by_reason"] == {"raised": 1}
    assert graph["lowering_check"]["status"] == "unchecked"
