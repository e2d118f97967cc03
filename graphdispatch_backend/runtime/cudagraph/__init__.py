"""Capture and replay engines (CUDA, and its CPU model), their memory pools and streams."""
