"""The gradient check (runtime/checks/autograd_check.py): an autograd graph's lowering against
eager in its outputs and in the gradients of one backward, on the 1st, 2nd, 4th, ... call;
every verdict makes the graph run as the Dynamo graph with eager autograd, and what the
check adds never changes what the user computes (`.grad`, the RNG, mutated buffers)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import graphdispatch_backend
from graphdispatch_backend import backend as backend_mod
from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.errors import Decline, StrictModeError
from graphdispatch_backend.runtime.checks import autograd_check as autograd_check_mod
from graphdispatch_backend.runtime.checks import novelty
from graphdispatch_backend.runtime.checks.autograd_check import GradientCheck, cotangents

EMULATE = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 2}


class GeoPool(nn.Module):
    """A product over features: aot traces `prod`'s backward through the formula that
    survives zeros, eager takes the cheaper one when the input holds none, so the
    gradients differ in their last bits while the outputs are bitwise equal."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.sigmoid(self.proj(x)) * self.scale + 0.5).prod(-1)


def graph() -> dict[str, Any]:
    (g,) = graphdispatch_backend.latest_report()["graphs"]
    for record in (g, g["backward"]):
        cg = record["cuda_graph"]
        assert record["calls"] == cg["replays"] + cg["eager_calls"], record["name"]
        assert sum(cg["eager_by_reason"].values()) == cg["eager_calls"], record["name"]
    return g


def steps(model: nn.Module, options: dict[str, Any], n: int, make: Callable[[int], torch.Tensor],
          loss: Callable[[torch.Tensor], torch.Tensor] = torch.sum, reference: nn.Module | None = None) -> int:
    """`n` forward+backward steps of the compiled model next to `reference` (a copy made
    now by default) run eagerly, on the same inputs and seeds; returns how many outputs or
    gradients were not bitwise eager's."""
    reference = copy.deepcopy(model) if reference is None else reference
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    wrong = 0
    for i in range(n):
        x = make(i)
        torch.manual_seed(i)
        out = compiled(x)
        torch.manual_seed(i)
        want = reference(x)
        loss(out).backward()
        loss(want).backward()
        wrong += not torch.equal(out, want)
        for p, q in zip(model.parameters(), reference.parameters()):
            wrong += not torch.equal(p.grad, q.grad)
            p.grad = q.grad = None
    return wrong


def inputs(i: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(i))


# -- verdicts through torch.compile -------------------------------------------------------------


def test_gradients_that_differ_name_the_parameters_and_the_graph_runs_eager_autograd():
    torch.manual_seed(0)
    assert steps(GeoPool(), EMULATE, 4, inputs) == 0
    g = graph()
    check = g["lowering_check"]
    assert check["status"] == "lowering_mismatch" and check["checked"] == 1
    assert check["gradients"] == ["proj.weight", "proj.bias", "scale"]
    assert check["detail"].startswith("differs from eager in its backward: the gradients of proj.weight: values:")
    # the first call was answered by eager (its backward the user's), the rest by the Dynamo graph
    assert g["cuda_graph"]["eager_by_reason"] == {"warmup": 1, "lowering_mismatch": 3}
    assert g["backward"]["calls"] == g["backward"]["checks"] == 1  # only the check's run


def test_without_the_gradient_check_the_user_gets_another_gradient(monkeypatch):
    """Mutation: with the gradient comparison removed, the outputs still match, so the
    lowered backward serves, and the user's gradients are not eager's."""
    monkeypatch.setattr(GradientCheck, "judge", lambda self, *args: None)
    torch.manual_seed(0)
    assert steps(GeoPool(), EMULATE, 4, inputs) > 0
    assert graph()["lowering_check"]["status"] == "bitwise"


def _raising_backward(self: Any, gm: Any, example: Any) -> Callable[..., Any]:
    def backward(args: list[Any]) -> Any:
        raise RuntimeError("the lowered backward gave up")

    backward._boxed_call = True  # type: ignore[attr-defined]
    return backward


def test_a_lowered_backward_that_raises_is_lowering_failed_and_eager_autograd_answers(monkeypatch):
    monkeypatch.setattr(backend_mod._Builder, "backward", _raising_backward)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    assert steps(model, EMULATE, 3, inputs) == 0  # the user's backward never reaches the lowered one
    check = graph()["lowering_check"]
    assert check["status"] == "lowering_failed"
    assert check["detail"] == "raised in its backward: RuntimeError: the lowered backward gave up"


