"""Fixtures for the diagnostics tests: a two-block model (`testing.Stack` with GELU as each
MLP's `act`: regions `blocks.0.mlp` and `blocks.1.mlp` share one signature, MLP_INPUTS and
MLP_OUTPUTS), artifact bundles for its MLPs (exact, off by a tanh GELU, slow, failing after
some calls, wrong signature), and the accounting check every fallback scenario must pass."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from graphdispatch_backend.testing import MLP_INPUTS, MLP_OUTPUTS, Stack, mlp_inputs, write_bundle

KERNELS = {
    # The native ops in the native order: bitwise equal.
    "exact": """
        import torch.nn.functional as F

        def forward(w1, b1, x, w2, b2):
            return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    """,
    # tanh-approximated GELU: close, not bit for bit; the parity gate demotes it.
    "off": """
        import torch.nn.functional as F

        def forward(w1, b1, x, w2, b2):
            return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)
    """,
    # Exact but far slower than the native region: the speed gate keeps native.
    "slow": """
        import time
        import torch.nn.functional as F

        def forward(w1, b1, x, w2, b2):
            time.sleep(0.03)  # far above the native region, even on a loaded machine
            return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    """,
    # Exact for its first calls, then raises (a kernel fault after capture).
    "flaky": """
        import torch.nn.functional as F

        CALLS = [0]

        def forward(w1, b1, x, w2, b2):
            CALLS[0] += 1
            if CALLS[0] > FAIL_AFTER:
                raise RuntimeError("kernel fault")
            return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    """,
}


def _write_mlp_bundle(root: Path, artifact_id: str, kernel: str, module: str = "blocks.*.mlp",
                      fail_after: int = 0, inputs: list[dict[str, Any]] | None = None, **fields: Any) -> Path:
    source = textwrap.dedent(KERNELS[kernel]).replace("FAIL_AFTER", str(fail_after))
    write_bundle(root / artifact_id, artifact_id, module, inputs or MLP_INPUTS, MLP_OUTPUTS, source, **fields)
    return root


@pytest.fixture(scope="session")
def write_mlp_bundle() -> Callable[..., Path]:
    """write_mlp_bundle(root, artifact_id, kernel, module=..., fail_after=..., inputs=...) -> root"""
    return _write_mlp_bundle


@pytest.fixture
def make_bundle(tmp_path: Path) -> Callable[..., Path]:
    """make_bundle(artifact_id, kernel, module="blocks.*.mlp", fail_after=..., inputs=...) writes a
    verified bundle under tmp_path/"bundles" and returns that root."""
    return lambda artifact_id, kernel, **kw: _write_mlp_bundle(tmp_path / "bundles", artifact_id, kernel, **kw)


@pytest.fixture(scope="session")
def mlp_inputs_factory() -> Callable[[], list[dict[str, Any]]]:
    return mlp_inputs


@pytest.fixture(name="mlp_inputs")
def mlp_inputs_fixture() -> list[dict[str, Any]]:
    return mlp_inputs()


def make_net() -> Stack:
    torch.manual_seed(0)
    return Stack(act=nn.GELU).eval()


@pytest.fixture(scope="session")
def net_factory() -> Callable[[], Stack]:
    return make_net


@pytest.fixture
def net() -> Stack:
    return make_net()


def _accounted(report: dict[str, Any]) -> None:
    """Every call of every graph (and of every captured piece) is a replay or an eager call
    with a named reason; the totals agree with the graphs."""
    assert report["graphs"], "no graph was compiled"
    graphs = report["graphs"] + [g["backward"] for g in report["graphs"] if g.get("backward")]
    for g in graphs:
        cg = g["cuda_graph"]
        assert g["calls"] == cg["replays"] + cg["eager_calls"], (g["name"], g["calls"], cg)
        assert sum(cg["eager_by_reason"].values()) == cg["eager_calls"], (g["name"], cg)
        assert all(reason and reason != "eager" for reason in cg["eager_by_reason"]), cg["eager_by_reason"]
        for piece in g["pieces"]:
            stats = piece.get("cuda_graph")
            if stats is not None:
                assert sum(stats["eager_by_reason"].values()) == stats["eager_calls"], (g["name"], piece)
        for sub in g.get("substitutions", ()):
            if sub["demoted"]:
                assert sub["reason"] and sub["detail"], sub
    totals = report["totals"]
    assert totals["calls"] == sum(g["calls"] for g in report["graphs"])
    assert totals["calls"] == totals["replays"] + totals["eager_calls"]
    assert totals["backward_calls"] == totals["backward_replays"] + totals["backward_eager_calls"]


@pytest.fixture
def accounted() -> Callable[[dict[str, Any]], None]:
    return _accounted


@pytest.fixture
def read_json() -> Callable[[Path], Any]:
    return lambda path: json.loads(Path(path).read_text("utf-8"))
