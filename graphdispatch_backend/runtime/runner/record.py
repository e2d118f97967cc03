"""Record one runner entry's graph: warm it up, classify its inputs, bind static buffers, capture.

Capturer takes a warming entry's calls: `warmup` eager calls, each recording every tensor
input's layout identity (its `Warming` phase, runner/phase.py); then, after evicting the
least recently used shape key past max_captures (runner/book.py), the capture (`record`),
which makes a `Capture`; runner/transitions.py makes the entry `Captured` with it.

Given an entry's warmup observations and the live inputs of the capture call:
- scalars are constants (they are in the shape key);
- tensors whose layout identity never changed, backed by one storage kept alive through
  warmup (the same tensor passed again, not a new one the allocator put at the old
  address), are pinned (read in place, their addresses checked on every replay);
  parameters and buffers must be pinned, or the capture is refused (`parameter_moved`);
- tensors marked with `torch._dynamo.mark_static_address` (a static KV cache: transformers
  marks its own) are pinned at the capture call's address even when they moved during
  warmup: their owner says the address is the graph's, and copying one in (and back,
  when written) on every replay would cost its whole size per call, where cudagraph
  trees never copy a static input either (runner/transitions.py re-captures when it moves);
  so is an input an earlier re-capture found held (written in place, it moved under a
  verified graph: a cache replaced by the next request, runner/transitions.py);
- the rest, and inputs an earlier re-capture found moving, are moving: copied into the
  session's shared static buffers, on the caller's stream after the device's last replay
  (another runner's replay may still read the same buffers), as every copy-in is;
- outputs must be tensors (copied out on replay) or None/bool/int/float constants.

The whole capture runs under the device lock and the device guard: a capture may run the
computation (the host model does; CUDA's warmup run does), reading the shared buffers and
writing the inputs the graph writes into (snapshotted before and put back after), and no
other thread's replay may copy into those buffers or read those inputs meanwhile. A
replay on another thread waits behind a capture (captures are rare; cudagraph trees hold
one process-wide lock for theirs). An allocation failure is `out_of_memory`, a
transient decline; anything else raised is `capture_failed`, an operation the capture
does not permit named with the code that ran it (cudagraph/refusals.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.errors import CudaGraphUnavailable, Decline, SnapshotRefused
from graphdispatch_backend.runtime.call.contract import LayoutIdentity
from graphdispatch_backend.runtime.checks.agree import Agreement, agreed_verdict
from graphdispatch_backend.runtime.checks.side_by_side import held
from graphdispatch_backend.runtime.checks.world import Writes
from graphdispatch_backend.runtime.cudagraph.engine import Like, is_out_of_memory
from graphdispatch_backend.runtime.cudagraph.refusals import refused_by_capture, where
from graphdispatch_backend.runtime.runner.book import EntryBook
from graphdispatch_backend.runtime.runner.entry import Entry
from graphdispatch_backend.runtime.runner.hints import CHURN_CALLS, churn_detail
from graphdispatch_backend.runtime.runner.inputs import InputPlan, fixed_address, picker
from graphdispatch_backend.runtime.runner.lookup import Lookup
from graphdispatch_backend.runtime.runner.outputs import OutputPlan
from graphdispatch_backend.runtime.runner.phase import Capture, Captured, Warming, bound
from graphdispatch_backend.runtime.runner.scope import DeviceRuntime, RuntimeScope
from graphdispatch_backend.runtime.runner.serve import follow
from graphdispatch_backend.runtime.runner.transitions import Transitions

CONSTANT_OUTPUTS = (type(None), bool, int, float)
_data_ptr = torch.Tensor.data_ptr


def _kept(warming: Warming, args: Sequence[Any], i: int) -> bool:
    """The tensor at `i` is backed by the storage the first warmup call saw, kept alive since."""
    ref = warming.first_storages[i] if i < len(warming.first_storages) else None
    return ref is not None and not ref.expired() and ref.cdata == args[i].untyped_storage()._cdata


class Capturer:
    """Warms a runner's entries up and captures them: the observations of `warmup` calls,
    the eviction that makes room, the capture (`record`), the agreement of the ranks on
    it. It owns the count of the static buffers the piece's captures hold."""

    def __init__(self, fn: Callable[..., Sequence[Any]], scope: RuntimeScope, device: DeviceRuntime,
                 stats: Any, book: EntryBook, lookup: Lookup, transitions: Transitions, *, warmup: int,
                 gates: Sequence[Any], writes: Writes, wide: Sequence[int], guarded: bool,
                 agreement: Agreement | None, names: Sequence[str]) -> None:
        self._fn, self._scope, self._device = fn, scope, device
        self._stats, self._book, self._lookup, self._transitions = stats, book, lookup, transitions
        self._warmup = warmup
        self._gates, self._writes, self._wide, self._guarded = tuple(gates), writes, tuple(wide), guarded
        self._agreement = agreement
        self._names = names
        self._buffers_used: dict[int, int] = {}  # id(static buffer) -> bytes, for the report

    def warm(self, entry: Entry, warming: Warming, key: tuple[Any, ...], args: Sequence[Any]) -> Captured | Decline:
        """A call to a warming entry (`warming`, its phase): observed, and captured once
        `warmup` calls were: the entry's Captured phase (this call verifies it), or the
        Decline the call is answered eagerly with."""
        if warming.see(args) <= self._warmup:
            return self._warming()
        # not in a piece holding collectives: a rank declining alone would leave the others
        # waiting in the capture's agreement below
        if self._agreement is None and self._book.thrashing(key):
            return self._transitions.thrashing(entry)
        if self._book.make_room(key) is not None:
            with self._stats.lock:
                self._stats.evictions += 1
        refusal: CudaGraphUnavailable | None = None
        captured = None
        try:
            captured = self.capture(entry, warming, args)
        except CudaGraphUnavailable as exc:
            refusal = exc
        own = (refusal.reason, refusal.detail) if refusal is not None else None
        verdict = agreed_verdict(self._agreement, own)  # every rank, one reason: the rank at fault's
        if verdict != own:  # another rank failed to capture
            self._transitions.decline(entry, *verdict)
            return verdict[0]
        if captured is not None:
            return captured
        assert refusal is not None
        if refusal.reason is Decline.OUT_OF_MEMORY and self._agreement is None:
            return self._transitions.out_of_memory(entry, refusal.detail)
        self._transitions.decline(entry, refusal.reason, refusal.detail)
        return refusal.reason

    def _warming(self) -> Decline:
        """`warmup`, or `shape_churn` while every call brings a new shape key (runner/hints.py)."""
        if self._lookup.fresh < CHURN_CALLS:
            return Decline.WARMUP
        detail = churn_detail(list(self._book.slots), self._lookup.key_positions or (), self._names)
        self._book.limit(Decline.SHAPE_CHURN, detail, then="calls with new shape keys run eager meanwhile")
        return Decline.SHAPE_CHURN

    def buffer(self, pos: int, like: torch.Tensor) -> torch.Tensor:
        """The static buffer a capture copies input `pos` into when it is moving (shared,
        made once per layout; runner/inputs.py)."""
        return self._scope.buffers.get(pos, like, wide=pos in self._wide)

    def capture(self, entry: Entry, warming: Warming, args: Sequence[Any], like: Like | None = None,
                buffers: Mapping[int, torch.Tensor] | None = None) -> Captured:
        """Capture `entry` now (`record`), counted: its new phase, Captured; raises
        CudaGraphUnavailable."""
        capture = record(entry, warming, args, self._fn, self._scope, self._device, self._lookup.state, self._gates,
                         self._writes, self._wide, self._guarded, lockstep=self._agreement is not None, like=like,
                         buffers=buffers, replays=self._stats.replays)  # hot replays included (runner/hot.py)
        with self._stats.lock:
            self._stats.captures += 1
            self._buffers_used.update((id(buf), buf.untyped_storage().nbytes()) for _, buf in capture.moving)
            # what this piece holds; the buffers are shared across pieces (session total in the report)
            record_fields.static_bytes(self._stats, sum(self._buffers_used.values()))
        return self._transitions.captured(entry, capture)


