"""An artifact across Dynamo's dynamic shapes, on transformers' LlamaModel (tiny, random).

A batch-size change makes Dynamo recompile with a symbolic batch: the region then takes
size symbols the static graph did not have. Those never reach the kernel or the manifest
(the kernel below takes exactly the four tensors and checks they are tensors), `null`
dims match the symbolic ones, and parity is checked per concrete shape. An artifact that
stops fitting after the recompile is a typed rejection, a WARNING and a status that says
so (and a failed compile under `strict`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend import testing

transformers = pytest.importorskip("transformers")

HIDDEN, INTER, SEQ = 32, 64, 8

# Plain torch, in the native order: F.linear on a 3-d input is the same mm on the same
# folded view as the lowered region's, so it is bitwise equal to it at every batch size.
KERNEL = """
import torch
import torch.nn.functional as F

def forward(gate_proj_weight, x, up_proj_weight, down_proj_weight):
    args = (gate_proj_weight, x, up_proj_weight, down_proj_weight)
    if not all(isinstance(a, torch.Tensor) for a in args):
        raise TypeError("a size symbol reached the kernel")
    return F.linear(F.silu(F.linear(x, gate_proj_weight)) * F.linear(x, up_proj_weight), down_proj_weight)
"""


def signature(batch: int | None, seq: int | None = None) -> dict[str, list[dict[str, Any]]]:
    return {
        "inputs": [{"name": "gate_proj.weight", "shape": [INTER, HIDDEN], "dtype": "float32"},
                   {"name": "input0", "shape": [batch, seq, HIDDEN], "dtype": "float32"},
                   {"name": "up_proj.weight", "shape": [INTER, HIDDEN], "dtype": "float32"},
                   {"name": "down_proj.weight", "shape": [HIDDEN, INTER], "dtype": "float32"}],
        "outputs": [{"shape": [batch, seq, HIDDEN], "dtype": "float32"}],
    }


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaModel(cfg).eval()


def run(tmp_path: Path, batches: list[int], sig: dict[str, Any], dynamic: bool | None = None,
        strict: bool = False) -> dict[str, Any]:
    testing.write_bundle(tmp_path / "kernels" / "llama-mlp", "llama-mlp", "layers.*.mlp", source=KERNEL, **sig)
    model = llama()
    options = {"artifacts": str(tmp_path / "kernels"), "cuda_graphs": "emulate", "strict": strict}
    compiled = torch.compile(model, backend="graphdispatch", dynamic=dynamic, options=options)
    with torch.no_grad():
        for i, batch in enumerate(batches):
            ids = torch.randint(0, 64, (batch, SEQ), generator=torch.Generator().manual_seed(i))
            assert torch.equal(compiled(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)
    return graphdispatch_backend.latest_report()


def compiled_graphs(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The graphs that were compiled (a Dynamo restart leaves an empty record behind)."""
    return [g for g in report["graphs"] if g["nodes"]]


def _served_on_every_graph(report: dict[str, Any], graphs: int) -> None:
    assert len(compiled_graphs(report)) == graphs
    for graph in compiled_graphs(report):
        subs = {s["region"]: s for s in graph["substitutions"]}
        assert set(subs) == {"layers.0.mlp", "layers.1.mlp"}, graph["name"]
        for sub in subs.values():
            assert sub["parity"] == "passed" and not sub["demoted"] and sub["calls"] + sub["replays"] >= 1
        mlp = next(r for r in graph["regions"] if r["name"] == "layers.0.mlp")
        assert [i["name"] for i in mlp["inputs"]] == [e["name"] for e in signature(None)["inputs"]]
    assert report["artifacts"]["llama-mlp"]["status"] == "serving"
    assert report["authoring"] == []


def test_automatic_dynamic_recompile_keeps_serving(tmp_path):
    # batch 2 compiles a static graph, batch 5 a graph with a symbolic batch, batch 3 reuses it
    report = run(tmp_path, [2, 5, 3], signature(None, SEQ))
    _served_on_every_graph(report, graphs=2)
    static, dynamic = compiled_graphs(report)
    mlp = {g["name"]: next(r for r in g["regions"] if r["name"] == "layers.0.mlp") for g in (static, dynamic)}
    assert mlp[static["name"]]["sizes"] == [] and mlp[static["name"]]["inputs"][1]["shape"] == [2, SEQ, HIDDEN]
    # the recompiled region takes sizes the kernel never sees; its tensor input has a null batch
    assert mlp[dynamic["name"]]["sizes"] and mlp[dynamic["name"]]["inputs"][1]["shape"] == [None, SEQ, HIDDEN]
    # parity is checked per concrete shape: batches 5 and 3 each passed their own gate
    assert all(s["gates"] >= 2 for s in dynamic["substitutions"])


