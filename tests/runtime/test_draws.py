"""An extra run's random draws (runtime/checks/draws.py, world.py): from private copies of the
generators as the call began, so that the user's generator advances once per call and no
other thread's draws are ever rewound."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphdispatch_backend import backend as backend_mod
from graphdispatch_backend.runtime.checks.draws import Start
from graphdispatch_backend.testing import accounted_graphs


def _in_thread(fn: Any) -> Any:
    got = []
    t = threading.Thread(target=lambda: got.append(fn()))
    t.start()
    t.join()
    return got[0]


def test_private_draws_are_the_global_streams_and_leave_it_alone():
    torch.manual_seed(0)
    start = Start()
    with start.private():
        a = torch.rand(4)  # an op with a generator argument: the private one is passed in
        mask = F.dropout(torch.ones(64), 0.5, training=True)  # native_dropout has none: swapped in for it
    assert torch.equal(torch.rand(4), a)  # the global generator had not moved
    assert torch.equal(F.dropout(torch.ones(64), 0.5, training=True), mask)


def test_a_thread_drawing_inside_a_private_run_is_not_rewound():
    torch.manual_seed(0)
    with Start().private():
        mine = torch.rand(4)
        theirs = _in_thread(lambda: torch.rand(4))  # another thread: the global generator
    assert torch.equal(theirs, mine)  # both streams started at the same state
    assert not torch.equal(torch.rand(4), theirs)  # the other thread's numbers are not drawn again


def test_a_thread_drawing_while_a_call_is_checked_is_not_rewound(monkeypatch):
    """The eager check runs the Dynamo graph beside the compiled one on every checked call
    (here every call). Another thread draws while it runs: its numbers are never drawn
    again. Mutation: a world that puts the global RNG back after the reference run
    (the rule removed) hands the main thread the other thread's numbers on every call."""
    made = backend_mod.generated_forward
    drawn: list[torch.Tensor] = []

    def hooked(gm: Any) -> Any:
        forward = made(gm)

        def run(*args: Any) -> Any:
            out = forward(*args)
            drawn.append(_in_thread(lambda: torch.rand(8)))  # meanwhile, in another thread
            return out

        return run

    monkeypatch.setattr(backend_mod, "generated_forward", hooked)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)).eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate", "recheck": "every"})
    repeated = 0
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(3, 8)
            assert torch.equal(compiled(x), model(x))
            repeated += torch.equal(torch.rand(8), drawn[-1])
    assert len(drawn) >= 5 and repeated == 0
    (graph,) = accounted_graphs()
    assert graph["lowering_check"]["status"] == "bitwise" and graph["cuda_graph"]["replays"] == 3


class _RaisesBetweenDraws(nn.Module):
    """Dropout, a group norm that aot's lowering runs on a layout its CPU kernel refuses
    (batch 1, a view of a transposed tensor: docs/diffusers.md), dropout again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop, self.norm = nn.Linear(64, 64), nn.Dropout(0.5), nn.GroupNorm(8, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.lin(x.flatten(2).transpose(1, 2)))
        h = h.transpose(-1, -2).view(1, 64, 16, 16) + x
        return self.drop(self.norm(h / 1))


def test_a_lowering_that_raises_between_its_draws_leaves_the_generator_where_eager_does():
    """The compiled run answers a checked call and draws from the user's generator; raising
    after its first dropout and before its second, it left the generator half-way, and
    every later call's dropout masks differed from eager's while eager answered them."""
    torch.manual_seed(0)
    model = _RaisesBetweenDraws().train()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate"})

    def run(fn: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        torch.manual_seed(1)
        with torch.no_grad():
            return [(fn(torch.randn(1, 64, 16, 16)), torch.get_rng_state()) for _ in range(3)]

    for (got, state), (want, eager_state) in zip(run(compiled), run(model)):
        assert torch.equal(got, want) and torch.equal(state, eager_state)
    (graph,) = accounted_graphs()
    assert graph["lowering_check"]["status"] == "lowering_failed"
