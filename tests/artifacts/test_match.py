"""Matching regions against manifests (docs/design.md section 4): every typed Rejection forced on
purpose. Regions are real: `tag_regions` over the lowered ATen graph of a small model; the
manifests start as a copy of the region's report entry, as a new user would write them,
and then get one thing wrong. `overlap` and `load_failed` happen in the substitute pass,
so they are forced through torch.compile."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import graphdispatch_backend
from graphdispatch_backend.artifacts.manifest import parse_manifest
from graphdispatch_backend.artifacts.match import match_region, signature_miss
from graphdispatch_backend.capture.names import clean_module_name
from graphdispatch_backend.errors import Rejection
from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.tag_regions import tag_regions
from graphdispatch_backend.region import Region
from graphdispatch_backend.testing import MLP_SOURCE, Block, Stack, aten_graph, manifest_from_region, write_bundle

TORCH = "2.13.0+cpu"


class Noisy(nn.Module):
    """Regions that draw random numbers, next to one that does not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.off = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.off(self.drop(self.lin(x)))


class Jitter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x)


class WithJitter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.jitter = Jitter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.jitter(x) * 2


class RowParallel(nn.Module):
    """A row-parallel projection as tensor parallelism writes it: the local matmul, then the
    all-reduce of the partial sums (functional collectives, as DTensor's are traced)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c10d = torch.ops._c10d_functional
        return c10d.wait_tensor(c10d.all_reduce(self.proj(x), "sum", dist.group.WORLD.group_name))


class WithRowParallel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = RowParallel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(x) + x


def regions(model: nn.Module, *args: Any, edit=None) -> dict[str, Region]:
    with torch.no_grad():
        lowered = aten_graph(model, *args)
    if edit is not None:
        edit(lowered.gm)
    ctx = PassContext(input_origins=lowered.origins)
    tag_regions(lowered.gm, ctx)
    return {r.name: r for r in ctx.regions}


@pytest.fixture(scope="module")
def stack() -> dict[str, Region]:
    torch.manual_seed(0)
    return regions(Stack().eval(), torch.randn(2, 8))


def artifact(region: Region, artifact_id: str = "art", module: str | None = None, **fields: Any):
    """A registry-like artifact whose manifest is the region's report entry, copied."""
    doc = {
        "schema_version": 1,
        "id": artifact_id,
        "region": {"module": module if module is not None else region.module},
        "signature": manifest_from_region(region.to_dict()),
        "entry_point": {"file": "kernel.py", "symbol": "forward"},
        "files": [{"path": "kernel.py", "sha256": "0" * 64, "bytes": 1}],
    }
    for key, value in fields.items():
        if key == "fingerprint":
            doc["region"]["fingerprint"] = value
        else:
            doc[key] = value
    return types.SimpleNamespace(id=artifact_id, manifest=parse_manifest(doc))


def edited_signature(region: Region, edit) -> dict[str, Any]:
    sig = copy.deepcopy(manifest_from_region(region.to_dict()))
    edit(sig)
    return sig


def only_rejection(outcome, reason: Rejection) -> str:
    assert outcome.selected is None
    (record,) = outcome.rejections
    assert record.reason is reason, record
    return record.detail


# -- a match, and the module pattern ------------------------------------------------------------


def test_manifest_copied_from_the_report_matches(stack):
    region = stack["blocks.0.mlp"]
    art = artifact(region, module="blocks.*.mlp", fingerprint=region.fingerprint)
    outcome = match_region(region, [art], [], TORCH)
    assert outcome.selected is art and outcome.rejections == [] and outcome.region == "blocks.0.mlp"


def test_one_manifest_matches_every_repeated_block(stack):
    art = artifact(stack["blocks.0.mlp"], module="blocks.*.mlp")
    matched = [name for name, r in stack.items() if match_region(r, [art], [], TORCH).selected is art]
    assert matched == ["blocks.0.mlp", "blocks.1.mlp"]
    assert stack["blocks.0.mlp"].fingerprint == stack["blocks.1.mlp"].fingerprint


