"""reinplace: a functional write into a graph input, copied back whole, becomes the write
itself (a KV cache's row, not the cache); chains that would read what they overwrite stay
functional, with the reason recorded."""

from __future__ import annotations

import sys
from typing import Any

import expecttest
import pytest
import torch
import torch.fx as fx

from graphdispatch_backend.passes import functional_writes
from graphdispatch_backend.passes.context import PassContext, WriteOutcome
from graphdispatch_backend.passes.reinplace import reinplace
from graphdispatch_backend.testing import accounted_graphs, aten_graph, normalize, op_counts

aten = torch.ops.aten


@torch.library.custom_op("gd_test_reinplace::cache_write", mutates_args=("cache",))
def cache_write(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    cache.index_copy_(0, slots, k)


@cache_write.register_fake
def _(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    return None


@torch.library.custom_op("gd_test_reinplace::kv_write", mutates_args=("kc", "vc"))
def kv_write(kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    kc.index_copy_(0, slots, k)
    vc.index_copy_(0, slots, k * 2)
    return k + 1


@kv_write.register_fake
def _(kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(k)


def _lowered(fn: Any, *args: Any) -> fx.GraphModule:
    with torch.no_grad():
        return aten_graph(fn, *args).gm


def _run(gm: fx.GraphModule) -> list[WriteOutcome]:
    ctx = PassContext()
    reinplace(gm, ctx)
    return ctx.writes


def decode(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, pos, k)
    return k * 2


def _decode_args() -> tuple[torch.Tensor, ...]:
    return torch.zeros(8, 4), torch.tensor([3]), torch.randn(1, 4)


class TestReinplace(expecttest.TestCase):
    def test_a_kv_cache_row_write_is_made_in_place_and_the_copy_back_goes(self):
        gm = _lowered(decode, *_decode_args())
        self.assertEqual(op_counts(gm), {"aten::copy_.default": 1, "aten::index_copy.default": 1,
                                         "aten::mul.Tensor": 1})
        writes = _run(gm)
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1, arg2_1):
    index_copy__default = torch.ops.aten.index_copy_.default(arg0_1, 0, arg1_1, arg2_1)
    mul = torch.ops.aten.mul.Tensor(arg2_1, 2)
    return (mul,)""")
        self.assertEqual(op_counts(gm), {"aten::index_copy_.default": 1, "aten::mul.Tensor": 1})
        self.assertEqual(writes, [WriteOutcome(0, True, "1 write(s) in place")])

    def test_writes_through_views_chain_in_place(self):
        def step(cache: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            cache[3:4] = k
            cache[:, 0].add_(1)
            return k * 2

        gm = _lowered(step, torch.zeros(8, 4), torch.randn(1, 4))
        _run(gm)
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1):
    slice_tensor = torch.ops.aten.slice.Tensor(arg0_1, 0, 3, 4)
    copy__default = torch.ops.aten.copy_.default(slice_tensor, arg1_1)
    select_int = torch.ops.aten.select.int(arg0_1, 1, 0)
    add__tensor = torch.ops.aten.add_.Tensor(select_int, 1)
    mul = torch.ops.aten.mul.Tensor(arg1_1, 2)
    return (mul,)""")
        self.assertNotIn("aten::slice_scatter.default", op_counts(gm))

    def test_a_nested_view_write_is_one_write_into_the_nested_view(self):
        def step(cache: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            cache[:, 1, 3] = k
            return k * 2

        gm = _lowered(step, torch.zeros(2, 3, 8), torch.randn(2))
        _run(gm)
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1):
    select_int = torch.ops.aten.select.int(arg0_1, 1, 1)
    select_int_1 = torch.ops.aten.select.int(select_int, 1, 3)
    copy__default = torch.ops.aten.copy_.default(select_int_1, arg1_1)
    mul = torch.ops.aten.mul.Tensor(arg1_1, 2)
    return (mul,)""")

    def test_a_row_write_into_a_view_of_the_input(self):
        def step(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            cache[0].index_copy_(0, pos, k)
            return cache.sum()

        gm = _lowered(step, torch.zeros(2, 8, 4), torch.tensor([3]), torch.randn(1, 4))
        _run(gm)
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1, arg2_1):
    select_int = torch.ops.aten.select.int(arg0_1, 0, 0)
    index_copy__default = torch.ops.aten.index_copy_.default(select_int, 0, arg1_1, arg2_1)
    sum_1 = torch.ops.aten.sum.default(arg0_1)
    return (sum_1,)""")

    def test_a_mutating_custom_op_is_called_on_the_input_itself(self):
        gm = _lowered(lambda c, p, k: (torch.ops.gd_test_reinplace.cache_write(c, p, k), k * 2)[1],
                      *_decode_args())
        self.assertEqual(op_counts(gm)["hop::auto_functionalized_v2"], 1)
        _run(gm)
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1, arg2_1):
    cache_write_default = torch.ops.gd_test_reinplace.cache_write.default(slots = arg1_1, k = arg2_1, cache = arg0_1)
    mul = torch.ops.aten.mul.Tensor(arg2_1, 2)
    return (mul,)""")

    def test_a_custom_op_on_a_view_gets_the_view_regenerated(self):
        gm = _lowered(lambda c, p, k: (torch.ops.gd_test_reinplace.cache_write(c[1], p, k), k * 2)[1],
                      torch.zeros(2, 8, 4), torch.tensor([3]), torch.randn(1, 4))
        _run(gm)
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1, arg2_1):
    as_strided_default = torch.ops.aten.as_strided.default(arg0_1, (8, 4), (4, 1), 32)
    cache_write_default = torch.ops.gd_test_reinplace.cache_write.default(slots = arg1_1, k = arg2_1, cache = as_strided_default)
    mul = torch.ops.aten.mul.Tensor(arg2_1, 2)
    return (mul,)""")  # noqa: E501

    def test_a_custom_op_writing_two_caches_returns_its_own_output(self):
        gm = _lowered(lambda kc, vc, p, k: torch.ops.gd_test_reinplace.kv_write(kc, vc, p, k) * 3,
                      torch.zeros(8, 4), torch.zeros(8, 4), torch.tensor([3]), torch.randn(1, 4))
        writes = _run(gm)
        self.assertExpectedInline(normalize(gm), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1):
    kv_write_default = torch.ops.gd_test_reinplace.kv_write.default(slots = arg2_1, k = arg3_1, kc = arg0_1, vc = arg1_1)
    mul = torch.ops.aten.mul.Tensor(kv_write_default, 3)
    return (mul,)""")  # noqa: E501
        self.assertEqual([(w.position, w.in_place) for w in writes], [(0, True), (1, True)])
        kc, vc, k = torch.zeros(8, 4), torch.zeros(8, 4), torch.randn(1, 4)
        (out,) = gm(kc, vc, torch.tensor([3]), k)
        assert torch.equal(out, (k + 1) * 3) and torch.equal(kc[3], k[0]) and torch.equal(vc[3], 2 * k[0])

    def test_an_overlapping_shift_stays_functional_and_says_why(self):
        def shift(cache: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            cache[:-1] = cache[1:]  # reads what it writes: in place, rows would be read after being overwritten
            return k * 2

        gm = _lowered(shift, torch.zeros(8, 4), torch.randn(4))
        code = normalize(gm)
        writes = _run(gm)
        self.assertEqual(normalize(gm), code)
        self.assertEqual(writes, [WriteOutcome(0, False, "slice_scatter reads a view of what it writes")])

    def test_a_read_of_the_old_value_after_the_write_keeps_it_functional(self):
        """aot orders reads before writes; a graph that reads the old value later must keep
        its copy (a hand-made graph: the rule holds whatever made the graph)."""
        graph = fx.Graph()
        cache, pos, k = graph.placeholder("cache"), graph.placeholder("pos"), graph.placeholder("k")
        written = graph.call_function(aten.index_copy.default, (cache, 0, pos, k))
        old = graph.call_function(aten.sum.default, (cache,))  # the old cache, after the write
        graph.call_function(aten.copy_.default, (cache, written))
        graph.output((old,))
        gm = fx.GraphModule(torch.nn.Module(), graph)
        writes = _run(gm)
        self.assertEqual(writes, [WriteOutcome(0, False, "sum_default reads the value index_copy_default overwrites")])
        self.assertIn("aten::copy_.default", op_counts(gm))

    def test_a_custom_op_with_one_base_that_must_stay_copied_keeps_both(self):
        gm = _lowered(lambda kc, vc, p, k: torch.ops.gd_test_reinplace.kv_write(kc, vc, p, k),
                      torch.zeros(8, 4), torch.zeros(8, 4), torch.tensor([3]), torch.randn(1, 4))
        # make the second base's chain fail: a write the pass has no in-place form for
        copy = next(n for n in gm.graph.nodes if n.target is aten.copy_.default and n.args[0].name == "arg1_1")
        with gm.graph.inserting_before(copy):
            odd = gm.graph.call_function(aten.cumsum.default, (copy.args[1], 0))
        odd.meta["val"] = copy.args[1].meta["val"]
        copy.args = (copy.args[0], odd)
        gm.recompile()
        writes = _run(gm)
        assert all(not w.in_place for w in writes), writes
        self.assertEqual(op_counts(gm)["hop::auto_functionalized_v2"], 1)


# -- end to end ------------------------------------------------------------------------------


def _allocated(fn: Any) -> int:
    """Bytes ATen ops allocate while `fn` runs (the profiler sees inside compiled code, where
    a dispatch mode would make Dynamo run the frame uncompiled)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.cpu_memory_usage for e in prof.events() if e.name.startswith("aten::") and e.cpu_memory_usage > 0)


