"""The README and docs/design.md say what the code does: every eager reason and artifact
status is explained, the demo's paths are the ones it writes, and the design document is
the project's own (no path outside the repository)."""

from __future__ import annotations

import re
from pathlib import Path

from graphdispatch_backend.__main__ import _parser
from graphdispatch_backend.errors import Decline

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text("utf-8")
DESIGN = (ROOT / "docs" / "design.md").read_text("utf-8")


def test_every_eager_reason_is_explained():
    table = README.split("Eager reasons", 1)[1].split("\n## ", 1)[0]
    explained = set(re.findall(r"`([a-z_]+)`", table))
    assert {d.value for d in Decline} <= explained


def test_every_artifact_status_is_explained():
    source = (ROOT / "graphdispatch_backend" / "diagnostics" / "attribution.py").read_text("utf-8")
    statuses = set(re.findall(r'return "([a-z_]+)"', source)) | set(re.findall(r'"([a-z_]+)" if', source))
    statuses |= set(re.findall(r'else "([a-z_]+)"', source))
    assert {"serving", "partly_rejected", "unmatched", "demoted"} <= statuses
    for status in statuses:
        assert f"`{status}`" in README and f"`{status}`" in DESIGN, status


def test_the_demo_paths_are_the_ones_it_writes():
    default = _parser().parse_args(["demo"]).report_dir
    assert f"report: {default}/dispatch.json" in README
    assert f"python -m graphdispatch_backend report {default}" in README
    assert "gd_demo" not in README


def test_the_design_document_is_the_projects_own():
    assert "docs/design.md" in README
    for text in (README, DESIGN):
        assert "DESIGN.md" not in text and "/work/" not in text
    sections = re.findall(r"^## (\d)\. ", DESIGN, flags=re.M)
    assert sections == [str(i) for i in range(1, 9)]