@pytest.mark.parametrize("pattern", ["blocks.*.ff", "Blocks.0.mlp", "blocks.0", "blocks.0.mlp.*", "mlp"])
def test_module_pattern_miss(stack, pattern):
    detail = only_rejection(match_region(stack["blocks.0.mlp"], [artifact(stack["blocks.0.mlp"], module=pattern)],
                                         [], TORCH), Rejection.MODULE)
    assert pattern in detail


@pytest.mark.parametrize("pattern", ["blocks.0.mlp", "blocks.?.mlp", "blocks.[01].mlp", "*.mlp", "*"])
def test_module_pattern_is_fnmatch_over_clean_names(stack, pattern):
    region = stack["blocks.0.mlp"]
    assert match_region(region, [artifact(region, module=pattern)], [], TORCH).selected is not None


# -- fingerprint, signature, device, torch version ------------------------------------------------------


def test_fingerprint_miss(stack):
    region = stack["blocks.0.mlp"]
    detail = only_rejection(match_region(region, [artifact(region, fingerprint="f" * 32)], [], TORCH),
                            Rejection.FINGERPRINT)
    assert "f" * 32 in detail and region.fingerprint in detail


def test_fingerprint_of_another_region_misses(stack):
    region, other = stack["blocks.0.mlp"], stack["blocks.0.mlp.fc1"]
    only_rejection(match_region(region, [artifact(region, fingerprint=other.fingerprint)], [], TORCH),
                   Rejection.FINGERPRINT)


def _drop_last_input(sig):
    sig["inputs"].pop()


def _extra_output(sig):
    sig["outputs"].append(dict(sig["outputs"][0]))


def _rename_input(sig):
    sig["inputs"][0]["name"] = "weight"


def _swap_inputs(sig):
    sig["inputs"][0], sig["inputs"][1] = sig["inputs"][1], sig["inputs"][0]


def _input_dtype(sig):
    sig["inputs"][2]["dtype"] = "bfloat16"


def _output_dtype(sig):
    sig["outputs"][0]["dtype"] = "float16"


def _input_shape(sig):
    sig["inputs"][2]["shape"] = [4, 8]


def _input_rank(sig):
    sig["inputs"][2]["shape"] = [2, 8, 1]


def _output_shape(sig):
    sig["outputs"][0]["shape"] = [2, 16]


def _output_rank_with_nulls(sig):
    sig["outputs"][0]["shape"] = [None]


SIGNATURE_MISSES = [
    (_drop_last_input, "4 inputs, region has 5"),
    (_extra_output, "2 outputs, region has 1"),
    (_rename_input, "input 0 'fc1.weight': manifest names it 'weight'"),
    (_swap_inputs, "input 0 'fc1.weight': manifest names it 'fc1.bias'"),
    (_input_dtype, "input 2 'input0': dtype bfloat16, region has float32"),
    (_output_dtype, "output 0: dtype float16, region has float32"),
    (_input_shape, "input 2 'input0': shape [4, 8], region has [2, 8] (a size that varies between calls: write "
                   "null there)"),
    (_input_rank, "input 2 'input0': shape [2, 8, 1], region has [2, 8]"),
    (_output_shape, "output 0: shape [2, 16], region has [2, 8] (a size that varies between calls: write null "
                    "there)"),
    (_output_rank_with_nulls, "output 0: shape [null], region has [2, 8]"),
]


@pytest.mark.parametrize("edit, expected", SIGNATURE_MISSES, ids=[e.__name__.strip("_") for e, _ in SIGNATURE_MISSES])
def test_signature_miss(stack, edit, expected):
    region = stack["blocks.0.mlp"]
    art = artifact(region, signature=edited_signature(region, edit))
    assert only_rejection(match_region(region, [art], [], TORCH), Rejection.SIGNATURE) == expected


