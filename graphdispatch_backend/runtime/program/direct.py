"""Direct: a tolerance segment's Inductor code called past aot's runtime wrapper.

`compile_fx` hands a tolerance segment's code back inside aot's runtime wrapper and Dynamo's
`disable` frame (torch/_functorch/_aot_autograd/runtime_wrappers.py `runtime_wrapper`):
they replay input mutations and regenerate output aliases from aot's metadata. A segment
writes no input and returns its views to ATen calls after it (fusion/segments.py keeps both
outside), so the wrapper changes nothing there, yet it cost 18-24 us a call inside a tiny
Mistral's and CogVideoX's call (the model's kernels evict its Python frames between calls;
5% of a call of those configs). `Direct` calls Inductor's compiled graph alone
(`CompiledSegment.alone`: its boxed call, a list of inputs, as aot calls it) once its first
call showed it returns what the wrapper returns: compared as a check compares
(runtime/checks/parity.py: count, types, shapes, dtypes, strides, bits; aliasing with each
other and with the inputs), and the storage offsets. A first call that differs in any of
these, or raises, keeps every call on the wrapper; so does a first call made while CUDA
captures a graph (comparing would synchronize).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.runtime.checks.parity import compare, compare_aliasing

# what Inductor's code raises on inputs it was not compiled for (torch's errors, a wrong count)
_REFUSED = (RuntimeError, TypeError, ValueError, IndexError)


class Direct:
    """A segment's run: the wrapper until the first call shows the compiled graph alone
    returns the same, then the compiled graph alone. `direct`: None until shown, then
    whether calls go past the wrapper."""

    def __init__(self, wrapped: Callable[..., Any], alone: Callable[[list[Any]], Any]) -> None:
        self._wrapped = wrapped
        self._alone = alone
        self._lock = threading.Lock()
        self.direct: bool | None = None

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        if self.direct:
            return tuple(self._alone(list(args)))  # the boxed call empties the list it is given
        want = tuple(self._wrapped(*args))
        if self.direct is None and not _capturing():
            with self._lock:
                if self.direct is None:
                    self.direct = _same(args, want, self._try(args))
        return want

    def _try(self, args: Sequence[Any]) -> tuple[Any, ...] | None:
        try:
            return tuple(self._alone(list(args)))
        except _REFUSED:
            return None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _same(args: Sequence[Any], want: tuple[Any, ...], got: tuple[Any, ...] | None) -> bool:
    """`got` stands in for `want` in everything a caller can see."""
    if got is None or compare(want, got) is not None or compare_aliasing(want, got, args) is not None:
        return False
    return [t.storage_offset() for t in want if isinstance(t, torch.Tensor)] == [
        t.storage_offset() for t in got if isinstance(t, torch.Tensor)]
