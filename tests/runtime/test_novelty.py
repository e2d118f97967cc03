"""Novelty (runtime/checks/novelty.py): which calls are new to what the checked calls saw.

Per watched input: the largest magnitude's binade, NaN, inf. Seen grows only with checked
calls. On the CPU the statistics decide their own call; the CPU model of a GPU
(`Arrival.NEXT_CALL`) and CUDA tensors (pinned memory and an event, never a sync) decide
a later call.
"""

from __future__ import annotations

import math

import pytest
import torch

from graphdispatch_backend.runtime.checks import novelty
from graphdispatch_backend.runtime.checks.novelty import Arrival, Novelty


def _calls(watch: Novelty, values: list[list[float]], checked_first: bool = True) -> list[str | None]:
    """Each call's `why` (None: not new), a call checked when it is new (and the first)."""
    out = []
    for i, vals in enumerate(values):
        seen = watch.observe([torch.tensor([v]) for v in vals])
        out.append(seen.why)
        if seen.why is not None or (checked_first and i == 0):
            seen.checked()
    return out


def test_a_call_is_new_only_above_the_checked_calls_binade():
    watch = Novelty([0], ["x"])
    whys = _calls(watch, [[0.75], [0.99], [1.0], [1.9], [2.0], [-3.5], [1.0]])
    assert [w is not None for w in whys] == [True, False, True, False, True, False, False]
    assert whys[2] == "x max|x| 1, at or above 1 (the checked calls' binade)"


def test_only_checked_calls_widen_what_was_seen():
    watch = Novelty([0], ["x"])
    first = watch.observe([torch.tensor([1.0])])
    first.checked()
    big = watch.observe([torch.tensor([100.0])])
    assert big.why is not None  # not checked (the caller did not check it) ...
    assert watch.observe([torch.tensor([100.0])]).why is not None  # ... so the next one is new too


def test_nan_and_inf_are_new_once_each_and_a_negative_magnitude_counts():
    watch = Novelty([0, 1], ["x", "y"])
    whys = _calls(watch, [[1.0, 1.0], [1.0, math.nan], [1.0, math.nan], [-math.inf, 1.0], [math.inf, 1.0],
                          [-5.0, 1.0]])
    assert whys[1] == "y holds NaN, which no checked call's did" and whys[2] is None
    assert whys[3] == "x holds inf, which no checked call's did" and whys[4] is None
    assert whys[5] is not None and "x max|x| 5" in whys[5]


def test_within_says_not_new_only_where_judge_would():
    """`within` (a fused graph's posted statistics, the usual call) is True only where `judge`
    finds nothing new; where it says False, `judge` decides (NaN or inf seen before is not new)."""
    watch = Novelty([0, 1], ["x", "y"])
    watch.judge([1.5, 1.0]).checked()
    watch.judge([1.5, math.nan]).checked()
    values = [[0.0, 1.0], [1.99, 0.0], [2.0, 1.0], [1.0, 2.0], [1.0, math.nan], [math.inf, 1.0], [0.5, 1.5]]
    for vals in values:
        assert not watch.within(vals) or watch.judge(vals).why is None
    assert [watch.within(v) for v in values] == [True, True, False, False, False, False, True]
    assert watch.judge([1.0, math.nan]).why is None  # not within, and not new either
    assert Novelty([0]).within([0.0]) is False  # nothing seen: every value is new


def test_zero_then_anything():
    watch = Novelty([0])
    assert _calls(watch, [[0.0], [0.0], [1e-30]])[1:] == [None, "input 0 max|x| 1e-30, at or above 4.941e-324 "
                                                                "(the checked calls' binade)"]


def test_a_growing_position_is_new_once_per_doubling():
    """A decode step's position (an int tensor growing by one per call): a check per
    doubling, 13 over 4096 calls, not 4096."""
    watch = Novelty([0], ["cache_position"])
    new = 0
    for pos in range(4096):
        seen = watch.observe([torch.tensor([pos])])
        if seen.why is not None or pos == 0:
            new += seen.why is not None
            seen.checked()
    assert new == 13


def test_unwatched_inputs_and_values_are_skipped():
    """Positions not watched, and bool, complex, empty or non-tensor inputs, decide nothing."""
    watch = Novelty([1, 2, 3, 4], ["w", "mask", "z", "e", "n"])
    inputs = [torch.tensor([1e9]), torch.tensor([True]), torch.tensor([1j]), torch.empty(0), 3]
    seen = watch.observe(inputs)
    assert seen.why is None
    seen.checked()
    assert watch.observe(inputs).why is None


def test_every_call_reads_its_inputs_even_the_same_tensor_unwritten_by_torch():
    """No call is skipped for passing the tensor the last call passed: a write through a
    numpy view (or `.data`, DLPack, a raw kernel) does not move its version counter, so
    identity and version cannot say it is unchanged. Each write is met at its call."""
    watch = Novelty([0], ["x"])
    x = torch.ones(4, 64)
    view = x.numpy()
    watch.observe([x]).checked()
    assert watch.observe([x]).why is None
    version = x._version
    view[1, 2] = 1e6
    assert x._version == version  # torch did not see the write ...
    assert "x max|x| 1e+06" in watch.observe([x]).why  # ... the statistics did
    x.data[0, 0] = -math.inf
    assert "x holds inf" in watch.observe([x]).why


