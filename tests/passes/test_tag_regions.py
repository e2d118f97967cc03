"""tag_regions: clean region names, boundaries, convexity, specs and fingerprints (docs/design.md section 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.fx as fx
from torch import nn

from graphdispatch_backend import testing
from graphdispatch_backend.artifacts.fingerprint import op_key
from graphdispatch_backend.passes import PassContext
from graphdispatch_backend.passes.tag_regions import tag_regions
from graphdispatch_backend.region import Region, TensorSpec

aten = torch.ops.aten


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = testing.Mlp(dim, act=nn.GELU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Gate(nn.Module):
    """Two non-state inputs around one parameter: `input0`, `scale`, `input1`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return x * self.scale + c


class Split(nn.Module):
    """Returns two tensors: a region with two outputs."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.chunk(2, dim=-1)
        return a.sin(), b.cos()


class Zoo(nn.Module):
    """Every container shape Dynamo spells differently, plus a module called twice."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(3))
        self.heads = nn.ModuleDict({"to-out": nn.Linear(dim, dim), "aux": nn.Linear(dim, dim)})
        self.grid = nn.ModuleList([nn.ModuleList([nn.Linear(dim, dim), nn.ReLU()]) for _ in range(2)])
        self.shared = nn.Linear(dim, dim)
        self.gate = Gate(dim)
        self.split = Split()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        x = self.heads["to-out"](x) + self.heads["aux"](x)
        for row in self.grid:
            x = row[1](row[0](x))
        x = self.shared(self.shared(x))
        x = self.gate(x, x.tanh())
        a, b = self.split(x)
        return torch.cat([b, a], dim=-1)


@pytest.fixture(scope="module")
def zoo() -> tuple[Zoo, testing.Lowered, dict[str, Region]]:
    torch.manual_seed(0)
    model = Zoo().eval()
    torch._dynamo.reset()
    with torch.no_grad():
        lowered = testing.aten_graph(model, torch.randn(2, 4, 8))
    return model, lowered, testing.regions(lowered)


def test_region_names_are_clean_module_names(zoo):
    model, _, regions = zoo
    modules = dict(model.named_modules())
    assert {r.module for r in regions.values()} <= set(modules)
    assert {
        "blocks.0", "blocks.2.mlp.fc2", "heads.to-out", "heads.aux", "grid.0.0", "grid.1.1", "shared", "gate", "split",
    } <= set(regions)
    for name, region in regions.items():
        assert "L[" not in name and "_modules" not in name and "__dict__" not in name
        assert name == (region.module if region.instance == 0 else f"{region.module}#{region.instance}")
    # containers never run code of their own, so they are no region; the root is the whole graph
    assert not {"", "blocks", "heads", "grid", "grid.0"} & set(regions)


ODD_KEYS = ("a-b", "with space", "br[0]", "q'uote", "0", "ünï", "L")


class OddKeys(nn.Module):
    """ModuleDict keys that look like Dynamo's own access syntax."""

    def __init__(self) -> None:
        super().__init__()
        self.d = nn.ModuleDict({k: nn.Linear(4, 4) for k in ODD_KEYS})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for key in ODD_KEYS:
            x = self.d[key](x)
        return x


def test_module_dict_keys_survive_verbatim():
    model = OddKeys().eval()
    with torch.no_grad():
        regions = testing.regions(testing.aten_graph(model, torch.randn(2, 4)))
    assert sorted(regions) == sorted(f"d.{k}" for k in ODD_KEYS)
    assert set(regions) <= set(dict(model.named_modules()))
    assert all(r.input_names == ["weight", "bias", "input0"] for r in regions.values())


def test_a_module_called_twice_gives_two_instances(zoo):
    _, _, regions = zoo
    first, second = regions["shared"], regions["shared#1"]
    assert (first.module, first.instance, second.module, second.instance) == ("shared", 0, "shared", 1)
    assert not set(first.nodes) & set(second.nodes)
    assert first.input_names == second.input_names == ["input0", "weight", "bias"]
    # the second call consumes the first call's output: that edge is the boundary between them
    assert second.inputs[0] is first.outputs[0]
    assert "shared#2" not in regions


