"""The recheck schedules (runtime/checks/schedule.py): which calls are checked, for as long as a
graph or an artifact lives: doubling up to an interval of CAP calls, jittered so that
periodic inputs cannot hide, the same on every rank; dense (the artifacts' default), four
then two checks per doubling up to DENSE_CAP; every Nth; every; and the union a graph with replayed
artifacts is checked on."""

from __future__ import annotations

import copy

import pytest
import torch

from graphdispatch_backend import testing
from graphdispatch_backend.runtime.checks import schedule
from graphdispatch_backend.runtime.checks.schedule import CAP, DENSE_CAP, Due, graph_schedule


def _checked(mode: str | int, calls: int, seed: str = "graph_0") -> list[int]:
    due = Due(mode, seed)
    return [n for n in range(1, calls + 1) if due()]


def test_doubling_then_capped_and_never_stopping():
    checked = _checked("doubling", 20000)
    assert checked[:5] == [1, 2, 4, 8, 16]
    gaps = [b - a for a, b in zip(checked, checked[1:])]
    assert max(gaps) <= CAP + CAP // 4  # capped (jitter included)
    assert len([n for n in checked if n > 10000]) >= 7  # checks go on for the graph's whole life
    assert checked[-1] > 20000 - CAP - CAP // 4


def test_positions_are_jittered_so_a_period_cannot_hide():
    checked = _checked("doubling", 50000)
    late = [n for n in checked if n > 5000]
    assert len({n % 10 for n in late}) > 3  # a bad input every 10th call meets a check
    assert _checked("doubling", 50000, "graph_0") == checked  # the same on every rank
    assert _checked("doubling", 50000, "graph_1") != checked


def test_every_nth_and_every_call():
    assert _checked(3, 10) == [1, 4, 7, 10]
    assert _checked("every", 5) == [1, 2, 3, 4, 5]


def test_without_jitter_a_periodic_bad_input_is_never_met(monkeypatch):
    """The rule removed: checks at multiples of the capped interval only ever see the same
    phase of a period that divides it."""
    monkeypatch.setattr(schedule, "JITTER_FROM", 10**9)
    late = [n for n in _checked("doubling", 50000) if n > 5000]
    assert len({n % 8 for n in late}) == 1


