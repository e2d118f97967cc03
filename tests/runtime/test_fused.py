"""Fused graphs at run time (runtime/program/fused.py, the fusion party of runtime/checks/isolate.py): a
fused op whose result differs from eager is caught by the check, named by running, kept
as an ATen call for that graph alone, and remembered on disk; no wrong value is served
meanwhile. Each rule has a test that removes it and sees the scenario fail."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import graphdispatch_backend
from graphdispatch_backend.examples.dit import ada_block as block
from graphdispatch_backend.examples.dit import ada_inputs as inputs
from graphdispatch_backend.fusion import recipe as recipe_mod
from graphdispatch_backend.fusion import segments as segments_mod
from graphdispatch_backend.runtime.program import fused as fused_mod
from graphdispatch_backend.runtime.program import fused_unit
from graphdispatch_backend.runtime.runner import GraphRunner
from graphdispatch_backend.testing import (
    MLP_OUTPUTS,
    MLP_SOURCE,
    Mlp,
    accounted_graphs,
    mlp_inputs,
    perturbed,
    write_bundle,
)

MUL = "aten.mul.Tensor"
SQRT = "aten.sqrt.default"
MODES = [False, "emulate"]


def run(model: nn.Module, options: dict[str, Any], calls: list[tuple[torch.Tensor, ...]]) -> list[bool]:
    compiled = torch.compile(model, backend="graphdispatch", options={"fuse": True, **options})
    with torch.no_grad():
        return [torch.equal(compiled(*args), model(*args)) for args in calls]


def fusion() -> dict[str, Any]:
    (graph,) = accounted_graphs()
    return graph["fusion"]


def learned(f: dict[str, Any]) -> list[str]:
    return [k["op"] for k in f["kept"] if k["why"] != "recipe"]


@pytest.mark.parametrize("cuda_graphs", MODES)
def test_a_fused_op_one_ulp_off_is_caught_named_and_kept_alone(cuda_graphs, tmp_path):
    with mock.patch.object(*perturbed(MUL)):
        same = run(block(), {"cuda_graphs": cuda_graphs, "recheck": "every", "cache_dir": tmp_path},
                   [inputs(i) for i in range(6)])
    assert all(same), same  # eager's values answered the call that caught it; the rest are fused, exact
    f = fusion()
    assert f["status"] == "fused" and f["rounds"] == 1
    assert learned(f) == [MUL]
    assert f["kept"][-1]["at_call"] == 1 and "aten.mul.Tensor" in f["kept"][-1]["detail"]
    assert "aten.add.Tensor" in f["fused_ops"] and MUL not in f["fused_ops"]  # the rest stays fused
    (graph,) = accounted_graphs()
    assert graph["lowering_check"]["status"] == "bitwise"  # the graph keeps its lowering
    if cuda_graphs == "emulate":
        assert graph["cuda_graph"]["replays"] >= 3  # captured, verified and replayed, fused


def test_the_default_schedule_catches_it_at_the_first_call(tmp_path):
    with mock.patch.object(*perturbed(MUL)):
        same = run(block(), {"cuda_graphs": "emulate", "cache_dir": tmp_path}, [inputs(i) for i in range(8)])
    assert all(same), same
    assert learned(fusion()) == [MUL] and fusion()["kept"][-1]["at_call"] == 1


_NEW_PROCESS = textwrap.dedent("""
    import json, sys, torch
    from unittest import mock
    sys.path.insert(0, {tests!r})
    import graphdispatch_backend
    from graphdispatch_backend.testing import accounted_graphs, perturbed
    from test_fused import MUL, block, inputs
    model = block()
    with mock.patch.object(*perturbed(MUL)):
        compiled = torch.compile(model, backend="graphdispatch",
                                 options={{"fuse": True, "recheck": "every", "cache_dir": {cache!r}}})
        with torch.no_grad():
            same = [torch.equal(compiled(*inputs(i)), model(*inputs(i))) for i in range(4)]
    (graph,) = accounted_graphs()
    print(json.dumps({{"same": same, "fusion": graph["fusion"], "lowering": graph["lowering_check"]}}))
