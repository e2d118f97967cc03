"""Artifacts at run time: each substituted region's gate (gate.py: parity on first calls,
re-checks on the artifact's schedule, demotion) and its run beside the native region
(beside.py). May import runtime/cudagraph, runtime/call and runtime/checks."""
