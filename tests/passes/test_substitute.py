"""substitute: matched regions become one call node each, behind the native region graph (docs/design.md section 5)."""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import expecttest
import torch
import torch.fx as fx
from torch import nn

from graphdispatch_backend import testing
from graphdispatch_backend.artifacts.match import MatchOutcome
from graphdispatch_backend.errors import Rejection
from graphdispatch_backend.passes import PassContext
from graphdispatch_backend.passes.substitute import substitute
from graphdispatch_backend.passes.tag_regions import tag_regions
from graphdispatch_backend.region import Region

aten = torch.ops.aten


# testing.Block and testing.Stack, built by _model at dim 4 with GELU as each MLP's `act` region
SMALL = {"dim": 4, "act": nn.GELU}


class Split(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.chunk(2, dim=-1)
        return a.sin(), b * 2


class TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.split = Split()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.split(x)
        return b - a


@dataclasses.dataclass
class Substituted:
    gm: fx.GraphModule
    original: fx.GraphModule  # a copy of the graph before substitution
    ctx: PassContext
    regions: dict[str, Region]
    natives: dict[str, fx.GraphModule]  # region -> the native region graph make_call received
    boundary: dict[str, tuple[list[str], list[str]]]  # region -> (input, output) node names in the original


def _fake_artifact(artifact_id: str) -> Any:
    return SimpleNamespace(id=artifact_id, manifest=SimpleNamespace(capturable=True))


def run_substitute(gm: fx.GraphModule, select: Sequence[str], origins: tuple = (),
                   loadable: bool = True) -> Substituted:
    """tag_regions + substitute with an injected matcher selecting the regions `select`
    names; each call target runs the native region graph it was given."""
    original = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    natives: dict[str, fx.GraphModule] = {}
    boundary: dict[str, tuple[list[str], list[str]]] = {}

    def matcher(region: Region) -> MatchOutcome:
        boundary[region.name] = ([n.name for n in region.inputs], [n.name for n in region.outputs])
        wanted = region.name in select
        return MatchOutcome(region.name, _fake_artifact(f"k-{region.name}") if wanted else None)

    def make_call(region: Region, outcome: MatchOutcome, native: fx.GraphModule) -> Callable[..., Any] | None:
        if not loadable:
            outcome.reject(outcome.selected.id, Rejection.LOAD_FAILED, "test")
            return None
        natives[region.name] = native

        def kernel(*args: Any) -> Any:
            return native(*args)

        # named as backend.py names artifact gates, so goldens do not depend on this file's import path
        kernel.__name__ = kernel.__qualname__ = "gd_" + "".join(c if c.isalnum() else "_" for c in region.name)
        kernel.__module__ = "graphdispatch"
        return kernel

    ctx = PassContext(input_origins=origins, matcher=matcher, make_call=make_call)
    tag_regions(gm, ctx)
    regions = {r.name: r for r in ctx.regions}
    substitute(gm, ctx)
    return Substituted(gm, original, ctx, regions, natives, boundary)


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and "gd_substitution" in n.meta]


def _lowered(model: nn.Module, *args: torch.Tensor) -> testing.Lowered:
    with torch.no_grad():
        return testing.aten_graph(model.eval(), *args)