""")


def test_a_new_process_with_the_same_cache_starts_with_the_op_unfused(tmp_path):
    with mock.patch.object(*perturbed(MUL)):
        run(block(), {"cuda_graphs": False, "recheck": "every", "cache_dir": tmp_path}, [inputs(0)])
    assert learned(fusion()) == [MUL]
    script = _NEW_PROCESS.format(tests=str(Path(__file__).parent), cache=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(out["same"]) and out["lowering"]["status"] == "bitwise"
    assert out["fusion"]["rounds"] == 0  # no mismatch: the op ran as an ATen call from the start
    assert [(k["op"], k["why"]) for k in out["fusion"]["kept"] if k["why"] != "recipe"] == [(MUL, "cache")]


def test_a_cache_never_skips_a_check(tmp_path):
    """The graph starts from a verdict naming one op; another op goes wrong: the first
    check still catches it (a cache that let checks be skipped would serve it)."""
    with mock.patch.object(*perturbed(MUL)):
        run(block(), {"cuda_graphs": False, "cache_dir": tmp_path}, [inputs(0)])
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    with mock.patch.object(*perturbed("aten.add.Tensor")):
        same = run(block(), {"cuda_graphs": False, "cache_dir": tmp_path}, [inputs(i) for i in range(3)])
    assert all(same), same
    f = fusion()
    assert [(k["op"], k["why"]) for k in f["kept"] if k["why"] != "recipe"] == [
        (MUL, "cache"), ("aten.add.Tensor", "learned")]


def test_without_bisection_the_whole_graph_would_lose_its_fusion(tmp_path):
    """Mutation: blame every fused op instead of finding the one that differs."""
    everything = lambda ops, kept, ok: list(ops)
    with mock.patch.object(*perturbed(MUL)), mock.patch.object(fused_mod, "_minimal", everything):
        run(block(), {"cuda_graphs": False, "recheck": "every", "cache_dir": False}, [inputs(0)])
    f = fusion()
    assert MUL in learned(f) and len(learned(f)) > 1 and "aten.add.Tensor" not in f["fused_ops"]


def _late(i: int) -> tuple[torch.Tensor, ...]:
    """A small conditioning for 4 calls (the modulation's products stay under 50, where the
    perturbed op is exact), then a large one."""
    return inputs(i, scale=1.0 if i < 4 else 40.0)


def test_a_captured_graph_is_recaptured_with_the_recompiled_code(tmp_path):
    with mock.patch.object(*perturbed(MUL, above=50.0)):
        same = run(block(), {"cuda_graphs": "emulate", "recheck": "every", "cache_dir": False},
                   [_late(i) for i in range(10)])
    assert all(same), same
    (graph,) = accounted_graphs()
    assert learned(graph["fusion"]) == [MUL] and graph["fusion"]["kept"][-1]["at_call"] == 5
    cg = graph["cuda_graph"]
    assert "verify_mismatch" not in cg["declines"] and cg["recaptures"] >= 1 and cg["replays"] >= 5


def test_without_the_recapture_the_old_capture_replays_the_bad_op(tmp_path):
    """Mutation: the runner ignores the recompile; its capture keeps the perturbed op, the
    next check blames the capture, and the piece runs eager from then on."""
    with mock.patch.object(*perturbed(MUL, above=50.0)), \
            mock.patch.object(GraphRunner, "recompiled", lambda self, detail: None):
        same = run(block(), {"cuda_graphs": "emulate", "recheck": "every", "cache_dir": False},
                   [_late(i) for i in range(10)])
    assert all(same), same  # every call is checked: eager answers
    assert "verify_mismatch" in accounted_graphs()[0]["cuda_graph"]["declines"]


def test_gives_up_fusion_when_what_it_learns_does_not_help(tmp_path):
    """Isolation blames the wrong op each time: after MAX_ROUNDS the graph runs its ATen
    kernels (`fusion_mismatch`, the ops named) and stays exact."""
    wrong = lambda ops, kept, ok: [next(op for op in ops if op != MUL)]
    with mock.patch.object(*perturbed(MUL)), mock.patch.object(fused_mod, "_minimal", wrong):
        same = run(block(), {"cuda_graphs": False, "recheck": "every", "cache_dir": tmp_path},
                   [inputs(i) for i in range(fused_mod.MAX_ROUNDS + 3)])
    assert all(same), same
    f = fusion()
    assert f["status"] == "fusion_mismatch" and f["rounds"] == fused_mod.MAX_ROUNDS + 1
    assert "differed on" in f["detail"] and f["kernels"] == 0
    (path,) = [p for p in (tmp_path / "fusion").glob("*.json") if not p.name.startswith("ops-")]
    verdict = json.loads(path.read_text())
    assert verdict["gave_up"] is True


class Wrapped(nn.Module):
    """Fused ops around an artifact's region: (x * 2 + 1) -> mlp -> * 3 + x."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x * 2 + 1) * 3 + x


