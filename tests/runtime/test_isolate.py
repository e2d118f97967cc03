"""Checks for the whole run that blame the right party (runtime/checks/eager_check.py, isolate.py):
a served call that differs from eager is answered with eager's values, and then the
artifact, the lowering or the capture at fault is found by running, never guessed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import graphdispatch_backend
from graphdispatch_backend import backend as backend_mod
from graphdispatch_backend.diagnostics.render import render
from graphdispatch_backend.runtime.checks import eager_check as eager_check_mod
from graphdispatch_backend.runtime.checks import novelty
from graphdispatch_backend.runtime.checks.schedule import Due
from graphdispatch_backend.runtime.runner import serve as serve_mod
from graphdispatch_backend.testing import (
    accounted_graphs,
    manifest_from_region,
    region_entry,
    serve_patches,
    write_bundle,
)

CALLS = 120
BAD_FROM = 41  # from this call on, the inputs are large


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x * 2)


def _make() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def _x(i: int) -> torch.Tensor:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) * 0.2
    x[0, 0] = 5.0 if i >= BAD_FROM else 0.1
    return x


# an exact MLP that adds 1e-3 where some |x| > 3: a large-magnitude path with a bug
KERNEL = """
import torch
import torch.nn.functional as F

NAMES = {names!r}


def forward(*inputs):
    a = dict(zip(NAMES, inputs))
    out = F.linear(F.gelu(F.linear(a["input0"], a["fc1.weight"], a["fc1.bias"])), a["fc2.weight"], a["fc2.bias"])
    return torch.where((a["input0"].abs() > 3).any(), out + 1e-3, out)  # no host sync: capturable
"""


def _bundle(root: Path) -> Path:
    region = region_entry(_make(), _x(0), name="mlp", cuda_graphs=False)
    sig = manifest_from_region(region)
    write_bundle(root / "mlp", "mlp-bug", "mlp", sig["inputs"], sig["outputs"],
                 KERNEL.format(names=[i["name"] for i in region["inputs"]]))
    return root


def _run(options: dict[str, Any], calls: int = CALLS) -> tuple[list[int], dict[str, Any]]:
    """The compiled model next to eager; the calls whose output differed."""
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    model, ref = _make(), _make()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate", **options})
    wrong = []
    with torch.no_grad():
        for i in range(1, calls + 1):
            x = _x(i)
            if not torch.equal(compiled(x), ref(x)):
                wrong.append(i)
    (graph,) = accounted_graphs()
    return wrong, graph


# -- an artifact wrong for some values only ---------------------------------------------------


def test_checking_every_call_no_wrong_value_is_served_and_the_artifact_goes(tmp_path):
    wrong, graph = _run({"artifacts": str(_bundle(tmp_path)), "recheck": "every"})
    assert wrong == []
    (sub,) = graph["substitutions"]
    assert (sub["demoted"], sub["reason"], sub["caught_at_call"], sub["unchecked_calls"]) == (
        True, "parity", BAD_FROM, 0), sub
    assert f"caught at call {BAD_FROM} of graph_0 (checked by the recheck schedule), inputs input0 [4, 16] float32 " \
           "max|x| 10" in sub["detail"]
    assert graph["lowering_check"]["status"] == "bitwise"  # the lowering is not blamed
    cg = graph["cuda_graph"]
    assert cg["recaptures"] == 1 and cg["declines"] == {}
    assert cg["replays"] >= CALLS - BAD_FROM - 3  # recaptured without the kernel, it replays again


def test_by_default_a_wrong_value_is_caught_at_the_next_check_and_counted(tmp_path):
    wrong, graph = _run({"artifacts": str(_bundle(tmp_path))})
    (sub,) = graph["substitutions"]
    caught = sub["caught_at_call"]
    assert sub["demoted"] and wrong == list(range(BAD_FROM, caught)), (wrong, caught)
    assert sub["unchecked_calls"] >= len(wrong)  # the calls served since the last check, said
    assert graph["lowering_check"]["status"] == "bitwise"
    assert graph["cuda_graph"]["replays"] > CALLS - caught - 4  # replays again after the recapture


class Accumulating(nn.Module):
    """Net, and state it writes: each call adds its output to a buffer and returns the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()
        self.register_buffer("acc", torch.zeros(4, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.mlp(x * 2)
        self.acc.add_(y)
        return self.acc * 1


def test_a_catch_says_the_state_the_calls_served_unchecked_wrote_stays(tmp_path, caplog):
    """A trial's RMSNorm kernel, 1 ulp off on some rows, served 3 decode steps unchecked
    whose keys and values the cache kept: 13 of the request's 16 steps came out off, where
    the catch said 3 calls. The kernel here is off where its input sums above zero (a sign:
    no statistic sees it), on calls 3, 5-7 and 8; the dense schedule checks 4 and 8."""
    region = region_entry(Net().eval(), _x(0), name="mlp", cuda_graphs=False)
    sig = manifest_from_region(region)
    source = KERNEL.format(names=[i["name"] for i in region["inputs"]])
    source = source.replace('(a["input0"].abs() > 3).any()', 'a["input0"].sum() > 0')
    write_bundle(tmp_path / "mlp", "mlp-sign", "mlp", sig["inputs"], sig["outputs"], source)
    torch.manual_seed(0)
    model = Accumulating().eval()
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"cuda_graphs": "emulate", "artifacts": str(tmp_path)})
    with torch.no_grad():
        for i in range(1, 13):
            x = _x(i)
            compiled(x if (x.sum() > 0) == (i in (3, 5, 6, 7, 8)) else -x)
    (graph,) = accounted_graphs()
    (sub,) = graph["substitutions"]
    assert (sub["caught_at_call"], sub["unchecked_calls"]) == (8, 3), sub
    assert sub["served_since_check"] == 0 and sub["largest_gap"] >= 3, sub  # the catch was a check
    said = next(r.getMessage() for r in caplog.records if "the artifact was at fault" in r.getMessage())
    assert "the 3 call(s) since the last check (call 4) were served unchecked, and what they wrote into" in said, said
    assert "acc" in said.split("wrote into", 1)[1].split("(state", 1)[0] and "stays" in said, said
    # the report says it too, not the log alone (a trial found it only there): the field and the rendered catch
    assert len(sub["stale_state"]) == 1 and "acc" in sub["stale_state"][0], sub
    rendered = render(graphdispatch_backend.latest_report())
    caught = rendered.split("Caught at a check", 1)[1]
    assert f"what they wrote into {sub['stale_state'][0]} (state the graph writes) stays" in caught, caught