def _call(gm: fx.GraphModule, lowered: testing.Lowered, model: nn.Module, *args: torch.Tensor) -> Any:
    """Call an aot graph: its flat inputs are the model's state and the call's arguments,
    in the order of the input origins."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    user = iter(args)
    with torch.no_grad():
        return gm(*[state[o.name] if o.is_state else next(user) for o in lowered.origins])


def _model(cls: type[nn.Module], *a: Any, **kw: Any) -> nn.Module:
    torch.manual_seed(0)
    return cls(*a, **kw).eval()


class TestSubstitute(expecttest.TestCase):
    def test_golden_one_call_node_per_region_inputs_in_signature_order(self):
        model = _model(testing.Block, **SMALL)
        x = torch.randn(2, 4)
        lowered = _lowered(model, x)
        before = testing.normalize(lowered.gm)
        self.assertExpectedInline(before, """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1):
    t = torch.ops.aten.t.default(arg0_1)
    addmm = torch.ops.aten.addmm.default(arg1_1, arg2_1, t)
    gelu = torch.ops.aten.gelu.default(addmm)
    t_1 = torch.ops.aten.t.default(arg3_1)
    addmm_1 = torch.ops.aten.addmm.default(arg4_1, gelu, t_1)
    add = torch.ops.aten.add.Tensor(arg2_1, addmm_1)
    return (add,)""")
        self.assertEqual(testing.op_counts(lowered.gm), {"aten::add.Tensor": 1, "aten::addmm.default": 2,
                                                          "aten::gelu.default": 1, "aten::t.default": 2})
        done = run_substitute(lowered.gm, ["mlp"], lowered.origins)
        self.assertExpectedInline(testing.normalize(done.gm), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1):
    gd_mlp = graphdispatch_gd_mlp(arg0_1, arg1_1, arg2_1, arg3_1, arg4_1)
    getitem = gd_mlp[0]
    add = torch.ops.aten.add.Tensor(arg2_1, getitem)
    return (add,)""")
        self.assertEqual(testing.op_counts(done.gm), {"aten::add.Tensor": 1, "getitem": 1,
                                                       "graphdispatch.gd_mlp": 1})
        (call,) = _calls(done.gm)
        region = done.regions["mlp"]
        # first-use order: a 2-d Linear is t(weight), then addmm(bias, x, t)
        self.assertEqual(region.input_names, ["fc1.weight", "fc1.bias", "input0", "fc2.weight", "fc2.bias"])
        placeholders = list(done.gm.graph.find_nodes(op="placeholder"))
        names = [lowered.origins[placeholders.index(a)].name for a in call.args]
        self.assertEqual(names, ["mlp.fc1.weight", "mlp.fc1.bias", "x", "mlp.fc2.weight", "mlp.fc2.bias"])
        self.assertEqual(call.meta["gd_substitution"], {"region": "mlp", "artifact": "k-mlp"})
        self.assertEqual([(s.region, s.artifact) for s in done.ctx.substitutions], [("mlp", "k-mlp")])
        self.assertTrue(torch.equal(_call(done.gm, lowered, model, x)[0], model(x)))

    def test_every_repeated_block_gets_its_own_call(self):
        model = _model(testing.Stack, 3, **SMALL)
        x = torch.randn(2, 4)
        lowered = _lowered(model, x)
        done = run_substitute(lowered.gm, ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"], lowered.origins)
        self.assertEqual([c.meta["gd_substitution"]["region"] for c in _calls(done.gm)],
                         ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"])
        self.assertEqual(testing.op_counts(done.gm), {"aten::add.Tensor": 3, "getitem": 3,
                                                       "graphdispatch.gd_blocks_0_mlp": 1,
                                                       "graphdispatch.gd_blocks_1_mlp": 1,
                                                       "graphdispatch.gd_blocks_2_mlp": 1})
        self.assertTrue(torch.equal(_call(done.gm, lowered, model, x)[0], model(x)))

    def test_multi_output_region_gets_one_getitem_per_output(self):
        model = _model(TwoOut)
        x = torch.randn(2, 4)
        lowered = _lowered(model, x)
        self.assertExpectedInline(testing.normalize(lowered.gm), """\
def forward(self, arg0_1):
    split = torch.ops.aten.split.Tensor(arg0_1, 2, -1)
    getitem = split[0]
    getitem_1 = split[1]
    sin = torch.ops.aten.sin.default(getitem)
    mul = torch.ops.aten.mul.Tensor(getitem_1, 2)
    sub = torch.ops.aten.sub.Tensor(mul, sin)
    return (sub,)""")
        done = run_substitute(lowered.gm, ["split"], lowered.origins)
        self.assertExpectedInline(testing.normalize(done.gm), """\
def forward(self, arg0_1):
    gd_split = graphdispatch_gd_split(arg0_1)
    getitem_2 = gd_split[0]
    getitem_3 = gd_split[1]
    sub = torch.ops.aten.sub.Tensor(getitem_3, getitem_2)
    return (sub,)""")
        self.assertEqual(testing.op_counts(done.gm), {"aten::sub.Tensor": 1, "getitem": 2, "graphdispatch.gd_split": 1})
        self.assertEqual(len(done.regions["split"].outputs), 2)
        self.assertTrue(torch.equal(_call(done.gm, lowered, model, x)[0], model(x)))

    def test_enclosing_region_wins_and_the_inner_one_is_rejected_as_overlap(self):
        model = _model(testing.Stack, 1, **SMALL)
        x = torch.randn(2, 4)
        lowered = _lowered(model, x)
        # listed inner first on purpose: size decides, not the order the matcher is asked in
        done = run_substitute(lowered.gm, ["blocks.0.mlp", "blocks.0.mlp.fc1", "blocks.0"], lowered.origins)
        self.assertEqual([c.meta["gd_substitution"]["region"] for c in _calls(done.gm)], ["blocks.0"])
        self.assertEqual(list(done.natives), ["blocks.0"])
        for inner in ("blocks.0.mlp", "blocks.0.mlp.fc1"):
            outcome = done.ctx.outcomes[inner]
            self.assertIsNone(outcome.selected)
            self.assertEqual([(r.artifact, r.reason) for r in outcome.rejections],
                             [(f"k-{inner}", Rejection.OVERLAP)])
        self.assertEqual(testing.op_counts(done.gm), {"getitem": 1, "graphdispatch.gd_blocks_0": 1})
        self.assertTrue(torch.equal(_call(done.gm, lowered, model, x)[0], model(x)))

    def test_back_to_back_regions_read_each_others_getitems(self):
        model = _model(Twice)
        x = torch.randn(2, 4)
        lowered = _lowered(model, x)
        done = run_substitute(lowered.gm, ["lin", "lin#1"], lowered.origins)
        first, second = _calls(done.gm)
        self.assertIs(second.args[done.regions["lin#1"].input_names.index("input0")], next(iter(first.users)))
        self.assertTrue(torch.equal(_call(done.gm, lowered, model, x)[0], model(x)))

    def test_a_region_that_does_not_load_leaves_the_graph_alone(self):
        model = _model(testing.Block, **SMALL)
        lowered = _lowered(model, torch.randn(2, 4))
        before = testing.normalize(lowered.gm)
        done = run_substitute(lowered.gm, ["mlp"], lowered.origins, loadable=False)
        self.assertEqual(testing.normalize(done.gm), before)
        self.assertEqual(done.ctx.substitutions, [])
        self.assertIsNone(done.ctx.outcomes["mlp"].selected)
        self.assertEqual([r.reason for r in done.ctx.outcomes["mlp"].rejections], [Rejection.LOAD_FAILED])

    def test_nodes_between_the_members_that_use_an_output_move_after_the_call(self):
        gm = _interleaved()
        args = (torch.randn(3, 5), torch.randn(3, 5))
        expected = gm(*args)
        done = run_substitute(gm, ["r"])
        self.assertExpectedInline(testing.normalize(done.gm), """\
def forward(self, x, w):
    exp_default = torch.ops.aten.exp.default(w)
    gd_r = graphdispatch_gd_r(x, w)
    getitem = gd_r[0]
    getitem_1 = gd_r[1]
    sin_default = torch.ops.aten.sin.default(getitem)
    neg_default = torch.ops.aten.neg.default(sin_default)
    add_tensor = torch.ops.aten.add.Tensor(neg_default, getitem_1)
    add_tensor_1 = torch.ops.aten.add.Tensor(add_tensor, exp_default)
    return (add_tensor_1,)""")
        self.assertEqual(testing.op_counts(done.gm), {"aten::add.Tensor": 2, "aten::exp.default": 1,
                                                       "aten::neg.default": 1, "aten::sin.default": 1,
                                                       "getitem": 2, "graphdispatch.gd_r": 1})
        (out,), (ref,) = done.gm(*args), expected
        self.assertTrue(torch.equal(out, ref))

    def test_native_region_graph_computes_what_the_original_did(self):
        model = _model(testing.Stack, 2, **SMALL)
        x = torch.randn(2, 4)
        lowered = _lowered(model, x)
        done = run_substitute(lowered.gm, ["blocks.1.mlp", "blocks.0"], lowered.origins)
        values = _node_values(done.original, lowered, model, x)
        for name, native in done.natives.items():
            region = done.regions[name]
            self.assertEqual(testing.op_counts(native), region.ops)
            self.assertEqual([p.name for p in native.graph.find_nodes(op="placeholder")],
                             [n.replace(".", "_") for n in region.input_names])
            inputs, outputs = done.boundary[name]
            with torch.no_grad():
                outs = native(*[values[n] for n in inputs])
            self.assertEqual(len(outs), len(outputs))
            for out, node in zip(outs, outputs):
                self.assertTrue(torch.equal(out, values[node]), name)
        # blocks.1.mlp reads blocks.0's output, which substitution replaced by a getitem
        mlp = done.regions["blocks.1.mlp"]
        self.assertEqual(mlp.inputs[mlp.input_names.index("input0")].target, operator.getitem)


    def test_a_non_convex_region_is_never_cut_even_if_the_matcher_selects_it(self):
        gm = _reentering()
        before = testing.normalize(gm)
        done = run_substitute(gm, ["r"])
        self.assertEqual(testing.normalize(done.gm), before)
        self.assertEqual([r.reason for r in done.ctx.outcomes["r"].rejections], [Rejection.NOT_CONVEX])

    def test_a_region_made_non_convex_by_an_earlier_substitution_is_rejected(self):
        """a and b are convex on their own, but once `a` is one call node, the path
        b1 -> call(a) -> b2 leaves b and re-enters it: cutting b too would need a cycle."""
        gm = _crossed()
        args = (torch.randn(3), torch.randn(3))
        expected = gm(*args)
        done = run_substitute(gm, ["a", "b"])
        self.assertTrue(done.regions["a"].convex and done.regions["b"].convex)
        self.assertEqual([c.meta["gd_substitution"]["region"] for c in _calls(done.gm)], ["a"])
        self.assertEqual([r.reason for r in done.ctx.outcomes["b"].rejections], [Rejection.NOT_CONVEX])
        self.assertTrue(all(torch.equal(o, e) for o, e in zip(done.gm(*args), expected)))

class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.lin(x)).relu()


def _node_values(gm: fx.GraphModule, lowered: testing.Lowered, model: nn.Module, *args: torch.Tensor
                 ) -> dict[str, Any]:
    """Every node's value (by name) when the graph runs."""
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n.name] = out = super().run_node(n)
            return out

    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    user = iter(args)
    with torch.no_grad():
        Recorder(gm).run(*[state[o.name] if o.is_state else next(user) for o in lowered.origins])
    return values


