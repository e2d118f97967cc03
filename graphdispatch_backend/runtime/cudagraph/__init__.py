"""Capture and replay engines (CUDA, and its CPU model), their memory pools and streams.
The lowest part of the runtime: imports none of the others."""
