"""Reference: eager's side of one check of the whole graph against eager (runtime/checks/eager_check.py).

Eager's outputs, or (`lean`: the graph's outputs are large) their print (runtime/checks/prints.py)
and, once a mismatch made eager run again, that second run's outputs: compared with the
compiled call's, with eager's second run, and handed back as the call's answer with the
world as eager left it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.errors import Contain
from graphdispatch_backend.runtime.checks.draws import Start, privately
from graphdispatch_backend.runtime.checks.parity import Mismatch, compare, compare_aliasing
from graphdispatch_backend.runtime.checks.prints import Printed, differs, take_print
from graphdispatch_backend.runtime.checks.side_by_side import REFERENCE, SideBySide


def flat(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


class Reference:
    """Eager's side of one check: its outputs, or (`lean`) their print and, once a mismatch
    made eager run again, that second run's outputs (see `_check`)."""

    def __init__(self, raw: Any, args: Sequence[Any], lean: bool, contain: Contain, start: Start | None,
                 skip: frozenset[int] = frozenset()) -> None:
        self._args = args
        self._skip = skip  # outputs made uninitialized and never written: their values are nobody's
        self._start = start  # the graph draws: every extra run draws from private copies (runtime/checks/draws.py)
        self._raw: Any = raw
        self._printed: Printed | None = None
        self._second: list[Any] | None = None  # eager's second run (lean): answers and details
        self._got: list[Any] | None = None
        if lean:  # printed at once: an output may view an input the world puts back
            printed, exc = contain(lambda: take_print(flat(raw), args, skip))
            if exc is None:  # else the outputs stay: a print is a saving, never a requirement
                self._printed = printed

    def drop(self) -> None:
        """Free the outputs once printed (the compiled run holds no second set)."""
        if self._printed is not None:
            self._raw = None

    def extra(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return privately(self._start, fn)

    @property
    def outputs(self) -> list[Any]:
        return flat(self._raw)

    def compare(self, got: list[Any], tolerance: Any = None) -> Mismatch | None:
        """The served call's outputs against eager's: bit for bit, or within a fused graph's
        declared tolerance (runtime/checks/tolerance.py; its checks are never lean)."""
        self._got = got
        if self._raw is None and self._printed is not None:
            return differs(self._printed, got, self._args)
        expected = flat(self._raw)
        values = tolerance.compare(expected, got, skip=self._skip) if tolerance is not None \
            else compare(expected, got, skip=self._skip)
        return values or compare_aliasing(expected, got, self._args)

    def again(self, second: list[Any]) -> Mismatch | None:
        """Eager's second run against its first."""
        if self._raw is None and self._printed is not None:
            self._second = second
            return differs(self._printed, second, self._args)
        return compare(flat(self._raw), second, skip=self._skip)

    def forget_second(self) -> None:
        """Eager's second run disagreed with its first, whose world is put back: the answer
        runs eager once more (`answer`)."""
        self._second = None

    def detail(self, detail: str) -> str:
        """A lean mismatch's detail, with values (max abs diff, first index) from eager's
        second run, which agreed with its first."""
        if self._second is None or self._got is None:
            return detail
        full = compare(self._second, self._got, skip=self._skip) or compare_aliasing(self._second, self._got,
                                                                                      self._args)
        return f"differs from eager: {full}" if full is not None else detail

    def answer(self, eager: Callable[..., Any], side: SideBySide, own: Callable[[Callable[[], Any]], None]) -> Any:
        """Eager's outputs, with the world as eager left it: kept, or run again (`own` runs
        graphdispatch's own steps, contained). Run again where its outputs record autograd
        history and the graph writes its inputs: putting eager's world back writes them in
        place, and a backward that saved them (a batch norm's running statistics) would
        raise on their version counters in the user's `backward()`."""
        if self._start is not None:  # the user's generators as eager leaves them (runtime/checks/draws.py)
            own(self._start.settle)
        if self._raw is not None and not (side.writes_inputs and _records_history(self._raw)):
            own(lambda: side.back(REFERENCE))
            return self._raw
        if self._second is not None:  # eager's second run agreed with its first: its outputs answer
            return tuple(self._second)
        own(side.back)
        return eager(*self._args)


def _records_history(raw: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in flat(raw))
