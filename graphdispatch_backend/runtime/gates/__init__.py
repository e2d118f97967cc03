"""Artifacts at run time: each substituted region's gate (gate.py: which calls are judged,
parity on first calls, re-checks on the artifact's schedule), what a judged call means
(judge.py: a demotion or a pass) and its run beside the native region (beside.py, over
runtime/checks/side_by_side.py). May import runtime/cudagraph, runtime/call and runtime/checks."""