def test_an_inference_tensor_and_bfloat16_are_read_right():
    """The lean path's kept outputs are written under inference mode and outside it, and a
    bfloat16 input (no numpy dtype) is read through torch."""
    watch = Novelty([0], ["x"])
    with torch.inference_mode():
        x = torch.ones(16)
        watch.observe([x]).checked()
        assert watch.observe([x]).why is None
        x[3] = -1e6
    assert "x max|x| 1e+06" in watch.observe([x]).why
    half = Novelty([0], ["h"])
    half.observe([torch.ones(8, dtype=torch.bfloat16)]).checked()
    assert half.observe([torch.full((8,), 1.5, dtype=torch.bfloat16)]).why is None
    assert "h max|x| 96" in half.observe([torch.full((8,), -96.0, dtype=torch.bfloat16)]).why


def test_several_inputs_of_several_dtypes_each_keep_their_own():
    """Inputs of different dtypes at one site (a float activation, an int position) are
    read into outputs of their own dtype: each one's statistic is its own."""
    watch = Novelty([0, 1], ["h", "pos"])
    watch.observe([torch.ones(4), torch.tensor([3])]).checked()
    assert watch.observe([torch.full((4,), 1.5), torch.tensor([2])]).why is None
    assert "pos max|x| 9" in watch.observe([torch.ones(4), torch.tensor([-9])]).why
    assert "h max|x| 40" in watch.observe([torch.full((4,), 40.0), torch.tensor([1])]).why


def test_off_when_nothing_is_watched_or_disabled(monkeypatch):
    assert not Novelty([]).on
    monkeypatch.setattr(novelty, "ENABLED", False)
    assert not Novelty([0]).on


def test_as_a_gpu_would_the_statistics_decide_the_next_call():
    """The CPU model of a GPU: a call's statistics reach the host after it; a new one makes
    the next call due, and a checked call's widen what was seen when they arrive."""
    watch = Novelty([0], ["x"], Arrival.NEXT_CALL)
    first = watch.observe([torch.tensor([1.0])])
    assert first.why is None  # nothing has arrived yet
    first.checked()
    assert watch.observe([torch.tensor([1.5])]).why is None  # call 1's arrived, checked: seen
    big = watch.observe([torch.tensor([50.0])])
    assert big.why is None  # its own statistics are not there yet
    after = watch.observe([torch.tensor([1.0])])
    assert after.why == "x max|x| 50, at or above 2 (the checked calls' binade) (in an earlier call: statistics " \
                        "read without a sync)"
    after.checked()
    # call 3 (50) was never checked: a 50 again is new again, a call later
    watch.observe([torch.tensor([50.0])])
    assert watch.observe([torch.tensor([1.0])]).why is not None


@pytest.mark.cuda
def test_cuda_statistics_reach_the_host_without_a_sync():
    """On CUDA the statistics are reduced on the device, copied into pinned memory after
    the call's work and read at a later call once their event completed: no
    synchronization (CUDA raises on one under `set_sync_debug_mode("error")`)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    watch = Novelty([0], ["x"])
    x = torch.ones(1024, device="cuda")
    first = watch.observe([x])
    first.checked()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        big = watch.observe([x * 100])
        assert big.why is None  # not there yet, or there: decided at the next call at the earliest
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()  # the event has completed
    later = watch.observe([x])
    assert later.why is not None and "x max|x| 100" in later.why


def test_a_written_cache_and_a_static_input_are_not_watched():
    """A decode step's cache (written in place) and a table marked with
    `mark_static_address` are state, read whole they would cost their size per call: a
    call whose cache or table holds a value a hundred binades above is not checked for it;
    the token's row, which the step only reads, is."""
    import graphdispatch_backend

    class Step(torch.nn.Module):
        def forward(self, cache, table, pos, k):
            cache.index_copy_(0, pos, k)
            return cache.sum(0) + table[pos].sum(0) + k[0]

    torch._dynamo.reset()
    graphdispatch_backend.reset()
    compiled = torch.compile(Step(), backend="graphdispatch", options={"cuda_graphs": False})
    cache, table = torch.zeros(64, 4), torch.randn(64, 4)
    torch._dynamo.mark_static_address(table)
    novel = []
    with torch.no_grad():
        for i in range(40):
            if i == 37:
                cache[60] = 1e30
                table[61] = 1e30
            k = torch.randn(1, 4) * (1e6 if i == 39 else 1)
            compiled(cache, table, torch.tensor([i % 4]), k)
            (graph,) = graphdispatch_backend.latest_report()["graphs"]
            novel.append(graph["lowering_check"].get("novelty", 0))
    assert novel[37] == novel[36] and novel[39] == novel[38] + 1, novel  # call 38: the cache, the table; 40: k