def test_dynamic_true_serves_every_batch(tmp_path):
    report = run(tmp_path, [2, 5], signature(None, None), dynamic=True)
    _served_on_every_graph(report, graphs=1)
    (graph,) = compiled_graphs(report)
    mlp = next(r for r in graph["regions"] if r["name"] == "layers.0.mlp")
    assert mlp["sizes"] and all(s["dtype"] == "symint" for s in mlp["sizes"])
    assert all(s["gates"] == 2 for s in graph["substitutions"])


def test_an_artifact_that_stops_fitting_after_a_recompile_says_so(tmp_path, gd_log):
    report = run(tmp_path, [2, 5], signature(2, SEQ))  # a concrete batch: fits the first graph only
    static, dynamic = compiled_graphs(report)
    assert {s["region"] for s in static["substitutions"]} == {"layers.0.mlp", "layers.1.mlp"}
    assert dynamic["substitutions"] == []
    rejected = [j for r in dynamic["regions"] for j in r.get("rejections", [])]
    assert {(j["artifact"], j["reason"]) for j in rejected} == {("llama-mlp", "signature")}
    assert "write null there" in rejected[0]["detail"]
    entry = report["artifacts"]["llama-mlp"]
    assert entry["status"] == "partly_rejected" and entry["rejections"]["signature"] == 2
    warnings = [r.getMessage() for r in gd_log.records
                if r.levelno == logging.WARNING and "does not fit" in r.getMessage()]
    assert len(warnings) == 1 and "layers.*.mlp" in warnings[0]  # once for the kind, not per layer
    assert [a["failure"] for a in report["authoring"]] == ["signature"]


def test_strict_fails_the_recompile_that_stops_fitting(tmp_path):
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        run(tmp_path, [2, 5], signature(2, SEQ), strict=True)
    assert isinstance(info.value.inner_exception, graphdispatch_backend.StrictModeError)
    assert "signature" in str(info.value.inner_exception)
    # the first graph compiled and served before the recompile failed
    first = compiled_graphs(graphdispatch_backend.latest_report())[0]
    assert {s["region"] for s in first["substitutions"]} == {"layers.0.mlp", "layers.1.mlp"}


class Normed(torch.nn.Module):
    """transformers' RMSNorm (a float `variance_epsilon` attribute), then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(16, eps=1e-6)
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(x))


RMS_KERNEL = """
import torch


def forward(x, eps, weight):
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps.to(torch.float32)))
"""


def test_under_dynamic_true_a_float_attribute_is_the_regions_input_not_a_split(tmp_path):
    """Under `dynamic=True` Dynamo passes `variance_epsilon` as a 0-dim input, and aot's
    `mean + eps` carried no module stack: the norm's region came out split (its mean an
    output, `mean + eps` an input) and a trial's RMSNorm manifest fit no region. The glue
    joins the region; the number is its input, named after the attribute."""
    torch.manual_seed(0)
    model = Normed().eval()
    with torch.no_grad():
        torch.compile(model, backend="graphdispatch", dynamic=True)(torch.randn(2, 5, 16))
    region = next(r for r in graphdispatch_backend.latest_report()["graphs"][-1]["regions"] if r["name"] == "norm")
    assert [(i["name"], i["shape"]) for i in region["inputs"]] == [
        ("input0", [None, None, 16]), ("variance_epsilon", []), ("weight", [16])], region["inputs"]
    assert [o["shape"] for o in region["outputs"]] == [[None, None, 16]]
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    testing.write_bundle(tmp_path / "rms", "rms", "norm", source=RMS_KERNEL, **testing.manifest_from_region(region))
    compiled = torch.compile(model, backend="graphdispatch", dynamic=True, options={"artifacts": str(tmp_path)})
    with torch.no_grad():
        for length in (5, 7, 3):
            x = torch.randn(2, length, 16)
            assert torch.equal(compiled(x), model(x))
    (sub,) = graphdispatch_backend.latest_report()["graphs"][-1]["substitutions"]
    assert (sub["parity"], sub["demoted"], sub["calls"]) == ("passed", False, 3), sub


class Timed(torch.nn.Module):
    """Root code on a number the caller passes (a 0-dim timestep), then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.lin((t * 1000).reshape(1, 1)) + x


def test_root_code_on_a_number_the_caller_passes_stays_out_of_the_region():
    """It carries no module stack either, as aot's glue for an attribute does: only what
    reads a module's own attribute joins that module's region."""
    with torch.no_grad():
        torch.compile(Timed().eval(), backend="graphdispatch", dynamic=True)(torch.randn(1, 8), torch.tensor(0.5))
    region = next(r for r in graphdispatch_backend.latest_report()["graphs"][-1]["regions"] if r["name"] == "lin")
    assert [(i["name"], i["shape"]) for i in region["inputs"]] == [("weight", [8, 1]), ("bias", [8]),
                                                                    ("input0", [1, 1])], region["inputs"]
