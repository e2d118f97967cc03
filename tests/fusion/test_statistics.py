"""statistics.py: a fused graph takes its watched inputs' statistics itself, as one more
output, equal to what the check's own reduction reads (runtime/checks/novelty.py)."""

from __future__ import annotations

import math

import expecttest
import torch

from graphdispatch_backend.fusion.inductor import compile_segment
from graphdispatch_backend.fusion.recipe import recipe_for
from graphdispatch_backend.fusion.statistics import STATISTIC, add_statistics, watchable
from graphdispatch_backend.options import FuseTolerance
from graphdispatch_backend.runtime.checks.novelty import Novelty
from graphdispatch_backend.testing import aten_graph, normalize, op_counts

RECIPES = (recipe_for("cpu"), recipe_for("cpu", FuseTolerance(rtol=1e-3, atol=1e-3)))


def _graph(x: torch.Tensor, n: torch.Tensor) -> torch.fx.GraphModule:
    def f(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * 2) + n

    return aten_graph(f, x, n).gm


def _alone(t: torch.Tensor) -> float:
    """What the check's own reduction reads of `t`."""
    return Novelty([0])._magnitude(t)


class TestAddStatistics(expecttest.TestCase):
    def test_each_watched_input_adds_one_value_to_a_last_output(self):
        gm = add_statistics(_graph(torch.randn(3, 4), torch.randn(4)), [0, 1])
        self.assertExpectedInline(str(op_counts(gm)), """{'aten::abs.default': 2, 'aten::add.Tensor': 1, 'aten::amax.default': 2, 'aten::cat.default': 1, 'aten::mul.Tensor': 1, 'aten::relu.default': 1, 'aten::unsqueeze.default': 2, 'prims::convert_element_type.default': 2}""")  # noqa: E501
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1):
    mul = torch.ops.aten.mul.Tensor(arg0_1, 2)
    relu = torch.ops.aten.relu.default(mul)
    add = torch.ops.aten.add.Tensor(relu, arg1_1)
    abs_default = torch.ops.aten.abs.default(arg0_1)
    amax_default = torch.ops.aten.amax.default(abs_default, [])
    convert_element_type_default = torch.ops.prims.convert_element_type.default(amax_default, torch.float64)
    unsqueeze_default = torch.ops.aten.unsqueeze.default(convert_element_type_default, 0)
    abs_default_1 = torch.ops.aten.abs.default(arg1_1)
    amax_default_1 = torch.ops.aten.amax.default(abs_default_1, [])
    convert_element_type_default_1 = torch.ops.prims.convert_element_type.default(amax_default_1, torch.float64)
    unsqueeze_default_1 = torch.ops.aten.unsqueeze.default(convert_element_type_default_1, 0)
    cat_default = torch.ops.aten.cat.default([unsqueeze_default, unsqueeze_default_1])
    return (add, cat_default)""")
        added = [n for n in gm.graph.nodes if STATISTIC in n.meta]
        self.assertEqual(len(added), 9)
        self.assertTrue(all(isinstance(n.meta["val"], torch.Tensor) for n in added))

    def test_the_values_are_what_the_checks_own_reduction_reads(self):
        """NaN where any is NaN, inf where any is infinite (a negative one too), the largest
        magnitude of a negative value, bfloat16 and integers; ATen and Inductor alike."""
        cases = [
            torch.tensor([[1.0, -7.5, 2.0]]),
            torch.tensor([[1.0, float("nan"), float("inf")]]),
            torch.tensor([[1.0, float("-inf"), 3.0]]),
            torch.tensor([[0.0, 0.0, 0.0]]),
            torch.tensor([[1.5, -300.0, 2.0]], dtype=torch.bfloat16),
            torch.tensor([[3, -9, 4]]),
        ]
        for x in cases:
            n = torch.ones(3, dtype=x.dtype)
            gm = add_statistics(_graph(x, n), [0, 1])
            exact, within = (compile_segment(gm, recipe, frozenset()) for recipe in RECIPES)
            for got in (gm(x, n)[-1], exact.run(x, n)[-1], within.run(x, n)[-1]):
                self.assertEqual(got.dtype, torch.float64)
                want = [_alone(x), _alone(n)]
                for g, w in zip(got.tolist(), want):
                    self.assertTrue(g == w or math.isnan(g) and math.isnan(w), (x, got, want))

    def test_only_static_non_empty_strided_tensors_are_watchable(self):
        self.assertTrue(watchable(torch.empty(2, 3)))
        self.assertFalse(watchable(torch.empty(0, 3)))  # amax of nothing raises
        self.assertFalse(watchable(torch.empty(2, 3).to_sparse()))
        self.assertFalse(watchable(3))
