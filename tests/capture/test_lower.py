"""lower() and input_origins() on real Dynamo graphs: where each flat input comes from, and
that the lowered graph computes exactly what eager does."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.fx as fx
from functorch.compile import make_boxed_func

from graphdispatch_backend.capture.autocast import AutocastState
from graphdispatch_backend.capture.lower import InputOrigin, input_origins, lower


class _Recorder:
    """A backend that lowers with graphdispatch's `lower` and keeps what it saw; it runs
    the lowered graph as is (no passes), so its outputs are the lowering's own. Only
    lowerings that finished are kept (Dynamo may restart a trace, e.g. to specialize floats)."""

    def __init__(self) -> None:
        self.origins: list[tuple[InputOrigin, ...]] = []
        self.example_inputs: list[list[Any]] = []
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        origins = input_origins(gm, example_inputs)

        def keep(aten: fx.GraphModule, _inputs: Sequence[Any]) -> Callable[..., Any]:
            self.origins.append(origins)
            self.example_inputs.append(list(example_inputs))
            self.graphs.append(aten)
            return make_boxed_func(aten.forward)

        return lower(gm, example_inputs, AutocastState.observe(), inference_compiler=keep,
                     forward_compiler=keep, backward_compiler=lambda bw, _: make_boxed_func(bw.forward))


class _Stateful(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4).eval()
        self.register_buffer("offset", torch.linspace(-1, 1, 4))
        self.scale = torch.full((4,), 0.5)  # a plain tensor attribute: neither parameter nor buffer

    def forward(self, x: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
        return self.bn(self.lin(x)) * self.scale + self.offset + extra[0]


def _stateful() -> _Stateful:
    torch.manual_seed(0)
    model = _Stateful().requires_grad_(False)
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    return model


def test_input_origins_of_parameters_buffers_attributes_and_inputs():
    model = _stateful()
    rec = _Recorder()
    x, extra = torch.randn(3, 4), torch.randn(3, 4)
    torch.compile(model, backend=rec)(x, [extra])
    (origins,) = rec.origins
    assert set(origins) == {
        InputOrigin("parameter", "lin.weight"),
        InputOrigin("parameter", "lin.bias"),
        InputOrigin("parameter", "bn.weight"),
        InputOrigin("parameter", "bn.bias"),
        InputOrigin("buffer", "bn.running_mean"),
        InputOrigin("buffer", "bn.running_var"),
        InputOrigin("buffer", "offset"),
        # A plain tensor attribute reaches the graph like an argument: docs/design.md section 3 names
        # only parameters and buffers by their module path, anything else is an input.
        InputOrigin("input", "self.scale"),
        InputOrigin("input", "x"),
        InputOrigin("input", "extra.0"),
    }
    assert len(origins) == len(set(origins))
    (flat,) = rec.example_inputs
    # one origin per flat input of the lowered graph (the Dynamo graph lifts no state of its own)
    assert len(origins) == len(flat) == len(list(rec.graphs[0].graph.find_nodes(op="placeholder")))
    # The origins point at the very tensors Dynamo passed, not only at plausible names.
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for origin, value in zip(origins, flat):
        if origin.is_state:
            assert origin.kind in ("parameter", "buffer")
            assert isinstance(state[origin.name], torch.nn.Parameter) == (origin.kind == "parameter")
            assert value is state[origin.name], origin
    by_name = {o.name: v for o, v in zip(origins, flat)}
    assert by_name["x"] is x and by_name["extra.0"] is extra and by_name["self.scale"] is model.scale


def test_input_origins_with_dynamic_shapes_include_the_symbol():
    model = _stateful()
    rec = _Recorder()
    compiled = torch.compile(model, backend=rec, dynamic=True)
    compiled(torch.randn(3, 4), [torch.randn(3, 4)])
    (origins,) = rec.origins
    (flat,) = rec.example_inputs
    symbols = [(o, v) for o, v in zip(origins, flat) if o.kind == "symbol"]
    assert len(symbols) == 1, origins  # x's batch size
    ((symbol, value),) = symbols
    assert isinstance(value, torch.SymInt) and not symbol.is_state
    assert symbol.name == "x.size().0"  # named by the access path of the Dynamo source it sizes
    assert [o for o in origins if o.kind == "input"] == [
        InputOrigin("input", "x"), InputOrigin("input", "self.scale"), InputOrigin("input", "extra.0"),
    ]
    assert {o.name for o in origins if o.is_state} == {
        "lin.weight", "lin.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "offset",
    }
    placeholders = list(rec.graphs[0].graph.find_nodes(op="placeholder"))
    assert len(placeholders) == len(origins)
    assert isinstance(placeholders[origins.index(symbol)].meta["val"], torch.SymInt)


def _run_both(model: Callable[..., Any], *calls: tuple[Any, ...], dynamic: bool | None = None) -> _Recorder:
    rec = _Recorder()
    compiled = torch.compile(model, backend=rec, dynamic=dynamic)
    for args in calls:
        ours, ref = compiled(*args), model(*args)
        assert ours.dtype == ref.dtype and ours.shape == ref.shape
        assert torch.equal(ours, ref)
    return rec


def test_lowered_graph_is_bitwise_equal_to_eager():
    model = _stateful()
    gen = torch.Generator().manual_seed(3)
    calls = [(torch.randn(3, 4, generator=gen), [torch.randn(3, 4, generator=gen)]) for _ in range(2)]
    rec = _run_both(model, *calls)
    assert len(rec.graphs) == 1


def test_lowered_graph_is_bitwise_equal_to_eager_with_dynamic_shapes():
    model = _stateful()
    gen = torch.Generator().manual_seed(4)
    calls = [(torch.randn(n, 4, generator=gen), [torch.randn(n, 4, generator=gen)]) for n in (3, 5, 8)]
    rec = _run_both(model, *calls, dynamic=True)
    assert len(rec.graphs) == 1  # one symbolic graph served every size


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lowered_attention_and_norm_are_bitwise_equal(dtype):
    torch.manual_seed(1)
    norm = torch.nn.LayerNorm(8).to(dtype)
    proj = torch.nn.Linear(8, 24).to(dtype)

    def attention(x: torch.Tensor) -> torch.Tensor:
        q, k, v = proj(norm(x)).reshape(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum(1)

    with torch.no_grad():
        rec = _run_both(attention, (torch.randn(2, 5, 8, dtype=dtype),))
    ops = {n.target._schema.name for n in rec.graphs[0].graph.nodes if hasattr(n.target, "_schema")}
    # aot keeps attention as one op (export + run_decompositions would expand it into math ops)
    assert any("scaled_dot_product" in op for op in ops), ops


def test_training_graphs_lower_through_the_forward_compiler():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    rec = _Recorder()
    torch.compile(model, backend=rec)(x).sum().backward()
    reference(x).sum().backward()
    for ours, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours.grad, ref.grad)
    assert len(rec.graphs) == 1  # the forward graph; backward goes through its own compiler
