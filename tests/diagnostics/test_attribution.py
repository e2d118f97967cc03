"""An artifact's `status` when its manifest pins a fingerprint: the regions of other kinds its
pattern also names were never its own, so refusing them is no `partly_rejected`; a region
of a module it serves, refused after a recompile changed its graph, still is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import graphdispatch_backend
from graphdispatch_backend.diagnostics.attribution import attribute
from graphdispatch_backend.testing import MLP_SOURCE, Stack, manifest_from_region, region_entry, write_bundle


class TwoWidths(torch.nn.Module):
    """Two dim-8 MLPs (`stack.blocks.<i>.mlp`) and one dim-4 MLP (`head.blocks.0.mlp`): the
    pattern `*.blocks.*.mlp` names regions of two kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = Stack(depth=2, dim=8)
        self.proj = torch.nn.Linear(8, 4)
        self.head = Stack(depth=1, dim=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.stack(x)))


def pinned_bundle(root: Path, region: dict[str, Any], module: str) -> Path:
    """The dim-8 MLP kernel, its manifest pinned to `region`'s fingerprint."""
    write_bundle(root / "mlp", "mlp", module, source=MLP_SOURCE, fingerprint=region["fingerprint"],
                 **manifest_from_region(region))
    return root


def run(model: torch.nn.Module, root: Path, batches: tuple[int, ...], strict: bool = True) -> dict[str, Any]:
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(root), "strict": strict})
    with torch.no_grad():
        for batch in batches:
            x = torch.randn(batch, 8)
            assert torch.equal(compiled(x), model(x))
    report = graphdispatch_backend.latest_report()
    assert report is not None
    return report


def test_a_pinned_artifact_serving_every_region_of_its_kind_is_serving(tmp_path):
    torch.manual_seed(0)
    model = TwoWidths().eval()
    region = region_entry(model, torch.randn(2, 8), name="stack.blocks.0.mlp")
    report = run(model, pinned_bundle(tmp_path / "kernels", region, "*.blocks.*.mlp"), (2, 2))
    (graph,) = report["graphs"]
    assert sorted(s["region"] for s in graph["substitutions"]) == ["stack.blocks.0.mlp", "stack.blocks.1.mlp"]
    head = next(r for r in graph["regions"] if r["name"] == "head.blocks.0.mlp")
    assert [j["reason"] for j in head["rejections"]] == ["fingerprint"]  # named by the pattern, not its kind
    entry = report["artifacts"]["mlp"]
    assert entry["rejections"]["fingerprint"] == 1  # still counted, and said where
    assert entry["status"] == "serving"


def test_a_pinned_artifact_that_stops_fitting_a_module_it_serves_is_partly_rejected(tmp_path):
    """Batch 5 recompiles with a symbolic batch: the same MLPs, another graph, another
    fingerprint. The artifact served them in the first graph and does not in the second: an
    authoring failure too (its pin refuses the recompile its signature would fit with null),
    so this runs without strict, which would fail the recompile."""
    torch.manual_seed(0)
    model = Stack(depth=2, dim=8).eval()
    region = region_entry(model, torch.randn(2, 8), name="blocks.0.mlp")
    report = run(model, pinned_bundle(tmp_path / "kernels", region, "blocks.*.mlp"), (2, 5), strict=False)
    static, dynamic = report["graphs"]
    assert len(static["substitutions"]) == 2 and dynamic["substitutions"] == []
    entry = report["artifacts"]["mlp"]
    assert entry["rejections"]["fingerprint"] == 2 and entry["status"] == "partly_rejected"
    assert [a["failure"] for a in report["authoring"]] == ["fingerprint"]


def test_attribution_of_a_pinned_artifact_from_graph_records():
    """The same verdicts from the report's records alone (what `attribute` reads)."""

    def graph(name: str, refused: list[str], served: list[str]) -> dict[str, Any]:
        regions = [{"name": n, "module": n.split("#", 1)[0],
                    "rejections": [{"artifact": "mlp", "reason": "fingerprint", "detail": ""}]} for n in refused]
        regions += [{"name": n, "module": n.split("#", 1)[0], "rejections": []} for n in served]
        subs = [{"artifact": "mlp", "region": n, "calls": 2, "replays": 0, "native_calls": 0, "parity": "passed",
                 "demoted": False, "speed": None} for n in served]
        return {"name": name, "regions": regions, "substitutions": subs}

    registry = {"loaded": ["mlp"]}
    other_kind = [graph("graph_0", ["head.mlp"], ["stack.0.mlp", "stack.1.mlp"])]
    assert attribute(other_kind, registry)["mlp"]["status"] == "serving"
    recompiled = [graph("graph_0", [], ["stack.0.mlp"]), graph("graph_1", ["stack.0.mlp"], [])]
    assert attribute(recompiled, registry)["mlp"]["status"] == "partly_rejected"
    second_call = [graph("graph_0", ["stack.0.mlp#1"], ["stack.0.mlp"])]  # the same module, called again
    assert attribute(second_call, registry)["mlp"]["status"] == "partly_rejected"