def test_under_strict_a_gradient_mismatch_raises(monkeypatch):
    compiled = torch.compile(GeoPool(), backend="graphdispatch", options={**EMULATE, "strict": True})
    with pytest.raises(StrictModeError, match="in its backward"):
        compiled(inputs(0))


def test_a_comparison_that_raises_is_check_failed_and_every_answer_stays_right(monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("comparison exploded")

    monkeypatch.setattr(autograd_check_mod, "compare", broken)
    torch.manual_seed(0)
    assert steps(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), EMULATE, 3, inputs) == 0
    check = graph()["lowering_check"]
    assert check["status"] == "check_failed" and "comparison exploded" in check["detail"]


def _backward_wrong_for_large_inputs(self: Any, gm: Any, example: Any) -> Callable[..., Any]:
    """The lowered backward, off by 1e-3 in its first gradient whenever a tensor it was
    handed holds some |x| > 3: a kernel wrong for some values only (a large-magnitude path)."""
    inner = _lowered_backward(self, gm, example)

    def run(args: list[Any]) -> Any:
        outs = list(inner(args))
        if any(isinstance(a, torch.Tensor) and a.abs().max() > 3 for a in args):
            i = next(i for i, o in enumerate(outs) if isinstance(o, torch.Tensor))
            outs[i] = outs[i] + 1e-3
        return outs

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


_lowered_backward = backend_mod._Builder.backward


@pytest.mark.parametrize(("recheck", "novel", "served", "checked"),
                         [("every", True, 0, 3), (4, True, 1, 2), (4, False, 2, 2)])
def test_gradients_are_rechecked_on_the_schedule_for_the_graphs_whole_life(monkeypatch, recheck, novel, served,
                                                                          checked):
    """Inputs turn large at the 3rd call. Checking every call, no wrong gradient reaches
    the user. Every 4th call (1, 5, ...): call 3's inputs are new (100 times the first
    two's), which emulated CUDA graphs know a call late, as a GPU reads them without a
    sync: call 3 is served with a wrong gradient, call 4 is checked for its inputs and
    catches it; without the novelty check, calls 3 and 4 are served wrong and call 5
    catches it. Mutation: without re-checks past the first calls, every later call is
    wrong."""
    monkeypatch.setattr(novelty, "ENABLED", novel)
    monkeypatch.setattr(backend_mod._Builder, "backward", _backward_wrong_for_large_inputs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    wrong = steps(model, {**EMULATE, "recheck": recheck}, 8, lambda i: inputs(i) * (0.1 if i < 2 else 10))
    assert wrong == served  # one parameter's gradient wrong on each call served in between
    check = graph()["lowering_check"]
    assert check["status"] == "lowering_mismatch"
    assert check["detail"].startswith("differs from eager in its backward")
    assert check["checked"] == checked


# -- what the check leaves alone ------------------------------------------------------------------


def test_the_check_leaves_grad_the_rng_and_the_users_backward_alone():
    """Dropout draws from the user's RNG: after the checked call the RNG is where eager
    alone leaves it, no `.grad` was written, and the user's backward runs on the outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4)).train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="graphdispatch", options=EMULATE)
    x = inputs(0)
    torch.manual_seed(7)
    out = compiled(x)
    after = torch.get_rng_state()
    torch.manual_seed(7)
    want = reference(x)
    assert torch.equal(after, torch.get_rng_state()) and torch.equal(out, want)
    assert all(p.grad is None for p in model.parameters())
    out.sum().backward()
    want.sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    assert graph()["lowering_check"] == {"checked": 1, "status": "bitwise"}


@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
def test_a_hook_that_draws_gets_eagers_numbers_and_the_check_blames_no_one(cuda_graphs):
    """A gradient-noise hook (`g + 1e-3 * randn_like(g)`) on a model with dropout: each
    step's gradients, loss and the RNG after it are eager's, and the check finds the
    lowering bitwise. Before, the hook drew from the user's stream inside the check's
    backwards: the user's own backward drew other noise, and the check blamed eager
    (`eager_nondeterministic`) or, the compiled forward drawing another dropout mask after
    eager's backward, the lowering (`lowering_mismatch`)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.25), nn.ReLU(), nn.Linear(16, 4)).train()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m[0].weight.register_hook(lambda g: g + 1e-3 * torch.randn_like(g))
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": cuda_graphs})
    for i in range(5):
        x = inputs(i)
        state = torch.get_rng_state()
        reference(x).square().sum().backward()
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        compiled(x).square().sum().backward()
        assert torch.equal(torch.get_rng_state(), after), i
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), i
            p.grad = q.grad = None
    g = graph()
    assert g["lowering_check"]["status"] == "bitwise" and g["lowering_check"]["checked"] >= 3, g["lowering_check"]