def test_without_checks_of_replays_wrong_values_go_on(tmp_path, monkeypatch):
    """The rule removed: checks stop after the first calls, as the doubling schedule that
    checked eager calls only did in effect once every call replayed."""
    monkeypatch.setattr(Due, "__call__", lambda self: setattr(self, "n", self.n + 1) or self.n <= 2)
    monkeypatch.setattr(novelty, "ENABLED", False)  # nor for new inputs
    wrong, _ = _run({"artifacts": str(_bundle(tmp_path)), "recheck": "every"})
    assert wrong == list(range(BAD_FROM, CALLS + 1))


def test_without_isolation_the_lowering_is_blamed_and_the_artifact_serves_on(tmp_path, monkeypatch):
    monkeypatch.setattr(eager_check_mod.EagerCheck, "_isolate", lambda self, *a: a[5])  # the verdict stands
    wrong, graph = _run({"artifacts": str(_bundle(tmp_path)), "recheck": "every"})
    (sub,) = graph["substitutions"]
    assert graph["lowering_check"]["status"] == "lowering_mismatch" and not sub["demoted"]


# -- a lowering that differs above a threshold --------------------------------------------------


def _threshold_lowering(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for a lowering that is wrong for large values only: the lowered graph's
    first output gains 1e-3 where it exceeds 3."""
    real = backend_mod.run_pipeline

    def run_pipeline(gm: fx.GraphModule, ctx: Any, *args: Any) -> Any:
        output = next(iter(reversed(gm.graph.nodes)))
        first = output.args[0][0]
        with gm.graph.inserting_before(output):
            big = gm.graph.call_function(torch.ops.aten.gt.Scalar, (first, 3.0))
            bump = gm.graph.call_function(torch.ops.aten.mul.Tensor, (big, 1e-3))
            new = gm.graph.call_function(torch.ops.aten.add.Tensor, (first, bump))
        for node, like in ((big, first), (bump, first), (new, first)):
            node.meta["val"] = like.meta["val"] if node is not big else like.meta["val"].gt(3.0)
        output.args = ((new, *output.args[0][1:]),)
        gm.recompile()
        return real(gm, ctx, *args)

    monkeypatch.setattr(backend_mod, "run_pipeline", run_pipeline)


def test_a_lowering_wrong_above_a_threshold_is_caught_on_a_replayed_call(monkeypatch):
    _threshold_lowering(monkeypatch)
    wrong, graph = _run({"recheck": "every"})
    assert wrong == []
    assert graph["lowering_check"]["status"] == "lowering_mismatch"
    assert f"call {BAD_FROM} of graph_0" in graph["lowering_check"]["detail"]
    assert graph["cuda_graph"]["replays"] >= BAD_FROM - 4  # it replayed until then
    wrong, graph = _run({})  # by default: caught at the next check after the values grow
    assert graph["lowering_check"]["status"] == "lowering_mismatch" and wrong and wrong[0] == BAD_FROM


# -- a capture wrong after it verified ----------------------------------------------------------


def test_a_replay_that_goes_wrong_is_blamed_on_the_capture(monkeypatch):
    real = serve_mod.serve
    replays = [0]

    def drifting(entry: Any, args: Any, streams: Any) -> list[Any]:
        out = real(entry, args, streams)
        replays[0] += 1
        return [o + 1e-3 if replays[0] > 60 and isinstance(o, torch.Tensor) else o for o in out]

    for module, name, value in serve_patches(drifting):
        monkeypatch.setattr(module, name, value)
    wrong, graph = _run({"recheck": "every"})
    assert wrong == []
    assert graph["lowering_check"]["status"] == "bitwise"
    assert graph["cuda_graph"]["declines"] == {"verify_mismatch": 1}
    assert "a replay differed from eager at call" in graph["cuda_graph"]["decline_details"]["verify_mismatch"]


# -- replay by the 3rd call ----------------------------------------------------------------------


def test_a_new_shape_key_first_replays_at_its_third_call():
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    model = _make()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate"}, dynamic=True)
    replays = []
    with torch.no_grad():
        for batch in (3, 5):
            for i in range(4):
                before = sum(g["cuda_graph"]["replays"] for g in accounted_graphs()) if i or batch == 5 else 0
                x = torch.randn(batch, 16)
                assert torch.equal(compiled(x), model(x))
                replays.append(sum(g["cuda_graph"]["replays"] for g in accounted_graphs()) - before)
    assert replays == [0, 0, 1, 1, 0, 0, 1, 1], replays


def test_checks_hold_under_threads(tmp_path):
    import threading

    graphdispatch_backend.reset()
    torch._dynamo.reset()
    model, ref = _make(), _make()
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"cuda_graphs": "emulate", "recheck": 3, "artifacts": str(_bundle(tmp_path))})
    errors: list[BaseException] = []
    wrong = []

    def work(seed: int) -> None:
        try:
            with torch.no_grad():
                for i in range(30):
                    x = _x(seed * 100 + i % 30 + (BAD_FROM if i > 20 else 0))
                    if not torch.equal(compiled(x), ref(x)):
                        wrong.append(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    accounted_graphs()  # every call accounted for



class Gated(nn.Module):
    """The MLP's output reaches the graph's output only where `m` says: a kernel's difference
    that stops short of the outputs at a check (rounded away downstream, in a trial)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return torch.where(m, self.mlp(x), 0.0)


def test_a_check_that_passes_on_a_replay_judges_the_kernels_inside_beside_their_regions(tmp_path):
    """A trial (diffusers Wan, emulate): a patch-embedding kernel one ulp off in its last
    element for large latents. The call its new inputs made due was checked, but the
    difference stopped short of the graph's outputs there, so the check passed and those
    inputs counted as seen; the next call was served wrong, unchecked. A check of a replayed
    call now judges each kernel still serving beside its region on the call's inputs
    (runtime/checks/isolate.py `beside`): demoted there, and no call is served wrong. Here
    the MLP's output is masked at the first two large calls (the first served as computed,
    its statistics arriving a call late as a GPU's; the second checked for them)."""
    torch.manual_seed(0)
    make = Gated().eval
    region = region_entry(make(), torch.randn(4, 16), torch.ones(4, 16, dtype=torch.bool), name="mlp",
                          cuda_graphs=False)
    sig = manifest_from_region(region)
    write_bundle(tmp_path / "mlp", "mlp-bug", "mlp", sig["inputs"], sig["outputs"],
                 KERNEL.format(names=[i["name"] for i in region["inputs"]]))
    torch.manual_seed(0)
    model = Gated().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={
        "cuda_graphs": "emulate", "artifacts": str(tmp_path), "recheck": 1024, "artifact_recheck": 1024})
    wrong = []
    with torch.no_grad():
        for i in range(1, 16):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) * 0.2
            x[0, 0] = 5.0 if i >= 10 else 0.1
            m = torch.full((4, 16), i not in (10, 11))
            if not torch.equal(compiled(x, m), model(x, m)):
                wrong.append(i)
    (graph,) = accounted_graphs()
    (sub,) = graph["substitutions"]
    assert (sub["demoted"], sub["caught_at_call"], sub["caught_by"]) == (True, 11, "novelty"), sub
    assert graph["lowering_check"]["status"] == "bitwise"
    assert wrong == [], wrong


