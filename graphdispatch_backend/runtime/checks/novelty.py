"""Novelty: a call is checked when its inputs leave what the checked calls have seen.

The schedules (runtime/checks/schedule.py) pick calls by position only. A kernel wrong
for some values (1 ulp off above a magnitude, wrong where an input holds NaN or inf) is
met by them only when such values happen to fall on a scheduled call. So every call also
takes cheap statistics of the inputs a site watches (the graph's for the lowering's check,
runtime/checks/eager_check.py; the region's for an artifact's, runtime/gates/gate.py): per
input, its largest magnitude and whether it holds NaN or inf. Against what the calls that
were checked saw (widened by every checked call, scheduled or not), a call is novel when
an input's largest magnitude reaches a binade above the largest seen (2**e, e the seen
maximum's exponent: a position id growing by one per decode step makes a check per
doubling, not per step), or holds NaN, or inf, where no checked call's did. A novel call is
checked as a scheduled one is, and counted as a check made for novelty.

Watched: inputs that are not parameters or buffers, not written by the graph (a KV cache
is judged by its written rows, and reading it whole per call would cost its size), not
marked with `torch._dynamo.mark_static_address` (state at a fixed address), floating or
integer, on the CPU or CUDA, not empty. The statistic is one reduction per input (`aminmax`):
a read of what the graph reads anyway, but a dispatch whose code and objects the model's
own kernels evict between calls (bench/recheck.py part 4: 3-9x what `observe` costs alone,
6-37 us a site inside a call); on the CPU into outputs the site keeps, both values
read back in one call (no `.item()` each: that and the plan a one-input site makes at its
first call take a quarter off the cost of a small input; in the CPU model of a GPU the usual
site holds its last value and observation for the next call, no `_InFlight` and no list: a
replayed toy call's site went from 18 to 10 us). Every call reads its inputs, even the
tensor the last call passed: its version counter would say whether torch wrote it since, but
not a write through a numpy view, `.data`, DLPack or a raw kernel (vLLM fills its CPU input
buffers through numpy views), and a statistic kept for such an input would hide its new
values from every later call.

When the values are known. On the CPU (`Arrival.NOW`) the statistics are read in the call
that took them, before it is decided: an input-dependent fault is met at its first call.
On a GPU, reading them would synchronize the host with the device on every call and stall
the launches that run ahead of it (on a replay, the whole point of the graph). So on CUDA
tensors they are reduced on the device into one small tensor, copied into pinned host
memory with `non_blocking=True` after an event on the current stream, and read at a later
call once that event has completed (`Event.query()`, which never waits): vLLM v1 hands its
sampled token ids to the host the same way (`vllm/v1/worker/gpu_model_runner.py`,
AsyncGPUModelRunnerOutput: a non-blocking copy into pinned memory and an event, read after
it), except that nothing here ever waits on the event. Such a call's statistics decide the
first call after them whose decision comes after the copy landed (usually the next): on a
GPU an input-dependent fault is met at the next call that shows the same novelty, or at
the next call, whichever comes first, never later than the schedule would. The CPU model
of a CUDA graph (`cuda_graphs="emulate"`, `Arrival.NEXT_CALL`) predicts that: its
statistics decide the next call, as the GPU's at the earliest.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Sequence
from threading import get_ident
from typing import Any

import torch

ENABLED = True  # bench/recheck.py turns it off to measure what it costs
MAX_IN_FLIGHT = 8  # a site's CUDA statistics not yet read: past it, a call takes none (bounded memory)
_TINY = math.ulp(0.0)  # the limit while every value seen was 0: anything above is new
_INF = math.inf


class Arrival(enum.Enum):
    NOW = "now"  # read in the call (CPU tensors)
    NEXT_CALL = "next_call"  # the CPU model of a GPU: read at the next call


class _Seen:
    """Per watched input: the binade limit (the smallest power of two above the largest
    magnitude a checked call's input had), and whether NaN and inf were seen."""

    __slots__ = ("inf", "limit", "nan")

    def __init__(self) -> None:
        self.limit = -1.0  # nothing seen: every value is new
        self.nan = self.inf = False

    def novel(self, m: float) -> bool:
        if m < self.limit:
            return False
        if m != m:
            return not self.nan
        if m == _INF:
            return not self.inf
        return True

    def widen(self, m: float) -> None:
        if m != m:
            self.nan = True
        elif m == _INF:
            self.inf = True
        elif m >= self.limit:
            self.limit = math.ldexp(1.0, math.frexp(m)[1]) if m > 0 else _TINY


class _InFlight:
    """A call's statistics on their way to the host: pinned memory and the event that says
    they are there (CUDA; `known`: those of its host tensors, read already), or already
    there and held back for the next call (the model: `host` is a list)."""

    __slots__ = ("checked", "event", "host", "known", "names")

    def __init__(self, host: Any, event: Any, names: tuple[int, ...], known: list[float] | None = None) -> None:
        self.host, self.event, self.names, self.known, self.checked = host, event, names, known or [], False

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def values(self) -> list[float]:
        if isinstance(self.host, list):
            return self.host + self.known
        read = self.host.tolist()
        return (read if isinstance(read, list) else [read]) + self.known


class Observation:
    """One call's statistics, and what makes the call novel (`why`, or None). `checked()`
    once the call was checked: what it saw counts as seen (`done`: it was)."""

    __slots__ = ("_novelty", "_stats", "done", "why")

    def __init__(self, novelty: Novelty, stats: Any, why: str | None) -> None:
        self._novelty, self._stats, self.why, self.done = novelty, stats, why, False

    def checked(self) -> None:
        self.done = True
        self._novelty.checked(self._stats)


class Novelty:
    """One site's watch (module docstring): `positions` of the inputs it watches, `names`
    of every input (for what a novel call says), `arrival`: when the statistics reach the host."""

    def __init__(self, positions: Sequence[int], names: Sequence[str] = (), arrival: Arrival = Arrival.NOW) -> None:
        self._positions = tuple(positions)
        self._names = tuple(names)
        self._arrival = arrival
        self._next = arrival is Arrival.NEXT_CALL
        self._seen: dict[int, _Seen] = {p: _Seen() for p in self._positions}
        self._pending: deque[_InFlight] = deque()  # in flight (CUDA) or waiting for the next call (the model)
        self._due: str | None = None  # an earlier call's statistics were novel: this call is checked
        # the model's lean path (one watched CPU input): the last call's observation and value,
        # held for the next call (no _InFlight: a replay's few microseconds); a deque, as
        # `_pending`, so that threads sharing the site take each exactly once
        self._held: deque[tuple[Observation, float]] = deque()
        self.on = bool(self._positions) and ENABLED
        # one watched input (most sites: an activation), on the CPU: the lean path, planned at
        # the first call that takes it (its dtype: Dynamo guards an input's dtype and device,
        # so later calls match; one that does not takes the general path)
        self._one = self._positions[0] if len(self._positions) == 1 else None
        self._one_names = self._positions[:1]
        self._one_dtype: torch.dtype | None = None
        # per thread and dtype: aminmax's outputs and their reader (`_magnitude`)
        self._outs: dict[tuple[int, torch.dtype], tuple[Any, Any]] = {}

    def observe(self, inputs: Sequence[Any]) -> Observation:
        """This call's statistics, taken now, and whether it is checked for novelty. Lean on
        purpose: it runs on every call (bench/recheck.py part 4 measures it): per watched CPU
        input one `aminmax` into outputs the site keeps, read back in one call, no `.item()`
        (a quarter less at small sizes); the usual site (one watched input) decides
        from a plan made at its first call."""
        one = self._one
        if one is not None:
            t = inputs[one]
            if (type(t) is _Tensor and t.dtype is self._one_dtype and t.is_cpu and t.layout is _STRIDED and t.numel()
                    and not hasattr(t, STATIC)):
                m = self._magnitude(t)
                if self._next:  # as a GPU's would, they decide a later call: held for it
                    waiting = self._held or self._due is not None or self._pending
                    seen = Observation(self, None, self._arrived() if waiting else None)
                    self._held.append((seen, m))
                    return seen
                return Observation(self, (self._one_names, [m]),
                                   None if m < self._seen[one].limit else self._novel(self._one_names, [m]))
        names: list[int] = []
        values: list[float] = []
        cuda = False
        for p in self._positions:
            t = inputs[p]
            if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
                continue
            if t.dtype not in _WATCHED or t.layout is not torch.strided or not t.numel() or hasattr(t, STATIC):
                continue
            if not t.is_cpu:
                cuda = t.is_cuda  # another device: not watched (its reads would synchronize)
                if cuda:
                    break
                continue
            if p == self._one and type(t) is _Tensor:
                self._one_dtype = t.dtype  # the lean path takes the next calls
            names.append(p)
            values.append(self._magnitude(t))
        if cuda:
            why = self._arrived()
            watched = [(p, inputs[p]) for p in self._positions if _watchable(inputs[p])]
            if len(self._pending) >= MAX_IN_FLIGHT:  # the device runs far behind: this call goes unwatched
                return Observation(self, None, why)
            flight = _launch(watched)
            self._pending.append(flight)
            return Observation(self, flight, why)
        if self._next:  # as a GPU's would, they decide a later call
            why = self._arrived()
            flight = _InFlight(values, None, tuple(names))
            self._pending.append(flight)
            return Observation(self, flight, why)
        return self._decide(names, values)

    def judge(self, values: Sequence[float]) -> Observation:
        """A call's statistics taken by the graph itself, after its run (runtime/checks/posted.py),
        in the order of the watched positions: read now, as `observe` reads a CPU input's."""
        return self._decide(self._positions, values)

    def within(self, values: Sequence[float], names: Sequence[int] | None = None) -> bool:
        """Whether statistics of the inputs at `names` (by default every watched position, in
        order, as `judge` takes them) stay below what the checked calls saw: the call is not
        new (False: it may be; NaN and inf need the slow path, `_novel`)."""
        seen = self._seen
        for p, m in zip(self._positions if names is None else names, values):  # noqa: SIM110 (a generator: two more frames per call)
            if not m < seen[p].limit:
                return False
        return True

    def _decide(self, names: Sequence[int], values: Sequence[float]) -> Observation:
        """Statistics read now: new when an input's reaches past what the checked calls saw."""
        return Observation(self, (names, values), None if self.within(values, names) else self._novel(names, values))

    def _magnitude(self, t: torch.Tensor) -> float:
        """CPU tensor `t`'s largest magnitude, NaN if any is NaN, inf if any is infinite (and
        none is NaN): `aminmax` into this thread's outputs for its dtype, both read back in one
        call (numpy's `tolist` on a view where numpy has the dtype, not bfloat16; else torch's)."""
        outs = self._outs.get((get_ident(), t.dtype))
        if outs is None:
            with torch.inference_mode(False):  # written by every call, in inference mode or not
                buf = torch.empty(2, dtype=t.dtype)
            try:
                read = buf.numpy().tolist
            except TypeError:
                read = buf.tolist
            outs = self._outs[(get_ident(), t.dtype)] = ((buf[0], buf[1]), read)
        _aminmax(t.detach() if t.requires_grad else t, out=outs[0])
        low, high = outs[1]()
        return high if high >= -low else -low  # NaN: neither comparison holds, and -low is NaN

    def checked(self, stats: Any) -> None:
        if isinstance(stats, _InFlight):
            stats.checked = True  # widens what was seen when it arrives
        elif stats is not None:
            self._widen(*stats)

    def _arrived(self) -> str | None:
        """The statistics that have reached the host since the last call: a checked call's
        widen what was seen; an unchecked one's make this call due when novel."""
        why, self._due = self._due, None
        held = self._held
        while held:  # the lean path's last call (module docstring: the model)
            try:
                seen, m = held.popleft()
            except IndexError:  # another thread's call took it
                break
            if seen.done:
                self._seen[self._one].widen(m)
            elif why is None and not m < self._seen[self._one].limit:
                why = self._novel(self._one_names, [m], late=True)
        pending = self._pending
        while pending and (self._arrival is Arrival.NEXT_CALL or pending[0].ready()):
            flight = pending.popleft()
            values = flight.values()
            if flight.checked:
                self._widen(flight.names, values)
            elif why is None:
                why = self._novel(flight.names, values, late=True)
        return why

    def _novel(self, names: Sequence[int], values: Sequence[float], late: bool = False) -> str | None:
        seen = self._seen
        for p, m in zip(names, values):
            if seen[p].novel(m):
                return self._say(p, m, late)
        return None

    def _widen(self, names: tuple[int, ...], values: list[float]) -> None:
        for p, m in zip(names, values):
            self._seen[p].widen(m)

    def _say(self, p: int, m: float, late: bool) -> str:
        s = self._seen[p]
        name = self._names[p] if p < len(self._names) and self._names[p] else f"input {p}"
        if m != m:
            what = "holds NaN, which no checked call's did"
        elif m == _INF:
            what = "holds inf, which no checked call's did"
        elif s.limit < 0:
            what = f"max|x| {m:.4g}, no checked call's seen"
        else:
            what = f"max|x| {m:.4g}, at or above {s.limit:.4g} (the checked calls' binade)"
        return f"{name} {what}" + (" (in an earlier call: statistics read without a sync)" if late else "")


_aminmax = torch.aminmax
_STRIDED = torch.strided
_Tensor = torch.Tensor
# set by `torch._dynamo.mark_static_address`: its owner's state at a fixed address (a static
# KV cache, a table), not an input that varies per call: read whole per call, it would cost its size
STATIC = "_dynamo_static_input_type"
# floating and integer dtypes: a largest magnitude (bool has none; complex, float8, quantized: not watched)
_WATCHED = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                      torch.int16, torch.int8, torch.uint8})


