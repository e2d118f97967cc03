"""Comparing with eager and blaming a party: one side-by-side comparison of a reference and
a candidate, every judge's (side_by_side.py: the world, the comparison, the rerun), parity
and prints of outputs (parity.py, prints.py, digest.py), the world a check snapshots and
puts back (world.py), private random draws (draws.py), when to check (schedule.py), ranks
agreeing on a verdict (agree.py), the eager and gradient checks of a served call
(eager_check.py, autograd_check.py) and what the eager check's verdicts do (lowering.py),
culprit isolation (isolate.py) and the modes it sets for the gates (modes.py), the op named
when eager disagrees with itself (suspects.py). May import
runtime/cudagraph and runtime/call; never the gates, the runner or the program."""