class _Ranks:
    """An agreement over this rank and scripted others: each round takes the largest of this
    rank's code and the others' for that round (checks/agree.py's all-reduce MAX)."""

    def __init__(self, *others: int) -> None:
        self.others, self.sent = list(others), []

    def agree(self, code: int) -> int:
        self.sent.append(code)
        return max(code, self.others.pop(0))


@pytest.mark.parametrize(("mine", "found", "others", "sent", "kept"), [
    # this rank matched; another rank's kernel was at fault (its own isolation found it): lowering kept
    (False, "capture", [0, 2], [0, 0], True),
    # this rank's call differed, its run again matched, another rank's kernel explains it: kept
    (True, "capture", [0, 2], [0, 1], True),
    # no kernel explains a difference: the capture, declined on every rank
    (True, "capture", [0, 0], [0, 1], False),
    # another rank's run again differs: the lowering, declined on every rank
    (False, "capture", [0, 3], [0, 0], False),
    (True, "lowering", [0, 2], [0, 3], False),
    # a rank that cannot tell its mismatch apart: no rank runs the graph again
    (None, None, [0], [1], False),
    (True, None, [1], [0], False),
])
def test_across_ranks_every_rank_isolates_in_step_and_the_ranks_agree_on_the_party(mine, found, others, sent, kept):
    from graphdispatch_backend.diagnostics.events import Events
    from graphdispatch_backend.diagnostics.report import GraphRecord
    from graphdispatch_backend.errors import Decline
    from graphdispatch_backend.runtime.checks.isolate import Checked, Culprit, across_ranks

    ranks, runs = _Ranks(*others), []

    def find() -> Culprit:
        runs.append(1)
        return Culprit(found, "what it did")

    verdict = (Decline.LOWERING_MISMATCH, "differs from eager")
    got = across_ranks(ranks, mine, find, Checked(GraphRecord(0), 8, 4), verdict, Events())
    assert ranks.sent == sent and ranks.others == []  # every rank makes the same rounds
    assert len(runs) == (found is not None)  # the graph runs again on every rank or on none
    if kept:
        assert got is None
    else:
        assert got[0] is Decline.LOWERING_MISMATCH and got[1].startswith("differs from eager; ")
        assert ("not isolated" in got[1]) == (found is None)


def test_the_state_a_catch_names_holds_the_tensors_the_graph_makes_and_writes():
    """A trial's prefill made its K/V cache inside the graph and wrote it in place; the catch
    named only the cache's length counters (the inputs it writes) as what stays."""
    from graphdispatch_backend.diagnostics.report import GraphRecord
    from graphdispatch_backend.runtime.checks.isolate import Checked

    record = GraphRecord(0)
    record.input_writes = [{"input": "cache.cumulative_length", "in_place": True, "detail": ""}]
    record.buffer_writes_in_place = 4
    state = Checked(record, 8, 4).state
    assert state[0] == "cache.cumulative_length" and state[1].startswith("4 tensor(s) the graph makes and writes")
    record.buffer_writes_in_place = 0
    assert Checked(record, 8, 4).state == ["cache.cumulative_length"]
