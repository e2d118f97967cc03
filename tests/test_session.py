"""Sessions (graphdispatch_backend/session.py): `reset()` writes every session's report before
forgetting it, and ranks sharing a report_dir each write their own file, the report naming
its rank (rank 0, like a single process, keeps dispatch.json)."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import forked
import pytest
import torch

import graphdispatch_backend
import graphdispatch_backend.session as session_module

EMULATE = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1}


def _run(options: dict, calls: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    with torch.no_grad():
        for _ in range(calls):
            compiled(torch.randn(2, 8))


def _calls(folder: Path, name: str = "dispatch.json") -> list[int]:
    return [g["calls"] for g in json.loads((folder / name).read_text())["graphs"]]


# -- reset() ---------------------------------------------------------------------------------
def test_reset_writes_every_sessions_report_before_forgetting_it(tmp_path):
    """docs/diffusers.md calls reset() between runs: the calls made since the last compile
    must reach dispatch.json (the file said 0 calls before: written at compile only)."""
    _run({**EMULATE, "report_dir": str(tmp_path / "a")}, calls=5)
    _run({**EMULATE, "warmup": 2, "report_dir": str(tmp_path / "b")}, calls=3)  # a second session
    assert _calls(tmp_path / "a") == [0]  # written at compile time, not per call
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    assert _calls(tmp_path / "a") == [5] and _calls(tmp_path / "b") == [3]
    assert graphdispatch_backend.load_report(tmp_path / "a")["graphs"][0]["cuda_graph"]["replays"] == 3
    assert graphdispatch_backend.latest_report() is None  # forgotten all the same


def test_reset_warns_and_goes_on_when_a_report_cannot_be_written(tmp_path, monkeypatch, caplog):
    """An OSError flushing one session (its exports' directory gone) is a warning, as at exit:
    reset() does not raise, forgets it, and still writes the other sessions' reports."""
    _run({**EMULATE, "report_dir": str(tmp_path / "a")}, calls=2)
    _run({**EMULATE, "warmup": 2, "report_dir": str(tmp_path / "b")}, calls=4)
    first = next(iter(session_module._SESSIONS.values()))

    def vanished() -> None:
        raise FileNotFoundError(2, "No such file or directory", str(tmp_path / "a" / "regions"))

    monkeypatch.setattr(first, "flush", vanished)
    with caplog.at_level(logging.WARNING, logger="graphdispatch_backend"):
        graphdispatch_backend.reset()
    assert "could not write the report at reset()" in caplog.text and "regions" in caplog.text
    assert _calls(tmp_path / "b") == [4]
    assert graphdispatch_backend.latest_report() is None and not session_module._SESSIONS


def test_reset_with_an_unwritable_report_dir_does_not_raise(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    _run({**EMULATE, "report_dir": str(blocker / "gd")}, calls=2)
    with caplog.at_level(logging.WARNING, logger="graphdispatch_backend"):
        graphdispatch_backend.reset()
    assert graphdispatch_backend.latest_report() is None


# -- ranks -----------------------------------------------------------------------------------
RANK1 = {"rank": 1, "world_size": 2, "backend": "gloo"}


def test_a_single_process_writes_dispatch_json_and_records_no_rank(tmp_path):
    _run({**EMULATE, "report_dir": str(tmp_path)}, calls=2)
    graphdispatch_backend.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dispatch.json", "timing.json"]
    assert "distributed" not in graphdispatch_backend.latest_report()
    assert "distributed" not in json.loads((tmp_path / "dispatch.json").read_text())


def test_rank_1_writes_its_own_files_and_keeps_them_after_the_group_is_gone(tmp_path, monkeypatch):
    """The rank is read through session.process_rank (faked here): rank 1 of 2 writes
    dispatch.rank1.json and timing.rank1.json, never rank 0's dispatch.json, and still does
    once the process group is destroyed (the write at exit comes after it)."""
    monkeypatch.setattr(session_module, "process_rank", lambda: dict(RANK1))
    _run({**EMULATE, "report_dir": str(tmp_path)}, calls=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dispatch.rank1.json", "timing.rank1.json"]
    assert graphdispatch_backend.latest_report()["distributed"] == RANK1
    monkeypatch.setattr(session_module, "process_rank", lambda: None)  # destroy_process_group()
    graphdispatch_backend.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dispatch.rank1.json", "timing.rank1.json"]
    report = graphdispatch_backend.load_report(tmp_path, rank=1)
    assert report["distributed"] == RANK1 and [g["calls"] for g in report["graphs"]] == [3]
    assert json.loads((tmp_path / "timing.rank1.json").read_text())["timing_schema_version"] == 1


def test_rank_0_keeps_dispatch_json_and_records_its_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(session_module, "process_rank", lambda: {**RANK1, "rank": 0})
    _run({**EMULATE, "report_dir": str(tmp_path)}, calls=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dispatch.json", "timing.json"]
    assert graphdispatch_backend.load_report(tmp_path)["distributed"] == {**RANK1, "rank": 0}


def test_process_rank_is_none_without_torch_distributed():
    assert session_module.process_rank() is None


WORKER = textwrap.dedent('''
    import json, logging, sys
    import torch, torch.distributed as dist

    logging.disable(logging.WARNING)
    rank, world, init_file, out_path, report_dir = sys.argv[1:6]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"cuda_graphs": "emulate", "report_dir": report_dir})
    calls = 3 + 2 * rank  # the ranks' reports differ: neither may stand for the other
    with torch.no_grad():
        for _ in range(calls):
            compiled(torch.randn(2, 8))
    with open(out_path, "w") as fh:
        json.dump({"rank": rank, "calls": calls}, fh)
    dist.barrier()
    dist.destroy_process_group()
    # no flush(): the write at exit, after the group is gone, still goes to this rank's file
''')


@pytest.mark.distributed
def test_two_gloo_ranks_sharing_a_report_dir_each_keep_their_report(tmp_path, capsys):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    report_dir = tmp_path / "gd"
    # run_ranks passes MODE last: here it is the shared report_dir
    runs = forked.run_ranks(script, tmp_path, str(report_dir), world=2, timeout_s=900)
    for run in runs:
        assert run.returncode == 0, run.log
    assert sorted(p.name for p in report_dir.iterdir()) == [
        "dispatch.json", "dispatch.rank1.json", "timing.json", "timing.rank1.json"]
    for rank in (0, 1):
        report = graphdispatch_backend.load_report(report_dir, rank=rank)
        assert report["distributed"] == {"rank": rank, "world_size": 2, "backend": "gloo"}
        assert [g["calls"] for g in report["graphs"]] == [3 + 2 * rank]
    assert graphdispatch_backend.load_report(report_dir) == graphdispatch_backend.load_report(report_dir, rank=0)

    from graphdispatch_backend.__main__ import main

    assert main(["report", str(report_dir)]) == 0
    shown = capsys.readouterr().out
    assert "rank 0 of 2 (torch.distributed gloo)" in shown and "1 graph, 3 calls" in shown
    assert f"other ranks' reports here: rank 1 dispatch.rank1.json (render one: python -m graphdispatch_backend " \
           f"report {report_dir / 'dispatch.rank1.json'})" in shown
    assert main(["report", str(report_dir / "dispatch.rank1.json")]) == 0
    shown = capsys.readouterr().out
    assert "rank 1 of 2" in shown and "1 graph, 5 calls" in shown and "rank 0 dispatch.json" in shown


@pytest.mark.parametrize(("fuse", "says", "never"), [
    (True, "eager-numerics recipe", "tolerance's compile"),
    ({"rtol": 1e-3, "atol": 1e-5}, "tolerance's compile applies each one", "eager-numerics recipe"),
    (False, "change nothing here", "recipe")])
def test_inductor_keys_in_options_are_said_once_for_the_mode_given(caplog, fuse, says, never):
    """A framework (FastVideo) passes Inductor keys to every backend: the one line says what
    becomes of them in the mode given; a tolerance has no eager-numerics recipe to speak of."""
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="graphdispatch_backend"):
        _run({"cuda_graphs": False, "fuse": fuse, "cache_dir": False, "emulate_precision_casts": True}, 1)
    said = [r.getMessage() for r in caplog.records if "Inductor settings" in r.getMessage()]
    assert len(said) == 1 and says in said[0] and never not in said[0], said


def test_two_option_sets_sharing_a_report_dir_are_warned_of(tmp_path, caplog):
    """Two models compiled with different options in one process are two sessions, each
    writing dispatch.json: sharing a report_dir, the file holds whichever wrote last. The
    second compile says so, once; one option set (or separate folders) says nothing."""
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    shared, own = str(tmp_path / "shared"), str(tmp_path / "own")
    with caplog.at_level(logging.WARNING, logger="graphdispatch_backend"):
        _run({"cuda_graphs": "emulate", "report_dir": shared}, 2)
        _run({"cuda_graphs": "emulate", "report_dir": own, "warmup": 1}, 2)
        assert "share report_dir" not in caplog.text
        _run({"cuda_graphs": False, "report_dir": shared}, 2)
        _run({"cuda_graphs": False, "report_dir": shared}, 2)
    assert caplog.text.count("share report_dir") == 1, caplog.text
    assert graphdispatch_backend.latest_report()["options"]["cuda_graphs"] is False  # the session compiled last