def watched_on(t: Any) -> str | None:
    """The device type of a call input the checks would watch (`_watchable`, its size
    aside: Dynamo guards it), None where they would not."""
    if (not isinstance(t, torch.Tensor) or t.dtype not in _WATCHED or t.layout is not torch.strided
            or hasattr(t, STATIC)):
        return None
    return t.device.type


def _watchable(t: Any) -> bool:
    return watched_on(t) in ("cpu", "cuda") and t.numel() > 0


def _magnitude(t: torch.Tensor) -> float:
    """Largest magnitude, NaN if any is NaN, inf if any is infinite (and none is NaN)."""
    lo, hi = _aminmax(t.detach())
    low, high = lo.item(), hi.item()
    return high if high >= -low else -low  # NaN: neither comparison holds, and -low is NaN


def _launch(watched: list[tuple[int, torch.Tensor]]) -> _InFlight:
    """The statistics of CUDA tensors reduced on the device, on their way to pinned host
    memory, with the event that says when they are there: no host sync. One reduction per
    input (`vector_norm(inf)` is the largest magnitude, NaN where one is NaN: `amax`
    propagates it; an integer input's `abs().amax()`), a stack where there are several,
    one copy, one event: three launches for one input. A host tensor among them (a CPU
    timestep) is read now: moved to the device it would synchronize."""
    cuda = [(p, t) for p, t in watched if t.is_cuda]
    host_side = [(p, t) for p, t in watched if not t.is_cuda]
    with torch.no_grad():
        parts = [torch.linalg.vector_norm(t.detach(), math.inf) if t.is_floating_point()
                 else t.detach().abs().amax() for _, t in cuda]
        if len({p.dtype for p in parts}) > 1:  # one dtype to stack (a binade survives float32)
            parts = [p.float() for p in parts]
        stats = parts[0] if len(parts) == 1 else torch.stack(parts)  # a launch fewer for the usual one
        host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)  # torch's caching host allocator
        host.copy_(stats, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    return _InFlight(host, event, tuple(p for p, _ in cuda) + tuple(p for p, _ in host_side),
                     [_magnitude(t) for _, t in host_side])
