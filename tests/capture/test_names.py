"""Dynamo's spellings of module, parameter and buffer paths -> clean `named_modules()` names."""

from __future__ import annotations

import pytest
import torch

from graphdispatch_backend.capture.names import clean_module_name, clean_path, instance_of, region_name, root_name
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