def _stack(name: str) -> dict[str, tuple[str, type]]:
    return {name: (f"L['self'].{name}", nn.Module)}


def _interleaved() -> fx.GraphModule:
    """Region r = {mul, cos}. Between them sit sin (reads r's output mul: it must move
    after the call), neg (reads sin: it moves too) and exp (reads only x: it stays)."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    mul = graph.call_function(aten.mul.Tensor, (x, w))
    sin = graph.call_function(aten.sin.default, (mul,))
    neg = graph.call_function(aten.neg.default, (sin,))
    exp = graph.call_function(aten.exp.default, (w,))
    cos = graph.call_function(aten.cos.default, (x,))
    add = graph.call_function(aten.add.Tensor, (neg, cos))
    graph.output((graph.call_function(aten.add.Tensor, (add, exp)),))
    for node in graph.nodes:
        if node.op == "call_function":
            node.meta["nn_module_stack"] = _stack("r") if node in (mul, cos) else {}
    return fx.GraphModule(nn.Module(), graph)


def _reentering() -> fx.GraphModule:
    """r = {sin, mul}; cos sits outside and reads sin, mul reads cos: out and back in."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    sin = graph.call_function(aten.sin.default, (x,))
    cos = graph.call_function(aten.cos.default, (sin,))
    mul = graph.call_function(aten.mul.Tensor, (sin, cos))
    graph.output((mul,))
    for node in (sin, mul):
        node.meta["nn_module_stack"] = _stack("r")
    return fx.GraphModule(nn.Module(), graph)


def _crossed() -> fx.GraphModule:
    """a = {a1, a2, a3}, b = {b1, b2}: b1 -> a1 and a2 -> b2, with a1 and a2 independent."""
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    b1 = graph.call_function(aten.sin.default, (x,))
    a1 = graph.call_function(aten.cos.default, (b1,))
    a2 = graph.call_function(aten.exp.default, (y,))
    a3 = graph.call_function(aten.neg.default, (a2,))
    b2 = graph.call_function(aten.mul.Tensor, (b1, a3))
    graph.output((a1, b2))
    for node, name in ((b1, "b"), (a1, "a"), (a2, "a"), (a3, "a"), (b2, "b")):
        node.meta["nn_module_stack"] = _stack(name)
    return fx.GraphModule(nn.Module(), graph)
