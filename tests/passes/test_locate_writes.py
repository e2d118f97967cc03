"""locate_writes: where a graph will write its inputs, as a program over its inputs that runs
before the graph (a KV cache's row, not the cache); writes it cannot locate in advance are
the whole input, with why."""

from __future__ import annotations

from typing import Any

import expecttest
import torch
import torch.fx as fx

from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.locate_writes import INDEX, INDICES, SCATTER, WHOLE, WritePlan, plan_writes
from graphdispatch_backend.passes.reinplace import reinplace
from graphdispatch_backend.testing import aten_graph, normalize


def _plan(fn: Any, *args: Any) -> tuple[fx.GraphModule, WritePlan]:
    with torch.no_grad():
        gm = aten_graph(fn, *args).gm
    reinplace(gm, PassContext())
    plan = plan_writes(gm)
    assert plan is not None
    return gm, plan


def _kinds(plan: WritePlan) -> list[tuple[int, str, str]]:
    return [(s.position, s.kind, s.why) for s in plan.sites]


class TestLocateWrites(expecttest.TestCase):
    def test_a_row_write_is_located_by_its_index_input(self):
        def step(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            cache.index_copy_(0, pos, k)
            return k * 2

        args = torch.zeros(8, 4), torch.tensor([3]), torch.randn(1, 4)
        _, plan = _plan(step, *args)
        self.assertEqual(_kinds(plan), [(0, INDEX, "")])
        (site,) = plan.sites
        values = plan.locate(*args)
        assert values[site.view] is args[0] and torch.equal(values[site.index[0]], args[1]) and site.dim == 0

    def test_a_static_cache_index_read_before_its_counter_moves(self):
        """transformers' StaticLayer: `cache_position = arange(n) + cumulative_length`, then
        `cumulative_length.add_(n)`, then `index_copy_` at cache_position."""
        def update(keys: torch.Tensor, count: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            position = torch.arange(k.shape[0]) + count
            count.add_(k.shape[0])
            keys.index_copy_(0, position, k)
            return keys.sum()

        args = torch.zeros(8, 4), torch.tensor([2]), torch.randn(2, 4)
        _, plan = _plan(update, *args)
        self.assertExpectedInline(normalize(plan.locate), """\
def forward(self, arg0_1, arg1_1, arg2_1):
    arange = torch.ops.aten.arange.default(2, device = device(type='cpu'), pin_memory = False)
    add = torch.ops.aten.add.Tensor(arange, arg1_1)
    return (arg1_1, arg2_1, add)""")
        self.assertEqual(_kinds(plan), [(1, WHOLE, "aten::add_ may write all of it"), (2, INDEX, "")])
        index = plan.locate(torch.zeros(8, 4), torch.tensor([5]), torch.randn(2, 4))[plan.sites[1].index[0]]
        assert index.tolist() == [5, 6]  # where the graph will write: before its counter moves

    def test_an_index_read_after_it_was_written_is_not_located(self):
        def bad(count: torch.Tensor, keys: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            count.add_(1)
            keys.index_copy_(0, count, k)
            return keys.sum()

        _, plan = _plan(bad, torch.tensor([2]), torch.zeros(8, 4), torch.randn(1, 4))
        self.assertEqual(_kinds(plan), [
            (0, WHOLE, "aten::add_ may write all of it"),
            (1, WHOLE, "the index aten::index_copy_ writes at cannot be computed in advance")])

    def test_views_are_located_as_views(self):
        def step(cache: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            cache[3:4] = k
            cache[:, 1, 2] = 1.0
            return k * 2

        args = torch.zeros(8, 3, 4), torch.randn(1, 3, 4)
        _, plan = _plan(step, *args)
        self.assertEqual(_kinds(plan), [(0, WHOLE, ""), (0, WHOLE, "")])
        values = plan.locate(*args)
        assert [tuple(values[s.view].shape) for s in plan.sites] == [(1, 3, 4), (8,)]

    def test_index_put_and_scatter(self):
        def put(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            cache[:, pos] = k
            return k

        _, plan = _plan(put, torch.zeros(3, 8, 4), torch.tensor([3]), torch.randn(3, 1, 4))
        (site,) = plan.sites
        assert site.kind == INDICES and site.index[0] is None and site.index[1] is not None

        def scatter(cache: torch.Tensor, idx: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            cache.scatter_(1, idx, k)
            return k

        _, plan = _plan(scatter, torch.zeros(4, 8), torch.tensor([[1], [2], [3], [0]]), torch.randn(4, 1))
        self.assertEqual(_kinds(plan), [(0, SCATTER, "")])

    def test_a_custom_op_may_write_anywhere_in_its_argument(self):
        @torch.library.custom_op("gd_test_locate::scramble", mutates_args=("cache",))
        def scramble(cache: torch.Tensor, k: torch.Tensor) -> None:
            cache.add_(k.sum())

        scramble.register_fake(lambda cache, k: None)
        _, plan = _plan(lambda c, k: (torch.ops.gd_test_locate.scramble(c, k), k + 1)[1],
                        torch.zeros(8, 4), torch.randn(4))
        self.assertEqual(_kinds(plan), [(0, WHOLE, "gd_test_locate::scramble may write all of it")])

    def test_a_graph_that_writes_no_input_has_no_plan(self):
        with torch.no_grad():
            gm = aten_graph(lambda x: x * 2, torch.randn(3)).gm
        assert plan_writes(gm) is None
