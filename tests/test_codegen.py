"""codegen.py: a deferred forward (the graph as aot lowered it, for a fallback most graphs
never run) generates no code until its first call, then runs as the generated forward of
the graph as it was, and FX forgets its source when it goes. Inductor's generated `call`,
bound (`bound_call`), enters no Python frame for the ATen calls it makes, computes the same,
and leaves Inductor's module as it was."""

from __future__ import annotations

import functools
import gc
import sys
import threading

import torch
import torch.fx as fx
from torch import nn
from torch.fx.graph_module import _loader

from graphdispatch_backend.codegen import bound_call, deferred_forward, generated_forward


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


def _op_frames(fn, *args) -> tuple[int, object]:
    """(the `OpOverload.__call__` frames `fn(*args)` entered, what it returned)."""
    entered = []

    def count(frame, event, arg):
        if event == "call" and frame.f_code is torch._ops.OpOverload.__call__.__code__:
            entered.append(1)

    sys.setprofile(count)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
    return len(entered), out


def test_inductors_call_bound_makes_its_aten_calls_without_a_python_frame():
    from torch._inductor.output_code import CompiledFxGraph

    from graphdispatch_backend.fusion import inductor
    from graphdispatch_backend.fusion.recipe import recipe_for
    from graphdispatch_backend.testing import aten_graph

    def block(x, w):  # gelu and layer norm kept by the exact recipe: ATen calls in Inductor's code
        h = torch.nn.functional.gelu(x @ w) * 2 + 1
        return torch.nn.functional.layer_norm(h, (h.shape[-1],)) - x

    args = (torch.randn(8, 16), torch.randn(16, 16))
    segment = inductor.compile_segment(aten_graph(block, *args).gm, recipe_for("cpu"), frozenset())
    graphs = [c.cell_contents for c in segment.run.__closure__ if isinstance(c.cell_contents, inductor._Boxed)]
    graph = graphs[0]._graph
    assert isinstance(graph, CompiledFxGraph)
    plain = graph.current_callable
    module_torch = plain.__func__.__globals__["torch"]
    frames, want = _op_frames(plain, list(args))
    assert frames >= 3  # mm, gelu, layer norm: each through OpOverload.__call__
    bound = bound_call(plain)
    frames, got = _op_frames(bound, list(args))
    assert frames == 0
    assert all(torch.equal(w, g) and w.stride() == g.stride() for w, g in zip(want, got))
    assert plain.__func__.__globals__["torch"] is module_torch is torch  # Inductor's module as it was
    frames, _ = _op_frames(segment.run, *args)  # the segment's own calls, past the first
    frames, _ = _op_frames(segment.run, *args)
    assert frames == 0


def test_what_is_no_function_over_torch_is_returned_as_it_is():
    partial = functools.partial(torch.add, 1)
    assert bound_call(partial) is partial
    scope: dict = {}
    exec("def call(args):\n    return args", scope)  # globals without torch
    assert bound_call(scope["call"]) is scope["call"]
    scope = {"torch": torch}
    exec("def call(args):\n    return torch.ops.aten.add.Tensor(args[0], 1), torch.float32", scope)
    bound = bound_call(scope["call"])
    assert bound is not scope["call"] and scope["torch"] is torch
    frames, (out, dtype) = _op_frames(bound, [torch.ones(2)])
    assert frames == 0 and torch.equal(out, torch.full((2,), 2.0)) and dtype is torch.float32
    exec("def ops_function(args):\n    return torch.ops.load_library", scope)  # not a namespace: as it is
    assert bound_call(scope["ops_function"])([]) == torch.ops.load_library  # (a bound method: equal, not the same)
