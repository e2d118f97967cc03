"""The CUDA-graph runner of one capturable piece: entries, capture, verification, replay.
May import runtime/cudagraph, runtime/call and runtime/checks; not the gates or the program."""

from graphdispatch_backend.runtime.runner.phase import State
from graphdispatch_backend.runtime.runner.runner import NOT_DISTINCT_LIMIT, GraphRunner
from graphdispatch_backend.runtime.runner.scope import RuntimeScope

__all__ = ["NOT_DISTINCT_LIMIT", "GraphRunner", "RuntimeScope", "State"]
