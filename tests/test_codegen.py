"""codegen.py: a deferred forward (the graph as aot lowered it, for a fallback most graphs
never run) generates no code until its first call, then runs as the generated forward of
the graph as it was, and FX forgets its source when it goes."""

from __future__ import annotations

import gc
import threading

import torch
import torch.fx as fx
from torch import nn
from torch.fx.graph_module import _loader

from graphdispatch_backend.codegen import deferred_forward, generated_forward


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("shift", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + self.shift


def _traced() -> fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    model = _Model().eval()
    return make_fx(lambda x: model(x))(torch.randn(2, 4))  # ATen ops, the weights as attributes


def _sources() -> dict[str, str]:
    return dict(_loader.eval_cache)


def test_a_deferred_forward_generates_its_code_at_its_first_call_as_the_graph_was():
    gm = _traced()
    x = torch.randn(2, 4)
    want = generated_forward(gm)(x)
    before = _sources()
    native = deferred_forward(gm)
    assert _sources().keys() == before.keys()  # nothing generated yet
    for node in list(gm.graph.nodes):  # the graph changes after (the passes): the copy does not
        if node.op == "call_function" and node.target is torch.ops.aten.relu.default:
            node.target = torch.ops.aten.sigmoid.default
    gm.recompile()
    before = _sources()
    assert torch.equal(native(x), want)
    made = [k for k, source in _sources().items() if k not in before and "graphdispatch_ops_aten_relu" in source]
    assert len(made) == 1
    assert torch.equal(native(x), want)  # generated once
    assert [k for k, source in _sources().items() if k not in before and "relu" in source] == made
    del native
    gc.collect()
    assert made[0] not in _sources()  # forgotten with it


def test_threads_racing_to_the_first_call_generate_it_once():
    gm = _traced()
    x = torch.randn(2, 4)
    native = deferred_forward(gm)
    before = _sources()
    outs: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: outs.append(native(x))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outs) == 4 and all(torch.equal(o, outs[0]) for o in outs)
    assert len([k for k, source in _sources().items() if k not in before and "relu" in source]) == 1