class Tied(nn.Module):
    """One Block in two ModuleList slots, called once through each: Dynamo gives both calls
    one stack key (it counts calls through one path only), and both paths clean to the one
    name named_modules() has for it."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        block = Block(dim)
        self.blocks = nn.ModuleList([block, block])
        self.mix = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.mix(self.blocks[0](x)))


def test_a_module_in_two_slots_gives_one_instance_per_call():
    """Before, its two calls were one region: 2 outputs, not convex (the mix between them
    inside), and an artifact for the block refused on its signature (a trial, 2026-12-07)."""
    with torch.no_grad():
        regions = testing.regions(testing.aten_graph(Tied().eval(), torch.randn(2, 4, 8)))
    first, second = regions["blocks.0"], regions["blocks.0#1"]
    assert (first.instance, second.instance) == (0, 1) and "blocks.1" not in regions
    assert not set(first.nodes) & set(second.nodes)
    assert first.input_names == second.input_names and len(first.outputs) == len(second.outputs) == 1
    assert first.convex and second.convex
    assert {"blocks.0.mlp.fc1", "blocks.0.mlp.fc1#1"} <= set(regions)


def test_class_names(zoo):
    model, _, regions = zoo
    modules = dict(model.named_modules())
    for region in regions.values():
        assert region.cls == type(modules[region.module]).__qualname__
    assert (regions["blocks.1"].cls, regions["blocks.1.norm"].cls, regions["heads.to-out"].cls) == (
        "Block", "LayerNorm", "Linear")


def test_boundary_inputs_in_first_use_order_named_relative_to_the_region(zoo):
    _, lowered, regions = zoo
    assert regions["blocks.0.mlp"].input_names == ["input0", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert regions["blocks.1"].input_names == [
        "input0", "norm.weight", "norm.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"]
    # `input<k>` counts the non-state inputs only, in first-use order around the parameter
    assert regions["gate"].input_names == ["input0", "scale", "input1"]
    assert regions["split"].input_names == ["input0"]
    # a parameter name really is that parameter: its placeholder's origin is the full path
    placeholders = list(lowered.gm.graph.find_nodes(op="placeholder"))
    mlp = regions["blocks.2.mlp"]
    for node, name in zip(mlp.inputs, mlp.input_names):
        if name != "input0":
            assert lowered.origins[placeholders.index(node)].name == f"blocks.2.mlp.{name}"


def test_boundary_specs_and_report_entry(zoo):
    _, _, regions = zoo
    mlp = regions["blocks.0.mlp"]
    assert mlp.input_specs[0] == TensorSpec((2, 4, 8), (32, 8, 1), "float32", "cpu")
    assert mlp.input_specs[1] == TensorSpec((16, 8), (8, 1), "float32", "cpu")
    assert mlp.output_specs == [TensorSpec((2, 4, 8), (32, 8, 1), "float32", "cpu")]
    entry = json.loads(json.dumps(mlp.to_dict()))  # what dispatch.json holds
    assert entry["module"] == "blocks.0.mlp" and entry["class"] == "Mlp" and entry["convex"] is True
    assert [i["name"] for i in entry["inputs"]] == mlp.input_names
    assert entry["inputs"][2] == {"name": "fc1.bias", "shape": [16], "stride": [1], "dtype": "float32",
                                  "device": "cpu"}
    assert entry["outputs"] == [{"name": "output0", "shape": [2, 4, 8], "stride": [32, 8, 1],
                                 "dtype": "float32", "device": "cpu"}]
    assert entry["nodes"] == len(mlp.nodes)


def test_outputs_are_the_values_used_outside(zoo):
    _, _, regions = zoo
    split = regions["split"]
    assert [op_key(o.target) for o in split.outputs] == ["aten::sin.default", "aten::cos.default"]
    assert [s.shape for s in split.output_specs] == [(2, 4, 4), (2, 4, 4)]
    # fc1's output is used inside the mlp only: the mlp has one output (fc2's)
    assert len(regions["blocks.0.mlp"].outputs) == 1
    assert regions["blocks.0.mlp"].outputs == regions["blocks.0.mlp.fc2"].outputs


def test_node_counts_and_op_histogram(zoo):
    _, lowered, regions = zoo
    linear = {"aten::addmm.default": 1, "aten::t.default": 1, "aten::view.default": 2}  # on a 3-d input
    assert regions["heads.aux"].ops == linear and len(regions["heads.aux"].nodes) == 4
    assert regions["blocks.0.mlp"].ops == {"aten::addmm.default": 2, "aten::gelu.default": 1,
                                           "aten::t.default": 2, "aten::view.default": 4}
    assert regions["split"].ops == {"aten::split.Tensor": 1, "getitem": 2, "aten::sin.default": 1,
                                    "aten::cos.default": 1}
    for name, region in regions.items():
        tagged = [n for n in lowered.gm.graph.nodes if name in n.meta.get("gd_regions", ())]
        assert tagged == region.nodes
        assert sum(region.ops.values()) == len(region.nodes)
    # every call node is annotated, outermost module first
    view = regions["blocks.0.mlp.fc1"].nodes[0]
    assert view.meta["gd_regions"] == ("blocks.0", "blocks.0.mlp", "blocks.0.mlp.fc1")
    assert all("gd_regions" in n.meta for n in lowered.gm.graph.nodes if n.op == "call_function")


def test_traced_regions_are_convex(zoo):
    _, _, regions = zoo
    assert all(r.convex for r in regions.values())
    assert all(r.deterministic for r in regions.values())


def _hand_built(reenter: bool) -> fx.GraphModule:
    """x -> a = sin(x) [r] -> b = cos(a) [outside] -> c = mul(a, b or x) [r].

    With `reenter`, c reads b: the path a -> b -> c leaves region r and comes back."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(aten.sin.default, (x,))
    b = graph.call_function(aten.cos.default, (a,))
    c = graph.call_function(aten.mul.Tensor, (a, b if reenter else x))
    graph.output((b, c))
    stack = {"1": ("L['self'].r", nn.Module)}
    a.meta["nn_module_stack"] = c.meta["nn_module_stack"] = stack
    b.meta["nn_module_stack"] = {}
    return fx.GraphModule(nn.Module(), graph)


