"""Forget the call stacks torch's compile metrics keep, so compiled graphs can be freed.

torch 2.13's compile metrics (`torch._dynamo.utils.get_metrics_context()`, one per thread)
record a CapturedTraceback with every metric a compile sets (`MetricsContext._edits`), to
name the earlier setter if a metric is set twice within one compile, and never drop them
once the compile is over. A traceback holds the code objects of its frames from C, where
no garbage collection sees them. Dynamo keeps a compiled function in the module's globals
until the transformed code it made for that frame dies (a CleanupHook), so a compile that
runs while a transformed frame is on the stack keeps that frame's code, and with it the
compiled graph, its runners and their captures, for the process (aot_eager's graphs too,
without captures to speak of). Two compiles do: the frame Dynamo compiles after a graph
break, called from the transformed frame before it, and the backward aot compiles lazily,
on its first run, which for the gradient check (runtime/checks/autograd_check.py) is inside the
compiled forward's call.

`forget_compile_stacks()` drops the recorded stacks of the current thread once no compile
is in progress on it (they serve only an error inside one). It runs on each graph's first
call (runtime/program/program.py), which follows the compile that made it and any compile run
before it from a transformed frame: a lazily compiled backward's first run comes right
after its compile, inside the gradient check.
"""

from __future__ import annotations

import torch
import torch._dynamo.utils


def forget_compile_stacks() -> None:
    """Drop the current thread's recorded compile stacks, unless a compile is in progress."""
    metrics = getattr(torch._dynamo.utils, "get_metrics_context", None)  # torch 2.13's; another may lack it
    context = metrics() if metrics is not None else None
    edits = getattr(context, "_edits", None)
    if isinstance(edits, list) and edits and not context.in_progress():  # type: ignore[union-attr]
        edits.clear()
