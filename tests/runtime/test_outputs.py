"""Outputs as eager returns them (runtime/runner/outputs.py): outputs that share memory
come back sharing it, views of an input stay views of the caller's tensor, stride-0 and
overlapping layouts keep their strides; verification compares aliasing as well as values
and strides, so a runner that copied each output on its own would not serve."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import graphdispatch_backend
from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine
from graphdispatch_backend.runtime.runner import GraphRunner, RuntimeScope
from graphdispatch_backend.runtime.runner import outputs as outputs_mod


def make_runner(fn: Callable[..., Sequence[Any]], **kw: Any) -> tuple[GraphRunner, CudaGraphStats]:
    scope = RuntimeScope(HostReplayEngine(), Timing(), Events(), make_contain(False))
    stats = CudaGraphStats()
    options = {"warmup": 2, "max_captures": 8, "verify_inputs": 2, "state_names": {}, **kw}
    return GraphRunner(fn, "piece", scope, stats, **options), stats


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def aliasing(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
    """Per output: (index of the first input or output sharing its storage, offset)."""
    seen: dict[int, str] = {storage(t): f"in{i}" for i, t in enumerate(ins)}
    shape = []
    for i, t in enumerate(outs):
        shape.append((seen.get(storage(t), "own"), t.storage_offset(), t.stride()))
        seen.setdefault(storage(t), f"out{i}")
    return shape


def drive(fn: Callable[..., Sequence[Any]], make: Callable[[], tuple[torch.Tensor, ...]], calls: int = 8,
          **kw: Any) -> tuple[CudaGraphStats, list[Any]]:
    runner, stats = make_runner(fn, **kw)
    keep, got = [], []
    for _ in range(calls):
        args = make()
        keep.append(args)
        out, want = runner(*args), fn(*args)
        assert aliasing(out, args) == aliasing(want, args)
        assert all(torch.equal(o, w) for o, w in zip(out, want))
        got.append((out, args))
    return stats, got


SHAPES = {
    "y and y.chunk(2)": (lambda x: (lambda y: (y, *y.chunk(2)))(x @ x.t() + 1), lambda: (torch.randn(4, 4),)),
    "unsafe_split": (lambda x: (x * 3).unsafe_split(2), lambda: (torch.randn(4, 2),)),
    "expand": (lambda x: ((x * 2).expand(3, 4, 8),), lambda: (torch.randn(4, 8),)),
    "broadcast_to": (lambda x: (torch.broadcast_to(x.sum(0), (5, 8)),), lambda: (torch.randn(4, 8),)),
    "unfold (overlapping)": (lambda x: ((x + 1).unfold(0, 3, 1),), lambda: (torch.randn(6, 2),)),
    "a view of an input": (lambda x: (x[1:], x * 2), lambda: (torch.randn(4, 3),)),
    "a transposed input view": (lambda x: (x.t(), x.sum()), lambda: (torch.randn(3, 5),)),
    "a conjugate view (ihfft)": (lambda x: (torch.fft.ihfft(x),), lambda: (torch.randn(8),)),
    "negative and conjugate views": (lambda x: (lambda y: (y.conj().imag, y.conj(), x.conj()))(x * 2),
                                     lambda: (torch.randn(4, dtype=torch.cfloat),)),
}
VIEW_BITS = ["a conjugate view (ihfft)", "negative and conjugate views"]


@pytest.mark.parametrize("name", SHAPES)
def test_outputs_replay_with_eagers_aliasing_and_strides(name):
    fn, make = SHAPES[name]
    stats, got = drive(fn, make)
    assert stats.replays > 0 and stats.declines == {}, (stats.declines, stats.decline_details)
    # a view of the caller's input is the caller's tensor, not a copy of the static buffer
    for out, args in got[-2:]:
        for o, w in zip(out, fn(*args)):
            if storage(w) == storage(args[0]):
                assert storage(o) == storage(args[0])


def test_a_held_output_is_not_changed_by_later_replays():
    fn, make = SHAPES["y and y.chunk(2)"]
    _, got = drive(fn, make, calls=10)
    for out, args in got:
        assert all(torch.equal(o, w) for o, w in zip(out, fn(*args)))


def _copy_each(self: Any, outputs: Sequence[Any], static_args: Sequence[Any], views: dict[int, int]) -> None:
    """The rule removed: every output copied on its own (no groups, no views)."""
    _real_init(self, outputs, static_args, {})
    self._items = [(0, o) if not isinstance(o, torch.Tensor) else None for o in outputs]
    srcs, makers = [], []
    for i, o in enumerate(outputs):
        if isinstance(o, torch.Tensor):
            self._items[i] = (1, len(srcs), -1, (), (), o.dtype, 0)
            srcs.append(o)
            makers.append((tuple(o.shape), torch.empty(o.shape).stride(), o.dtype, o.device))
    self._srcs, self._makers = srcs, makers


_real_init = outputs_mod.OutputPlan.__init__


@pytest.mark.parametrize("name", ["y and y.chunk(2)", "expand", "unfold (overlapping)", "a view of an input"])
def test_without_the_rule_verification_refuses_to_serve(name, monkeypatch):
    monkeypatch.setattr(outputs_mod.OutputPlan, "__init__", _copy_each)
    fn, make = SHAPES[name]
    runner, stats = make_runner(fn)
    for _ in range(6):
        runner(*make())
    assert stats.replays == 0 and set(stats.declines) == {"verify_mismatch"}, stats.decline_details


@pytest.mark.parametrize("name", VIEW_BITS)
def test_lazy_view_bits_come_back_as_eager_returns_them(name):
    fn, make = SHAPES[name]
    stats, got = drive(fn, make)
    assert stats.replays > 0 and stats.declines == {}, stats.decline_details
    for out, args in got[-3:]:
        want = fn(*args)
        assert [(o.is_conj(), o.is_neg(), o._is_view()) for o in out] == [
            (w.is_conj(), w.is_neg(), w._is_view()) for w in want]


@pytest.mark.parametrize("name", VIEW_BITS)
def test_without_the_bits_verification_refuses_to_serve(name, monkeypatch):
    monkeypatch.setattr(outputs_mod, "view_bits", lambda t: 0)  # copied as stored, bits not given back
    fn, make = SHAPES[name]
    runner, stats = make_runner(fn)
    for _ in range(6):
        args = make()
        assert all(torch.equal(o, w) for o, w in zip(runner(*args), fn(*args)))
    assert stats.replays == 0 and set(stats.declines) == {"verify_mismatch"}, stats.decline_details


def test_as_strided_reads_outside_the_view_through_the_whole_storage():
    """The graph reads its input with as_strided past the view's own extent (its row is a
    slice of a wider one): the static buffer holds the whole storage, copied each call."""
    def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.as_strided(x, (2, 8), (8, 1), x.storage_offset()) * 2,)

    def make() -> tuple[torch.Tensor]:
        return (torch.randn(2, 8)[:, :4],)

    stats, _ = drive(fn, make, wide=(0,))
    assert stats.replays > 0 and stats.declines == {}
    runner, stats = make_runner(fn)  # the rule removed: a buffer of the view's own extent
    for _ in range(6):
        args = make()
        assert torch.equal(runner(*args)[0], fn(*args)[0])
    # the read past the buffer fails to capture (or would verify wrong): the fast path is lost
    assert stats.replays == 0 and set(stats.declines) <= {"capture_failed", "verify_mismatch"}


def _strided_same_values(monkeypatch: pytest.MonkeyPatch | None) -> CudaGraphStats:
    """as_strided past the view's extent, and the same values on every call: verification
    needs a derived set, made over the whole storage the graph reads."""
    from graphdispatch_backend.runtime.runner import verify as verify_mod

    if monkeypatch is not None:  # the rule removed: derived over the view's elements only
        real = verify_mod.derive
        monkeypatch.setattr(verify_mod, "derive", lambda moving, salt, wide=None: real(moving, salt))

    def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.as_strided(x, (2, 8), (8, 1), x.storage_offset()) * 2,)

    def make() -> tuple[torch.Tensor]:
        return (torch.randn(2, 8, generator=torch.Generator().manual_seed(0))[:, :4],)

    stats, _ = drive(fn, make, wide=(0,))
    return stats


def test_a_derived_set_of_an_input_read_with_as_strided_covers_its_whole_storage():
    stats = _strided_same_values(None)
    assert stats.replays > 0 and stats.declines == {}, stats.decline_details


def test_without_the_rule_the_derived_set_fails(monkeypatch):
    stats = _strided_same_values(monkeypatch)  # never verified: every call answered eagerly
    assert stats.replays == 0 and stats.eager_by_reason["verifying"] > 2, stats


# -- through torch.compile ----------------------------------------------------------------------


class Chunked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.lin(x)
        return y, y.chunk(2)[1], (y * 2).expand(3, 4, 8), (y + 1).unfold(0, 2, 1)


def test_aliased_outputs_through_compile_replay_as_eager_returns_them():
    torch.manual_seed(0)
    model = Chunked().eval()
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"cuda_graphs": "emulate", "warmup": 2, "verify_inputs": 2})
    with torch.no_grad():
        for _ in range(8):
            x = torch.randn(4, 8)
            got, want = compiled(x), model(x)
            assert aliasing(got, [x]) == aliasing(want, [x])
            assert all(g.stride() == w.stride() and torch.equal(g, w) for g, w in zip(got, want))
    cg = graphdispatch_backend.latest_report()["graphs"][0]["cuda_graph"]
    # 2 warmups, the capture call verifies live and derived inputs, then 5 replays
    assert cg["replays"] == 5 and cg["declines"] == {}
