"""`python -m graphdispatch_backend artifacts scaffold DIR --region PATTERN OUT`: a bundle that
reproduces a region from the report alone and passes bitwise parity as written (under bf16
autocast, with its casts explicit, and under dynamic shapes, sizes computed from its
inputs); and every way it refuses, with a message that says what to do."""

from __future__ import annotations

import copy
import dataclasses
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from expecttest import assert_expected_inline
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import graphdispatch_backend
from graphdispatch_backend.__main__ import main
from graphdispatch_backend.artifacts.bundle import verify_bundle
from graphdispatch_backend.artifacts.match import match_region
from graphdispatch_backend.artifacts.scaffold import ScaffoldError, scaffold
from graphdispatch_backend.diagnostics.report_dir import load
from graphdispatch_backend.diagnostics.report_file import expand
from graphdispatch_backend.errors import Rejection
from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.substitute import substitute
from graphdispatch_backend.passes.tag_regions import tag_regions
from graphdispatch_backend.testing import Mlp, Stack, aten_graph

TORCH = "2.13.0+cpu"


def compile_stack(report_dir: Path, batches: tuple[int, ...] = (2, 2), artifacts: Path | None = None,
                  autocast: bool = False, dynamic: bool | None = None, **options: Any) -> dict[str, Any]:
    """Run a seeded Stack (dim 8, 3-d input), bitwise against eager on every call; the report."""
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack(depth=2, dim=8).eval()
    options = {"report_dir": str(report_dir), "cuda_graphs": "emulate", **options}
    if artifacts is not None:
        options["artifacts"] = str(artifacts)
    compiled = torch.compile(model, backend="graphdispatch", options=options, dynamic=dynamic)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for i, batch in enumerate(batches):
            x = torch.randn(batch, 4, 8, generator=torch.Generator().manual_seed(i))
            assert torch.equal(compiled(x), model(x)), f"call {i}"
    graphdispatch_backend.flush()
    return json.loads((report_dir / "dispatch.json").read_text())


def substitutions(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for g in report["graphs"] for s in g["substitutions"]]


