"""Fusion: a graph's runs of exact ATen ops compiled by Inductor under an eager-numerics
recipe (recipe.py), cut out around what Inductor may not hold (segments.py), compiled one
segment at a time without touching Inductor's process-wide tables (inductor.py), and what
each graph learned kept on disk (verdicts.py).

Below the runtime in the pipeline: it imports capture/ and passes/, never runtime/. The
runtime decides when a graph is fused, checks it against eager like any lowering, and asks
for a recompile when a check found an op whose fused result differs (runtime/program/fused.py).
"""