@pytest.mark.parametrize("cuda_graphs", MODES)
def test_an_artifact_serves_its_region_inside_a_fused_graph(cuda_graphs, tmp_path):
    write_bundle(tmp_path / "mlp", "mlp-exact", "mlp", mlp_inputs(), MLP_OUTPUTS, MLP_SOURCE)
    torch.manual_seed(0)
    model = Wrapped().eval()
    same = run(model, {"cuda_graphs": cuda_graphs, "artifacts": str(tmp_path), "cache_dir": False},
               [(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)),) for i in range(5)])
    assert all(same), same
    report = graphdispatch_backend.latest_report()
    assert report["artifacts"]["mlp-exact"]["status"] == "serving"
    f = fusion()
    # fused around the artifact's call: one segment before it, one after
    assert f["status"] == "fused" and f["segments"] == 2 and f["rounds"] == 0


class Noisy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2 + 1
        return (h + torch.rand_like(h)) * 3 - x  # the draw stays outside every captured piece


def test_pieces_split_around_a_random_draw_are_fused_one_by_one():
    model = Noisy()
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"fuse": True, "cuda_graphs": "emulate", "cache_dir": False})
    same = []
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            torch.manual_seed(i)
            got = compiled(x)
            torch.manual_seed(i)
            same.append(torch.equal(got, model(x)))
    assert all(same), same
    (graph,) = accounted_graphs()
    assert [p["capturable"] for p in graph["pieces"]] == [True, False, True]
    assert graph["fusion"]["segments"] == 2 and graph["fusion"]["status"] == "fused"
    assert graph["cuda_graph"]["replays"] == 3


def test_a_graph_no_piece_of_which_is_captured_is_fused_whole():
    """A prefill that makes its cache (split reason made_buffer, passes/split_pieces.py) is
    not captured: it is fused whole, as under cuda_graphs=False, every call bitwise."""
    rows = 1 << 12

    def prefill(pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = torch.zeros(4, rows, 64)  # 4 MiB, made at the first forward
        cache.index_copy_(1, pos, k)
        return cache, (k * 2).relu()

    compiled = torch.compile(prefill, backend="graphdispatch",
                             options={"fuse": True, "cuda_graphs": "emulate", "cache_dir": False})
    with torch.no_grad():
        for i in range(4):
            args = torch.arange(3), torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(i))
            assert all(torch.equal(a, b) for a, b in zip(compiled(*args), prefill(*args)))
    (graph,) = accounted_graphs()
    assert graph["split_reasons"] == {"made_buffer": 1} and graph["cuda_graph"]["reason"] == "no_capturable_piece"
    assert graph["fusion"]["status"] == "fused"
    assert graph["fusion"]["fused_ops"] == {"aten.zeros.default": 1, MUL: 1, "aten.relu.default": 1}


