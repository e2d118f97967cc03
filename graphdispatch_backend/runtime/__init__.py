"""The runtime: placeholder contract, artifact gates, CUDA-graph runners. Never edits a graph."""