@pytest.mark.parametrize("reenter", [True, False])
def test_convexity_on_a_hand_built_graph(reenter):
    gm = _hand_built(reenter)
    ctx = PassContext()
    tag_regions(gm, ctx)
    (region,) = ctx.regions
    assert region.name == "r" and [n.target for n in region.nodes] == [aten.sin.default, aten.mul.Tensor]
    # an outsider between the members is fine; a path out and back in is not
    assert region.convex is (not reenter)
    assert region.to_dict()["convex"] is (not reenter)


def test_symbolic_dims_are_none_under_dynamic():
    model = Block(8).eval()
    with torch.no_grad():
        lowered = testing.aten_graph(model, torch.randn(3, 5, 8), dynamic=True)
    mlp = testing.regions(lowered)["mlp"]
    x = next(s for s in mlp.input_specs if s is not None and s.dtype == "float32" and len(s.shape) == 3)
    assert x.shape == (None, None, 8) and x.stride[2] == 1 and None in x.stride
    assert mlp.output_specs[0].shape == (None, None, 8)
    assert mlp.to_dict()["outputs"][0]["shape"] == [None, None, 8]
    # sizes Dynamo passes as symbols enter the region as size inputs, apart from the tensors:
    # `input<k>` counts tensors only, and the report lists sizes with where they come from
    symbols = [(n, s) for n, s in zip(mlp.input_names, mlp.input_specs) if s is not None and s.is_scalar]
    assert symbols and all(s.dtype == "symint" and n.startswith("size") for n, s in symbols)
    assert mlp.kernel_names == ["input0", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    entry = mlp.to_dict()
    assert [i["name"] for i in entry["inputs"]] == mlp.kernel_names
    assert [s["name"] for s in entry["sizes"]] == [n for n, _ in symbols]
    # each size is an expression over dims of the tensor inputs: evaluated on x (3, 5, 8) it
    # gives the sizes the region uses (the flattened 15 for its 2-d matmuls, 3 and 5 to unflatten)
    shapes = {"input0": (3, 5, 8)}
    values = sorted(eval(s["expr"], {sym: shapes[where[0]][where[1]] for sym, where in s["symbols"].items()})
                    for s in entry["sizes"])
    assert values == [3, 5, 15]
    # no region holds a size computation: aot shares them between modules
    assert not any(op.startswith("_operator") for op in mlp.ops)
    # the parameters keep their concrete shapes
    assert mlp.input_specs[mlp.input_names.index("fc1.weight")].shape == (16, 8)


# --- fingerprints -------------------------------------------------------------------------


class Cell(nn.Module):
    """Knobs for every fingerprint ingredient: op, wiring, constants, names."""

    def __init__(self, dim: int = 8, act: type[nn.Module] = nn.GELU, eps: float = 1e-5, scale: float = 0.5,
                 swap: bool = False, skip: str = "h", names: tuple[str, str] = ("up", "down")) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.names = names
        setattr(self, names[0], nn.Linear(dim, dim))
        setattr(self, names[1], nn.Linear(dim, dim))
        self.act = act()
        self.scale, self.swap, self.skip = scale, swap, skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        up, down = (getattr(self, n) for n in self.names)
        a = self.act(up(h)) * self.scale
        b = down(h)
        out = b - a if self.swap else a - b
        return out + (h if self.skip == "h" else x)


class Host(nn.Module):
    def __init__(self, attr: str = "cell", **cell: object) -> None:
        super().__init__()
        self.attr = attr
        setattr(self, attr, Cell(**cell))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.attr)(x).relu()


