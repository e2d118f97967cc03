"""Dynamo's spellings of module, parameter and buffer paths -> clean `named_modules()` names."""

from __future__ import annotations

import functools

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.capture.lower import input_origins
from graphdispatch_backend.capture.names import (
    access_name,
    clean_module_name,
    clean_path,
    instance_of,
    region_name,
    resolve_graph_names,
    root_name,
)
from graphdispatch_backend.testing import aten_graph

MODULE_PATHS = [
    ("L['self'].transformer_blocks.0.ff", "transformer_blocks.0.ff"),
    ("L['self'].__dict__['_modules']['transformer_blocks'].0.ff", "transformer_blocks.0.ff"),
    ("L['self']._modules['transformer_blocks']._modules['0']._modules['ff']", "transformer_blocks.0.ff"),
    ("G['model'].d.k-1", "d.k-1"),
    ("L['self'].layers[0][1]", "layers.0.1"),
    ("L['self'].layers['a.b']", "layers.a.b"),
    ('L["self"].blocks.3', "blocks.3"),
    ("L['self']", ""),  # the root module itself: no name
    ("blocks.0.ff", "blocks.0.ff"),  # already clean: unchanged
]


@pytest.mark.parametrize(("dynamo", "clean"), MODULE_PATHS, ids=[p for p, _ in MODULE_PATHS])
def test_module_paths(dynamo, clean):
    assert clean_module_name(dynamo) == clean
    assert clean_path(dynamo) == (clean, "attribute")


STATE_PATHS = [
    ("L['s']._modules['l']._parameters['weight']", "l.weight", "parameter"),
    ("L['self'].__dict__['_modules']['blocks'].0._parameters['bias']", "blocks.0.bias", "parameter"),
    ("L['self'].__dict__['_parameters']['w']", "w", "parameter"),
    ("L['s']._modules['bn']._buffers['running_mean']", "bn.running_mean", "buffer"),
    ("G['model']._buffers['pos_embed']", "pos_embed", "buffer"),
    ("L['self'].blocks.0.scale", "blocks.0.scale", "attribute"),
]


@pytest.mark.parametrize(("dynamo", "clean", "kind"), STATE_PATHS, ids=[p for p, _, _ in STATE_PATHS])
def test_parameter_and_buffer_sources(dynamo, clean, kind):
    assert clean_path(dynamo) == (clean, kind)


@pytest.mark.parametrize(
    ("dynamo", "root"),
    [("L['self'].a", "self"), ("G['model'].d.k-1", "model"), ("L['x']", "x"), ('L["inputs"][0]', "inputs"),
     ("blocks.0", None)],
)
def test_root_name(dynamo, root):
    assert root_name(dynamo) == root


@pytest.mark.parametrize(
    ("key", "instance"),
    [("140035317104016", 0), ("140035317104016@1", 1), ("140035317104016@12", 12), ("L__self___ff@2", 2),
     ("odd@x", 0)],
)
def test_instance_of_nn_module_stack_keys(key, instance):
    assert instance_of(key) == instance


def test_region_names():
    assert region_name("transformer_blocks.0.ff", 0) == "transformer_blocks.0.ff"
    assert region_name("transformer_blocks.0.ff", 1) == "transformer_blocks.0.ff#1"
    assert region_name(clean_module_name("G['model'].d.k-1"), instance_of("123@1")) == "d.k-1#1"


