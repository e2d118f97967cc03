"""segments.py and canonical.py: which nodes Inductor may get, cut out around the ones it
may not; the rewrites that let it lower ops aot leaves undecomposed, each exact."""

from __future__ import annotations

from collections.abc import Callable

import expecttest
import pytest
import torch
import torch.fx as fx

from graphdispatch_backend.fusion.canonical import ORIGIN, rewrite
from graphdispatch_backend.fusion.recipe import EXACT_OPS, recipe_for
from graphdispatch_backend.fusion.segments import SEGMENT_META, cut, op_name, recipe_allows
from graphdispatch_backend.options import FuseTolerance
from graphdispatch_backend.testing import accounted_graphs, aten_graph, normalize, op_counts

CPU = recipe_for("cpu")
TOL = {"rtol": 1e-3, "atol": 1e-5}
CPU_TOL = recipe_for("cpu", FuseTolerance(**TOL))


def _named(i: int):
    def segment(*args):
        raise AssertionError("not run")

    segment.__name__ = segment.__qualname__ = f"gd_segment_{i}"
    return segment


def _graph() -> fx.GraphModule:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x * 2 + 1) @ w
        return torch.nn.functional.dropout(h, 0.5, training=True) + h.t().t()

    return aten_graph(f, torch.randn(4, 4), torch.randn(4, 4)).gm


class TestCut(expecttest.TestCase):
    def test_runs_with_a_fusable_op_become_segments_around_what_inductor_may_not_hold(self):
        gm = _graph()
        segments: list[fx.GraphModule] = []
        n = cut(gm, CPU, lambda i, seg: segments.append(seg) or _named(i))
        self.assertEqual(n, 2)
        # the random draw stays outside every segment
        self.assertExpectedInline(str(op_counts(gm)), """{'aten::native_dropout.default': 1, 'getitem': 3, 'tests.fusion.test_segments.gd_segment_0': 1, 'tests.fusion.test_segments.gd_segment_1': 1}""")  # noqa: E501
        self.assertExpectedInline(normalize(segments[0]), """\
def forward(self, arg0_1, arg1_1):
    mul = torch.ops.aten.mul.Tensor(arg0_1, 2)
    add = torch.ops.aten.add.Tensor(mul, 1)
    relu = torch.ops.aten.relu.default(add)
    mm = torch.ops.aten.mm.default(relu, arg1_1)
    return (mm,)""")
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1):
    gd_segment_0 = tests_fusion_test_segments_gd_segment_0(arg0_1, arg1_1)
    getitem_2 = gd_segment_0[0]
    native_dropout = torch.ops.aten.native_dropout.default(getitem_2, 0.5, True)
    getitem = native_dropout[0]
    gd_segment_1 = tests_fusion_test_segments_gd_segment_1(getitem_2, getitem)
    getitem_3 = gd_segment_1[0]
    return (getitem_3,)""")
        self.assertEqual([n.meta[SEGMENT_META] for n in gm.graph.nodes if SEGMENT_META in n.meta], [0, 1])

    def test_a_run_with_nothing_to_fuse_stays_inline(self):
        gm = aten_graph(lambda x, w: torch.exp(x @ w), torch.randn(2, 2), torch.randn(2, 2)).gm
        self.assertEqual(cut(gm, CPU, lambda i, seg: None), 0)

    def test_a_returned_chunk_goes_where_its_split_goes(self):
        """Under a tolerance the views of outputs run after the segment; but a `split` one of
        whose chunks the segment reads stays in it, and so does the chunk it returns: left
        outside, the segment returned the split's list of views (aot refused to compile it)."""
        def f(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = (e * 2).chunk(2, dim=1)
            return a + 1, b.t()

        gm = aten_graph(f, torch.randn(2, 16)).gm
        segments: list[fx.GraphModule] = []
        self.assertEqual(cut(gm, CPU_TOL, lambda i, seg: segments.append(seg) or _named(i)), 1)
        self.assertExpectedInline(normalize(segments[0]), """\
def forward(self, arg0_1):
    mul = torch.ops.aten.mul.Tensor(arg0_1, 2)
    split = torch.ops.aten.split.Tensor(mul, 8, 1)
    getitem = split[0]
    getitem_1 = split[1]
    add = torch.ops.aten.add.Tensor(getitem, 1)
    return (getitem_1, add)""")
        # the returned chunk's own view still runs after the segment, as ATen
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1):
    gd_segment_0 = tests_fusion_test_segments_gd_segment_0(arg0_1)
    getitem_2 = gd_segment_0[0]
    getitem_3 = gd_segment_0[1]
    t = torch.ops.aten.t.default(getitem_2)
    return (getitem_3, t)""")


def _node(fn, *args, target: str) -> fx.Node:
    gm = aten_graph(fn, *args).gm
    return next(n for n in gm.graph.nodes if op_name(n) == target)


def test_what_the_recipe_allows():
    x = torch.randn(4, 4)
    assert recipe_allows(_node(lambda a: a * 3, x, target="aten.mul.Tensor"), CPU)
    # eager's a + alpha * b is one fused multiply-add; floor division is eager's own formula
    assert not recipe_allows(_node(lambda a: torch.add(a, a, alpha=2), x, target="aten.add.Tensor"), CPU)
    assert not recipe_allows(_node(lambda a: torch.div(a, 3, rounding_mode="floor"), x, target="aten.div.Tensor_mode"),
                             CPU)
    assert not recipe_allows(_node(lambda a: torch.exp(a), x, target="aten.exp.default"), CPU)
    assert not recipe_allows(_node(lambda a: a.sum(0), x, target="aten.sum.dim_IntList"), CPU)
    assert recipe_allows(_node(lambda a: (a > 0).sum(0), x, target="aten.sum.dim_IntList"), CPU)  # integers: exact
    assert recipe_allows(_node(lambda a: a ** 2, x, target="aten.pow.Tensor_Scalar"), CPU)
    assert not recipe_allows(_node(lambda a: a ** 4, x, target="aten.pow.Tensor_Scalar"), CPU)
    assert not recipe_allows(_node(lambda a: a.bfloat16() ** 3, x, target="aten.pow.Tensor_Scalar"), CPU)
    assert not recipe_allows(_node(lambda a: a.abs().sqrt(), x, target="aten.sqrt.default"), CPU)  # eager's is MKL's
    assert recipe_allows(_node(lambda a: a + torch.arange(4.0), x, target="aten.arange.default"), CPU) is False
    assert recipe_allows(_node(lambda a: a + torch.arange(4), x, target="aten.arange.default"), CPU)
    assert not recipe_allows(_node(lambda a: a.bfloat16() + torch.arange(300, dtype=torch.bfloat16)[:4], x,
                                   target="aten.arange.default"), CPU)  # 299 is no bf16
    # a bf16 graph on another device type than the recipe's
    assert not recipe_allows(_node(lambda a: a * 3, x, target="aten.mul.Tensor"), recipe_for("cuda"))


def test_the_recipe_keeps_reductions_transcendentals_and_matmuls_out():
    kept = {"mean", "var_mean", "_softmax", "native_layer_norm", "exp", "tanh", "erf", "gelu",
            "silu", "sigmoid", "sin", "cos", "log", "mm", "addmm", "bmm", "convolution",
            "_scaled_dot_product_flash_attention_for_cpu"}
    assert not kept & EXACT_OPS  # (sum, pow, sqrt: per node, above)


class TestCanonical(expecttest.TestCase):
    def test_views_casts_and_rsub_become_ops_inductor_lowers_exactly(self):
        def f(x: torch.Tensor) -> torch.Tensor:
            return (1 - x.t().transpose(0, 1)).to(torch.bfloat16)

        x = torch.randn(3, 5)
        gm = aten_graph(f, x).gm
        before = gm(x)
        nodes = {n for n in gm.graph.nodes if n.op == "call_function"}
        added = rewrite(gm, nodes)
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1):
    t = torch.ops.aten.permute.default(arg0_1, [1, 0])
    transpose = torch.ops.aten.permute.default(t, [1, 0])
    neg_default = torch.ops.aten.neg.default(transpose)
    rsub = torch.ops.aten.add.Tensor(neg_default, 1)
    _to_copy = torch.ops.prims.convert_element_type.default(rsub, torch.bfloat16)
    return (_to_copy,)""")
        self.assertEqual(len(added - nodes), 1)  # the neg
        after = gm(x)
        self.assertTrue(torch.equal(before[0], after[0]) and before[0].stride() == after[0].stride())
        # each rewritten node keeps the name of the op it was: verdicts name what the graph held
        self.assertEqual(sorted(n.meta[ORIGIN] for n in gm.graph.nodes if ORIGIN in n.meta),
                         ["aten._to_copy.default", "aten.rsub.Scalar", "aten.rsub.Scalar", "aten.t.default",
                          "aten.transpose.int"])


