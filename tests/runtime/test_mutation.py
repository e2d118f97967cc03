"""Mutation tests: with one identity check removed, some scenario returns a WRONG output.

For every check the runner relies on (pinned address, pinned layout, parameter identity,
scalar constants in the key, moving copy-in, output clone, verify before publish) a
scenario is run twice: as shipped, every output is bitwise equal to eager; with that one
check monkeypatched away, at least one output is stale or poisoned. This is the proof that
the CPU suite (HostReplayEngine replays against the storages it captured, like a CUDA graph)
catches a missing check. Each property is checked once per call: the addresses of pinned
inputs and parameters by one pointer comparison; their layouts by Dynamo's guards through
compile, and by LayoutIdentity for a runner driven directly.

Not covered, and why: the artifact-demotion check (an entry re-captures when a gate in it
was demoted) cannot fail on CPU, because HostReplayEngine re-runs the gate's Python on every
replay and so always sees the demotion; a CUDA graph would keep replaying the artifact's
kernels.
"""

from __future__ import annotations

import dataclasses
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
from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.call.contract import LayoutIdentity
from graphdispatch_backend.runtime.checks import eager_check as eager_check_mod
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine
from graphdispatch_backend.runtime.runner import GraphRunner, RuntimeScope
from graphdispatch_backend.runtime.runner import lookup as runner_mod
from graphdispatch_backend.runtime.runner import record as record_mod
from graphdispatch_backend.runtime.runner.inputs import InputPlan
from graphdispatch_backend.runtime.runner.verify import Verifier
from graphdispatch_backend.testing import serve_patches


def make_runner(fn: Callable[..., Sequence[Any]], *, warmup: int = 2, verify_inputs: int = 1,
                state: dict[int, str] | None = None) -> GraphRunner:
    scope = RuntimeScope(HostReplayEngine(), Timing(), Events(), make_contain(False))
    return GraphRunner(fn, "piece", scope, CudaGraphStats(), warmup=warmup, max_captures=8,
                       verify_inputs=verify_inputs, state_names=state or {})


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def count_wrong(fn: Callable[..., Any], ref: Callable[..., Any], calls: Sequence[Callable[[], tuple[Any, ...]]]) -> int:
    """Run `fn` and `ref` on each call's arguments (made just before the call); compare every
    output held by the caller with eager's at the END, so an output that a later replay
    overwrote counts as wrong too."""
    got, want = [], []
    with torch.no_grad():
        for make_args in calls:
            args = make_args()
            got.append(fn(*args))
            want.append(ref(*args))
    return sum(not same(g, w) for g, w in zip(got, want))


def affine(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    return (x @ w + 1.0,)


def fresh(*shape: int) -> Callable[[], torch.Tensor]:
    keep: list[torch.Tensor] = []  # kept alive: each new tensor is at a new address (a moving input)

    def make() -> torch.Tensor:
        keep.append(torch.randn(*shape))
        return keep[-1]

    return make


# -- scenarios: each returns how many outputs were wrong ---------------------------------------


def pinned_input_replaced() -> int:
    """x stays put during warmup (pinned, read in place); then the caller passes a new tensor."""
    runner = make_runner(affine)
    x, w, new = torch.randn(3, 4), torch.randn(4, 4), fresh(3, 4)
    return count_wrong(runner, affine, [lambda: (x, w)] * 4 + [lambda: (new(), w)] * 3)


def parameter_restrided_in_place() -> int:
    """A parameter replaced by a restrided view of the same block: same address, new layout."""
    runner = make_runner(affine, state={1: "lin.weight"})
    w, x = torch.randn(4, 4), fresh(3, 4)
    return count_wrong(runner, affine, [lambda: (x(), w)] * 4 + [lambda: (x(), w.t())] * 3)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.lin(x))


