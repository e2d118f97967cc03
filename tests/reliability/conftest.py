"""The reliability suite's hypothesis profile. Its case counters (`counts`, `opdb_records`)
and their end-of-run sections live in tests/conftest.py, which the test runner's main
process loads even when xdist workers run the tests. Sizes scale with environment
variables (GD_FUZZ_SCALE, GD_DIFF_CASES) or `--run-slow` (tests marked slow), never silently.
"""

from __future__ import annotations

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