def _cell_region(seed: int = 0, shape: tuple[int, ...] = (2, 4, 8), dtype: torch.dtype = torch.float32,
                 attr: str = "cell", **cell: object) -> Region:
    torch.manual_seed(seed)
    model = Host(attr, **cell).eval().to(dtype)
    with torch.no_grad():
        lowered = testing.aten_graph(model, torch.randn(shape, dtype=dtype))
    return testing.regions(lowered)[attr]


@pytest.fixture(scope="module")
def base() -> Region:
    return _cell_region()


def test_fingerprint_is_32_hex(base):
    assert len(base.fingerprint) == 32 and int(base.fingerprint, 16) >= 0
    assert base.fingerprint == base.fingerprint.lower()


def test_fingerprint_is_equal_across_the_repeated_blocks_of_a_stack(zoo):
    _, _, regions = zoo
    for suffix in ("", ".norm", ".mlp", ".mlp.fc1", ".mlp.act"):
        assert len({regions[f"blocks.{i}{suffix}"].fingerprint for i in range(3)}) == 1, suffix
    assert regions["blocks.0"].fingerprint != regions["blocks.0.mlp"].fingerprint
    # two calls of one module on same-shaped values are the same computation too
    assert regions["shared"].fingerprint == regions["shared#1"].fingerprint


CHANGES = {
    "op (GELU -> ReLU)": dict(act=nn.ReLU),
    "wiring (operands of an internal sub swapped)": dict(swap=True),
    "wiring (skip from the input, not the norm)": dict(skip="x"),
    "constant (eps)": dict(eps=1e-6),
    "constant (scale)": dict(scale=0.25),
    "shape": dict(shape=(2, 6, 8)),
    "dtype": dict(dtype=torch.float64),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_fingerprint_changes_with_the_computation(base, change):
    other = _cell_region(**CHANGES[change])
    assert other.fingerprint != base.fingerprint
    if change.startswith("wiring"):
        # only edges moved: same ops, same boundary, same names
        assert other.ops == base.ops and other.input_names == base.input_names
        assert other.input_specs == base.input_specs and other.output_specs == base.output_specs


def test_fingerprint_ignores_weight_values_and_module_names(base):
    reseeded = _cell_region(seed=123)
    assert reseeded.fingerprint == base.fingerprint
    renamed = _cell_region(attr="body", names=("fc_in", "fc_out"))
    assert renamed.name == "body" and renamed.input_names[3] == "fc_in.weight"
    assert renamed.input_names != base.input_names  # the names differ; the hash does not see them
    assert renamed.fingerprint == base.fingerprint


def test_method_calls_are_hashed_by_name():
    """Graphs that still hold `call_method` nodes (Dynamo's, which the region exporter
    tags) must not hash every method alike."""

    def graph(method: str) -> str:
        g = fx.Graph()
        x = g.placeholder("x")
        y = g.call_method(method, (x,))
        y.meta["nn_module_stack"] = {"1": ("L['self'].m", nn.Module)}
        g.output((y,))
        ctx = PassContext()
        tag_regions(fx.GraphModule(nn.Module(), g), ctx)
        assert ctx.regions[0].ops == {f"Tensor.{method}": 1}
        return ctx.regions[0].fingerprint

    assert graph("relu") != graph("sigmoid")


_SCRIPT = textwrap.dedent("""
    import torch
    from graphdispatch_backend import testing
    from graphdispatch_backend.examples.dit import DiTConfig, make_model
    cfg = DiTConfig(depth=2, dim=32, heads=2, image_size=8)
    model = make_model(seed=SEED, cfg=cfg)
    x = torch.randn(1, cfg.in_channels, cfg.image_size, cfg.image_size)
    with torch.no_grad():
        regions = testing.regions(testing.aten_graph(model, x, torch.full((1,), 3.0)))
    print(regions["blocks.0"].fingerprint, regions["blocks.1.mlp"].fingerprint)
""")


def test_fingerprint_is_equal_across_processes():
    def run(seed: int, hashseed: str) -> list[str]:
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        done = subprocess.run([sys.executable, "-c", _SCRIPT.replace("SEED", str(seed))], capture_output=True,
                              text=True, timeout=900, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.split()

    here = {}
    exec(_SCRIPT.replace("SEED", "0").replace("print(", "here['fp'] = ("), {"here": here})
    there = run(7, "12345")  # another process, other weights, another str-hash seed
    assert list(here["fp"]) == there
    assert all(len(fp) == 32 for fp in there)