def test_dense_starts_as_doubling_then_four_then_two_checks_per_doubling_up_to_its_cap():
    checked = _checked("dense", 40000)
    # four per doubling up to 64: a kernel wrong on calls 9 to 12 serves the 9th, the 10th catches it
    assert checked[:16] == [1, 2, 4, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    nominal = [96, 128, 192, 256, 384, 512, 768, 1024, 1280]  # then twice per doubling, then every DENSE_CAP
    for got, want in zip(checked[16:], nominal):
        assert abs(got - want) <= (want - checked[checked.index(got) - 1]) // 2, (got, want)
    gaps = [b - a for a, b in zip(checked, checked[1:])]
    assert max(gaps) <= DENSE_CAP + 2 * (DENSE_CAP // 4)  # capped (each end jittered by up to a quarter)
    late = [n for n in checked if n > 10000]
    assert abs(len(late) - 30000 / DENSE_CAP) <= 4  # one in DENSE_CAP on average: the cost bench/recheck.py measures
    assert len({n % 16 for n in late}) > 8  # a bad input every 16th call meets a check
    assert len(checked) > 3 * len(_checked("doubling", 40000))


def test_dense_without_its_denser_start_serves_three_wrong_calls_of_a_kernel_wrong_on_9_to_12(monkeypatch):
    """The rule removed (twice per doubling from call 8): calls 9, 10 and 11 are served before
    the 12th is checked. With it: the 9th only, the 10th is checked."""
    wrong = {9, 10, 11, 12, 20}
    served_wrong = next(n for n in _checked("dense", 30) if n in wrong) - min(wrong)
    assert served_wrong == 1
    monkeypatch.setattr(schedule, "DENSE_QUARTER_UNTIL", 0)
    assert next(n for n in _checked("dense", 30) if n in wrong) - min(wrong) == 3


def test_a_novel_check_moves_last_and_previous_but_not_the_positions():
    due, plain = Due("dense", "g"), Due("dense", "g")
    for n in range(1, 40):
        assert due() == plain()
        if n == 23:
            due.checked_now()  # checked off the schedule
            assert (due.previous, due.last) == (20, 23)
    assert (due.previous, due.last) == (plain.previous, plain.last) == (28, 32)


def test_dense_is_denser_than_doubling_everywhere():
    dense, doubling = set(_checked("dense", 5000)), _checked("doubling", 5000)
    assert set(doubling[:5]) <= dense  # 1, 2, 4, 8, 16: every call the lowering checks early
    for upto in (16, 100, 1000, 5000):
        assert len([n for n in dense if n <= upto]) > len([n for n in doubling if n <= upto])


def test_a_union_checks_on_either_schedules_calls_and_keeps_the_lowerings_positions():
    union = _checked("doubling|dense", 20000, "graph_3")
    lowering = _checked("doubling", 20000, "graph_3")  # the same seed: the same calls, artifacts or not
    artifacts = _checked("dense", 20000, "graph_3|dense")
    assert union == sorted(set(lowering) | set(artifacts))
    due = Due("doubling|7", "g")
    seen = [(n, due.previous) for n in range(1, 30) if due()]
    assert [n for n, _ in seen] == [1, 2, 4, 8, 15, 16, 22, 29]
    assert [p for _, p in seen] == [0, 1, 2, 4, 8, 15, 16, 22]  # `previous`: the union's last checked call


def test_graph_schedule_adds_the_artifacts_only_where_they_replay():
    assert graph_schedule("doubling", "dense", replayed_artifacts=False) == "doubling"
    assert graph_schedule("doubling", "dense", replayed_artifacts=True) == "doubling|dense"
    assert graph_schedule(10**9, "dense", replayed_artifacts=True) == f"{10**9}|dense"
    assert graph_schedule("every", "dense", replayed_artifacts=True) == "every"
    assert graph_schedule("dense", "dense", replayed_artifacts=True) == "dense"


def test_an_unknown_schedule_is_an_error():
    with pytest.raises(ValueError, match="'sometimes'"):
        Due("doubling|sometimes", "g")



# -- per state: blocks compiled one by one share a graph, each with its own weights ----------

WRONG_FOR_ONE_BLOCK = """
import torch
def forward(w1, b1, x, w2, b2):
    y = torch.addmm(b2, torch.relu(torch.addmm(b1, x, w1.t())), w2.t())
    # one ulp high for the block whose fc2.bias starts with MARK: a kernel wrong for some weights
    return torch.where(b2[0] == float.fromhex(MARK), torch.nextafter(y, torch.full_like(y, float("inf"))), y)
"""


def _blocks_compiled_one_by_one(tmp_path, cuda_graphs, depth=6, wrong=2, calls=8):
    """A Stack of `depth` Blocks, each compiled alone (`block.compile()`, as diffusers'
    compile_repeated_blocks does: one graph for all), an artifact for their `mlp` wrong for
    block `wrong`'s weights only; outputs that differ from the uncompiled copy's, and the report."""
    torch.manual_seed(0)
    model = testing.Stack(depth).eval()
    reference = copy.deepcopy(model)
    mark = model.blocks[wrong].mlp.fc2.bias[0].item().hex()
    root = tmp_path / "artifacts"
    testing.write_bundle(root / "mlp-one-block-off", "mlp-one-block-off", "mlp", testing.mlp_inputs(),
                         testing.MLP_OUTPUTS, WRONG_FOR_ONE_BLOCK.replace("MARK", repr(mark)))
    for block in model.blocks:
        block.compile(backend="graphdispatch", options={"cuda_graphs": cuda_graphs, "artifacts": str(root)})
    wrong_calls = 0
    with torch.no_grad():
        for i in range(calls):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            wrong_calls += not torch.equal(model(x), reference(x))
    (graph,) = testing.accounted_graphs()
    return wrong_calls, graph


@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
def test_a_kernel_wrong_for_one_blocks_weights_is_caught_at_that_blocks_first_call(tmp_path, cuda_graphs):
    """Counted together, six blocks' calls put every scheduled check below call 96 on blocks
    0, 1 and 3 ("dense": 1, 2, 4, 8, 10, 12, ...), and a kernel wrong for block 2's weights
    served every call (a trial's Wan, 2026-12-07: 12 of 12 wrong, the report bitwise). Each
    block's own schedule checks its first call."""
    wrong_calls, graph = _blocks_compiled_one_by_one(tmp_path, cuda_graphs)
    assert wrong_calls == 0
    (sub,) = graph["substitutions"]
    assert sub["demoted"] and sub["parity"] == "failed", sub


def test_without_a_schedule_per_state_the_kernel_serves_every_call(tmp_path, monkeypatch):
    """Mutation: every block's calls share one schedule (no state gets its own)."""
    monkeypatch.setattr(schedule, "INSTANCES", 0)
    wrong_calls, graph = _blocks_compiled_one_by_one(tmp_path, False)
    assert wrong_calls == 8
    assert not graph["substitutions"][0]["demoted"]


def test_a_state_is_its_first_parameters_storage_numbered_as_it_came_and_new_ones_past_the_bound_share_one(
        monkeypatch):
    monkeypatch.setattr(schedule, "INSTANCES", 2)
    instances = schedule.Instances([1])
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    x = torch.ones(2)
    assert instances.key(("k",), [x, a]) == ("k",)  # the first state: the shape key as it is
    assert instances.key(("k",), [x, a.view(2)]) == ("k",)  # the same storage: the same state
    assert instances.key(("k",), [x, b]) == ("k", 1)
    assert instances.key(("k",), [x, c]) == ("k", None)  # a third state, past the bound: shared
    assert instances.key(("j",), [x, b]) == ("j", 1)
    assert schedule.Instances([]).key(("k",), [x]) == ("k",)


def _checked_calls(weights: list[torch.Tensor], calls: int) -> list[tuple[int, int]]:
    due = schedule.GraphDue("doubling|dense", "graph_0", False, [0], None, state=[1])
    x = torch.ones(2)
    return [(n, i) for n in range(calls) for i, w in enumerate(weights) if due([x, w]) is not None]


def test_the_checked_calls_do_not_depend_on_where_the_weights_are():
    """A schedule's jitter is seeded by its key: were the weights' address in it, two runs
    (or two ranks, which must check the same calls) would check different calls. CI saw
    that as a check count differing between two runs of one model."""
    first = _checked_calls([torch.zeros(4), torch.zeros(4)], 300)
    second = _checked_calls([torch.zeros(8)[4:], torch.zeros(4)], 300)  # block 0's weights elsewhere
    assert first == second
    assert {i for _, i in first} == {0, 1} and len(first) > 2 * 12  # each block past the jittered positions




def test_a_new_tensor_where_a_dead_states_weights_were_is_a_new_state():
    """A model dropped and a new one built puts its weights where the old ones were (a
    trial's hot swap by new instance: 3 to 5 of 24 swaps served a kernel wrong for the new
    weights at their first call, the report clean). The state holds its tensor weakly."""
    instances = schedule.Instances([0])
    base = torch.zeros(8)
    old = base[:4]
    assert instances.key(("k",), [old]) == ("k",)
    assert instances.key(("k",), [base[:4]]) == ("k",)  # another tensor at a live state's storage: the same
    address = old.data_ptr()
    del old
    new = base[:4]  # at the dead state's address
    assert new.data_ptr() == address
    assert instances.key(("k",), [new]) == ("k", 1)
    assert instances.key(("k",), [new]) == ("k", 1)


def test_writes_into_watched_weights_are_seen_at_the_next_call_without_grad():
    weight, x = torch.zeros(4), torch.ones(4)
    instances = schedule.Instances([1], watched=[1])
    seen = []
    with torch.no_grad():
        for write in (None, None, lambda: weight.copy_(torch.ones(4)), None, lambda: weight.mul_(2),
                      lambda: weight.data.add_(1)):  # through .data: torch counts no write
            if write is not None:
                write()
            instances.key((), [x, weight])
            seen.append(instances.written)
    assert seen == [False, False, True, False, True, False]
    with torch.no_grad():
        weight.add_(1)
    instances.key((), [x, weight])  # with grad on (a training step writes them every time): not watched
    assert not instances.written


WRONG_FOR_A_LOADED_BIAS = """
import torch
def forward(w1, b1, x, w2, b2):
    y = torch.addmm(b2, torch.relu(torch.addmm(b1, x, w1.t())), w2.t())
    # one ulp high once fc2.bias starts with 0.5: a kernel wrong for some weights
    return torch.where(b2[0] == 0.5, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
"""


def _a_checkpoint_loaded_in_place(tmp_path, cuda_graphs, before=40, after=6):
    """A Stack compiled whole, an artifact for its `mlp` wrong once fc2.bias[0] is 0.5;
    `before` calls, then a checkpoint holding that value loaded in place (load_state_dict
    copies into the parameters), then `after` calls: the calls after it that differ from the
    uncompiled copy's (loaded alike), and the report."""
    torch.manual_seed(0)
    model = testing.Stack(2).eval()
    reference = copy.deepcopy(model)
    root = tmp_path / "artifacts"
    testing.write_bundle(root / "mlp-off-for-a-bias", "mlp-off-for-a-bias", "*.mlp", testing.mlp_inputs(),
                         testing.MLP_OUTPUTS, WRONG_FOR_A_LOADED_BIAS)
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"cuda_graphs": cuda_graphs, "artifacts": str(root)})
    checkpoint = copy.deepcopy(model.state_dict())
    checkpoint["blocks.1.mlp.fc2.bias"][0] = 0.5
    wrong_calls = 0
    with torch.no_grad():
        for i in range(before + after):
            if i == before:  # call 41: on neither schedule ("doubling|dense": 32, 40, 48, 64)
                model.load_state_dict(checkpoint)
                reference.load_state_dict(checkpoint)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            same = torch.equal(compiled(x), reference(x))
            wrong_calls += i >= before and not same
    (graph,) = testing.accounted_graphs()
    return wrong_calls, graph


@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
def test_a_checkpoint_loaded_in_place_is_checked_at_its_first_call(tmp_path, cuda_graphs):
    """A trial's LoRA fused in place after 209 calls: 29 of 29 calls wrong until a
    scheduled check; a kernel caching its packed weights by address served 0.415 off.
    torch counts writes into the weights an artifact reads: the next call is checked."""
    wrong_calls, graph = _a_checkpoint_loaded_in_place(tmp_path, cuda_graphs)
    assert wrong_calls == 0
    subs = [s for s in graph["substitutions"] if s["region"] == "blocks.1.mlp"]
    assert subs and subs[0]["demoted"] and subs[0]["caught_at_call"] == 41, subs


def test_without_watching_the_weights_the_loaded_checkpoint_is_served_wrong(tmp_path, monkeypatch):
    """Mutation: no write counted."""
    monkeypatch.setattr(schedule, "_versions", lambda inputs, positions: 0)
    wrong_calls, graph = _a_checkpoint_loaded_in_place(tmp_path, False)
    assert wrong_calls == 6
