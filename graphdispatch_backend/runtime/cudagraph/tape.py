"""Tape: what a host capture ran, at the ATen level, and its replay, which runs no Python.

A CUDA graph holds kernels with their arguments as they were at capture: a replay runs
none of the Python that launched them. A value that Python read at capture (a counter in
an artifact, a module attribute, a branch on a Python number) is frozen in the graph.
The host model records the same thing: while it captures, `Recorder` (a dispatch mode)
appends every ATen op with its arguments bound (a tensor made earlier in the capture is
a slot, filled again by each replay; any other tensor, the pinned inputs and parameters
among them, is held as the capture saw it, as a graph holds an address; every other
argument is a constant). `Tape.replay` runs that list, as one straight-line function
generated from it (cudagraph/tape_code.py). Custom ops made with
`torch.library.custom_op` are entered, so their Python is frozen too (their ops are
recorded, not the op); other custom ops are recorded whole (a C++ kernel has no Python).

While recording, what CUDA refuses during a capture raises (cudagraph/refusals.py), and
the capture stays refused even where the code catches that error (CUDA invalidates the
capture). The recorder also measures the capture's working set (the peak bytes of
storages made meanwhile) and runs no collective: one returns an uninitialized tensor of
its output's shape, as a CUDA capture records an NCCL kernel without running it (vLLM's
custom all-reduce does the same while warming up inside its capture context); its
replay runs the collective, as a graph replay launches the captured kernel.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._library.custom_ops import _maybe_get_opdef
from torch._ops import HigherOrderOperator
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from graphdispatch_backend.errors import CaptureRefused
from graphdispatch_backend.runtime.cudagraph.engine import view_bits, with_view_bits
from graphdispatch_backend.runtime.cudagraph.refusals import HOST_READS, refusal
from graphdispatch_backend.runtime.cudagraph.tape_code import FLAT, NESTED, SLOT, TENSOR, VIEW, straight_line, view_over

_COLLECTIVES = ("_c10d_functional", "c10d_functional")


class _Recording(threading.local):
    recorder: Recorder | None = None  # the Recorder capturing on this thread (a class default: engine.py `_Recording`)


_recording = _Recording()


def opaque(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, called so that while a host capture records on this thread, each call is one
    step of its tape. For compiled code whose kernels no dispatch mode sees (Inductor's
    fused kernels, runtime/program/fused_unit.py): a CUDA capture records their launches, so
    the host model records the call and its replay makes it again, on the replay's tensors.
    The ATen ops it runs inside are not recorded apart, and what a capture refuses is
    refused there too. One frame per call: a fused graph's segment is called on every call."""

    def call(*args: Any) -> Any:
        recorder = _recording.recorder
        return fn(*args) if recorder is None else recorder.opaque(fn, args)

    return call


class Tape:
    """The recorded steps; `replay()` runs them and returns the capture's outputs anew."""

    def __init__(self) -> None:
        # per step: (op, positional arguments, keyword arguments (tensors of the capture
        # replaced by None), the positions holding a list to copy before filling it,
        # [(0 for args | 1 for kwargs, position or key, index in a list or None, kind, what)]
        # to fill, the slots the op's tensor outputs go to, what it returned (TENSOR, FLAT
        # or NESTED), the slots no later step reads: freed after this one)
        self.steps: list[tuple[Any, ...]] = []
        self.outputs: list[tuple[int | None, Any]] = []  # per output: (kind, what), as an argument's
        self._replay: Callable[[], list[Any]] | None = None  # a rebound tape has only this (`rebound`)

    def replay(self) -> list[Any]:
        return self._generated()()

    def rebound(self, moves: dict[int, torch.Tensor]) -> Tape:
        """This tape reading, wherever it held a tensor over the storage at address `p`,
        the same view over `moves[p]`'s storage instead (HostReplayEngine.capture's `like`:
        what a CUDA capture at the new addresses records). Nothing else changes: the new
        tape's replay is this one's code, its constants rebound (no source written again:
        half of a relocation's cost on a decode step). It keeps no steps and no outputs,
        which are in that code, and would hold the tensors that moved (a dropped cache) for
        as long as the graph lives."""
        replay = self._generated()
        tape = Tape()
        held = {name: rebind(value, moves) for name, value in replay.__globals__.items()}
        tape._replay = types.FunctionType(replay.__code__, held)
        return tape

    def _generated(self) -> Callable[[], list[Any]]:
        if self._replay is None:  # generated at the first replay (cudagraph/tape_code.py)
            self._replay = straight_line(self.steps, self.outputs)
        return self._replay