def test_null_dims_match_any_size(stack):
    region = stack["blocks.0.mlp"]

    def any_size(sig):
        for entry in sig["inputs"] + sig["outputs"]:
            entry["shape"] = [None] * len(entry["shape"])

    art = artifact(region, signature=edited_signature(region, any_size))
    assert signature_miss(art.manifest, region) is None
    assert match_region(region, [art], [], TORCH).selected is art


def test_device_miss(stack):
    region = stack["blocks.0.mlp"]
    detail = only_rejection(match_region(region, [artifact(region, devices=["cuda"])], [], TORCH), Rejection.DEVICE)
    assert "cpu" in detail and "cuda" in detail


@pytest.mark.parametrize("bounds, have, miss", [
    ({"min": "2.14"}, "2.13.0+cpu", "needs torch >= 2.14, have 2.13.0+cpu"),
    ({"min": "2.13.1"}, "2.13.0", "needs torch >= 2.13.1, have 2.13.0"),
    ({"min": "2.13"}, "2.13.0+cpu", None),
    ({"max_exclusive": "2.13"}, "2.13.0+cpu", "needs torch < 2.13, have 2.13.0+cpu"),
    ({"max_exclusive": "2.13.0"}, "2.13.0a0+git", "needs torch < 2.13.0, have 2.13.0a0+git"),
    ({"max_exclusive": "2.14"}, "2.13.9", None),
    ({"min": "2.12", "max_exclusive": "2.13"}, "2.13.0", "needs torch < 2.13, have 2.13.0"),
    ({"min": "2.13", "max_exclusive": "2.14"}, "2.13.0+cu128", None),
])
def test_torch_version_bounds(stack, bounds, have, miss):
    region = stack["blocks.0.mlp"]
    outcome = match_region(region, [artifact(region, torch=bounds)], [], have)
    if miss is None:
        assert outcome.selected is not None and outcome.rejections == []
    else:
        assert only_rejection(outcome, Rejection.TORCH_VERSION) == miss


def test_checks_stop_at_the_first_miss(stack):
    region = stack["blocks.0.mlp"]
    art = artifact(region, devices=["cuda"], signature=edited_signature(region, _input_dtype))
    only_rejection(match_region(region, [art], [], TORCH), Rejection.DEVICE)


# -- the region's own shape: convexity and randomness ----------------------------------------------------


def _relu_leaves_the_mlp(gm) -> None:
    """Take relu out of `mlp`: fc1 -> relu (outside) -> fc2 is a path that leaves the region
    and re-enters it, as when a module hands its intermediate to code outside it."""
    (relu,) = [n for n in gm.graph.nodes if n.op == "call_function" and "relu" in str(n.target)]
    relu.meta["nn_module_stack"] = {
        k: v for k, v in relu.meta["nn_module_stack"].items() if clean_module_name(v[0]) != "mlp"
    }


def test_not_convex():
    torch.manual_seed(0)
    found = regions(Block().eval(), torch.randn(2, 8), edit=_relu_leaves_the_mlp)
    region = found["mlp"]
    assert region.convex is False and "aten::relu.default" not in region.ops
    assert found["mlp.fc1"].convex and found["mlp.fc2"].convex
    detail = only_rejection(match_region(region, [artifact(region)], [], TORCH), Rejection.NOT_CONVEX)
    assert "leaves" in detail


def test_dropout_in_train_mode_is_nondeterministic():
    found = regions(Noisy().train(), torch.randn(2, 8))
    assert found["drop"].deterministic is False
    only_rejection(match_region(found["drop"], [artifact(found["drop"])], [], TORCH), Rejection.NONDETERMINISTIC)
    # p=0 draws nothing; neither does a region without random ops: both still match
    for name in ("off", "lin"):
        assert found[name].deterministic, name
        assert match_region(found[name], [artifact(found[name])], [], TORCH).selected is not None


