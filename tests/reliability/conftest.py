"""Shared pieces of the reliability suite: case counters and the hypothesis profile.

Every fuzz example, differential case and injected fault increments a counter; the totals
are printed at the end of the run (section "reliability counts"), so a CI log says how many
cases ran with zero wrong outputs. Sizes scale with environment variables (GD_FUZZ_SCALE,
GD_DIFF_CASES) or `--run-slow` (tests marked slow), never silently.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings

# Deterministic for CI: derandomized, no deadline (compiles are slow and vary), no example
# database (a failure must reproduce from the code alone, not from a local cache).
settings.register_profile(
    "gd_reliability",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    # the only function-scoped fixtures used with @given hand out fresh folders per example
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

_COUNTS: Counter[str] = Counter()


@pytest.fixture(scope="session")
def counts() -> Counter[str]:
    """Session-wide counters: fuzz_cases, differential_cases, injected_faults, ..."""
    return _COUNTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _COUNTS:
        return
    terminalreporter.section("reliability counts")
    fuzz = sum(v for k, v in _COUNTS.items() if k.startswith("fuzz_cases:"))
    if fuzz:
        terminalreporter.write_line(f"fuzz_cases (total): {fuzz}")
    for key, value in sorted(_COUNTS.items()):
        terminalreporter.write_line(f"{key}: {value}")
