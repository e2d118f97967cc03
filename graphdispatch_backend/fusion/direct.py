"""Direct: a segment compiled as Inductor compiles it, called past aot's runtime wrapper.

`compile_fx` hands a tolerance segment's code back inside aot's runtime wrapper and Dynamo's
`disable` frame (torch/_functorch/_aot_autograd/runtime_wrappers.py `runtime_wrapper`):
they replay input mutations and regenerate output aliases from aot's metadata. A segment
writes no input and returns its views to ATen calls after it (fusion/segments.py keeps both
outside), so the wrapper changes nothing there, yet it cost 18-24 us a call inside a tiny
Mistral's and CogVideoX's call (the model's kernels evict its Python frames between calls;
5% of a call of those configs). `Direct` calls Inductor's compiled graph itself (its boxed
call, a list of inputs, as aot calls it) once its first call showed it returns what the
wrapper returns: the same outputs, each with the wrapper's shape, strides, offset, dtype
and bits, aliased alike (with each other and with the inputs). A first call that differs
in any of these, or raises, keeps every call on the wrapper; so does a first call made
while CUDA captures a graph (comparing would synchronize).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

# what Inductor's code raises on inputs it was not compiled for (torch's errors, a wrong count)
_REFUSED = (RuntimeError, TypeError, ValueError, IndexError)


class Direct:
    """A segment's run: the wrapper until the first call shows the compiled graph alone
    returns the same, then the compiled graph alone. `direct`: None until shown, then
    whether calls go past the wrapper."""

    def __init__(self, wrapped: Callable[..., Any], inner: Callable[[list[Any]], Any]) -> None:
        self._wrapped = wrapped
        self._inner = inner
        self._lock = threading.Lock()
        self.direct: bool | None = None

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        if self.direct:
            return tuple(self._inner(list(args)))  # the boxed call empties the list it is given
        want = tuple(self._wrapped(*args))
        if self.direct is None and not _capturing():
            with self._lock:
                if self.direct is None:
                    self.direct = _same(args, want, self._alone(args))
        return want

    def _alone(self, args: Sequence[Any]) -> tuple[Any, ...] | None:
        try:
            return tuple(self._inner(list(args)))
        except _REFUSED:
            return None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _same(args: Sequence[Any], want: tuple[Any, ...], got: tuple[Any, ...] | None) -> bool:
    """`got` is `want` in everything a caller can see: count, types, layouts, bits, and
    which outputs share memory with each other or with an input."""
    if got is None or len(got) != len(want):
        return False
    for a, b in zip(want, got):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if not isinstance(a, torch.Tensor):
            if a != b:
                return False
            continue
        if (a.shape, a.stride(), a.storage_offset(), a.dtype, a.device) != (
                b.shape, b.stride(), b.storage_offset(), b.dtype, b.device) or not _bits_equal(a, b):
            return False
    inputs = [t for t in args if isinstance(t, torch.Tensor)]
    return _sharing(inputs, want) == _sharing(inputs, got)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _sharing(inputs: list[torch.Tensor], outs: tuple[Any, ...]) -> list[tuple[int, int]]:
    """Pairs (output i, j) that share memory, j an output after i or (as -1 - k) input k."""
    def storage(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr() if t.numel() else -1

    tensors = [(i, storage(t)) for i, t in enumerate(outs) if isinstance(t, torch.Tensor)]
    held = [storage(t) for t in inputs]
    pairs = [(i, j) for n, (i, s) in enumerate(tensors) for j, r in tensors[n + 1:] if s == r != -1]
    return pairs + [(i, -1 - k) for i, s in tensors for k, r in enumerate(held) if s == r != -1]
