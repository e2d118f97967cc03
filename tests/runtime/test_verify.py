"""Verification on inputs the capture never saw (runtime/verify.py, runtime/derive.py).

Callers that build the same values anew every call (a fixed prompt, `torch.ones`, a seeded
`randn`) never supply a second distinct input set: the runner derives one from the live
values (a cyclic shift of their elements, or doubled), and the capture call verifies on it
besides its own. These tests show such loops replay from call warmup + 2, bitwise, and
that a replay right only on its capture inputs is still caught, with repeated and with
varying values; an eager that rejects the derived values falls back to waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine
from graphdispatch_backend.runtime.runner import NOT_DISTINCT_LIMIT, GraphRunner, RuntimeScope
from graphdispatch_backend.runtime.runner import verify as verify_module
from graphdispatch_backend.runtime.runner.derive import derive, permuted


def make_runner(fn: Callable[..., Sequence[Any]], *, warmup: int = 2, verify_inputs: int = 2,
                state: dict[int, str] | None = None) -> tuple[GraphRunner, CudaGraphStats]:
    scope = RuntimeScope(HostReplayEngine(), Timing(), Events(), make_contain(False))
    stats = CudaGraphStats()
    runner = GraphRunner(fn, "piece", scope, stats, warmup=warmup, max_captures=8, verify_inputs=verify_inputs,
                         state_names=state or {})
    return runner, stats


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def affine(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    return (x @ w + 1.0,)


def run_loop(runner: GraphRunner, ref: Callable[..., Any], make_args: Callable[[], tuple[Any, ...]],
             calls: int) -> list[bool]:
    """Call `calls` times with freshly made arguments; True per call that replayed. Every
    output is compared with eager at the end (a later replay must not change it)."""
    got, want, replayed, keep = [], [], [], []
    for _ in range(calls):
        before = runner._stats.replays
        args = make_args()
        keep.append(args)  # alive: a new tensor is never at an old one's address (PtrMemo keys by address)
        got.append(runner(*args))
        want.append(ref(*args))
        replayed.append(runner._stats.replays > before)
    assert all(same(g, w) for g, w in zip(got, want))
    return replayed


# -- derive ------------------------------------------------------------------------------------


def test_permutation_keeps_the_values_and_the_layout():
    ids = torch.arange(12).reshape(3, 4).t()  # strided: the derived set keeps the strides
    out = permuted(ids, salt=0)
    assert out.stride() == ids.stride() and out.dtype == ids.dtype
    assert sorted(out.flatten().tolist()) == sorted(ids.flatten().tolist())
    assert not torch.equal(out, ids)
    assert not torch.equal(permuted(ids, salt=1), out)  # another salt, another set


def test_derived_sets_keep_the_inputs_alignment():
    # eager on the derived set must take the path the replay's static buffer (which keeps
    # the caller's alignment mod 16) does: kernels choose vectorized paths by it
    for offset in (1, 2, 3):
        x = torch.randn(40)[offset:]
        for values in derive([x], salt=0):
            assert values[0].data_ptr() % 16 == x.data_ptr() % 16 and values[0].stride() == x.stride()
        ones = torch.ones(40)[offset:]
        doubled = next(derive([ones], salt=0))
        assert doubled[0].data_ptr() % 16 == ones.data_ptr() % 16


def test_single_valued_float_is_doubled_and_single_valued_int_has_no_set():
    (doubled,) = derive([torch.ones(3, 4)], salt=0)
    assert torch.equal(doubled[0], torch.full((3, 4), 2.0))
    # derive makes its candidates one at a time (a generator): none at all here
    assert list(derive([torch.full((5,), 7, dtype=torch.int64)], salt=0)) == []
    assert list(derive([torch.zeros(5, dtype=torch.bool)], salt=0)) == []
    assert list(derive([torch.zeros(4)], salt=0)) == []  # zero doubles to zero


# -- the runner ----------------------------------------------------------------------------------


@pytest.mark.parametrize("values", ["randn", "ones", "arange"])
def test_repeated_values_replay_from_warmup_plus_two(values):
    runner, stats = make_runner(affine, warmup=3, verify_inputs=2)
    w = torch.randn(4, 4)
    make = {"randn": lambda: torch.randn(3, 4, generator=torch.Generator().manual_seed(7)),
            "ones": lambda: torch.ones(3, 4),
            "arange": lambda: torch.arange(12.0).reshape(3, 4)}[values]
    replayed = run_loop(runner, affine, lambda: (make(), w), 12)
    assert replayed.index(True) == 3 + 1  # call 5: warmup 3, then the capture call verifies live + derived
    assert all(replayed[4:])
    assert stats.declines == {} and stats.eager_by_reason == {"warmup": 3, "verifying": 1}


def test_the_same_tensors_every_call_replay_from_warmup_plus_three():
    """Nothing moves (each input the same object, read in place): no set can be derived in
    memory the caller owns, so the capture call verifies its own inputs and the next call,
    which may hold other values by then, is the second set (docs/guarantees.md)."""
    runner, stats = make_runner(affine, warmup=2, verify_inputs=2)
    args = (torch.randn(3, 4), torch.randn(4, 4))
    replayed = run_loop(runner, affine, lambda: args, 8)
    assert replayed.index(True) == 2 + 2 and all(replayed[4:])
    assert stats.declines == {} and stats.eager_by_reason == {"warmup": 2, "verifying": 2}


def test_outputs_that_no_input_changes_take_a_second_verifying_call():
    """A zero-initialized projection (a fresh ControlNet's) returns zeros whatever it is
    given: the derived set's outputs are the live ones and show nothing more, so the next
    call with other values is the second set (docs/report.md, `verifying`); its contrast,
    the same graph with weights, replays a call sooner."""
    def zeroed(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        return (x @ w,)

    for w, verifying in ((torch.zeros(4, 4), 2), (torch.randn(4, 4), 1)):
        runner, stats = make_runner(zeroed, warmup=1, verify_inputs=2)
        replayed = run_loop(runner, zeroed, lambda w=w: (torch.randn(3, 4), w), 8)
        assert replayed.index(True) == 1 + verifying and all(replayed[1 + verifying:])
        assert stats.declines == {} and stats.eager_by_reason == {"warmup": 1, "verifying": verifying}


def test_repeated_integer_ids_are_permuted_not_invented():
    """An embedding lookup: a derived set outside the id range would raise; a permutation stays valid."""
    table = torch.randn(10, 4)
    seen: list[torch.Tensor] = []

    def lookup(ids: torch.Tensor) -> tuple[torch.Tensor]:
        seen.append(ids.clone())
        return (table[ids],)

    runner, stats = make_runner(lookup)
    replayed = run_loop(runner, lambda ids: (table[ids],), lambda: (torch.tensor([[1, 5, 9], [2, 2, 0]]),), 8)
    assert any(replayed) and stats.declines == {}
    assert all(set(s.flatten().tolist()) <= {0, 1, 2, 5, 9} for s in seen)


def test_single_repeated_integer_value_waits_says_so_and_verifies_at_the_first_other_value(caplog, monkeypatch):
    """One token id repeated (a recurrent decode step on a random model): no derived set
    exists. Past the limit the calls are answered eagerly, counted and said once, with no
    derived set tried again; the capture is kept, and the first call with another id
    verifies it (it used to decline for good: a Mamba server never replayed again)."""
    runner, stats = make_runner(lambda ids, w: (w[ids] * 2,))
    w = torch.randn(8, 3)
    tries = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        tries.append(1)
        return derive(*args, **kwargs)

    monkeypatch.setattr(verify_module, "derive", counted)
    repeated = 3 + NOT_DISTINCT_LIMIT + 4
    ids = iter([[3] * 4] * repeated + [[1, 4, 6, 3]] + [[5] * 4] * 4)  # a new tensor each call
    replayed = run_loop(runner, lambda ids, w: (w[ids] * 2,), lambda: (torch.tensor(next(ids)), w), repeated + 5)
    assert not any(replayed[:repeated + 1]) and all(replayed[repeated + 1:]), replayed
    assert stats.declines == {"verify_inputs_not_distinct": 1}
    assert "one repeated integer or bool value" in stats.decline_details["verify_inputs_not_distinct"]
    past = repeated - 2 - 1 - (NOT_DISTINCT_LIMIT + 1)  # less warmups, the capture call, the calls that waited
    assert stats.eager_by_reason["verify_inputs_not_distinct"] == past, stats.eager_by_reason
    assert len(tries) == 1 + NOT_DISTINCT_LIMIT + 1  # the capture call's, then each wait's: none after
    assert caplog.text.count("held back") == 1 and "same tensor object" in caplog.text
    assert "declined" not in caplog.text


class PtrMemo:
    """The stale-read double: a kernel with a host-side cache keyed by input address, right
    on its capture inputs and on every fresh tensor, stale on the static buffer once its
    values change (what a graph that reads a captured address instead of the buffer does).
    The cache keeps each tensor it saw alive, as the runner's and the mutation tests' doubles
    do: the runner's own derived sets are freed, and a later call's fresh tensor put at one
    of their addresses would read the double's stale entry in plain eager too."""

    def __init__(self) -> None:
        self.memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        hit = self.memo.get(x.data_ptr())
        if hit is None:
            hit = self.memo[x.data_ptr()] = (x, x * 2 + 1)
        return (hit[1] + 0,)


@pytest.mark.parametrize("repeated", [True, False], ids=["repeated values", "varying values"])
def test_a_replay_right_only_on_its_capture_inputs_is_caught(repeated):
    runner, stats = make_runner(PtrMemo())
    base = torch.randn(6)
    replayed = run_loop(runner, lambda x: (x * 2 + 1,), lambda: (base.clone() if repeated else torch.randn(6),), 10)
    assert not any(replayed)
    assert stats.declines == {"verify_mismatch": 1}


def test_eager_that_rejects_the_derived_values_falls_back_to_waiting():
    """A data-dependent check: the first element must stay the largest. Any cyclic shift of the
    live values breaks it, so eager raises on the derived set: contained, the runner waits for
    distinct live values, and a distinct call then verifies. The check is asynchronous (a
    device-side assert): a host read (`bool()`) would make the capture fail, as on a GPU."""
    def checked(x: torch.Tensor) -> tuple[torch.Tensor]:
        torch._assert_async(x[0] == x.max(), "x[0] must be the largest")
        return (x * 3,)

    runner, stats = make_runner(checked)
    same_values = lambda: (torch.tensor([9.0, 1.0, 2.0, 3.0]),)
    replayed = run_loop(runner, checked, same_values, 5)
    assert not any(replayed) and stats.declines == {}
    assert stats.eager_by_reason == {"warmup": 2, "verifying": 3}
    replayed = run_loop(runner, checked, lambda: (torch.tensor([8.0, 1.0, 5.0, 3.0]),), 3)
    assert replayed == [False, True, True] and stats.declines == {}


def test_a_module_that_updates_a_buffer_in_forward_replays():
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.steps += 1
            return self.lin(x) * self.steps

    torch.manual_seed(0)
    model, ref = Counter().eval(), Counter().eval()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"cuda_graphs": "emulate", "warmup": 3, "verify_inputs": 2})
    import graphdispatch_backend

    with torch.no_grad():
        for i in range(12):
            x = torch.ones(2, 4)
            assert same(compiled(x), ref(x)), f"call {i + 1}"
            assert torch.equal(model.steps, ref.steps)
    cg = graphdispatch_backend.latest_report()["graphs"][0]["cuda_graph"]
    # 3 warmups, the capture call verifies (x doubled is its derived set), then replays
    assert cg["replays"] == 12 - (3 + 1) and cg["eager_calls"] == 4 and cg["declines"] == {}