class _Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())])
        self.d = torch.nn.ModuleDict({"k-1": torch.nn.Linear(4, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers[0](x)
        return self.d["k-1"](self.d["k-1"](y))  # called twice: a second instance


def test_real_dynamo_module_stacks_clean_to_named_modules():
    model = _Nested().eval()
    lowered = aten_graph(model, torch.randn(2, 4))
    modules = dict(model.named_modules())
    regions = set()
    for node in lowered.gm.graph.nodes:
        for key, (path, cls) in (node.meta.get("nn_module_stack") or {}).items():
            name = clean_module_name(path)
            if name:
                assert name in modules, (path, name)
                assert isinstance(modules[name], cls)
                regions.add(region_name(name, instance_of(key)))
    assert regions == {"layers.0", "layers.0.0", "layers.0.1", "d.k-1", "d.k-1#1"}


# -- text cleaning of the roots Dynamo uses for a model reached in other ways ----------------------

ROOTED = [
    ("L['args'][0].layers.0.mlp", "layers.0.mlp"),  # forward decorated as wrapper(*args, **kwargs)
    ("L['kwargs']['model'].blocks.1", "blocks.1"),
    ("G['orig'].__self__.layers.0", "layers.0"),  # an instance forward closing over the original
    ("getattr(L['self'].d, 'k-1')", "d.k-1"),  # Dynamo's spelling of a non-identifier attribute
    ("getattr(L['self'].d, 'k-1').net.0", "d.k-1.net.0"),
    ("L['args'][0]._modules['layers']._modules['0']._parameters['weight']", "layers.0.weight"),
]


@pytest.mark.parametrize(("dynamo", "clean"), ROOTED, ids=[p for p, _ in ROOTED])
def test_roots_with_subscripts_and_bound_methods_clean_as_text(dynamo, clean):
    assert clean_path(dynamo)[0] == clean


def test_access_name_keeps_every_step_of_an_input():
    assert access_name("L['kwargs']['input_ids']") == "kwargs.input_ids"
    assert access_name("L['self'].__dict__['_buffers']['freqs']") == "self.freqs"
    assert access_name("L['x']") == "x"


# -- live resolution: every way a model reaches Dynamo names regions as named_modules() does -------


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, 8)
        self.down = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(2))
        self.d = torch.nn.ModuleDict({"k-1": torch.nn.Linear(4, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.d["k-1"](x)


def _args_decorator(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # as transformers decorates LlamaModel.forward
        return fn(*args, **kwargs)

    return wrapper


def _self_decorator(fn):
    @functools.wraps(fn)
    def wrapper(self, x):
        return fn(self, x)

    return wrapper


class _ArgsForward(_Model):
    @_args_decorator
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class _SelfForward(_Model):
    @_self_decorator
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


_GLOBAL = _Model()


def _global_caller(x: torch.Tensor) -> torch.Tensor:
    return _GLOBAL(x) * 2


def _plain(model):
    return torch.compile(model, backend="graphdispatch")


def _method(model):
    model.compile(backend="graphdispatch")
    return model


def _hooked(model):
    model.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    model.layers[0].register_forward_hook(lambda module, args, out: out + 1)
    return torch.compile(model, backend="graphdispatch")


def _hooked_method(model):
    model.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    return _method(model)


def _instance_closure(model):
    original = model.forward

    def forward(*args, **kwargs):  # accelerate-style: the instance's forward wraps the original
        return original(*args, **kwargs)

    model.forward = forward
    return torch.compile(model, backend="graphdispatch")


def _instance_partial(model):
    model.forward = functools.partial(type(model).forward, model)
    return torch.compile(model, backend="graphdispatch")


WAYS = {
    "plain_forward": (_Model, _plain),
    "decorated_args_kwargs": (_ArgsForward, _plain),
    "functools_wraps_self": (_SelfForward, _plain),
    "hooks": (_Model, _hooked),
    "model_compile": (_Model, _method),
    "model_compile_with_hook": (_Model, _hooked_method),
    "instance_forward_closure": (_Model, _instance_closure),
    "instance_forward_partial": (_Model, _instance_partial),
    "decorated_model_compile": (_ArgsForward, _method),
}


@pytest.mark.parametrize("way", sorted(WAYS))
def test_every_way_to_reach_dynamo_names_regions_as_named_modules(way):
    cls, compile_it = WAYS[way]
    torch.manual_seed(0)
    model = cls().eval()
    compiled = compile_it(model)
    with torch.no_grad():
        compiled(torch.randn(2, 4))
    report = graphdispatch_backend.latest_report()
    regions = [r for g in report["graphs"] for r in g["regions"]]
    names = {r["name"] for r in regions}
    assert {"layers.0", "layers.0.mlp", "layers.1.mlp.down", "d.k-1"} <= names, names
    for region in regions:
        module = model.get_submodule(region["module"])
        assert type(module).__qualname__ == region["class"]
        state = dict(module.named_parameters())
        assert {i["name"] for i in region["inputs"] if not i["name"].startswith("input")} <= set(state)
    mlp = next(r for r in regions if r["name"] == "layers.1.mlp")
    assert [i["name"] for i in mlp["inputs"]] == ["up.weight", "up.bias", "input0", "down.weight", "down.bias"]


def test_a_compiled_function_names_a_global_model_from_its_own_root():
    with torch.no_grad():
        torch.compile(_global_caller, backend="graphdispatch")(torch.randn(2, 4))
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    names = {r["name"] for r in graph["regions"]}
    assert "layers.0.mlp" in names and all(_GLOBAL.get_submodule(n.split("#")[0]) is not None for n in names)


def test_a_compiled_block_names_regions_from_the_block():
    model = _Model().eval()
    model.layers[0].compile(backend="graphdispatch")
    with torch.no_grad():
        model(torch.randn(2, 4))
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    assert {r["name"] for r in graph["regions"]} == {"mlp", "mlp.up", "mlp.down"}


def test_resolution_rewrites_the_graphs_module_stacks_and_lists_the_models_modules():
    model = _ArgsForward().eval()
    seen = {}

    def backend(gm, example_inputs):
        input_origins(gm, example_inputs)
        seen["paths"] = {p for n in gm.graph.nodes for p, _ in (n.meta.get("nn_module_stack") or {}).values()}
        seen["modules"] = gm.meta["gd_model_modules"]
        return gm.forward

    torch.compile(model, backend=backend)(torch.randn(2, 4))
    assert seen["paths"] == {"layers.0", "layers.0.mlp", "layers.0.mlp.up", "layers.0.mlp.down", "layers.1",
                             "layers.1.mlp", "layers.1.mlp.up", "layers.1.mlp.down", "d.k-1"}
    assert set(seen["modules"]) == {n for n, _ in model.named_modules() if n}


def test_without_a_frame_names_are_cleaned_as_text():
    gm = torch.fx.symbolic_trace(_Model())
    for node in gm.graph.nodes:
        node.meta["nn_module_stack"] = {"1": ("L['args'][0].layers.0", _Layer)}
    names = resolve_graph_names(gm, ["L['args'][0]._modules['d']._parameters['weight']"], frame=None)
    assert names["L['args'][0].layers.0"] == ("layers.0", "attribute")
    assert names["L['args'][0]._modules['d']._parameters['weight']"] == ("d.weight", "parameter")
    assert gm.meta["gd_model_modules"] is None
