"""A matmul aot traced unfolded where eager folds it (capture/matmul_folds.py): a Linear on a
transposed activation under CPU bf16 autocast, with parameters that require grad, differs
from eager on a few inputs only. Such a graph is declined before its first call, every
output eager's; `requires_grad_(False)`, the fix the message names, makes it replay."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from graphdispatch_backend import backend as backend_mod
from graphdispatch_backend.testing import accounted_graphs

CALLS = 60


class Attend(nn.Module):
    """A diffusers attention block's projection: `to_q` on `hidden_states.transpose(1, 2)`."""

    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_q(x.transpose(1, 2)) * 2.0


def _serve(model: nn.Module) -> tuple[int, dict[str, Any]]:
    """CALLS calls under bf16 autocast and no_grad; how many differed from eager, and the graph."""
    torch.manual_seed(0)
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    gen = torch.Generator().manual_seed(1)
    wrong = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(CALLS):
            x = (torch.randn(2, 32, 64, generator=gen) * (1 + i % 5)).bfloat16()
            wrong += not torch.equal(compiled(x), model(x))
    (graph,) = accounted_graphs()
    return wrong, graph


def _mm_and_bmm_differ() -> bool:
    """Whether eager's folded `mm` and the traced `bmm` give other bf16 bits on `_serve`'s
    inputs here: they do on an AVX2 CPU (a few inputs of the 60), and agreed on every one
    on an AVX512-BF16 CPU (an AMD EPYC, 2026-12-07), whose bf16 kernels accumulate alike."""
    w = torch.randn(32, 32).bfloat16()
    gen = torch.Generator().manual_seed(1)
    for i in range(CALLS):
        x = (torch.randn(2, 32, 64, generator=gen) * (1 + i % 5)).bfloat16().transpose(1, 2)
        if not torch.equal(torch.mm(x.reshape(-1, 32), w.t()).view(2, 64, 32), torch.bmm(x, w.t().expand(2, 32, 32))):
            return True
    return False


def test_a_matmul_eager_folds_is_declined_before_its_first_call_and_names_the_fix() -> None:
    wrong, graph = _serve(Attend())
    assert wrong == 0
    check = graph["lowering_check"]
    assert check["status"] == "lowering_unfaithful" and check["checked"] == 0
    assert "to_q.weight" in check["detail"] and "requires_grad_(False)" in check["detail"]
    assert graph["cuda_graph"]["eager_by_reason"] == {"lowering_unfaithful": CALLS}


def test_with_the_fix_it_replays_bitwise() -> None:
    wrong, graph = _serve(Attend().requires_grad_(False))
    assert wrong == 0
    assert graph["lowering_check"]["status"] == "bitwise" and graph["cuda_graph"]["replays"] == CALLS - 2


def test_served_anyway_some_calls_between_checks_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the decline is for: served, the lowering passes the calls its checks pick and
    differs from eager on others."""
    if not _mm_and_bmm_differ():
        pytest.skip(f"this CPU's bf16 mm and bmm agree on these inputs "
                    f"({torch.backends.cpu.get_cpu_capability()}): nothing to serve otherwise")
    monkeypatch.setattr(backend_mod, "unfolded_matmul", lambda *args: None)
    wrong, graph = _serve(Attend())
    assert wrong > 0 and graph["lowering_check"]["status"] == "bitwise"