def parameter_moved_through_compile() -> int:
    """`module.weight.data = new` (what FSDP2 reshard and offload do) between two replays."""
    torch.manual_seed(0)
    model = _Block().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate", "warmup": 2})
    x = fresh(2, 8)

    def move() -> tuple[torch.Tensor]:
        model.lin.weight.data = torch.randn(8, 8)
        return (x(),)

    return count_wrong(compiled, model, [lambda: (x(),)] * 6 + [move] + [lambda: (x(),)] * 5)


def scalar_changed() -> int:
    def scaled(x: torch.Tensor, n: int, s: float) -> tuple[torch.Tensor]:
        return (x * n + s,)

    runner = make_runner(scaled)
    x = fresh(4)
    return count_wrong(runner, scaled, [lambda: (x(), 2, 0.5)] * 4 + [lambda: (x(), 3, 0.5), lambda: (x(), 2, -1.0)])


def dynamic_int_through_compile() -> int:
    def f(x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n + n

    compiled = torch.compile(f, backend="graphdispatch", options={"cuda_graphs": "emulate", "warmup": 2},
                             dynamic=True)
    x = fresh(4)
    return count_wrong(compiled, f, [lambda: (x(), 2)] * 5 + [lambda: (x(), 3)] * 3)


def moving_input_changes(verify_inputs: int) -> Callable[[], int]:
    def scenario() -> int:
        runner = make_runner(affine, verify_inputs=verify_inputs)
        w, x = torch.randn(4, 4), fresh(3, 4)
        return count_wrong(runner, affine, [lambda: (x(), w)] * 7)

    return scenario


def outputs_held_across_replays() -> int:
    runner = make_runner(affine)
    w, x = torch.randn(4, 4), fresh(3, 4)
    return count_wrong(runner, affine, [lambda: (x(), w)] * 7)


class PtrMemo:
    """A kernel with a host-side cache keyed by input address: right on every fresh tensor
    and on the capture inputs, stale on the static buffer once its values change."""

    def __init__(self) -> None:
        self.memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        hit = self.memo.get(x.data_ptr())
        if hit is None:
            hit = self.memo[x.data_ptr()] = (x, x * 2 + 1)
        return (hit[1] + 0,)


def kernel_right_only_on_capture_inputs() -> int:
    runner = make_runner(PtrMemo(), verify_inputs=2)
    x = fresh(4)
    return count_wrong(runner, lambda t: (t * 2 + 1,), [lambda: (x(),)] * 8)


# -- the checks, and how each is removed --------------------------------------------------------


def _always(value: bool) -> Callable[..., bool]:
    return lambda *args, **kwargs: value


def _ignoring(reason: Decline) -> Callable[..., Any]:
    real = GraphRunner._check

    def check(self: GraphRunner, entry: Any, args: Sequence[Any]) -> Any:
        problem = real(self, entry, args)
        return None if problem is not None and problem[0] is reason else problem

    return check


def _no_copy_in(self: InputPlan, args: Sequence[Any]) -> None:
    pass


def _serve_static_outputs(entry: Any, args: Sequence[Any], streams: Any) -> list[Any]:
    """A replay that hands out the static outputs themselves instead of copies."""
    entry.inputs.copy_in(args)
    entry.graph.replay()
    return list(entry.graph.outputs)


NO_ADDRESS_CHECK = (record_mod, "picker", lambda positions: lambda args: ())


@dataclasses.dataclass(frozen=True)
class Mutation:
    check: str
    patches: tuple[tuple[Any, str, Any], ...]  # (owner, attribute, replacement)
    scenario: Callable[[], int]

    def apply(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for owner, name, value in self.patches:
            monkeypatch.setattr(owner, name, value)


def _tensors_only(values: Any) -> tuple[Any, ...]:
    """The runner's shape key without its scalars (the mutation of the constants check)."""
    return tuple((v.shape, v.stride()) for v in values if isinstance(v, torch.Tensor))
# Through compile, the eager check (runtime/checks/eager_check.py) compares the first call of each
# new shape key with real eager, and would catch a runner that replays a stale constant on
# it: a second line of defence (test_eager_check_catches_a_stale_constant). These mutations
# test the runner's own check, so that line is switched off for them.
NO_EAGER_CHECK = (eager_check_mod, "MAX_KEYS", 0)

MUTATIONS = [
    Mutation("pinned address", (NO_ADDRESS_CHECK,), pinned_input_replaced),
    Mutation("parameter address", (NO_ADDRESS_CHECK, NO_EAGER_CHECK), parameter_moved_through_compile),
    Mutation("pinned layout and strides", ((LayoutIdentity, "layouts_match", _always(True)),),
             parameter_restrided_in_place),
    Mutation("parameter layout declines at replay", ((GraphRunner, "_check", _ignoring(Decline.PARAMETER_MOVED)),),
             parameter_restrided_in_place),
    Mutation("scalar constants in the key", ((runner_mod, "layout_key", _tensors_only),), scalar_changed),
    Mutation("scalar constants in the key, through compile", ((runner_mod, "layout_key", _tensors_only),
                                                              NO_EAGER_CHECK),
             dynamic_int_through_compile),
    Mutation("moving copy-in", ((InputPlan, "fill", InputPlan.copy_in), (InputPlan, "copy_in", _no_copy_in)),
             moving_input_changes(verify_inputs=1)),  # the capture still gets its first values
    Mutation("output clone", serve_patches(_serve_static_outputs), outputs_held_across_replays),
    Mutation("verify before publish", ((Verifier, "judge", lambda self, *args: None),),
             kernel_right_only_on_capture_inputs),
]
IDS = [m.check for m in MUTATIONS]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=IDS)
def test_with_the_check_every_output_is_right(mutation: Mutation):
    assert mutation.scenario() == 0


@pytest.mark.parametrize("mutation", MUTATIONS, ids=IDS)
def test_without_the_check_some_output_is_wrong(mutation: Mutation, monkeypatch: pytest.MonkeyPatch):
    mutation.apply(monkeypatch)
    assert mutation.scenario() > 0


# -- defence in depth ------------------------------------------------------------------------------


def test_verification_catches_a_missing_copy_in(monkeypatch):
    """With verify_inputs=2 the second, distinct input set exposes the missing copy-in
    before the graph serves: it declines (verify_mismatch) and every output stays right."""
    monkeypatch.setattr(InputPlan, "fill", InputPlan.copy_in)
    monkeypatch.setattr(InputPlan, "copy_in", _no_copy_in)
    runner = make_runner(affine, verify_inputs=2)
    w, x = torch.randn(4, 4), fresh(3, 4)
    assert count_wrong(runner, affine, [lambda: (x(), w)] * 7) == 0
    assert runner._stats.declines == {"verify_mismatch": 1}


def test_eager_check_catches_a_moved_parameter_at_its_first_call(monkeypatch):
    """With the runner's address check gone, a parameter moved between replays is a new
    state of the graph, whose first call the eager check compares with real eager
    (runtime/checks/schedule.py, per weights): the stale replay is answered eagerly."""
    monkeypatch.setattr(*NO_ADDRESS_CHECK)
    assert parameter_moved_through_compile() == 0


def test_eager_check_catches_a_stale_constant(monkeypatch):
    """With the runner's scalar key gone, the new shape key's first call is still compared
    with real eager: the stale replay is caught there and answered eagerly, and since the
    graph run eagerly matches eager, the capture takes the blame (runtime/checks/isolate.py): the
    replayed entry declines verify_mismatch, the lowering stays, no output is wrong."""
    monkeypatch.setattr(runner_mod, "layout_key", _tensors_only)
    assert dynamic_int_through_compile() == 0
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    assert graph["lowering_check"]["status"] == "bitwise"
    assert "verify_mismatch" in graph["cuda_graph"]["declines"]
