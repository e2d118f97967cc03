"""export_regions: deferred torch.export of every region at flush(), under the replayed autocast
state, with every kept reference dropped afterwards (docs/design.md section 4)."""

from __future__ import annotations

import contextlib
import gc
import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphdispatch_backend
from graphdispatch_backend import export as export_module
from graphdispatch_backend.capture.autocast import AutocastState
from graphdispatch_backend.testing import Mlp

MATMULS = ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::bmm")


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = Attention(dim)
        self.mlp = Mlp(dim, act=nn.GELU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Stack(nn.Module):
    def __init__(self, depth: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Cast(nn.Module):
    """Explicit dtype casts: torch.export emits one _assert_tensor_metadata per cast."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(torch.bfloat16)).to(torch.float32)


class WithCast(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.cast = Cast(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cast(x).relu()


def _compile(model: nn.Module, report_dir: Path) -> Any:
    return torch.compile(model, backend="graphdispatch",
                         options={"export_regions": True, "report_dir": str(report_dir)})


def _call_one_block(report_dir: Path) -> tuple[nn.Module, weakref.ref[torch.Tensor]]:
    """A seeded one-block Stack, compiled into `report_dir` and called once; returns it and
    a weak reference to that call's input (this holds no strong one)."""
    torch.manual_seed(0)
    model = Stack(depth=1).eval()
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        _compile(model, report_dir)(x)
    return model, weakref.ref(x)


def _exports(report_dir: Path) -> dict[str, dict[str, Any]]:
    (graph,) = json.loads((report_dir / "dispatch.json").read_text())["graphs"]
    return {e["region"]: e for e in graph["export"]}


def _matmuls(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.op == "call_function" and hasattr(n.target, "_schema")
            and n.target._schema.name in MATMULS]


@pytest.fixture(scope="module")
def stack_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    report_dir = tmp_path_factory.mktemp("stack")
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        out, ref = _compile(model, report_dir)(x), model(x)
    graphdispatch_backend.flush()
    return report_dir, out, ref


def test_flush_writes_a_folder_per_region(stack_export):
    report_dir, out, ref = stack_export
    assert torch.equal(out, ref)
    folder = report_dir / "regions" / "blocks.0.mlp"
    assert sorted(p.name for p in folder.iterdir()) == ["export.pt2", "export_graph.txt", "graph.txt", "region.json"]
    meta = json.loads((folder / "region.json").read_text())
    (graph,) = json.loads((report_dir / "dispatch.json").read_text())["graphs"]
    reported = next(r for r in graph["regions"] if r["name"] == "blocks.0.mlp")
    assert meta["status"] == "exported" and meta["region"] == reported  # the report entry, verbatim
    assert meta["autocast"]["devices"]["cpu"]["enabled"] is False
    assert meta["ops"] == {"aten::gelu.default": 1, "aten::linear.default": 2}
    assert "fc1" in (folder / "graph.txt").read_text()
    program = torch.export.load(folder / "export.pt2")
    assert [n.target._schema.name for n in _matmuls(program)] == ["aten::linear", "aten::linear"]
    # parameters carry their names relative to the region, as manifests spell them
    assert set(program.state_dict) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


def test_repeated_blocks_export_once(stack_export):
    report_dir, _, _ = stack_export
    exports = _exports(report_dir)
    for suffix in ("", ".attn", ".mlp", ".mlp.fc1"):
        first, second = exports[f"blocks.0{suffix}"], exports[f"blocks.1{suffix}"]
        assert first["status"] == "exported"
        assert second["status"] == "same_as" and second["same_as"] == f"blocks.0{suffix}"
        assert second["fingerprint"] == first["fingerprint"]
        assert not (report_dir / "regions" / f"blocks.1{suffix}").exists()
    assert {e["status"] for e in exports.values()} == {"exported", "same_as"}


def test_attention_stays_one_op(stack_export):
    report_dir, _, _ = stack_export
    folder = report_dir / "regions" / "blocks.0.attn"
    program = torch.export.load(folder / "export.pt2")
    sdpa = [n for n in program.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 1
    assert _exports(report_dir)["blocks.0.attn"]["ops"]["aten::scaled_dot_product_attention.default"] == 1
    assert "aten.scaled_dot_product_attention.default" in (folder / "export_graph.txt").read_text()
    # not decomposed into its math
    assert not any(n.target in (torch.ops.aten._softmax.default, torch.ops.aten.bmm.default)
                   for n in program.graph.nodes)


def _autocast_export(tmp_path: Path, replay: bool, monkeypatch: pytest.MonkeyPatch) -> torch.fx.Node:
    torch.manual_seed(0)
    model = Stack(depth=1).eval()
    x = torch.randn(2, 4, 8)
    compiled = _compile(model, tmp_path)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
        ref = model(x)
    assert torch.equal(out, ref)
    assert not torch.is_autocast_enabled("cpu")  # flush runs outside autocast, as at process exit
    if not replay:  # the control: what a deferred trace does without the replay
        monkeypatch.setattr(AutocastState, "replay", lambda self: contextlib.nullcontext())
    graphdispatch_backend.flush()
    program = torch.export.load(tmp_path / "regions" / "blocks.0.mlp" / "export.pt2")
    first, *_ = _matmuls(program)
    return first


def test_matmul_dtype_is_pinned_by_the_replayed_autocast_state(tmp_path, monkeypatch):
    """THE required test: traced after the autocast block closed, the region's matmul
    still has the dtype the live call had."""
    matmul = _autocast_export(tmp_path, replay=True, monkeypatch=monkeypatch)
    assert matmul.meta["val"].dtype == torch.bfloat16
    meta = json.loads((tmp_path / "regions" / "blocks.0.mlp" / "region.json").read_text())
    assert meta["autocast"]["devices"]["cpu"] == {"enabled": True, "dtype": "bfloat16"}


def test_control_without_the_replay_the_matmul_silently_becomes_float32(tmp_path, monkeypatch):
    matmul = _autocast_export(tmp_path, replay=False, monkeypatch=monkeypatch)
    assert matmul.meta["val"].dtype == torch.float32


def test_the_exporter_drops_every_reference_at_flush(tmp_path):
    torch.manual_seed(0)
    model = Stack(depth=1).eval()
    compiled = _compile(model, tmp_path)
    x = torch.randn(2, 4, 8)
    alive = weakref.ref(x)
    with torch.no_grad():
        compiled(x)
    del x
    gc.collect()
    assert alive() is not None  # kept for the deferred export, not by this test
    graphdispatch_backend.flush()
    gc.collect()
    assert alive() is None
    assert _exports(tmp_path)["blocks.0"]["status"] == "exported"
    graphdispatch_backend.flush()  # a second flush has nothing left to export and still writes the report
    assert _exports(tmp_path)["blocks.0"]["status"] == "exported"


def test_a_failing_export_is_recorded_for_its_region_and_nothing_is_raised(tmp_path, monkeypatch):
    real = torch.export.export

    def export(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if any(n.target is F.scaled_dot_product_attention for n in module.graph.nodes):
            raise RuntimeError("cannot export attention today")
        return real(module, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", export)
    model, alive = _call_one_block(tmp_path)
    graphdispatch_backend.flush()
    exports = _exports(tmp_path)
    for region in ("blocks.0", "blocks.0.attn"):  # both hold the attention call
        assert exports[region]["status"] == "failed"
        assert exports[region]["reason"] == "RuntimeError: cannot export attention today"
        assert not (tmp_path / "regions" / region).exists()
    assert exports["blocks.0.mlp"]["status"] == "exported"
    assert exports["blocks.0.attn.qkv"]["status"] == "exported"
    gc.collect()
    assert alive() is None  # a failure keeps nothing alive either


def test_a_failing_replay_is_recorded_and_nothing_is_raised(tmp_path, monkeypatch):
    model, _ = _call_one_block(tmp_path)

    def broken(self: AutocastState) -> Any:
        raise RuntimeError("no autocast here")

    monkeypatch.setattr(AutocastState, "replay", broken)
    graphdispatch_backend.flush()
    (graph,) = json.loads((tmp_path / "dispatch.json").read_text())["graphs"]
    (entry,) = graph["export"]
    assert entry["status"] == "failed" and "no autocast here" in entry["reason"]


def test_a_failure_around_the_regions_is_recorded_and_nothing_is_raised(tmp_path, monkeypatch):
    model, alive = _call_one_block(tmp_path)

    def tag_regions(gm: Any, ctx: Any) -> None:
        raise KeyError("odd nn_module_stack")

    monkeypatch.setattr(export_module, "tag_regions", tag_regions)
    graphdispatch_backend.flush()
    (graph,) = json.loads((tmp_path / "dispatch.json").read_text())["graphs"]
    assert graph["export"] == [{"shape_key": 0, "status": "failed", "reason": "KeyError: 'odd nn_module_stack'"}]
    gc.collect()
    assert alive() is None


def test_strip_assertions_runs_on_the_exported_graph(tmp_path):
    torch.manual_seed(0)
    model = WithCast().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        out = _compile(model, tmp_path)(x)
    assert torch.equal(out, model(x))
    graphdispatch_backend.flush()
    entry = _exports(tmp_path)["cast"]
    assert entry["status"] == "exported"
    assert entry["stripped_assertions"] == 2  # one per cast: to(bfloat16), to(float32)
    folder = tmp_path / "regions" / "cast"
    assert "_assert_tensor_metadata" not in (folder / "export_graph.txt").read_text()
    program = torch.export.load(folder / "export.pt2")
    schemas = [n.target._schema.name for n in program.graph.nodes if hasattr(n.target, "_schema")]
    assert "aten::_assert_tensor_metadata" not in schemas and schemas.count("aten::to") == 2
    assert json.loads((folder / "region.json").read_text())["stripped_assertions"] == 2
