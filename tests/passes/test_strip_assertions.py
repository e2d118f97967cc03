"""strip_assertions: dead tensor-metadata assertions go (counted), everything else stays."""

from __future__ import annotations

import expecttest
import torch
import torch.fx as fx

import graphdispatch_backend
from graphdispatch_backend.passes import PIPELINE
from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.strip_assertions import strip_assertions
from graphdispatch_backend.testing import aten_graph, normalize, op_counts

ASSERT_META = torch.ops.aten._assert_tensor_metadata.default
ASSERT_KEY = "aten::_assert_tensor_metadata.default"


@torch.library.custom_op("gdtest_strip::_assert_tensor_metadata", mutates_args=())
def _lookalike(x: torch.Tensor) -> None:
    """A different op whose str() reads like the real one (`gdtest_strip._assert_tensor_metadata.default`)."""


class _Impostor:
    """A call target whose str() is exactly the real overload's: only a str() match would remove it."""

    __name__ = "_assert_tensor_metadata"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor, **kwargs: object) -> None:
        self.calls += 1

    def __str__(self) -> str:
        return str(ASSERT_META)


class _Casts(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.bfloat16) * 2
        return y.float() + 1


class _ScalarCheck(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.sum().item()
        torch._check(n > -1000)
        return x * n


def _graph(*targets: object) -> fx.GraphModule:
    """x -> one call per target (results unused) -> x + 1."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    for target in targets:
        graph.call_function(target, (x,), {"dtype": torch.float32})
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (x, 1)),))
    return fx.GraphModule(torch.nn.Module(), graph)


class TestStripAssertions(expecttest.TestCase):
    def test_export_graph_before_and_after(self):
        x = torch.randn(2, 3)
        program = torch.export.export(_Casts(), (x,))
        gm = program.graph_module
        self.assertExpectedInline(normalize(gm), """\
def forward(self, x):
    _assert_tensor_metadata_default = torch.ops.aten._assert_tensor_metadata.default(x, dtype = torch.float32, device = device(type='cpu'), layout = torch.strided)
    to = torch.ops.aten.to.dtype(x, torch.bfloat16)
    mul = torch.ops.aten.mul.Tensor(to, 2)
    _assert_tensor_metadata_default_1 = torch.ops.aten._assert_tensor_metadata.default(mul, dtype = torch.bfloat16, device = device(type='cpu'), layout = torch.strided)
    to_1 = torch.ops.aten.to.dtype(mul, torch.float32)
    add = torch.ops.aten.add.Tensor(to_1, 1)
    return (add,)""")  # noqa: E501
        before = op_counts(gm)
        self.assertEqual(before[ASSERT_KEY], 2)  # one per dtype cast

        ctx = PassContext()
        strip_assertions(gm, ctx)

        self.assertExpectedInline(normalize(gm), """\
def forward(self, x):
    to = torch.ops.aten.to.dtype(x, torch.bfloat16)
    mul = torch.ops.aten.mul.Tensor(to, 2)
    to_1 = torch.ops.aten.to.dtype(mul, torch.float32)
    add = torch.ops.aten.add.Tensor(to_1, 1)
    return (add,)""")
        after = op_counts(gm)
        self.assertEqual(ctx.stripped_assertions, 2)
        self.assertEqual(after, {k: v for k, v in before.items() if k != ASSERT_KEY})
        (out,) = gm(x)  # the stripped graph still computes what the module does
        self.assertTrue(torch.equal(out, _Casts()(x)))

    def test_count_accumulates_in_the_context(self):
        ctx = PassContext(stripped_assertions=3)
        strip_assertions(_graph(ASSERT_META, ASSERT_META), ctx)
        self.assertEqual(ctx.stripped_assertions, 5)
        strip_assertions(_graph(), ctx)  # nothing to strip: unchanged
        self.assertEqual(ctx.stripped_assertions, 5)

    def test_assertion_with_users_is_kept(self):
        graph = fx.Graph()
        x = graph.placeholder("x")
        used = graph.call_function(ASSERT_META, (x,), {"dtype": torch.float32})
        graph.call_function(ASSERT_META, (x,), {"dtype": torch.float32})  # dead
        graph.output((graph.call_function(torch.ops.aten.add.Tensor, (x, 1)), used))
        gm = fx.GraphModule(torch.nn.Module(), graph)
        ctx = PassContext()
        strip_assertions(gm, ctx)
        self.assertEqual(ctx.stripped_assertions, 1)
        self.assertEqual(op_counts(gm)[ASSERT_KEY], 1)
        self.assertIn(used, gm.graph.nodes)

    def test_assert_scalar_is_kept(self):
        program = torch.export.export(_ScalarCheck(), (torch.randn(2, 3),))
        gm = program.graph_module
        before = op_counts(gm)
        self.assertEqual(before.get("aten::_assert_scalar.default"), 1)
        ctx = PassContext()
        strip_assertions(gm, ctx)
        self.assertEqual(ctx.stripped_assertions, 0)
        self.assertEqual(op_counts(gm), before)

    def test_matching_is_by_schema_name_not_str(self):
        impostor = _Impostor()
        lookalike = torch.ops.gdtest_strip._assert_tensor_metadata.default
        self.assertEqual(str(impostor), str(ASSERT_META))
        self.assertIn("_assert_tensor_metadata", str(lookalike))
        graph = fx.Graph()
        x = graph.placeholder("x")
        graph.call_function(ASSERT_META, (x,), {"dtype": torch.float32})
        graph.call_function(impostor, (x,), {"dtype": torch.float32})
        graph.call_function(lookalike, (x,))
        graph.output((graph.call_function(torch.ops.aten.add.Tensor, (x, 1)),))
        gm = fx.GraphModule(torch.nn.Module(), graph)
        ctx = PassContext()
        strip_assertions(gm, ctx)
        self.assertEqual(ctx.stripped_assertions, 1)
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        self.assertEqual(targets, [impostor, lookalike, torch.ops.aten.add.Tensor])
        gm(torch.randn(2))  # the impostor still runs
        self.assertEqual(impostor.calls, 1)

    def test_strip_assertions_runs_first_in_the_pipeline(self):
        self.assertIs(PIPELINE[0], strip_assertions)

    def test_aot_route_emits_no_assertions(self):
        x = torch.randn(2, 3)
        with torch.no_grad():
            lowered = aten_graph(_Casts(), x)
        self.assertNotIn(ASSERT_KEY, op_counts(lowered.gm))
        self.assertEqual(op_counts(lowered.gm).get("aten::_to_copy.default"), 2)  # the casts are there

    def test_report_counts_zero_through_torch_compile(self):
        x = torch.randn(2, 3)
        model = _Casts()
        with torch.no_grad():
            out = torch.compile(model, backend="graphdispatch")(x)
        self.assertTrue(torch.equal(out, model(x)))
        (graph,) = graphdispatch_backend.latest_report()["graphs"]
        self.assertEqual(graph["kind"], "inference")
        self.assertEqual(graph["stripped_assertions"], 0)