def _chunk_one_returned(e: torch.Tensor) -> tuple[torch.Tensor, ...]:  # MochiRMSNormZero's shape
    a, b = (e * 2).chunk(2, dim=1)
    return a + 1, b


def _unbind_two_returned(e: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a, b, c, d = (e * 2).view(2, 4, 4).unbind(1)
    return b * a, c, d.unsqueeze(0)


def _uneven_split_returned_with_its_base(e: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = e * 2
    a, b, c = y.split([3, 5, 8], dim=1)
    return b + 1, a, y, c


@pytest.mark.parametrize("fuse", [True, TOL], ids=["exact", "tolerance"])
@pytest.mark.parametrize("f", [_chunk_one_returned, _unbind_two_returned, _uneven_split_returned_with_its_base],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_graph_that_reads_one_chunk_and_returns_another_is_fused(
        fuse: object, f: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> None:
    """Fused in both modes (the tolerance mode failed to compile it: `failed`, the ATen graph
    served), every output eager's values (bits under `fuse=True`), strides and aliasing."""
    compiled = torch.compile(f, backend="graphdispatch", options={"fuse": fuse, "cache_dir": False,
                                                                  "cuda_graphs": "emulate"})
    for i in range(4):
        e = torch.randn(2, 16, generator=torch.Generator().manual_seed(i))
        got, want = compiled(e), f(e)
        for g, w in zip(got, want):
            if fuse is True:
                assert torch.equal(g, w)
            else:
                torch.testing.assert_close(g, w, **TOL)
            assert g.stride() == w.stride()
        assert _shared(got) == _shared(want)  # a chunk aliases its base, and the other chunks, as eager's
    (graph,) = accounted_graphs()
    assert graph["fusion"]["status"] == "fused", graph["fusion"]
    assert graph["lowering_check"]["status"] == ("bitwise" if fuse is True else "within_tolerance")


def _shared(outputs: tuple[torch.Tensor, ...]) -> list[list[bool]]:
    """Which outputs share memory with which."""
    return [[a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in outputs] for a in outputs]
