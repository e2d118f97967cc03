"""ArtifactGate: the call a substituted region makes, with its parity gate and demotion.

On the first call per shape key the native region and the artifact run on the same live
inputs, each from the same state (runtime/gates/beside.py: an artifact that writes into an input
it does not declare is caught, and undone where a copy fit `max_snapshot_bytes`; the
inputs it declares in `signature.mutates`, a KV cache's rows, it must write as native
does, and nowhere else); the artifact serves only if its outputs pass the manifest's
parity (the values: bits, or allclose with NaN/inf in place). Raising at any call, a wrong
output at any call (`bad_output`: count, type, shape, dtype, stride or device, at the gate as
later), failing parity, mutating an input, or (with `speed_gate`) not being faster, demotes
the artifact to the native region for the rest of the session; the run goes on with the
native output. Under `strict` a demotion raises.

An artifact can also go wrong after its gate (state, a cache, values only some inputs
have): it is checked again on the calls of each shape key its own schedule picks (the
`artifact_recheck` option, runtime/checks/schedule.py: by default "dense", denser than the
lowering's, since a hand-written kernel is far likelier to be wrong on some inputs than
torch's lowering), on the eager calls whose region inputs leave what its checked calls saw
(runtime/checks/novelty.py: a largest magnitude a binade above, NaN or inf), and on every
call under `timing="shadow"`, which runs native anyway. A
re-check judges the outputs, the undeclared inputs and the declared ones where the region
writes them (a KV cache's new rows): what the kernel writes beyond those rows is judged at
the first call of each shape key, where the cache is read whole, not again on every
re-check at the cache's size. A replay inside a CUDA graph calls no Python, so the gate
re-checks eager calls only; a graph whose artifacts replay is checked whole against eager
on their schedule too (runtime/checks/eager_check.py, with `schedule.graph_schedule`), and a call a
bitwise artifact served inside such a check counts as checked here.

The record says, per region, the calls the artifact served since its last check and the
most it served unchecked in a row (`served_since_check`, `largest_gap`), and for a demotion
at a re-check the call that caught it and the calls served unchecked before it.

Under dynamic shapes the region also takes size symbols (SymInts, concrete ints at run
time): the native region gets every input, the artifact its tensor inputs only
(`kernel_inputs`), so a manifest never names a size; the shape key still includes the
sizes, so parity is checked per concrete shape.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import SubstitutionRecord
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import CaptureRefused, Contain, Demotion
from graphdispatch_backend.runtime.call.keys import layout_key
from graphdispatch_backend.runtime.checks.modes import judging_call, natively
from graphdispatch_backend.runtime.checks.novelty import Arrival, Novelty, Observation
from graphdispatch_backend.runtime.checks.parity import Mismatch, compare
from graphdispatch_backend.runtime.checks.world import Writes
from graphdispatch_backend.runtime.cudagraph.engine import in_recording
from graphdispatch_backend.runtime.cudagraph.refusals import refused_by_capture
from graphdispatch_backend.runtime.gates.beside import Beside, Outcome
from graphdispatch_backend.runtime.gates.checked import CheckBook
from graphdispatch_backend.runtime.gates.demote import Demoter, describe, describe_meta
from graphdispatch_backend.runtime.gates.speed import SpeedTrial

# what a structural mismatch is (runtime/checks/parity.py `Mismatch.what`): a wrong output, not a parity
# failure of its values (errors.py Demotion.BAD_OUTPUT), at the gate as at a later call
_STRUCTURE = frozenset({"count", "type", "shape", "dtype", "device", "stride"})


def _meta(outs: Sequence[Any]) -> tuple[Any, ...]:
    return tuple((o.shape, o.stride(), o.dtype, o.device) if isinstance(o, torch.Tensor) else type(o) for o in outs)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _reason(mismatch: Mismatch) -> Demotion:
    return Demotion.BAD_OUTPUT if mismatch.what in _STRUCTURE else Demotion.PARITY


class ArtifactGate:
    def __init__(
        self,
        *,
        artifact: Callable[..., Any],
        native: Callable[..., Sequence[Any]],
        record: SubstitutionRecord,
        parity: Any,  # manifest Parity: mode, rtol, atol
        contain: Contain,
        contain_artifact: Contain,
        events: Events,
        timing: Timing,
        speed_gate: bool = False,
        strict: bool = False,
        kernel_inputs: Sequence[int] | None = None,
        writes: Writes | None = None,
        snapshot_limit: int | None = None,
        input_names: Sequence[str] = (),
        recheck: str | int = "dense",
        novelty: Arrival = Arrival.NOW,
    ) -> None:
        if kernel_inputs is None:
            self._artifact = artifact
        else:
            positions = tuple(kernel_inputs)

            def tensors_only(*inputs: Any) -> Any:
                return artifact(*(inputs[i] for i in positions))

            self._artifact = tensors_only
        self._native = native
        self._record = record
        self._parity = parity
        self._contain = contain  # graphdispatch's own steps (a snapshot, a comparison)
        # the kernel's runs: what it raises comes back even under strict, so that it is demoted
        # here, and under strict the demotion raises, naming the artifact, region and call
        self._contain_artifact = contain_artifact
        self._events = events
        self._timing = timing
        self._speed_gate = speed_gate
        self._strict = strict
        self._passed: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        # the region's inputs that are no parameters and that it does not write: watched for new values
        watched = [i for i, name in enumerate(input_names) if re.fullmatch(r"input\d+", name or "")
                   and i not in (writes.positions if writes is not None else ())]
        # which eager calls are checked (its schedule, and calls with new inputs); what it served unchecked
        self._checks = CheckBook(recheck, record, Novelty(watched, input_names, novelty))
        self._lock = threading.Lock()
        self.demoted = False
        self._tolerant = parity.mode != "bitwise"
        record.parity_mode = parity.mode
        # native and artifact side by side, each from the same state (runtime/gates/beside.py); the
        # inputs the manifest says the kernel writes (signature.mutates), and where
        self._beside = Beside(writes if writes is not None else Writes(()), snapshot_limit, contain, contain_artifact)
        self._speed = SpeedTrial(self._artifact, native, self._beside, contain, contain_artifact)  # speed_gate only
        self._demoter = Demoter(record, events, timing, strict, input_names)  # what a demotion records and says

    def __call__(self, *inputs: Any) -> Sequence[Any]:
        if self.demoted:
            return self._run_native(inputs)
        call = judging_call()
        if call is not None:
            return self._judge_call(inputs, call)
        if self._tolerant and natively():
            return self._reference_call(inputs)
        key = layout_key(inputs)
        expected = self._passed.get(key)
        if expected is None:
            with self._lock:
                if self.demoted:
                    return self._run_native(inputs)
                if key not in self._passed:
                    return self._gate(key, inputs)
                expected = self._passed[key]
        replaying = in_recording()
        seen = None  # what this call's inputs hold (runtime/checks/novelty.py); none read inside a capture
        if not replaying:
            due, seen, novel = self._checks.take(key, inputs)
            if due:  # unlocked: a lost call under threads only shifts a re-check
                with self._lock:
                    return (self._judge(key, inputs, recheck=True, seen=seen, novel=novel) if not self.demoted
                            else self._run_native(inputs))
        if self._timing.shadow and not replaying:  # a capture may not sync; a replay runs no Python
            if self._beside.mutates:  # both would write: every call is judged side by side instead
                with self._lock:
                    return (self._judge(key, inputs, recheck=True, seen=seen) if not self.demoted
                            else self._run_native(inputs))
            return self._shadow(inputs, expected, seen)
        outs = self._outputs(inputs, expected)
        if outs is None:
            return self._run_native(inputs)
        if not replaying:  # a replay is counted once, by the runner (replayed())
            checked = self._in_graph_check()
            self._checks.served(checked=checked)
            if checked and seen is not None:
                seen.checked()
        return outs

    def _in_graph_check(self) -> bool:
        """This call runs inside the whole graph's check against eager (runtime/checks/eager_check.py),
        which compares what a bitwise artifact served here, bit for bit, and isolates it if it
        differs: the call is a checked one."""
        return not self._tolerant and natively()

    def _outputs(self, inputs: Sequence[Any], expected: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The artifact's outputs, or None after demoting it for raising or a bad output."""
        result, exc = self._contain_artifact(lambda: self._artifact(*inputs))
        if exc is not None and in_recording() and refused_by_capture(exc):
            # not the artifact's fault as an eager kernel: the capture fails, naming it, and
            # the graph's eager calls go on serving it (a demotion would lose it for good)
            raise CaptureRefused(f"{exc} in artifact {self._record.artifact}") from exc
        if exc is not None:
            self._demote(Demotion.RAISED, f"{type(exc).__name__}: {exc}", cause=exc, counted=False, inputs=inputs)
            return None
        outs = _as_tuple(result)
        if _meta(outs) != expected:
            self._demote(Demotion.BAD_OUTPUT, f"returned {describe(outs)}, expected {describe_meta(expected)}",
                         counted=False, inputs=inputs)
            return None
        return outs

    def _judge_call(self, inputs: Sequence[Any], call: str) -> Sequence[Any]:
        """Inside judging(): the artifact beside native on this call's inputs; demoted if it
        differs, naming the call and the inputs; the native outputs answer either way."""
        with self._lock:
            if self.demoted:
                return self._run_native(inputs)
            with self._record.lock:
                self._record.gates += 1
            o = self._beside.run(inputs, lambda *a: self._run_native(a), self._artifact, self._parity)
            if o.unjudged is not None or o.native is None:
                return o.native if o.native is not None else self._run_native(inputs)
            verdict = self._verdict(layout_key(inputs), o, recheck=False)
            self._contain(o.keep_native)
            if verdict is not None:
                reason, detail, mismatch = verdict
                if not self._tolerant:  # its serving in this check counted as checked: it failed the check
                    self._checks.reopen()
                self._demote(reason, f"{detail}; caught at {call}, inputs {self._demoter.inputs(inputs)}", mismatch,
                             cause=o.raised, at="")
            return o.native

    def replayed(self, native: bool = False) -> None:
        """The runner served one call of this region from a captured graph: one recorded
        with the artifact's kernels, or (`native`) with the native region's."""
        if native:
            with self._record.lock:
                self._record.native_calls += 1
        else:  # inside a whole-graph check the replay's outputs are compared with eager's
            self._checks.served(checked=self._in_graph_check(), replayed=True)

    def _reference_call(self, inputs: Sequence[Any]) -> Sequence[Any]:
        """Inside native_regions(): gate as usual if this shape key is new, but answer natively."""
        key = layout_key(inputs)
        with self._lock:
            if key not in self._passed and not self.demoted:
                self._checks.due(key)  # the key's first call: its schedule starts here
                return self._judge(key, inputs, native_answer=True)
        return self._run_native(inputs)

    def _run_native(self, inputs: Sequence[Any]) -> Sequence[Any]:
        # counted once per call it answers: a run inside a capture, a verification or an
        # emulated replay answers no call (a replay is counted by the runner, replayed()),
        # so the count is the same under emulate as on a GPU; nor does a check's culprit
        # run (`judging`: the call it judges was counted when it was served)
        if not in_recording() and judging_call() is None:
            with self._record.lock:
                self._record.native_calls += 1
        return self._native(*inputs)

    def _gate(self, key: tuple[Any, ...], inputs: Sequence[Any]) -> Sequence[Any]:
        start = self._timing.now() if self._timing.enabled else 0.0
        # the key's first call (checked, whatever the schedule): its schedule starts here
        seen = self._checks.first(key, inputs) if not in_recording() else None
        try:
            return self._judge(key, inputs, seen=seen)
        finally:
            if self._timing.enabled:
                self._timing.add("artifact_gate", self._timing.now() - start)

    def _judge(self, key: tuple[Any, ...], inputs: Sequence[Any], recheck: bool = False,
               native_answer: bool = False, seen: Observation | None = None,
               novel: str | None = None) -> Sequence[Any]:
        """The artifact judged beside its native region on this call's inputs; `seen`: what
        the inputs hold (seen, once judged), `novel`: why they made the call due."""
        with self._record.lock:
            self._record.gates += 1
        # a re-check judges the declared inputs on the rows the call writes; whole (a cache's
        # size) only at the first call of a shape key (runtime/gates/beside.py)
        o = self._beside.run(inputs, lambda *a: self._run_native(a), self._artifact, self._parity,
                             whole=not recheck)
        if o.unjudged is not None:  # graphdispatch's own step failed (memory): no verdict this call
            self._timing.note(f"artifact {self._record.artifact} not judged at {self._record.region}: {o.unjudged}")
            return o.native if o.native is not None else self._run_native(inputs)
        native = o.native
        assert native is not None
        verdict = self._verdict(key, o, recheck)
        if seen is not None:  # judged: what this call's inputs hold counts as seen
            seen.checked()
        if novel is not None:
            self._checks.novel_check()
        if verdict is not None:
            self._contain(o.keep_native)
            reason, detail, mismatch = verdict
            if o.outside and "beyond the rows" not in detail:
                detail += f"; {self._beyond(o)}"
            if recheck:
                detail += self._checks.caught(key, novel)
            self._demote(reason, detail, mismatch, cause=o.raised, inputs=inputs)
            return native
        # Parity passed: say so before the speed gate, whose "slower" is no parity failure.
        p = self._parity
        with self._record.lock:
            self._record.parity = "passed"
        if self._speed_gate and not recheck and not self._faster(inputs):
            return native
        outs = _as_tuple(o.result)
        self._passed[key] = _meta(outs)
        if not recheck:  # a passed re-check is routine; a failed one is a demotion event
            self._events.decision("parity", {"region": self._record.region, "artifact": self._record.artifact,
                                             "verdict": "passed", "mode": p.mode})
        if native_answer:  # the eager check wants the lowering's own bits (see native_regions)
            self._contain(o.keep_native)
            return native
        if not in_recording():
            with self._record.lock:
                self._record.native_calls -= 1  # the native run here was the reference, not a fallback
            self._checks.served(checked=True)
        return outs

    def _verdict(self, key: tuple[Any, ...], o: Outcome, recheck: bool) -> tuple[Demotion, str, Any] | None:
        """Why the artifact is demoted after this side-by-side run, or None (it passed)."""
        if o.touched:
            names = ", ".join(f"input {i}" for i in o.touched)
            undone = "" if o.undone else (" (too large to copy beforehand: the write could not be undone; "
                                          "those inputs may hold what it wrote)")
            return Demotion.MUTATED_INPUT, f"wrote into {len(o.touched)} of its inputs ({names}){undone}", None
        if o.raised is not None:
            return Demotion.RAISED, f"{type(o.raised).__name__}: {o.raised}", None
        outs = _as_tuple(o.result)
        if recheck and _meta(outs) != self._passed.get(key, _meta(outs)):  # what a later call would call bad
            expected = describe_meta(self._passed[key])
            return Demotion.BAD_OUTPUT, f"returned {describe(outs)}, expected {expected}", None
        if not all(isinstance(out, torch.Tensor) for out in outs):
            return Demotion.BAD_OUTPUT, f"returned {describe(outs)}; tensors expected", None
        p = self._parity
        assert o.native is not None
        mismatch = compare(list(o.native), list(outs), p.mode, p.rtol, p.atol)
        if mismatch is not None:
            return _reason(mismatch), str(mismatch), mismatch
        if o.writes is not None:
            return Demotion.PARITY, o.writes.describe(f"the rows it writes in place ({self._written()})"), o.writes
        if o.outside:
            return Demotion.PARITY, self._beyond(o), None
        return None

    def _beyond(self, o: Outcome) -> str:
        undone = "undone" if o.outside_undone else ("not undone: too large to copy within max_snapshot_bytes; it may "
                                            "hold what the artifact wrote")
        return f"it wrote {self._written()} beyond the rows the region writes ({undone})"

    def _written(self) -> str:
        return ", ".join(self._record.mutates) or "its declared inputs"

    def _faster(self, inputs: Sequence[Any]) -> bool:
        speed, demotion = self._speed.judge(inputs)
        if speed is not None:
            self._record.speed = speed
        if demotion is not None:
            self._demote(*demotion, inputs=inputs)
        return demotion is None

    def _shadow(self, inputs: Sequence[Any], expected: tuple[Any, ...],
                seen: Observation | None = None) -> Sequence[Any]:
        t0 = self._timing.now()
        outs = self._outputs(inputs, expected)
        t1 = self._timing.now()
        native = self._run_native(inputs)
        t2 = self._timing.now()
        with self._record.lock:
            shadow = self._record.shadow
            shadow["calls"] = shadow.get("calls", 0) + 1
            shadow["artifact_s"] = shadow.get("artifact_s", 0.0) + (t1 - t0)
            shadow["native_s"] = shadow.get("native_s", 0.0) + (t2 - t1)
        if outs is None:  # demoted; the native run above answers (not run a second time)
            return native
        p = self._parity
        mismatch = compare(list(native), list(outs), p.mode, p.rtol, p.atol)
        if seen is not None:
            seen.checked()
        if mismatch is not None:  # native ran anyway: every call is a parity check
            with self._record.lock:
                self._record.caught_by = "shadow"
            self._demote(_reason(mismatch), f"{mismatch} (shadow check)", mismatch, inputs=inputs)
            return native
        with self._record.lock:
            self._record.native_calls -= 1  # the shadow's native run was timing, not a fallback
        self._checks.served(checked=True)
        return outs

    def _demote(self, reason: Demotion, detail: str, mismatch: Mismatch | None = None, **how: Any) -> None:
        """Serve native from now on, the demotion recorded and said (runtime/gates/demote.py;
        under strict it raises instead)."""
        self.demoted = True
        self._demoter(reason, detail, mismatch, **how)
