"""Shared fixtures. CPU by default; `@pytest.mark.cuda` tests skip without a GPU."""

from __future__ import annotations

import logging

import pytest
import torch

import graphdispatch_backend


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
def gd_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="graphdispatch_backend")
    return caplog