def test_buffers_the_graph_writes_advance_once_per_call():
    """BatchNorm in training writes its running statistics: the check runs the graph twice
    on its calls, and the snapshot puts them back in between."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()).train()
    reference = copy.deepcopy(model)
    assert steps(model, EMULATE, 6, inputs, reference=reference) == 0
    bn, ref_bn = model[1], reference[1]
    assert torch.equal(bn.running_mean, ref_bn.running_mean) and torch.equal(bn.running_var, ref_bn.running_var)
    assert bn.num_batches_tracked.item() == 6
    g = graph()
    # 6 calls: warmup 1, the capture call verifies its inputs and a set derived from them, 4 replays
    assert g["lowering_check"] == {"checked": 3, "status": "bitwise"} and g["cuda_graph"]["replays"] == 4


def test_a_backward_that_saved_a_buffer_the_graph_writes_is_compared_and_never_raises():
    """BatchNorm in training under CPU bf16 autocast: eager's backward saves the running
    statistics the graph writes. Taken after the check put eager's world back (and the
    compiled forward wrote it again), eager's backward raised on their version counters,
    the check took that for "the user's would raise too" and passed the lowering unjudged,
    and aot's backward (which torch 2.13 traces with the batch norm's saved statistics in
    bf16, where the CPU kernel returns float32) served gradients that were not eager's.
    Eager's gradients are now taken right after its forward; an answer by eager runs it
    again rather than hand back outputs whose saved buffers were written since."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4)).train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="graphdispatch", options=EMULATE)
    for i in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        state = torch.get_rng_state()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x)
        torch.set_rng_state(state)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = reference(x)
        out.float().square().mean().backward()  # outside autocast, as the AMP recipe runs it
        want.float().square().mean().backward()
        assert torch.equal(out, want)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad)
            p.grad = q.grad = None
        for b, c in zip(model.buffers(), reference.buffers()):
            assert torch.equal(b, c)
    g = graph()
    assert g["backward"]["checks"] >= 1  # eager's and the lowered backward were compared
    if g["lowering_check"]["status"] == "lowering_mismatch":  # torch 2.13 on a CPU
        assert g["lowering_check"]["gradients"][:2] == ["0.weight", "0.bias"]


# -- the check on its own -------------------------------------------------------------------------


class _Noisy(torch.autograd.Function):
    """Identity whose backward adds noise: an eager backward that disagrees with itself."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad + float(int.from_bytes(os.urandom(2), "little"))


def _check() -> GradientCheck:
    record = GraphRecord(index=0)
    record.backward = GraphRecord(index=0, kind="backward", role="backward")
    return GradientCheck([], ["x"], make_contain(False), record)


def test_an_eager_backward_that_disagrees_with_itself_is_nondeterminism():
    x = torch.randn(4, requires_grad=True)
    check, expected = _check(), [_Noisy.apply(x)]
    verdict = check.judge(check.reference([x], expected), expected, [x * 1.0])
    assert verdict is not None and verdict.reason is Decline.EAGER_NONDETERMINISTIC
    assert verdict.gradients == ("x",) and "disagrees with itself" in verdict.detail


def test_an_output_with_history_on_one_side_only_is_a_mismatch():
    x = torch.randn(4, requires_grad=True)
    check, expected = _check(), [x * 2]
    verdict = check.judge(check.reference([x], expected), expected, [(x * 2).detach()])
    assert verdict is not None and verdict.reason is Decline.LOWERING_MISMATCH
    assert "record autograd history" in verdict.detail


def test_equal_gradients_are_no_verdict_and_count_one_backward_run():
    check, x = _check(), torch.randn(4, requires_grad=True)
    expected = [x.sin()]
    assert check.judge(check.reference([x], expected), expected, [x.sin()]) is None
    assert check._record.backward is not None and check._record.backward.checks == 1
    assert x.grad is None


def test_cotangents_are_fixed_follow_the_layout_and_leave_the_rng_alone():
    outputs = [torch.empty(3, 5).t(), torch.empty(4, dtype=torch.bfloat16)]
    state = torch.get_rng_state()
    first, second = cotangents(outputs), cotangents(outputs)
    assert torch.equal(state, torch.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert first[0].stride() == outputs[0].stride() and first[1].dtype == torch.bfloat16
