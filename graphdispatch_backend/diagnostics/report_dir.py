"""A report directory read back: `dispatch.json` (and `timing.json` when there is one).

`load` hands every reader (the report renderer, the artifact commands) the report with
each region entry whole (`expand`: the file keeps most of them brief, their kind's detail
once per fingerprint); `load_report` (public: `graphdispatch_backend.load_report`) is the
report alone, what `latest_report()` returned in the process that wrote it. A missing
directory, a missing `dispatch.json`, corrupt JSON or another schema is a ReportError that
says why; `run_command` prints it on stderr and exits 2. An unreadable `timing.json` is
said, not fatal. Nothing here imports torch.
"""

from __future__ import annotations

import json
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphdispatch_backend.diagnostics.report_file import READABLE_SCHEMA_VERSIONS, expand
from graphdispatch_backend.errors import GraphDispatchError

TIMING_SCHEMA_VERSION = 1


class ReportError(GraphDispatchError):
    """The directory holds no report this graphdispatch can read; the message says why."""


def load_report(directory: str | Path) -> dict[str, Any]:
    """The whole report of a report directory (`options={"report_dir": ...}`): what
    `graphdispatch_backend.latest_report()` returned in the process that wrote it, every
    region entry whole (the file keeps most of them brief). Raises ReportError, saying
    why, for a directory that holds no readable report. Imports no torch.

        report = graphdispatch_backend.load_report("gd_out")
        for graph in report["graphs"]:
            print(graph["name"], graph["calls"], graph["cuda_graph"]["replays"])
    """
    return _report(Path(directory))


def load(directory: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None, str | None]:
    """(report, timing or None, why timing is missing or None)."""
    folder = Path(directory)
    report = _report(folder)
    timing_path = folder / "timing.json"
    if not timing_path.is_file():
        return report, None, "no timing.json"
    try:
        timing = _read_json(timing_path)
    except ReportError as exc:
        return report, None, str(exc)
    if not isinstance(timing, dict) or timing.get("timing_schema_version") != TIMING_SCHEMA_VERSION:
        return report, None, f"{timing_path} is not timing_schema_version {TIMING_SCHEMA_VERSION}"
    return report, timing, None


def _report(folder: Path) -> dict[str, Any]:
    """`folder`'s dispatch.json, read, checked and expanded."""
    path = folder / "dispatch.json"
    if not folder.exists():
        raise ReportError(f"report directory {folder} does not exist")
    if not folder.is_dir():
        raise ReportError(f"{folder} is not a directory (give the report_dir, which holds dispatch.json)")
    if not path.is_file():
        raise ReportError(f"no dispatch.json in {folder}: run with options={{'report_dir': ...}} and call "
                          "graphdispatch_backend.flush() or let the process exit")
    report = _read_json(path)
    if not isinstance(report, dict) or "schema_version" not in report:
        raise ReportError(f"{path} is not a graphdispatch report (no schema_version)")
    if report["schema_version"] not in READABLE_SCHEMA_VERSIONS:
        raise ReportError(f"{path} has schema_version {report['schema_version']!r}; this graphdispatch reads "
                          f"schema_version {' or '.join(map(str, READABLE_SCHEMA_VERSIONS))}")
    if not isinstance(report.get("graphs"), list):
        raise ReportError(f"{path} is not a graphdispatch report (graphs[] is missing)")
    return _expanded(report, path)


def _expanded(report: dict[str, Any], path: Path) -> dict[str, Any]:
    """Every region entry whole (the file keeps most of them brief: diagnostics/report.py)."""
    try:
        return expand(report)
    except (KeyError, TypeError, AttributeError, ValueError, zlib.error) as exc:
        raise ReportError(f"{path} holds region detail that does not decode ({type(exc).__name__}: {exc}); "
                          "was it edited by hand?") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text("utf-8"))
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path} is not valid JSON ({exc}); was it copied while being written?") from None


def run_command(directory: str, text_of: Callable[[dict[str, Any], Any, bool, str], str], reader: str) -> int:
    """Load `directory`'s report, print what `text_of(report, timing, timing_missing,
    source)` makes of it; a missing, foreign or mistyped report is one error line and exit
    status 2 (`reader`: what reads the fields, for the message)."""
    path = Path(directory) / "dispatch.json"
    try:
        report, timing, missing = load(directory)
        text = text_of(report, timing, missing, str(path))
    except ReportError as exc:
        print(f"graphdispatch report: error: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        print(f"graphdispatch report: error: {path} is missing or mistypes a field {reader} needs "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print(text)
    return 0
