"""Draws: an extra run's random numbers, drawn from a private copy of the RNG.

The eager check runs the graph twice for one call (eager's reference, then the compiled
run that answers): both must see the same random numbers, and the user's generator must
advance once, as in eager. Putting the global state back after the reference run would
do that for this thread, but would also rewind what another thread drew meanwhile (its
numbers drawn again, by whoever draws next). Instead the reference run (and every other
extra run of the call) draws from private generators that start where the global ones
stood as the call began (`Start`); the global generators are left alone for the run that
answers, and for every other thread. Where eager's outputs answer instead (a verdict, once
per graph), the compiled run drew from the user's generators and may have stopped short
(it raised) or drawn otherwise: they are then set where eager's run left its copies
(`Start.settle`); the same where the compiled run raises on an unchecked call, back to
where the call began before the Dynamo graph answers (`Start.restore`). Those two reset
the global state: a draw another thread made meanwhile is drawn again (a call's
correctness over another thread's stream, on a call that ends a lowering).

Ops with a `generator` argument get the private generator of their device passed in. An
op without one (`native_dropout`, attention's dropout) draws from the global generator:
its state is swapped to the private one for that op alone (a window of one op, under the
module's lock, where another thread's draw would land in the private stream).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SWAP = threading.Lock()


def _default(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class Start:
    """The default generators' states as a call starts: each `private()` run draws from
    copies of them (module docstring); `settle()` leaves the default generators where the
    first such run (eager's reference) left its copies."""

    __slots__ = ("_end", "_states")

    def __init__(self) -> None:
        self._states: dict[torch.device, torch.Tensor] = {torch.device("cpu"): torch.default_generator.get_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, g in enumerate(torch.cuda.default_generators):
                self._states[torch.device("cuda", i)] = g.get_state()
        self._end: dict[torch.device, torch.Tensor] | None = None

    def private(self) -> _PrivateDraws:
        return _PrivateDraws(self._states)

    def ran(self, draws: _PrivateDraws) -> None:
        """A private run ended: the first one's generators are where eager leaves the user's."""
        if self._end is None:
            self._end = {device: g.get_state() for device, g in draws.generators.items()}

    def moved(self) -> bool:
        """Whether a default generator has moved since this was taken (a run drew from it)."""
        return any(not torch.equal(_default(device).get_state(), state) for device, state in self._states.items())

    def restore(self) -> None:
        """The user's generators as the call began: a compiled run that raised drew from
        them, and the Dynamo graph that answers instead must draw what eager would."""
        for device, state in self._states.items():
            _default(device).set_state(state)

    def settle(self) -> None:
        """Eager's outputs answer the call: the user's generators as eager leaves them (on a
        device its run drew nothing from, as the call began). The run that answers otherwise,
        the compiled one, drew from them itself, and may have stopped short (it raised) or
        drawn otherwise (it differed)."""
        for device, state in {**self._states, **(self._end or {})}.items():
            _default(device).set_state(state)

    @contextlib.contextmanager
    def where_eager_left(self) -> Iterator[None]:
        """The default generators where eager's run left its copies (as the call began on
        a device it drew nothing from) for the block, then put back where they stood: the
        check's backward of eager's outputs runs there, as the user's own backward of
        eager's call would (a tensor hook that draws: runtime/checks/autograd_check.py).
        A draw another thread makes inside the block is drawn again after it."""
        before = {device: _default(device).get_state() for device in self._states}
        self.settle()
        try:
            yield
        finally:
            for device, state in before.items():
                _default(device).set_state(state)


class _PrivateDraws(TorchDispatchMode):
    def __init__(self, states: dict[torch.device, torch.Tensor]) -> None:
        super().__init__()
        self._states = states
        self._private: dict[torch.device, torch.Generator] = {}

    @property
    def generators(self) -> dict[torch.device, torch.Generator]:
        return self._private

    def _generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        found = self._private.get(device)
        if found is None:
            found = self._private[device] = torch.Generator(device=device)
            state = self._states.get(device)
            found.set_state(state if state is not None else _default(device).get_state())
        return found

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
            return func(*args, **kwargs)
        device = _device(args, kwargs)
        private = self._generator(device)
        if any(a.name == "generator" for a in func._schema.arguments):
            if kwargs.get("generator") is None:
                kwargs["generator"] = private
            return func(*args, **kwargs)
        default = _default(device)
        with _SWAP:  # no generator argument: the global state is the private one for this op
            saved = default.get_state()
            default.set_state(private.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                private.set_state(default.get_state())
                default.set_state(saved)


def privately(start: Start | None, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as an extra run of a call: its random draws from private copies of the
    generators as they stood when the call began (`start`; None: it draws nothing)."""
    if start is None:
        return fn

    def run(*args: Any) -> Any:
        draws = start.private()
        with draws:
            out = fn(*args)
        start.ran(draws)
        return out

    return run


def _device(args: Any, kwargs: dict[str, Any]) -> torch.device:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


def undrawn(run: Callable[[], Any]) -> tuple[Any, bool]:
    """`run`'s result, and whether it drew from a default generator; where it did, the
    generators are put back where they stood before it (runtime/gates/beside.py: a kernel
    judged beside its region may not shift the caller's later draws)."""
    start = Start()
    result = run()
    drew = start.moved()
    if drew:
        start.restore()
    return result, drew
