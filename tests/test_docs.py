"""The README and the guides in docs/ say what the code does: the README is a short front
door whose quick start runs as written and whose commands are CI's; every eager reason and
artifact status is explained (docs/report.md), every option is in both options tables, the
demo's paths are the ones it writes, every link resolves, every figure names its command and
date, and no document cites a path outside the repository."""

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
REPORT = (ROOT / "docs" / "report.md").read_text("utf-8")  # the report reference: what the demo prints, reasons
GUIDES = sorted((ROOT / "docs").glob("*.md"))
DOCS = {"README.md": README, **{f"docs/{p.name}": p.read_text("utf-8") for p in GUIDES},
        "tests/README.md": (ROOT / "tests" / "README.md").read_text("utf-8")}


def test_the_readme_is_a_front_door():
    """Read in five minutes: at most ~250 lines, the quick start first, and a link to every guide."""
    assert len(README.splitlines()) <= 250
    assert README.index("## Quick start") < README.index("## Set up, demo, test")
    for guide in GUIDES:
        assert f"(docs/{guide.name})" in README, f"the README does not link docs/{guide.name}"


def _quick_start() -> str:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_quick_start_runs_as_written_on_a_cpu(tmp_path):
    """The README's first snippet, as a newcomer pastes it, in a fresh process on a CPU: it
    says `cuda_graphs="emulate"` (the default runs a CPU graph eagerly), asserts bitwise
    equality, reads its report with load_report and prints what the README says it prints."""
    code = _quick_start()
    assert '"cuda_graphs": "emulate"' in code and "load_report(" in code
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHDISPATCH_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    said = README.split("It prints `", 1)[1].split("`", 1)[0]
    assert " ".join(said.split()) in done.stdout, done.stdout
    assert (tmp_path / "gd_quickstart" / "dispatch.json").is_file()


def test_every_eager_reason_is_explained():
    table = REPORT.split("Eager reasons", 1)[1].split("\n## ", 1)[0]
    explained = set(re.findall(r"`([a-z_]+)`", table))
    assert {d.value for d in Decline} <= explained


def test_every_artifact_status_is_explained():
    source = (ROOT / "graphdispatch_backend" / "diagnostics" / "attribution.py").read_text("utf-8")
    statuses = set(re.findall(r'return "([a-z_]+)"', source)) | set(re.findall(r'"([a-z_]+)" if', source))
    statuses |= set(re.findall(r'else "([a-z_]+)"', source))
    assert {"serving", "partly_rejected", "unmatched", "demoted"} <= statuses
    for status in statuses:
        assert f"`{status}`" in REPORT and f"`{status}`" in DESIGN, status


def test_the_demo_paths_are_the_ones_it_writes():
    default = _parser().parse_args(["demo"]).report_dir
    assert f"report in `{default}`" in README
    assert f"report: {default}/dispatch.json" in REPORT
    assert f"python -m graphdispatch_backend report {default}" in REPORT
    assert all("gd_demo" not in text for text in DOCS.values())


def _normalized(text: str) -> list[str]:
    """Lines as the demo prints them, less what differs per run: the compile time, the
    staged bundles' folder, trailing blanks."""
    text = re.sub(r"compiled\+ran in \d+(\.\d+)?s", "compiled+ran in Ns", text)
    text = re.sub(r"/tmp/gd_bundles_\S+", "/tmp/gd_bundles_", text)
    return [line.rstrip() for line in text.strip().splitlines()]