class Counter(nn.Module):
    """A static cache and its position, as transformers' decode step keeps them: the
    position is read, then advanced in place, then the row written."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(16, 8))
        self.register_buffer("pos", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        at = torch.arange(1) + self.pos
        self.pos.add_(1)
        self.cache.index_copy_(0, at, x * 2 + 1)
        return self.cache * 3


def _decode(patch: Any = None) -> tuple[list[bool], dict[str, Any]]:
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    model, ref = Counter().eval(), Counter().eval()
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"fuse": True, "cuda_graphs": False, "cache_dir": False, "recheck": "every"})
    same = []
    with torch.no_grad(), patch or contextlib.nullcontext():
        for i in range(4):
            x = torch.randn(1, 8, generator=torch.Generator().manual_seed(i))
            same.append(torch.equal(compiled(x), ref(x)) and torch.equal(model.cache, ref.cache))
    (graph,) = accounted_graphs()
    return same, graph


def test_writes_in_place_run_between_the_fused_parts_in_order():
    same, graph = _decode()
    assert all(same) and graph["lowering_check"]["status"] == "bitwise"
    assert graph["fusion"]["rounds"] == 0 and graph["fusion"]["segments"] == 3
    assert [w["in_place"] for w in graph["input_writes"]] == [True, True]


def test_without_it_a_fused_read_of_the_position_follows_its_write():
    """Mutation: the writes inside the fused graph, as ATen calls there. Inductor realizes a
    fused value where its first ATen user needs it, after the position's `add_`: the row
    goes to the next position, outside what the check snapshots and puts back."""
    same, graph = _decode(mock.patch.object(segments_mod, "_writes", lambda target: False))
    assert not all(same) or graph["lowering_check"]["status"] != "bitwise"


def test_autograd_and_dynamic_graphs_are_not_fused_and_say_why():
    model = block()
    compiled = torch.compile(model, backend="graphdispatch", options={"fuse": True, "cache_dir": False})
    compiled(*inputs(0))  # grad mode on, parameters need grad: an autograd graph
    assert "autograd graphs are not fused" in fusion()["detail"] and fusion()["status"] == "off"
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    compiled = torch.compile(model, backend="graphdispatch", dynamic=True, options={"fuse": True, "cache_dir": False})
    with torch.no_grad():
        compiled(*inputs(0))
    assert "dynamic shapes" in accounted_graphs()[-1]["fusion"]["detail"]


class SqrtGraph(nn.Module):
    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (x * c[:, None]).abs().sqrt() * 0.5 + x


class SignedSqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().sqrt() * x.sign()


def _count_compiles() -> Any:
    calls = []
    real = fused_unit.compile_segment

    def counted(*args: Any) -> Any:
        calls.append(args[0])
        return real(*args)

    return calls, mock.patch.object(fused_unit, "compile_segment", counted)


def _second_graph(options: dict[str, Any], new_session: bool) -> tuple[dict[str, Any], int]:
    """`sqrt` fused one ulp off (the op_db case: eager's CPU sqrt is not Inductor's; the recipe
    now keeps it out on CPU, so it is let in here, as the old recipe did): a first graph
    learns it; then another graph holding `sqrt` runs. (Its fusion report, its compiles.)"""
    exact_node = recipe_mod.exact_node
    allow = mock.patch.object(recipe_mod, "exact_node", lambda node, device: exact_node(node, "cuda"))  # sqrt in
    with allow, mock.patch.object(*perturbed(SQRT)):
        assert all(run(SqrtGraph().eval(), options, [inputs(i) for i in range(3)]))
        assert learned(fusion()) == [SQRT] and fusion()["rounds"] == 1
        if new_session:
            torch._dynamo.reset()
            graphdispatch_backend.reset()
        compiles, counting = _count_compiles()
        with counting:
            model = block()
            model.norm = nn.Sequential(model.norm, SignedSqrt())  # another graph, holding a sqrt
            assert all(run(model, options, [inputs(i) for i in range(4)]))
    return accounted_graphs()[-1]["fusion"], len(compiles)


@pytest.mark.parametrize("cache", ["folder", "session"])
def test_what_one_graph_learned_serves_every_later_graph_on_the_device(cache, tmp_path):
    """The second graph, on the same device and recipe, keeps `sqrt` as an ATen call from its
    first call: no round, no trial compile. From the folder (a new session) or, with no
    folder, from the session's memory."""
    options = {"cuda_graphs": False, "recheck": "every", "cache_dir": tmp_path if cache == "folder" else False}
    f, compiles = _second_graph(options, new_session=cache == "folder")
    assert f["rounds"] == 0 and [(k["op"], k["why"], k["learned_in"]) for k in f["kept"] if k["why"] != "recipe"] \
        == [(SQRT, "device", "graph_0")]
    assert compiles == f["segments"]  # compiled once: no isolation trial
    assert SQRT not in f["fused_ops"] and f["kernels"] > 0