def _decode_loop(options: dict[str, Any], rows: int = 4096, calls: int = 12) -> int:
    """Compile the decode step, run it next to eager (cache included, bit for bit), and
    return the bytes the last (replayed or plain) call allocated."""
    compiled = torch.compile(decode, backend="graphdispatch", options=options)
    cache, ref = torch.zeros(rows, 64), torch.zeros(rows, 64)
    with torch.no_grad():
        for i in range(calls):
            pos, k = torch.tensor([i * 7 % rows]), torch.randn(1, 64)
            assert torch.equal(compiled(cache, pos, k), decode(ref, pos, k))
            assert torch.equal(cache, ref)
        pos, k = torch.tensor([5]), torch.randn(1, 64)
        return _allocated(lambda: compiled(cache, pos, k))


@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
def test_a_compiled_decode_step_writes_its_row_not_the_cache(cuda_graphs):
    allocated = _decode_loop({"cuda_graphs": cuda_graphs, "warmup": 1})
    assert allocated < 4096 * 64 * 4 / 64, allocated  # the output, small copies: not the cache
    (graph,) = accounted_graphs()
    assert graph["input_writes"] == [{"input": "cache", "in_place": True, "detail": "1 write(s) in place"}]
    if cuda_graphs:
        assert graph["cuda_graph"]["replays"] >= 8


def test_without_the_pass_the_cache_is_copied_whole(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(functional_writes, "in_place", lambda node: None)
    monkeypatch.setattr(sys.modules[reinplace.__module__], "auto", lambda node: None)
    allocated = _decode_loop({"cuda_graphs": False, "warmup": 1})
    assert allocated >= 4096 * 64 * 4, allocated  # index_copy's new cache