def test_dropout_in_eval_mode_is_deterministic():
    found = regions(Noisy().eval(), torch.randn(2, 8))
    assert all(r.deterministic for r in found.values())


def test_rand_is_nondeterministic():
    region = regions(WithJitter(), torch.randn(2, 8))["jitter"]
    assert "aten::rand_like.default" in region.ops
    detail = only_rejection(match_region(region, [artifact(region)], [], TORCH), Rejection.NONDETERMINISTIC)
    assert "random" in detail


def test_a_region_holding_a_collective_runs_native_and_the_matmul_before_it_matches(two_fake_ranks):
    """Each rank's gate checks and demotes on its own (a tensor-parallel region's inputs
    differ per rank); a region whose check would run its all-reduce twice on one rank is
    not substituted. The sharded matmul inside it, without the collective, is."""
    found = regions(WithRowParallel(), torch.randn(2, 8))
    down, proj = found["down"], found["down.proj"]
    assert down.collective and "_c10d_functional::all_reduce.default" in down.ops and not proj.collective
    detail = only_rejection(match_region(down, [artifact(down)], [], TORCH), Rejection.COLLECTIVE)
    assert "out of step" in detail and "holds none" in detail
    assert match_region(proj, [artifact(proj)], [], TORCH).selected is not None


# -- several artifacts ------------------------------------------------------------------------------------


def test_two_artifacts_match_the_first_by_id_wins(stack):
    region = stack["blocks.0.mlp"]
    late, early = artifact(region, "zz-late"), artifact(region, "aa-early")
    outcome = match_region(region, [late, early], [], TORCH)  # given in the other order on purpose
    assert outcome.selected is early
    (record,) = outcome.rejections
    assert (record.artifact, record.reason) == ("zz-late", Rejection.NOT_SELECTED)
    assert "aa-early" in record.detail


def test_not_enabled_is_reported_only_where_the_excluded_pattern_matches(stack):
    region = stack["blocks.0.mlp"]
    excluded = [artifact(region, "off"), artifact(region, "elsewhere", module="final.*")]
    outcome = match_region(region, [], excluded, TORCH)
    assert outcome.selected is None
    assert [(r.artifact, r.reason) for r in outcome.rejections] == [("off", Rejection.NOT_ENABLED)]
    assert outcome.rejections[0].to_dict() == {"artifact": "off", "reason": "not_enabled",
                                               "detail": "not in the enable allowlist"}


def test_every_candidate_gets_its_own_rejection(stack):
    region = stack["blocks.0.mlp"]
    arts = [artifact(region, "a-module", module="x"), artifact(region, "b-device", devices=["cuda"]),
            artifact(region, "c-ok"), artifact(region, "d-ok")]
    outcome = match_region(region, arts, [artifact(region, "e-off")], TORCH)
    assert outcome.selected.id == "c-ok"
    assert [(r.artifact, r.reason.value) for r in outcome.rejections] == [
        ("e-off", "not_enabled"), ("a-module", "module"), ("b-device", "device"), ("d-ok", "not_selected")]


# -- overlap and load_failed: through the substitute pass --------------------------------------------------


LINEAR_SOURCE = """
import torch
def forward(w, b, x):
    return torch.addmm(b, x, w.t())
"""


def _bundle_for(root, artifact_id, region: Region, source: str, module: str | None = None):
    sig = manifest_from_region(region.to_dict())
    write_bundle(root / artifact_id, artifact_id, module or region.module, sig["inputs"], sig["outputs"], source)


def _run(model: nn.Module, root, x: torch.Tensor) -> dict:
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(root)})
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(x), model(x))
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    return graph


