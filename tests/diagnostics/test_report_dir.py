"""A report directory read back with several ranks' reports in it (report_dir.py): rank 0's
`dispatch.json` is what every reader takes by default, `load_report(DIR, rank=N)` or a rank's
file given as the path reads rank N's (with its own timing file), and a missing rank is a
ReportError naming the ranks the directory holds. The files are written as a session writes
them (SessionReport.write, report_file.rank_file_names); tests/test_session.py runs 2 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import graphdispatch_backend
from graphdispatch_backend import ReportError
from graphdispatch_backend.__main__ import main
from graphdispatch_backend.diagnostics.report_dir import load, rank_reports
from graphdispatch_backend.diagnostics.report_file import rank_file_names, write_json_atomic
from graphdispatch_backend.diagnostics.session_report import SessionReport


def _write_rank(folder: Path, rank: int, world: int = 3, calls: int = 0) -> None:
    report = SessionReport(options={"cuda_graphs": "emulate"},
                           distributed={"rank": rank, "world_size": world, "backend": "gloo"})
    record = report.new_graph()
    for _ in range(calls):
        record.called(False, "warmup")
    report_name, timing_name = rank_file_names(rank)
    report.write(folder, report_name)
    write_json_atomic(folder / timing_name, {"timing_schema_version": 1, "mode": f"rank{rank}", "phases": {}})


@pytest.fixture
def ranks_dir(tmp_path: Path) -> Path:
    for rank in range(3):
        _write_rank(tmp_path, rank, calls=rank + 1)
    return tmp_path


def test_file_names_per_rank():
    assert rank_file_names(None) == rank_file_names(0) == ("dispatch.json", "timing.json")
    assert rank_file_names(2) == ("dispatch.rank2.json", "timing.rank2.json")


def test_rank_0_by_default_and_each_rank_by_number_or_by_file(ranks_dir):
    assert sorted(p.name for p in ranks_dir.iterdir()) == [
        "dispatch.json", "dispatch.rank1.json", "dispatch.rank2.json",
        "timing.json", "timing.rank1.json", "timing.rank2.json"]
    assert graphdispatch_backend.load_report(ranks_dir)["distributed"]["rank"] == 0
    for rank in range(3):
        report = graphdispatch_backend.load_report(ranks_dir, rank=rank)
        assert report["distributed"] == {"rank": rank, "world_size": 3, "backend": "gloo"}
        assert report["graphs"][0]["calls"] == rank + 1
        assert graphdispatch_backend.load_report(ranks_dir / rank_file_names(rank)[0]) == report
        _, timing, missing = load(ranks_dir, rank=rank)  # each rank's timing beside its report
        assert missing is None and timing["mode"] == f"rank{rank}"
    assert rank_reports(ranks_dir) == {r: ranks_dir / rank_file_names(r)[0] for r in range(3)}


def test_a_missing_rank_names_the_ranks_there(ranks_dir):
    with pytest.raises(ReportError, match=r"no dispatch\.rank5\.json in .*rank 0: dispatch\.json, "
                                          r"rank 1: dispatch\.rank1\.json, rank 2: dispatch\.rank2\.json"):
        graphdispatch_backend.load_report(ranks_dir, rank=5)
    (ranks_dir / "dispatch.json").unlink()  # rank 0 died before writing
    with pytest.raises(ReportError, match=r"no dispatch\.json in .*rank 1: dispatch\.rank1\.json.*rank=N"):
        graphdispatch_backend.load_report(ranks_dir)
    with pytest.raises(ReportError, match="rank must be an integer >= 0"):
        graphdispatch_backend.load_report(ranks_dir, rank=-1)
    with pytest.raises(ReportError, match="one report file"):
        graphdispatch_backend.load_report(ranks_dir / "dispatch.rank1.json", rank=1)


def test_report_renders_rank_0_and_names_the_other_ranks_files(ranks_dir, capsys):
    assert main(["report", str(ranks_dir)]) == 0
    out = capsys.readouterr().out
    assert "rank 0 of 3 (torch.distributed gloo)" in out.splitlines()
    assert (f"other ranks' reports here: rank 1 dispatch.rank1.json, rank 2 dispatch.rank2.json (render one: "
            f"python -m graphdispatch_backend report {ranks_dir / 'dispatch.rank1.json'})") in out.splitlines()
    assert "1 graph, 1 call:" in out and "timing='rank0'" in out
    assert main(["report", str(ranks_dir / "dispatch.rank2.json")]) == 0
    out = capsys.readouterr().out
    assert f"graphdispatch report ({ranks_dir / 'dispatch.rank2.json'})" in out and "rank 2 of 3" in out
    assert "1 graph, 3 calls:" in out and "timing='rank2'" in out
    assert "rank 0 dispatch.json, rank 1 dispatch.rank1.json (render one" in out
    assert main(["report", str(ranks_dir / "dispatch.rank1.json"), "--regions"]) == 0  # the catalog too
    assert "dispatch.rank1.json" in capsys.readouterr().out


def test_a_single_process_report_says_nothing_of_ranks(tmp_path, capsys):
    SessionReport(options={}).write(tmp_path)
    assert "distributed" not in json.loads((tmp_path / "dispatch.json").read_text())
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rank" not in out.split("\nSummary", 1)[0]
