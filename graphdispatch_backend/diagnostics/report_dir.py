"""A report directory read back: `dispatch.json` (and `timing.json` when there is one).

`load` hands every reader (the report renderer, the artifact commands) the report with
each region entry whole (`expand`: the file keeps most of them brief, their kind's detail
once per fingerprint); `load_report` (public: `graphdispatch_backend.load_report`) is the
report alone, what `latest_report()` returned in the process that wrote it. A missing
directory, a missing `dispatch.json`, corrupt JSON or another schema is a ReportError that
says why; `run_command` prints it on stderr and exits 2. An unreadable `timing.json` is
said, not fatal. Nothing here imports torch.

Several ranks may share a directory (report_file.rank_file_names): `dispatch.json` is rank
0's (or a single process's), `dispatch.rankN.json` rank N's; every reader takes rank 0's
from the directory, and a rank's file, given as the path, reads like a directory
(`report DIR/dispatch.rank1.json`, `load_report(DIR, rank=1)`).
"""

from __future__ import annotations

import json
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphdispatch_backend.diagnostics.report_file import (
    RANK_REPORT,
    READABLE_SCHEMA_VERSIONS,
    REPORT_NAME,
    TIMING_NAME,
    expand,
    rank_file_names,
)
from graphdispatch_backend.errors import GraphDispatchError

TIMING_SCHEMA_VERSION = 1


class ReportError(GraphDispatchError):
    """The directory holds no report this graphdispatch can read; the message says why."""


def load_report(directory: str | Path, rank: int | None = None) -> dict[str, Any]:
    """The whole report of a report directory (`options={"report_dir": ...}`): what
    `graphdispatch_backend.latest_report()` returned in the process that wrote it, every
    region entry whole (the file keeps most of them brief). Where several ranks shared the
    directory, that is rank 0's; `rank=N` reads rank N's (`report["distributed"]` holds
    the rank and `world_size`). `directory` may also be one report file. Raises
    ReportError, saying why, for a directory that holds no readable report. Imports no torch.

        report = graphdispatch_backend.load_report("gd_out")
        for graph in report["graphs"]:
            print(graph["name"], graph["calls"], graph["cuda_graph"]["replays"])
    """
    return _report(report_path(directory, rank))


def load(directory: str | Path, rank: int | None = None) -> tuple[dict[str, Any], dict[str, Any] | None, str | None]:
    """(report, timing or None, why timing is missing or None)."""
    path = report_path(directory, rank)
    report = _report(path)
    timing_path = _timing_path(path)
    if timing_path is None or not timing_path.is_file():
        return report, None, f"no {timing_path.name if timing_path else TIMING_NAME}"
    try:
        timing = _read_json(timing_path)
    except ReportError as exc:
        return report, None, str(exc)
    if not isinstance(timing, dict) or timing.get("timing_schema_version") != TIMING_SCHEMA_VERSION:
        return report, None, f"{timing_path} is not timing_schema_version {TIMING_SCHEMA_VERSION}"
    return report, timing, None


def report_path(target: str | Path, rank: int | None = None) -> Path:
    """The report file a reader reads: `target`'s `dispatch.json` (rank N's own with
    `rank`), or `target` itself when it names a `.json` file."""
    target = Path(target)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ReportError(f"rank must be an integer >= 0, got {rank!r}")
    if target.suffix == ".json" and not target.is_dir():
        if rank is not None:
            raise ReportError(f"{target} is one report file: give its directory with rank={rank}, or the file alone")
        if not target.is_file():
            raise ReportError(f"report file {target} does not exist" + _present(target.parent))
        return target
    if not target.exists():
        raise ReportError(f"report directory {target} does not exist")
    if not target.is_dir():
        raise ReportError(f"{target} is not a directory (give the report_dir, which holds dispatch.json)")
    return target / rank_file_names(rank)[0]


def rank_reports(directory: str | Path) -> dict[int, Path]:
    """The report files of each rank `directory` holds: {0: dispatch.json, N: dispatch.rankN.json}."""
    folder = Path(directory)
    found = {0: folder / REPORT_NAME} if (folder / REPORT_NAME).is_file() else {}
    if folder.is_dir():
        for path in folder.iterdir():
            match = RANK_REPORT.fullmatch(path.name)
            if match and path.is_file():
                found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def _timing_path(path: Path) -> Path | None:
    """The timing file written beside a report file (`timing.rankN.json` beside rank N's)."""
    if path.name == REPORT_NAME:
        return path.with_name(TIMING_NAME)
    match = RANK_REPORT.fullmatch(path.name)
    return path.with_name(rank_file_names(int(match.group(1)))[1]) if match else None


def _present(folder: Path) -> str:
    """What else `folder` holds, for an error about a report it lacks: the ranks' files."""
    ranks = rank_reports(folder)
    if not ranks:
        return ""
    files = ", ".join(f"rank {r}: {p.name}" for r, p in ranks.items())
    return f"; it holds the reports of {files} (read one with load_report(DIR, rank=N) or `report DIR/FILE`)"


def _report(path: Path) -> dict[str, Any]:
    """The report file `path`, read, checked and expanded."""
    if not path.is_file():
        folder = path.parent
        if path.name == REPORT_NAME and not rank_reports(folder):
            raise ReportError(f"no dispatch.json in {folder}: run with options={{'report_dir': ...}} and call "
                              "graphdispatch_backend.flush() or let the process exit")
        raise ReportError(f"no {path.name} in {folder}" + _present(folder))
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
    path = Path(directory) / REPORT_NAME
    try:
        path = report_path(directory)
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
