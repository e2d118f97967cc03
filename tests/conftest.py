"""Shared fixtures. CPU by default; `@pytest.mark.cuda` tests skip without a GPU.

The reliability suite's counters are here too: every fuzz example, differential case and
injected fault increments one; the totals are printed at the end of the run (section
"reliability counts"), so a CI log says how many cases ran with zero wrong outputs. Under
xdist (`-n`) each worker hands its counts to the main process when it finishes, which
prints them: this file is the one conftest the main process loads.
"""

from __future__ import annotations

import gc
import logging
from collections import Counter, defaultdict
from typing import Any

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.table import table


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run the larger fuzz/differential sweeps")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_slow = pytest.mark.skip(reason="larger sweep: pass --run-slow")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def _fresh_state():
    """Every test starts with no compiled code and no graphdispatch session: Dynamo's
    cache would otherwise reuse a graph compiled by an earlier test (and its
    cache_size_limit would start refusing recompiles), and sessions are per Options."""
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    yield
    torch._dynamo.reset()
    graphdispatch_backend.reset()


@pytest.fixture
def two_fake_ranks():
    """A process group of 2 ranks that communicates nothing (torch's fake backend), in this
    process: enough to trace collectives and build DTensors."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def gd_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="graphdispatch_backend")
    return caplog


# -- reliability counts ----------------------------------------------------------------------

_COUNTS: Counter[str] = Counter()
_OPDB: list[dict[str, Any]] = []  # one record per op_db sample (test_opdb.py)


@pytest.fixture(scope="session")
def counts() -> Counter[str]:
    """Session-wide counters: fuzz_cases, differential_cases, injected_faults, ..."""
    return _COUNTS


@pytest.fixture(scope="session")
def opdb_records() -> list[dict[str, Any]]:
    """One dict per op_db sample that ran: op, dtype, category, outcomes, report excerpt."""
    return _OPDB


def opdb_table(records: list[dict[str, Any]]) -> list[str]:
    """Samples per category and dtype, then every failure and excused difference, by op."""
    def column(r: dict[str, Any]) -> str:  # a dtype, and " fuse" for the fused runs
        return r.get("column", r["dtype"])

    dtypes = sorted({column(r) for r in records})
    per: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for r in records:
        per[r["category"]][column(r)] += 1
    rows = [[cat, *(per[cat][d] for d in dtypes)] for cat in sorted(per)]
    rows.append(["samples", *(sum(1 for r in records if column(r) == d) for d in dtypes)])
    rows.append(["OpInfos", *(len({r["op"] for r in records if column(r) == d}) for d in dtypes)])
    rows.append(["seconds", *(round(sum(r["seconds"] for r in records if column(r) == d)) for d in dtypes)])
    lines = table(["op_db sample", *dtypes], rows).splitlines()
    failed = [(r, [o for o in r["outcomes"] if o["excuse"] is None]) for r in records]
    if any(outcomes for _, outcomes in failed):
        lines.append("failures (graphdispatch differs from eager where aot_eager does not), per sample:")
    for r, outcomes in failed:
        for kind in sorted({o["kind"] for o in outcomes}):
            hits = [o for o in outcomes if o["kind"] == kind]
            calls = ", ".join(str(o["call"]) for o in hits)
            lines.append(f"  {r['op']} {column(r)} sample {r['sample']} calls {calls}: {kind}: {hits[0]['text']}")
    # excused differences: one line per op, dtype and excuse (a full sweep has many)
    excused: defaultdict[tuple[str, str, str], list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    for r in records:
        for o in r["outcomes"]:
            if o["excuse"] is not None:
                excused[(r["op"], column(r), o["excuse"])].append((r, o))
    if excused:
        lines.append("excused (graphdispatch differs from eager, and so does the control):")
    for (op, dtype, why), hits in sorted(excused.items()):
        r, o = hits[0]
        samples = len({h[0]["sample"] for h in hits})
        lines.append(f"  {op} {dtype}: {why}: {len(hits)} calls in {samples} samples; first: sample {r['sample']} "
                     f"call {o['call']}: {o['kind']}: {o['text']}")
    return lines


def pytest_sessionfinish(session: pytest.Session) -> None:
    output = getattr(session.config, "workeroutput", None)
    if output is not None:  # an xdist worker: its figures go to the main process
        output["gd_counts"] = dict(_COUNTS)
        output["gd_opdb"] = list(_OPDB)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's main process: add a finished worker's figures to the totals."""
    output = getattr(node, "workeroutput", {})
    _COUNTS.update(output.get("gd_counts", {}))
    _OPDB.extend(output.get("gd_opdb", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _OPDB:
        terminalreporter.section("op_db differential (test_opdb.py)")
        for line in opdb_table(_OPDB):
            terminalreporter.write_line(line)
    if not _COUNTS:
        return
    terminalreporter.section("reliability counts")
    fuzz = sum(v for k, v in _COUNTS.items() if k.startswith("fuzz_cases:"))
    if fuzz:
        terminalreporter.write_line(f"fuzz_cases (total): {fuzz}")
    for key, value in sorted(_COUNTS.items()):
        terminalreporter.write_line(f"{key}: {value}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Once every test module is imported (torch, transformers, diffusers: several hundred thousand
    objects that live as long as the process), Python's collector is told to leave them out
    of its passes (`gc.freeze`), and to run its young passes less often. Each full pass over
    that heap cost about 0.2 s, and a compile makes several: 13% of the test process's CPU on
    two fusion family tests, 3% of the whole suite's (2026-12-07). The suite's process only:
    the package never changes the collector, and a test that needs garbage gone calls
    `gc.collect()`, which still collects all but the frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
