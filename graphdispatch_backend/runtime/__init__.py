"""The runtime: what runs a compiled graph's calls. Never edits a graph.

Its parts, lowest first; each may import the ones before it, never one after
(tests/test_layout.py):

- cudagraph/  the capture and replay engines (CUDA, and its CPU model), pools and streams;
- call/       what a call is: the placeholder contract, shape keys, the call's bookkeeping;
- checks/     comparing with eager and blaming a party: parity, prints and digests, the
              world a check puts back, private draws, the recheck schedules, the eager and
              gradient checks, culprit isolation;
- gates/      the artifacts at run time: each region's gate and its beside-run;
- runner/     a capturable piece's CUDA-graph state machine: capture, verify, replay;
- program/    the graph's callable: the contract-checked entry point, autograd, fusion.
"""