def test_without_the_device_verdicts_the_second_graph_pays_its_own_round(tmp_path):
    """Mutation: verdicts per graph only (as before): the second graph isolates `sqrt` again."""
    with mock.patch.object(fused_mod.Verdicts, "load_ops", lambda self, device, recipe: {}):
        f, compiles = _second_graph({"cuda_graphs": False, "recheck": "every", "cache_dir": tmp_path}, True)
    assert f["rounds"] == 1 and compiles > f["segments"]


def test_a_graph_inductor_lowers_nothing_of_says_nothing_fused():
    """Only views to fuse (`t`): Inductor generates no kernel, so the graph runs its ATen
    graph and says so (it used to say `fused` with no kernel and no fused op)."""
    w = torch.randn(8, 8)
    compiled = torch.compile(lambda x: x.t() @ w, backend="graphdispatch", options={"fuse": True, "cache_dir": False})
    with torch.no_grad():
        x = torch.randn(8, 8)
        assert torch.equal(compiled(x), x.t() @ w)
    f = fusion()
    assert f["status"] == "nothing_fused" and f["kernels"] == 0 and f["fused_ops"] == {}
    assert "no kernel" in f["detail"]


def test_the_aten_runs_between_captured_pieces_are_fused_too():
    """A prefill that makes its cache (a run that is not captured: made_buffer), a random draw,
    then a captured piece: the uncaptured run's ops are fused like the piece's."""
    rows = 1 << 12

    def prefill(pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = torch.zeros(4, rows, 64)
        cache.index_copy_(1, pos, k * 2 + 1)
        noise = torch.rand_like(k)
        return cache, (noise * 3 - k).relu()

    compiled = torch.compile(prefill, backend="graphdispatch",
                             options={"fuse": True, "cuda_graphs": "emulate", "cache_dir": False})
    with torch.no_grad():
        for i in range(5):
            args = torch.arange(3), torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(i))
            torch.manual_seed(i)
            got = compiled(*args)
            torch.manual_seed(i)
            assert all(torch.equal(a, b) for a, b in zip(got, prefill(*args)))
    (graph,) = accounted_graphs()
    assert [p["capturable"] for p in graph["pieces"]] == [False, False, True]
    f = graph["fusion"]
    assert f["status"] == "fused" and f["segments"] == 2  # the uncaptured run, and the piece
    assert f["fused_ops"] == {"aten.zeros.default": 1, MUL: 2, "aten.add.Tensor": 1, "aten.sub.Tensor": 1,
                              "aten.relu.default": 1}
    assert graph["cuda_graph"]["replays"] >= 2


