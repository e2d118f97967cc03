"""What an autograd graph's forward and backward callables need beyond an inference graph's.

aot runs both inside its `autograd.Function`, under no_grad, and compiles the backward
lazily, inside the user's first `backward()`. So:

- `without_history`: were grad mode on inside the lowered graph anyway, a replay would
  hand out tensors without the autograd history the lowered graph records; that call runs
  the lowered graph, not captured (`autograd`). One check of a C flag per call.
- `backward_fallback`: a backward graphdispatch could not build runs as aot lowered it,
  every run counted `backend_error`: the failure never raises into the user's backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.record_fields import failed
from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.call.calls import mark_eager

AUTOGRAD_DETAIL = ("grad mode was on inside the lowered graph, where a replay would record no autograd history: "
                   "the lowered forward and backward run, not captured")


def without_history(run: Callable[..., Any], lowered: Callable[..., Any], events: Events,
                    record: GraphRecord) -> Callable[..., Any]:
    """`run` (whose pieces may replay) while grad mode is off, else `lowered`."""
    is_grad_enabled = torch.is_grad_enabled

    def call(*args: Any) -> Any:
        if not is_grad_enabled():
            return run(*args)
        mark_eager(Decline.AUTOGRAD.value)
        events.warn_once(f"autograd:{record.name}", "graphdispatch: %s ran eager (autograd): %s", record.name,
                         AUTOGRAD_DETAIL)
        return lowered(*args)

    return call


def backward_fallback(events: Events, record: GraphRecord, lowered: fx.GraphModule,
                      exc: Exception) -> Callable[[list[Any]], Any]:
    """The lowered backward as aot made it (`lowered`, copied before any pass ran), for
    aot's boxed calling convention; `record` says why."""
    error = failed(record, exc, whole=False)
    events.warn_once(f"backend_error:backward:{type(exc).__name__}",
                     "graphdispatch: %s runs as aot lowered it because compiling it failed: %s", record.name, error)
    run = lowered.forward

    def call(args: list[Any]) -> Any:
        out = run(*args)
        record.called(False, Decline.BACKEND_ERROR.value)
        return out

    call._boxed_call = True  # type: ignore[attr-defined]  # aot hands over its argument list
    return call