def test_scaffold_verify_compile_parity_bitwise(tmp_path, capsys):
    first = compile_stack(tmp_path / "first")
    bundle = tmp_path / "kernels" / "block-mlp"
    assert main(["artifacts", "scaffold", str(tmp_path / "first"), "--region", "blocks.*.mlp", str(bundle)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["artifacts", "verify", str(tmp_path / "kernels")]) == 0
    manifest = json.loads((bundle / "artifact.json").read_text())
    mlp = next(r for r in expand(first)["graphs"][0]["regions"] if r["name"] == "blocks.0.mlp")
    # no pinned fingerprint: it covers shapes, and would refuse the recompile that null dims are for
    assert manifest["region"] == {"module": "blocks.*.mlp"}
    assert manifest["signature"]["inputs"] == [{"name": i["name"], "shape": i["shape"], "dtype": i["dtype"]}
                                               for i in mlp["inputs"]]
    assert manifest["parity"] == {"mode": "bitwise"} and manifest["devices"] == ["cpu", "cuda"]
    assert manifest["torch"] == {"min": "2.13", "max_exclusive": "2.14"}
    assert_expected_inline((bundle / "kernel.py").read_text().split('"""', 2)[2], """\


import torch


def forward(input0, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
    # inputs (dtype[shape] stride), as the region receives them:
    #   input0: float32[2, 4, 8] stride (32, 8, 1)
    #   fc1_weight: float32[16, 8] stride (8, 1)
    #   fc1_bias: float32[16] stride (1,)
    #   fc2_weight: float32[8, 16] stride (16, 1)
    #   fc2_bias: float32[8] stride (1,)
    view = torch.ops.aten.view.default(input0, [8, 8])  # float32[8, 8] stride (8, 1)
    t = torch.ops.aten.t.default(fc1_weight)  # float32[8, 16] stride (1, 8)
    addmm = torch.ops.aten.addmm.default(fc1_bias, view, t)  # float32[8, 16] stride (16, 1)
    view_1 = torch.ops.aten.view.default(addmm, [2, 4, 16])  # float32[2, 4, 16] stride (64, 16, 1)
    relu = torch.ops.aten.relu.default(view_1)  # float32[2, 4, 16] stride (64, 16, 1)
    view_2 = torch.ops.aten.view.default(relu, [8, 16])  # float32[8, 16] stride (16, 1)
    t_1 = torch.ops.aten.t.default(fc2_weight)  # float32[16, 8] stride (1, 16)
    addmm_1 = torch.ops.aten.addmm.default(fc2_bias, view_2, t_1)  # float32[8, 8] stride (8, 1)
    view_3 = torch.ops.aten.view.default(addmm_1, [2, 4, 8])  # float32[2, 4, 8] stride (32, 8, 1)
    # outputs: parity compares their dtype, shape, stride and values with the region's:
    #   view_3: float32[2, 4, 8] stride (32, 8, 1)
    return (view_3,)
""")

    second = compile_stack(tmp_path / "second", batches=(2, 2, 2, 2), artifacts=tmp_path / "kernels", strict=True)
    subs = substitutions(second)
    assert sorted(s["region"] for s in subs) == ["blocks.0.mlp", "blocks.1.mlp"]
    assert all(s["parity"] == "passed" and not s["demoted"] and s["calls"] + s["replays"] == 4 for s in subs)
    assert second["artifacts"]["block-mlp"]["status"] == "serving"

    # a report of a compile that substituted the region still holds its graph as tagged
    # (substitution erases the region's nodes): scaffolding from it writes the same kernel
    again = scaffold(second, "blocks.*.mlp", tmp_path / "again" / "block-mlp")
    assert again["signature"] == manifest["signature"]
    body = (bundle / "kernel.py").read_text().split('"""', 2)[2]
    assert (tmp_path / "again" / "block-mlp" / "kernel.py").read_text().split('"""', 2)[2] == body


def test_casts_are_explicit_under_autocast(tmp_path):
    compile_stack(tmp_path / "first", autocast=True)
    scaffold(json.loads((tmp_path / "first" / "dispatch.json").read_text()), "blocks.*.mlp",
             tmp_path / "kernels" / "bf16-mlp")
    source = (tmp_path / "kernels" / "bf16-mlp" / "kernel.py").read_text()
    assert source.count("torch.ops.aten._to_copy.default(") >= 4 and "dtype=torch.bfloat16" in source
    second = compile_stack(tmp_path / "second", artifacts=tmp_path / "kernels", autocast=True, strict=True)
    subs = substitutions(second)
    assert len(subs) == 2 and all(s["parity"] == "passed" for s in subs)


def test_under_dynamic_shapes_the_kernel_computes_its_sizes(tmp_path):
    first = compile_stack(tmp_path / "first", batches=(2, 5), dynamic=True)
    mlp = next(r for g in expand(first)["graphs"] for r in g["regions"] if r["name"] == "blocks.0.mlp")
    assert mlp["sizes"] and mlp["inputs"][0]["shape"] == [None, None, 8]
    manifest = scaffold(first, "blocks.*.mlp", tmp_path / "kernels" / "dyn-mlp")
    assert all(i["dtype"] != "symint" for i in manifest["signature"]["inputs"])
    source = (tmp_path / "kernels" / "dyn-mlp" / "kernel.py").read_text()
    assert "input0.shape[0]" in source and "input0.shape[1]" in source
    second = compile_stack(tmp_path / "second", batches=(2, 5, 3), dynamic=True, artifacts=tmp_path / "kernels",
                           strict=True)
    subs = substitutions(second)
    assert len(subs) == 2 and all(s["parity"] == "passed" and s["gates"] == 3 for s in subs)


# -- refusals -------------------------------------------------------------------------------------


@pytest.fixture
def report(tmp_path: Path) -> dict[str, Any]:
    return compile_stack(tmp_path / "r", batches=(2,))


def test_a_pattern_naming_several_kinds_asks_for_a_fingerprint(report, tmp_path):
    with pytest.raises(ScaffoldError, match=r"names \d+ kinds of region: .*pick one with --fingerprint"):
        scaffold(report, "blocks.0*", tmp_path / "out")
    mlp = next(r for r in report["graphs"][0]["regions"] if r["name"] == "blocks.0.mlp")
    manifest = scaffold(report, "blocks.0*", tmp_path / "out", fingerprint=mlp["fingerprint"][:8])
    assert manifest["region"]["fingerprint"] == mlp["fingerprint"]


def test_a_pattern_naming_nothing_says_what_would(report, tmp_path):
    with pytest.raises(ScaffoldError, match=r"names no region of the report; did you mean `blocks\.\*\.mlp`"):
        scaffold(report, "layers.*.mlp", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_existing_bundle_is_never_overwritten(report, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kernel.py").write_text("mine")
    assert main(["artifacts", "scaffold", str(tmp_path / "r"), "--region", "blocks.*.mlp", str(tmp_path / "out")]) == 1
    assert "never overwrites" in capsys.readouterr().err
    assert (tmp_path / "out" / "kernel.py").read_text() == "mine"


def _edited(report: dict[str, Any], edit) -> dict[str, Any]:
    doc = expand(copy.deepcopy(report))  # region_graphs as data, to edit
    graph = doc["graphs"][0]
    fp = next(r for r in graph["regions"] if r["name"] == "blocks.0.mlp")["fingerprint"]
    edit(graph["region_graphs"][fp], graph)
    return doc


def _not_an_op(region_graph, graph):
    region_graph["nodes"][0]["target"] = None


def _odd_argument(region_graph, graph):
    region_graph["nodes"][0]["args"].append({"unsupported": "Foo"})


def _no_graph(region_graph, graph):
    graph["region_graphs"].clear()


@pytest.mark.parametrize("edit, said", [
    (_not_an_op, "is not a torch op"),
    (_odd_argument, "an argument the scaffold cannot write: Foo"),
    (_no_graph, "holds no graph"),
], ids=["not_an_op", "odd_argument", "no_graph"])
def test_what_the_scaffold_cannot_write_is_an_error(report, tmp_path, edit, said):
    with pytest.raises(ScaffoldError, match=said):
        scaffold(_edited(report, edit), "blocks.*.mlp", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_written_bundle_verifies_and_its_id_comes_from_the_folder(report, tmp_path):
    manifest = scaffold(report, "blocks.*.mlp", tmp_path / "my kernels!")
    assert manifest["id"] == "my-kernels-"
    assert verify_bundle(tmp_path / "my kernels!").manifest.id == "my-kernels-"


# -- devices: a bundle scaffolded on a CPU serves on a GPU ------------------------------------------


class Chain(torch.nn.Module):
    """Two MLPs, the second fed by the first: substituting `mlps.0` rewires `mlps.1`'s input."""

    def __init__(self) -> None:
        super().__init__()
        self.mlps = torch.nn.ModuleList(Mlp(8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mlp in self.mlps:
            x = mlp(x)
        return x


def on_cuda(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The same lowered graph with every value on cuda:0 (shapes, strides, dtypes kept): what
    lowering these modules on a GPU gives, built here without one. Matching reads only this."""
    mode = FakeTensorMode()
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            node.meta["val"] = FakeTensor(mode, meta, torch.device("cuda:0"))
    return gm


def test_a_bundle_scaffolded_on_cpu_lists_cuda_and_serves_the_region_on_cuda(tmp_path):
    torch.manual_seed(0)
    model = Chain().eval()
    x = torch.randn(2, 8)
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="graphdispatch", options={"report_dir": str(tmp_path / "r")})(x)
    graphdispatch_backend.flush()
    report, _, _ = load(tmp_path / "r")
    # pinned (`--fingerprint`), to show a CPU pin fits the same graph on a GPU
    fp = next(r for g in report["graphs"] for r in g["regions"] if r["name"] == "mlps.0")["fingerprint"]
    manifest = scaffold(report, "mlps.?", tmp_path / "kernels" / "mlp", fingerprint=fp)
    assert manifest["devices"] == ["cpu", "cuda"] and manifest["region"]["fingerprint"] == fp
    assert '"cuda"' in (tmp_path / "kernels" / "mlp" / "kernel.py").read_text()  # and it says how to narrow it
    artifact = types.SimpleNamespace(id="mlp", manifest=verify_bundle(tmp_path / "kernels" / "mlp").manifest)

    torch._dynamo.reset()
    with torch.no_grad():
        lowered = aten_graph(model, x)
    ctx = PassContext(input_origins=lowered.origins)
    tag_regions(on_cuda(lowered.gm), ctx)
    regions = {r.name: r for r in ctx.regions}
    region = regions["mlps.0"]
    # the boundary's device type is part of a fingerprint: the CPU one pinned in the manifest
    # is not this region's, and the match still holds (the same graph, on a device it lists)
    assert region.device_type == "cuda" and region.fingerprint != manifest["region"]["fingerprint"]
    assert match_region(region, [artifact], [], TORCH).selected is artifact
    only_cpu = types.SimpleNamespace(id="mlp", manifest=dataclasses.replace(artifact.manifest, devices=("cpu",)))
    (rejection,) = match_region(region, [only_cpu], [], TORCH).rejections
    assert rejection.reason is Rejection.DEVICE  # narrowed by hand: refused, and said why

    # and substituted, both: `mlps.1` is matched after `mlps.0`'s call replaced its input
    ctx.matcher = lambda r: match_region(r, [artifact], [], TORCH)
    ctx.make_call = lambda _region, _outcome, native: lambda *args: native(*args)
    substitute(lowered.gm, ctx)
    assert [(s.region, s.artifact) for s in ctx.substitutions] == [("mlps.0", "mlp"), ("mlps.1", "mlp")]


class Positions(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)


class WithPositions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = Positions()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pos(x) * 2


def test_a_region_whose_graph_spells_its_device_is_scaffolded_for_that_device(tmp_path):
    """`arange(..., device=cpu)` is another graph on a GPU (another fingerprint): the bundle
    lists the device its graph spells, and says so."""
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(WithPositions(), backend="graphdispatch",
                      options={"report_dir": str(tmp_path / "r")})(torch.randn(2, 8))
    graphdispatch_backend.flush()
    report, _, _ = load(tmp_path / "r")
    manifest = scaffold(report, "pos", tmp_path / "kernels" / "pos")
    assert manifest["devices"] == ["cpu"] and "cpu only: its graph spells the device" in manifest["description"]
    assert "torch.device('cpu')" in (tmp_path / "kernels" / "pos" / "kernel.py").read_text()
