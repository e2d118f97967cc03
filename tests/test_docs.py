"""The README and docs/design.md say what the code does: every eager reason and artifact
status is explained, the demo's paths are the ones it writes, and the design document is
the project's own (no path outside the repository)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
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


def _setup_block() -> list[str]:
    section = README.split("## Set up, demo, test", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]


def test_two_readme_commands_set_up_and_run_the_demo_and_the_tests():
    """A fresh machine needs two commands (README), and CI runs exactly those on a clean clone."""
    demo, tests = _setup_block()
    assert demo == "./dev python -m graphdispatch_backend demo" and tests == "./dev python -m pytest -q -n auto"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text("utf-8").splitlines()]
    assert tests in ci, "CI does not run the README's test command"
    assert any(line.startswith(demo) for line in ci), "CI does not run the README's demo command"
    script = ROOT / "dev"
    assert script.stat().st_mode & 0o111, "./dev is not executable"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    wrong = subprocess.run([str(script)], capture_output=True, text=True)
    assert wrong.returncode == 2 and "usage: ./dev COMMAND" in wrong.stderr


def test_dev_reuses_a_set_up_environment_and_runs_the_command(tmp_path):
    """With the environment set up for this pyproject.toml and setup.cfg (its stamp), ./dev
    installs nothing and runs the command with the arguments given."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    (venv / "bin" / "activate").write_text(f"PATH={venv / 'bin'}:$PATH\n")
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "setup.cfg").read_bytes()).hexdigest()
    (venv / ".graphdispatch-setup").write_text(digest + "\n")
    done = subprocess.run([str(ROOT / "dev"), "python", "-m", "graphdispatch_backend", "demo", "--help"],
                          capture_output=True, text=True, env={**os.environ, "GD_VENV": str(venv)}, timeout=900)
    assert done.returncode == 0, done.stderr
    assert "setting up" not in done.stderr and "--report-dir" in done.stdout


FIGURE = re.compile(r"(?<![\w.])\d+\.\d+\s?(?:x|ms|us|s|MiB|GiB|KiB|KB|MB|GB|%)(?![\w])|under \d+ (?:MiB|KB|ms)")
DATE = re.compile(r"20\d\d-\d\d-\d\d")


def _prose_units(text: str) -> list[str]:
    """README text outside fenced blocks, cut into bullets, paragraphs and table rows."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    units: list[str] = []
    for para in re.split(r"\n\s*\n", prose):
        units += [u for u in re.split(r"\n(?=- |\| )", para) if u.strip()]
    return units


def test_every_figure_in_the_readme_names_its_command_and_date():
    """A measured figure (a decimal with a unit, or "under N MiB") is a promise: its bullet,
    paragraph or table row says the command that gives it and the date it was measured."""
    bare = [u.strip()[:160] for u in _prose_units(README)
            if FIGURE.search(u) and not (DATE.search(u) and re.search(r"`(python |bench/|\./dev|time )", u))]
    assert not bare, "figures without their command and date:\n" + "\n".join(bare)


def test_every_fusion_status_and_kept_reason_is_explained():
    from graphdispatch_backend.errors import FusionStatus, KeptWhy

    guide = (ROOT / "docs" / "fusion.md").read_text("utf-8")
    for value in [s.value for s in FusionStatus] + [k.value for k in KeptWhy]:
        assert f"`{value}`" in guide and f"`{value}`" in DESIGN, value