def test_what_the_demo_prints_is_what_docs_report_shows(tmp_path):
    """docs/report.md's two listings are the demo's output and its rendered report, line
    for line (the log line the demo's demotion writes comes on stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHDISPATCH_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    demo = subprocess.run([sys.executable, "-m", "graphdispatch_backend", "demo"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=900)
    assert demo.returncode == 0, demo.stderr[-3000:]
    shown = REPORT.split("## What the demo prints", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    logged = [line for line in _normalized(shown) if line.startswith("graphdispatch: ")]
    assert [line for line in _normalized(shown) if line not in logged] == _normalized(demo.stdout)
    assert logged and all(line in demo.stderr for line in logged)
    rendered = subprocess.run([sys.executable, "-m", "graphdispatch_backend", "report", "gd_out"], cwd=tmp_path,
                              capture_output=True, text=True, env=env, timeout=900)
    assert rendered.returncode == 0, rendered.stderr
    shown = REPORT.split("then renders the report:", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    assert _normalized(shown) == _normalized(rendered.stdout)


def test_the_design_document_is_the_projects_own():
    assert "docs/design.md" in README
    for name, text in DOCS.items():
        assert "DESIGN.md" not in text and "/work/" not in text, name
    sections = re.findall(r"^## (\d)\. ", DESIGN, flags=re.M)
    assert sections == [str(i) for i in range(1, 9)]


def _setup_blocks() -> list[list[str]]:
    section = README.split("## Set up, demo, test", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in section.split("```bash")[1:]]
    return [[line.split("#", 1)[0].strip() for line in b.strip().splitlines()] for b in blocks]


def test_two_readme_commands_set_up_and_run_the_demo_and_the_tests():
    """A fresh machine needs two commands (README), and CI runs exactly those on a clean clone;
    the set-up by hand is what ./dev does."""
    by_hand, (demo, tests) = _setup_blocks()
    dev = (ROOT / "dev").read_text("utf-8")
    assert by_hand[0].startswith("python3 -m venv .venv") and "python3 -m venv" in dev
    for step in by_hand[1].split("&&"):
        assert step.strip().replace("pip install", "-m pip install -q") in dev, step
    assert demo == "./dev python -m graphdispatch_backend demo" and tests == "./dev python -m pytest -q -n auto"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text("utf-8").splitlines()]
    assert tests in ci, "CI does not run the README's test command"
    assert any(line.startswith(demo) for line in ci), "CI does not run the README's demo command"
    assert f"`{tests}` is the suite CI runs" in README.split("## Testing", 1)[1]
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


def test_every_figure_in_the_readme_and_guides_names_its_command_and_date():
    """A measured figure (a decimal with a unit, or "under N MiB") is a promise: its bullet,
    paragraph or table row says the command that gives it and the date it was measured
    (the README and every guide the README text moved to; docs/design.md and the guides
    written before, fusion.md and several-gpus.md, state theirs in their own form)."""
    bare = [f"{name}: {u.strip()[:160]}" for name, text in DOCS.items()
            if name not in ("docs/design.md", "docs/fusion.md", "docs/several-gpus.md")
            for u in _prose_units(text)
            if FIGURE.search(u) and not (DATE.search(u) and re.search(r"`(python |bench/|\./dev|time )", u))]
    assert not bare, "figures without their command and date:\n" + "\n".join(bare)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    heads = re.findall(r"^#+ (.+)$", prose, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_link_in_the_readme_and_guides_resolves():
    """Every Markdown link to a file of the repository names one that exists, and an anchor
    one of its headings; none leaves the repository."""
    broken = []
    for name, text in DOCS.items():
        for target in LINK.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
            assert not target.startswith(("http:", "https:", "/")), f"{name}: {target}"
            path, _, anchor = target.partition("#")
            file = (ROOT / name).parent / path if path else ROOT / name
            if not file.resolve().is_relative_to(ROOT) or not file.exists():
                broken.append(f"{name}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text("utf-8")):
                broken.append(f"{name}: {target} (no such heading)")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def _table_keys(text: str, heading: str) -> list[str]:
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)


def test_both_options_tables_name_every_option():
    """The README's short table and the full one (docs/torch-compile-arguments.md) list every
    option Options takes, once, and nothing else; the turn-off table names options
    that exist."""
    from graphdispatch_backend.options import Options

    names = set(Options.names())
    guide = (ROOT / "docs" / "torch-compile-arguments.md").read_text("utf-8")
    for keys in (_table_keys(README, "## Options"), _table_keys(guide, "## Every option, in full")):
        assert len(keys) == len(set(keys)) and set(keys) == names, sorted(names ^ set(keys))
    off = README.split("## Turn each part off", 1)[1].split("\n## ", 1)[0]
    for key in re.findall(r"`([a-z_]+)=", off):
        assert key in names | {"backend"}, key


def test_every_fusion_status_and_kept_reason_is_explained():
    from graphdispatch_backend.errors import FusionStatus, KeptWhy

    guide = (ROOT / "docs" / "fusion.md").read_text("utf-8")
    for value in [s.value for s in FusionStatus] + [k.value for k in KeptWhy]:
        assert f"`{value}`" in guide and f"`{value}`" in DESIGN, value