def rebind(value: Any, moves: dict[int, torch.Tensor]) -> Any:
    """`value`, or, for a tensor over a storage at an address in `moves` (or a list of
    such), the same view (offset, sizes, strides, dtype, lazy negative and conjugate bits)
    over the moved tensor's storage."""
    if isinstance(value, torch.Tensor):
        new = moves.get(value.untyped_storage().data_ptr())
        if new is None:
            return value
        return with_view_bits(view_over(new, value.storage_offset(), value.shape, value.stride(), value.dtype),
                              view_bits(value))
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(rebind(v, moves) for v in value)
    return value


class _HostReads(TorchFunctionMode):
    """Catches what reads a tensor's values on the host without an ATen op (`.tolist()`)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self._recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        why = HOST_READS.get(func)
        if why is not None:
            self._recorder.refuse(getattr(func, "__name__", str(func)), why)
        return func(*args, **(kwargs or {}))


class Recorder(TorchDispatchMode):
    """Records a capture onto a Tape (module docstring). Use `record(fn, args)`."""

    # a higher-order operator comes to __torch_dispatch__, refused there by name (refusals.py)
    supports_higher_order_operators = True

    def __init__(self, held: set[int]) -> None:
        super().__init__()
        self._held = held  # the arguments' storages: not the computation's own memory
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._total = 0  # bytes of the storages in _live, some possibly gone since
        self.peak = 0
        self.tape = Tape()
        self._made: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}  # id -> (tensor, slot)
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}  # storage ptr -> (storage, slot)
        self._reads: list[int] = []  # per slot, the last step that reads it
        self._refused: CaptureRefused | None = None
        self._inside: list[str] = []  # the custom ops being entered, outermost first
        self._quiet = 0  # inside an opaque call: ops are refused as usual, not recorded

    def record(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
        with self.capturing():
            fresh = tuple(fn(*args))
        return self.finish(fresh)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Record what runs inside: `record`'s first half, for a caller that brackets the
        capture itself (as CUDA's capture_begin and capture_end do)."""
        before = _recording.recorder
        _recording.recorder = self
        try:
            with _HostReads(self), self:
                yield
        finally:
            _recording.recorder = before

    def opaque(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Run `fn(*args)` and record it as one step (see `opaque` above)."""
        self._quiet += 1
        try:
            out = fn(*args)
            if self._quiet == 1:  # the outermost: binding its arguments (a held tensor's detach()
                self._append(fn, args, {}, out)  # dispatches through this mode) records nothing more
                self._measure(out)
        finally:
            self._quiet -= 1
        return out

    @property
    def refused(self) -> CaptureRefused | None:
        """What invalidated the capture, if anything did (even where the code caught it)."""
        return self._refused

    def alive(self) -> list[torch.Tensor]:
        """The tensors the capture made that something still holds: its outputs, for a
        caller that does not know them (a CUDA graph keeps whatever its pool still holds)."""
        return [t for t in (ref() for ref, _ in list(self._made.values())) if t is not None]

    def finish(self, fresh: tuple[Any, ...]) -> tuple[Any, ...]:
        """Bind the capture's outputs `fresh`; raise what invalidated the capture."""
        if self._refused is not None:  # caught by the code that ran; CUDA invalidates the capture anyway
            raise self._refused
        tape = self.tape
        tape.outputs = [self._bind(out, len(tape.steps)) if isinstance(out, torch.Tensor) else (None, out)
                        for out in fresh]
        last_reads: dict[int, list[int]] = {}
        kept = {what if kind == SLOT else what[0] for kind, what in tape.outputs if kind is not None}
        for slot, step in enumerate(self._reads):
            if slot not in kept:
                last_reads.setdefault(step, []).append(slot)
        tape.steps = [(*s[:7], tuple(last_reads.get(i, ()))) for i, s in enumerate(tape.steps)]
        return fresh

    def refuse(self, op: str, why: str) -> None:
        inside = f" in custom op {self._inside[-1]}" if self._inside else ""
        error = CaptureRefused(f"operation not permitted when stream is capturing: {op} ({why}){inside}")
        if self._refused is None:
            self._refused = error
        raise error

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        why = refusal(func, args, kwargs)
        if why is not None:
            self.refuse(func.name() if isinstance(func, HigherOrderOperator) else str(func), why)
        opdef = _maybe_get_opdef(func) if func.namespace not in ("aten", "prims") else None
        if opdef is not None:  # a custom op's Python: entered, recorded op by op (frozen as a graph would)
            kernel = opdef._backend_fns.get(_device_type(args), opdef._backend_fns.get(None, opdef._init_fn))
            self._inside.append(str(opdef._qualname))
            try:
                with _HostReads(self), self:  # function modes are off inside a dispatch
                    out = kernel(*args, **kwargs)
            finally:
                self._inside.pop()
            self._measure(out)
            return out
        if self._quiet:  # inside an opaque call, which is recorded whole
            return func(*args, **kwargs)
        if getattr(func, "namespace", None) in _COLLECTIVES:
            out = _stand_in(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        self._append(func, args, kwargs, out)
        self._measure(out)
        return out

    # -- recording ------------------------------------------------------------------------
    def _append(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        step = len(self.tape.steps)
        args, kwargs = list(args), dict(kwargs)
        lists: list[tuple[int, Any]] = []
        fills: list[tuple[int, Any, int | None, int, Any]] = []
        for where, holder in ((0, args), (1, kwargs)):
            for key in (range(len(holder)) if where == 0 else list(holder)):
                value = holder[key]
                if isinstance(value, torch.Tensor):
                    holder[key] = self._arg(value, step, fills, where, key, None)
                elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                    items = list(value)
                    for index, item in enumerate(items):
                        if isinstance(item, torch.Tensor):
                            items[index] = self._arg(item, step, fills, where, key, index)
                    holder[key] = items
                    lists.append((where, key))
        outs = []
        form, leaves = _leaves(out)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and self._slot_of(leaf) is None:
                slot = len(self._reads)
                self._reads.append(step)  # freed after the step that made it, unless read later
                self._made[id(leaf)] = (weakref.ref(leaf), slot)
                storage = leaf.untyped_storage()
                if storage.data_ptr() not in self._storages:
                    self._storages[storage.data_ptr()] = (StorageWeakRef(storage), slot)
                outs.append((i, slot))
        self.tape.steps.append((func, tuple(args), kwargs, tuple(lists), fills, outs, form, ()))

    def _arg(self, t: torch.Tensor, step: int, fills: list[Any], where: int, key: Any, index: int | None) -> Any:
        """The value a step holds for tensor argument `t`: None where each replay fills it in."""
        kind, what = self._bind(t, step)
        if kind is None:
            return what
        fills.append((where, key, index, kind, what))
        return None

    def _slot_of(self, t: torch.Tensor) -> int | None:
        found = self._made.get(id(t))
        return found[1] if found is not None and found[0]() is t else None

    def _bind(self, t: torch.Tensor, step: int) -> tuple[int | None, Any]:
        """How a replay finds tensor `t`: a slot, a view over a slot's storage, or `t` itself
        (made before the capture: held, as a graph holds an address)."""
        slot = self._slot_of(t)
        if slot is not None:
            self._reads[slot] = step
            return SLOT, slot
        storage = t.untyped_storage()
        owner = self._storages.get(storage.data_ptr())
        if owner is not None and not owner[0].expired() and owner[0].cdata == storage._cdata:
            self._reads[owner[1]] = step  # made in the capture, reached without an op (`.data`)
            return VIEW, (owner[1], t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        return None, t.detach()

    def _measure(self, out: Any) -> None:
        """The peak bytes of the storages the capture made and still holds. Their total
        only grows with a new storage: only then can it pass the peak, and only then are
        the ones gone dropped and the total counted again (not on every op)."""
        added = False
        for t in _leaves(out)[1]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in self._held:
                    continue
                known = self._live.get(key)
                if known is not None:
                    if not known[0].expired():  # alive: this very storage, counted
                        continue
                    self._total -= known[1]  # gone, and a new storage at its address
                nbytes = storage.nbytes()
                self._live[key] = (StorageWeakRef(storage), nbytes)
                self._total += nbytes
                added = True
        if added and self._total > self.peak:  # the total counts storages gone since: count again
            self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
            self._total = sum(n for _, n in self._live.values())
            self.peak = max(self.peak, self._total)


def _leaves(out: Any) -> tuple[int, Sequence[Any]]:
    """What an op returned (TENSOR, FLAT or NESTED) and its leaves, without pytree for the
    two common forms."""
    if isinstance(out, torch.Tensor):
        return TENSOR, (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return FLAT, out
    return NESTED, pytree.tree_leaves(out)


def _device_type(args: Any) -> str | None:
    t = next((a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)), None)
    return None if t is None else t.device.type


def _stand_in(func: Any, args: Any, kwargs: Any) -> Any:
    """A collective's output, shaped by its meta kernel, never communicated."""
    if func is torch.ops._c10d_functional.wait_tensor.default:
        return args[0]
    real = next(t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor))
    meta = func(*pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), args),
                **pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), kwargs))
    return pytree.tree_map_only(torch.Tensor, lambda m: torch.empty(m.shape, dtype=m.dtype, device=real.device), meta)