class _ConvBlock(nn.Module):
    """A UNet's residual shape: Inductor's layout optimization ran its convolutions channels-last."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.c2(self.c1(x) * 2 + t) + x


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * 2 + x) / 3  # add, mul, div: fused under the exact recipe


def _fusion_of_conv_then_mlp() -> tuple[dict[str, Any], dict[str, Any]]:
    torch.manual_seed(0)
    conv = _ConvBlock().eval()
    mlp = _Residual().eval()
    options = {"cuda_graphs": "emulate", "fuse": True, "cache_dir": False}
    with torch.no_grad():
        for model, make in ((conv, lambda: (torch.randn(2, 4, 16, 16), torch.randn(2, 8, 1, 1))),
                            (mlp, lambda: (torch.randn(8, 16),))):
            compiled = torch.compile(model, backend="graphdispatch", dynamic=False, options=options)
            for _ in range(3):
                args = make()
                assert torch.equal(compiled(*args), model(*args))  # every call bitwise, whatever the fusion did
    first, second = (g["fusion"] for g in graphdispatch_backend.latest_report()["graphs"])
    return first, second


def test_a_convolution_block_fuses_in_eagers_layout():
    """The exact recipe turns Inductor's layout optimization off: a conv block's output was
    channels-last, found at call 1 (a UNet under fuse=True fused nothing)."""
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    conv, mlp = _fusion_of_conv_then_mlp()
    assert conv["status"] == "fused" and conv["kernels"] > 0 and mlp["status"] == "fused", (conv, mlp)


def test_an_output_laid_out_otherwise_learns_no_op_for_other_graphs(monkeypatch):
    """Where fused code still lays an output out otherwise than eager (forced here: the
    layout optimization on), that graph gives up fusion, said as a layout, and no op is
    learned: it once kept add, mul, view and 14 more off for every later graph of the
    device and recipe, and, through the verdict cache, of later processes."""
    monkeypatch.setitem(recipe_mod._COMMON, "layout_optimization", True)
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    conv, mlp = _fusion_of_conv_then_mlp()
    assert conv["status"] == "fusion_mismatch", conv
    assert conv["detail"].startswith("the fused code lays an output out otherwise than eager"), conv
    assert mlp["status"] == "fused" and not [k for k in mlp["kept"] if k["why"] != "recipe"], mlp


def test_an_expanded_input_of_a_fused_graph_verifies_at_the_capture_call():
    """A pipeline passes its timestep as `t.expand(batch)` (LTX, SD3): stride 0. The set
    derived from it at the capture call (the value doubled) keeps that layout, which the
    fused code's stride checks assume; laid out contiguously it raised there, so the capture
    waited for the next call to verify and the first replay came a call later than unfused."""
    def f(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return x * t[:, None] + 1

    seen = {}
    for fuse in (False, True):
        torch._dynamo.reset()
        graphdispatch_backend.reset()
        compiled = torch.compile(f, backend="graphdispatch", dynamic=False,
                                 options={"cuda_graphs": "emulate", "fuse": fuse, "cache_dir": False})
        with torch.no_grad():
            for step in range(4):
                x, t = torch.randn(2, 8), torch.tensor(1000.0 - 200 * step).expand(2)
                assert torch.equal(compiled(x, t), f(x, t))
        (graph,) = graphdispatch_backend.latest_report()["graphs"]
        seen[fuse] = dict(graph["cuda_graph"]["eager_by_reason"])
        assert fuse is False or graph["fusion"]["status"] == "fused", graph["fusion"]
    assert seen[True] == seen[False] == {"warmup": 1, "verifying": 1}, seen


class Scaled(nn.Module):
    """A bf16 tensor times and over a float32 0-dim scale Dynamo passes as an input."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.tensor(0.3)  # a plain tensor attribute: an input of the graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale + 1) / self.scale


@pytest.mark.parametrize("rule", [True, False], ids=["recipe", "without_the_rule"])
def test_a_0_dim_operand_of_another_dtype_is_kept_by_the_recipe_not_learned(rule, tmp_path):
    """A trial: `x * s` and `x / s` with `x` bf16 and `s` a float32 0-dim tensor differ fused
    (eager computes with `s` unrounded, Inductor rounds it to bf16 first); each device paid a
    learning round for them at call 1. The recipe keeps them out."""
    other = mock.patch.object(recipe_mod, "_other_zero_dim", lambda node: False) if not rule \
        else contextlib.nullcontext()
    with other:
        same = run(Scaled(), {"cache_dir": tmp_path, "recheck": "every"},
                   [((torch.randn(1003) * 3).to(torch.bfloat16),) for _ in range(3)])
    assert all(same), same  # either way no wrong value is served
    kept = {(k["op"], k["why"]) for k in fusion()["kept"]}
    if rule:
        assert {(MUL, "recipe"), ("aten.div.Tensor", "recipe")} <= kept and not learned(fusion()), kept
    else:
        assert learned(fusion()), kept  # the round the rule saves