def record(entry: Entry, warming: Warming, args: Sequence[Any], fn: Callable[..., Sequence[Any]],
           scope: RuntimeScope, device: DeviceRuntime, state: dict[int, str], gates: Sequence[Any], writes: Writes,
           wide: Sequence[int], guarded: bool, lockstep: bool = False,
           like: Like | None = None, buffers: Mapping[int, torch.Tensor] | None = None, replays: int = 0,
           ) -> Capture:
    """The capture of `entry` from its warmup (`warming`) and this call's inputs; raise
    CudaGraphUnavailable with the reason otherwise. `replays`: the runner's replay count
    now (runner/transitions.py's REPIN_AFTER counts from it). `like`: the entry's verified
    capture and its arguments, when this one is the same graph at other addresses
    (runner/relocate.py; the engine may rebind it, cudagraph/engine.py); `buffers`: the
    static buffers its moving inputs keep (a relocation's: the verified capture's, the
    graph's own memory, whatever alignment this call's inputs have)."""
    first = warming.observations[0]
    stable = {i for i, ident in enumerate(first)
              if ident is not None and all(o[i] == ident for o in warming.observations) and _kept(warming, args, i)}
    for pos, name in state.items():
        if pos not in stable:
            raise CudaGraphUnavailable(Decline.PARAMETER_MOVED, f"{name} changed address or layout during warmup")
    tensors = [i for i, ident in enumerate(first) if ident is not None]
    moving = [i for i in tensors if (i not in stable or i in entry.forced_moving) and i not in state
              and i not in entry.held and not fixed_address(args[i])]
    pinned = [i for i in tensors if i not in moving]
    static_args = list(args)
    kept = buffers or {}
    buffers = []
    for pos in moving:
        buf = kept[pos] if pos in kept else scope.buffers.get(pos, args[pos], wide=pos in wide)
        static_args[pos] = buf
        buffers.append((pos, buf))
    inputs = InputPlan(buffers, writes.positions, wide, args)
    with device.lock:  # the buffers are shared with every other replay of the device
        _, exc = scope.contain(lambda: _fill(inputs, args, device))
        if exc is not None:
            raise _refusal(exc, "copying the inputs in")
        # the regions of the inputs (or their buffers) the capture's own runs write: put
        # back after the warmup run (the recording starts from the caller's state) and after
        rewind, exc = scope.contain(lambda: held(writes.regions(static_args)))
        if exc is not None:
            raise _refusal(exc, "snapshotting the inputs the graph writes")
        while True:
            gate_state = tuple(g.demoted for g in gates)
            # collectives inside (lockstep): no warmup run that one rank would make alone
            with device.guard():
                graph, exc = scope.contain(lambda: scope.engine.capture(fn, static_args, device.device,
                                                                        warmup=not lockstep, rewind=rewind,
                                                                        like=like))
            rewind()
            if exc is not None or tuple(g.demoted for g in gates) == gate_state:
                break
            # an artifact demoted during the warmup or the recorded run (a write into an input
            # it does not declare, runtime/gates/gate.py): the graph may hold its kernel, which
            # no replay may run; captured again at once without it (each round demotes one more)
            graph.reset()
    if exc is not None:
        raise _refusal(exc, "capturing")
    for i, out in enumerate(graph.outputs):
        if not isinstance(out, (torch.Tensor, *CONSTANT_OUTPUTS)):
            graph.reset()
            raise CudaGraphUnavailable(Decline.NON_TENSOR_OUTPUT, f"output {i} is a {type(out).__name__}")
    # an output may view a pinned input, or the buffer of a moving one that keeps its layout
    views = {static_args[p].untyped_storage().data_ptr(): p for p in pinned}
    for pos, buf in buffers:
        if buf.stride() == args[pos].stride():
            views[buf.untyped_storage().data_ptr()] = pos
    pick_pinned = picker(tuple(pinned))
    return Capture(
        graph=graph, **bound(static_args),
        moving=tuple(buffers), inputs=inputs,
        outputs=OutputPlan(graph.outputs, static_args, views), pinned=tuple(pinned), pick_pinned=pick_pinned,
        ptrs=list(map(_data_ptr, pick_pinned(args))),
        # Dynamo guards every graph input's sizes and strides: only the addresses need a check
        # then; a runner driven by anything else checks the pinned inputs' layouts too
        identity=None if guarded else LayoutIdentity(pinned, args, addressed=()),
        gate_state=gate_state,
        seen=first, replays_at=replays)


def _fill(inputs: InputPlan, args: Sequence[Any], device: DeviceRuntime) -> None:
    """The buffers' first values, written on the caller's stream after the device's last
    replay, whichever stream that was on (it may still read these buffers), as every
    copy-in is (runner/serve.py); the caller holds the device lock."""
    streams = device.streams
    caller = streams.current()
    if caller is not streams.replayed_on:
        follow(streams, caller)
    streams.launch(inputs.fill, args)


def _refusal(exc: Exception, doing: str) -> CudaGraphUnavailable:
    if isinstance(exc, SnapshotRefused):
        return CudaGraphUnavailable(Decline.SNAPSHOT_TOO_LARGE, exc.detail)
    if is_out_of_memory(exc):
        return CudaGraphUnavailable(Decline.OUT_OF_MEMORY, f"{doing}: {type(exc).__name__}: {exc}")
    origin = where(exc) if refused_by_capture(exc) else ""
    # an operation the capture does not permit: named with the code that ran it (an
    # artifact's, a custom op's, a module's), the same from either engine
    return CudaGraphUnavailable(Decline.CAPTURE_FAILED,
                                f"{type(exc).__name__}: {exc}" + (f", at {origin}" if origin else ""))