def test_overlap_an_enclosing_substituted_region_wins(tmp_path, stack):
    _bundle_for(tmp_path, "mlp", stack["blocks.0.mlp"], MLP_SOURCE, "blocks.*.mlp")
    _bundle_for(tmp_path, "fc1", stack["blocks.0.mlp.fc1"], LINEAR_SOURCE, "blocks.*.mlp.fc1")
    torch.manual_seed(0)
    graph = _run(Stack().eval(), tmp_path, torch.randn(2, 8))
    assert [(s["region"], s["artifact"]) for s in graph["substitutions"]] == [
        ("blocks.0.mlp", "mlp"), ("blocks.1.mlp", "mlp")]
    by_name = {r["name"]: r for r in graph["regions"]}
    for name in ("blocks.0.mlp.fc1", "blocks.1.mlp.fc1"):
        assert by_name[name]["artifact"] is None
        assert [(r["artifact"], r["reason"]) for r in by_name[name]["rejections"]] == [("fc1", "overlap")]


def test_without_the_enclosing_artifact_the_inner_one_substitutes(tmp_path, stack):
    """The control for the overlap test: alone, `fc1` does serve."""
    _bundle_for(tmp_path, "fc1", stack["blocks.0.mlp.fc1"], LINEAR_SOURCE, "blocks.*.mlp.fc1")
    torch.manual_seed(0)
    graph = _run(Stack().eval(), tmp_path, torch.randn(2, 8))
    assert [(s["region"], s["parity"]) for s in graph["substitutions"]] == [
        ("blocks.0.mlp.fc1", "passed"), ("blocks.1.mlp.fc1", "passed")]


@pytest.mark.parametrize("source, symbol, names", [
    ("import torch\nraise ImportError('needs triton')\ndef forward(*a):\n    pass\n", "forward", "needs triton"),
    (MLP_SOURCE, "missing_symbol", "missing_symbol"),
    ("def forward(:\n", "forward", "SyntaxError"),
])
def test_load_failed_leaves_the_region_native(tmp_path, stack, source, symbol, names):
    sig = manifest_from_region(stack["blocks.0.mlp"].to_dict())
    write_bundle(tmp_path / "broken", "broken", "blocks.*.mlp", sig["inputs"], sig["outputs"], source, symbol=symbol)
    _bundle_for(tmp_path, "fc2", stack["blocks.0.mlp.fc2"], LINEAR_SOURCE, "blocks.*.mlp.fc2")
    torch.manual_seed(0)
    graph = _run(Stack().eval(), tmp_path, torch.randn(2, 8))
    assert graph["kind"] == "inference" and graph["error"] is None  # the graph compiled; only the region fell back
    by_name = {r["name"]: r for r in graph["regions"]}
    for name in ("blocks.0.mlp", "blocks.1.mlp"):
        (rejection,) = by_name[name]["rejections"]
        assert rejection["reason"] == "load_failed" and names in rejection["detail"]
    # the failed load does not hold back the artifact of the regions inside it
    assert [(s["region"], s["artifact"], s["parity"]) for s in graph["substitutions"]] == [
        ("blocks.0.mlp.fc2", "fc2", "passed"), ("blocks.1.mlp.fc2", "fc2", "passed")]


def test_report_lists_signature_rejections_and_counts_module_misses(tmp_path, stack):
    region = stack["blocks.0.mlp"]
    sig = edited_signature(region, _input_dtype)
    write_bundle(tmp_path / "wrong", "wrong", "blocks.*.mlp", sig["inputs"], sig["outputs"], MLP_SOURCE)
    torch.manual_seed(0)
    graph = _run(Stack().eval(), tmp_path, torch.randn(2, 8))
    assert graph["substitutions"] == []
    by_name = {r["name"]: r for r in graph["regions"]}
    assert by_name["blocks.1.mlp"]["rejections"] == [
        {"artifact": "wrong", "reason": "signature", "detail": "input 2 'input0': dtype bfloat16, region has float32"}]
    # module misses are counted per artifact, not listed on every region
    assert graph["module_rejections"] == {"wrong": len(graph["regions"]) - 2}
    assert by_name["blocks.0"]["rejections"] == []
