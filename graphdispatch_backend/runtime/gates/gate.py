"""ArtifactGate: the call a substituted region makes, with its parity gate and demotion.

On the first call per shape key the native region and the artifact run on the same live
inputs, each from the same state (runtime/gates/beside.py: an artifact that writes into an input
it does not declare is caught, and undone where a copy fit `max_snapshot_bytes`; the
inputs it declares in `signature.mutates`, a KV cache's rows, it must write as native
does, and nowhere else); the artifact serves only if its outputs pass the manifest's
parity (the values: bits, or allclose with NaN/inf in place). Raising at any call, a wrong
output at any call (`bad_output`: count, type, shape, dtype, stride or device, at the gate as
later; at a judged call also memory shared with an input or another output where native's
is not), failing parity, mutating an input (at a judged call by the guards; at an unchecked
eager call, and in the runs a CUDA graph's warmup, capture and check make, by torch's count
of writes, `Tensor._version`), drawing from a default generator
(`drew`), or (with `speed_gate`) not being faster, demotes the artifact to the native region
for the rest of the session; the run goes on with the native output. Under `strict` a
demotion raises.

An artifact can also go wrong after its gate (state, a cache, values only some inputs
have): it is checked again on the calls of each shape key its own schedule picks (the
`artifact_recheck` option, runtime/checks/schedule.py: by default "dense", denser than the
lowering's, since a hand-written kernel is far likelier to be wrong on some inputs than
torch's lowering), on the eager calls whose region inputs leave what its checked calls saw
(runtime/checks/novelty.py: a largest magnitude a binade above, NaN or inf), and on every
call under `timing="shadow"`, which runs native anyway. A
re-check judges the outputs, the undeclared inputs and the declared ones where the region
writes them (a KV cache's new rows), and what the kernel writes beyond those rows by a
fingerprint of the cache after each run, at every check (a whole copy to undo it only at
the first call of each shape key: runtime/gates/beside.py). A replay inside a CUDA graph calls no Python, so the gate
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

import operator
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import SubstitutionRecord
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import CaptureRefused, Contain, Demotion
from graphdispatch_backend.runtime.call.keys import layout_key
from graphdispatch_backend.runtime.checks.modes import judging_call, natively
from graphdispatch_backend.runtime.checks.novelty import Arrival, Novelty
from graphdispatch_backend.runtime.checks.parity import Mismatch
from graphdispatch_backend.runtime.checks.world import Writes
from graphdispatch_backend.runtime.cudagraph.engine import in_recording
from graphdispatch_backend.runtime.cudagraph.refusals import refused_by_capture
from graphdispatch_backend.runtime.gates.beside import Beside
from graphdispatch_backend.runtime.gates.checked import CheckBook
from graphdispatch_backend.runtime.gates.demote import Demoter, describe, describe_meta, raised
from graphdispatch_backend.runtime.gates.judge import GateJudge, as_tuple, meta
from graphdispatch_backend.runtime.gates.kin import KindOf
from graphdispatch_backend.runtime.gates.reuse import memory_of, reused_detail
from graphdispatch_backend.runtime.gates.speed import SpeedTrial

# the fix a CUDA capture's refusal inside an artifact names: its own words say what the kernel
# did (a host sync, a size known only after it ran), not what the author may change
CAPTURE_FIX = ('a capture refuses it: set "capturable": false in its artifact.json and the CUDA graph is split '
               "around the call, so the rest of the graph replays; or take that operation out of the kernel")


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
        kin: KindOf | None = None,
    ) -> None:
        if kernel_inputs is None:
            self._artifact = artifact
        else:
            positions = tuple(kernel_inputs)

            def tensors_only(*inputs: Any) -> Any:
                return artifact(*[inputs[i] for i in positions])  # (a generator: a frame per input, per call)

            self._artifact = tensors_only
        self._native = native
        self._record = record
        self._contain = contain  # graphdispatch's own steps (a snapshot, a comparison)
        # the kernel's runs: what it raises comes back even under strict, so that it is demoted
        # here, and under strict the demotion raises, naming the artifact, region and call
        self._contain_artifact = contain_artifact
        self._timing = timing
        self._strict = strict
        # the region's inputs that are no parameters and that it does not write: watched for new values
        written = writes.positions if writes is not None else ()
        watched = [i for i, name in enumerate(input_names)
                   if re.fullmatch(r"input\d+", name or "") and i not in written]
        # which eager calls are checked (its schedule, and calls with new inputs); what it served unchecked
        state = [i for i, name in enumerate(input_names) if name and not re.fullmatch(r"input\d+", name)
                 and i not in written]  # its weights, not a cache
        self._checks = CheckBook(recheck, record, Novelty(watched, input_names, novelty), state)
        # the inputs it may not write, whose writes torch counts (`Tensor._version`): an
        # unchecked call that writes one (its bias, once) is caught on that call; a check
        # after it would compare two runs that both read what it wrote
        self._unwritable = tuple(i for i in range(len(input_names)) if i not in written)
        self._counted = self._unwritable
        self._names = list(input_names)
        self._lock = threading.Lock()
        self.demoted = False
        # the gates of this kernel at its other regions: a fault of the kernel's demotes them (kin.py)
        self._kin = kin
        record_fields.parity_mode(record, parity.mode)
        # native and artifact side by side, each from the same state (runtime/gates/beside.py); the
        # inputs the manifest says the kernel writes (signature.mutates), and where
        self._beside = Beside(writes if writes is not None else Writes(()), snapshot_limit, contain, contain_artifact)
        speed = SpeedTrial(self._artifact, native, self._beside, contain, contain_artifact) if speed_gate else None
        self._demoter = Demoter(record, events, timing, strict, input_names)  # what a demotion records and says
        # what a judged call means: a demotion or a pass (runtime/gates/judge.py)
        # the storages of the kernel's last outputs, shared by every region it serves (runtime/gates/reuse.py)
        self._memory = memory_of(artifact)
        self._judge = GateJudge(self._artifact, self._run_native, record, parity, self._beside, speed, self._checks,
                                contain, events, timing, self._demote, self._memory)
        self._tolerant = self._judge.tolerant
        self._passed = self._judge.passed
        if kin is not None:  # last: a kernel its kin found at fault before this gate was made is demoted here too
            kin.join(self)

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
                    return (self._judge.judge(key, inputs, recheck=True, seen=seen, novel=novel) if not self.demoted
                            else self._run_native(inputs))
        if self._timing.shadow and not replaying:  # a capture may not sync; a replay runs no Python
            if self._beside.mutates:  # both would write: every call is judged side by side instead
                with self._lock:
                    return (self._judge.judge(key, inputs, recheck=True, seen=seen) if not self.demoted
                            else self._run_native(inputs))
            t0 = self._timing.now()
            outs = self._outputs(inputs, expected)
            return self._judge.shadow(inputs, outs, self._timing.now, t0, self._timing.now(), seen)
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
        """The artifact's outputs, or None after demoting it for raising, a bad output, or
        a write torch counted into an input it does not declare."""
        # inside a recording too (a CUDA graph's warmup, its capture, the graph check's eager
        # runs): none of those snapshots an input the graph does not write, so a write there
        # stays, and a capture that recorded it would repeat it on every replay; the
        # runner captures again without the artifact (runner/record.py takes the gates'
        # states before the capture)
        counts = self._write_counts(inputs) if self._unwritable else None
        result, exc = self._contain_artifact(lambda: self._artifact(*inputs))
        if counts is not None and (after := self._write_counts(inputs)) != counts:
            names = ", ".join(f"input {p} ({self._names[p]})" if self._names[p] else f"input {p}"
                              for p, a, b in zip(self._counted, counts, after) if a != b)
            run = ("in a run made for a CUDA graph (its warmup, its capture or its check against eager)"
                   if in_recording() else "on a call served unchecked")
            self._demote(Demotion.MUTATED_INPUT,
                         f"wrote into {names} {run} (torch counted the write; not undone: "
                         "such a run keeps no copy, so those inputs may hold what it wrote, but where the graph's "
                         "check against eager made the run and copied them: it puts them back)",
                         counted=False, inputs=inputs)
            return None
        if exc is not None and in_recording() and refused_by_capture(exc):
            # not the artifact's fault as an eager kernel: the capture fails, naming it, and
            # the graph's eager calls go on serving it (a demotion would lose it for good)
            raise CaptureRefused(f"{exc} in artifact {self._record.artifact} ({CAPTURE_FIX})") from exc
        if exc is not None:
            self._demote(Demotion.RAISED, raised(exc), cause=exc, counted=False, inputs=inputs)
            return None
        outs = as_tuple(result)
        if meta(outs) != expected:
            self._demote(Demotion.BAD_OUTPUT, f"returned {describe(outs)}, expected {describe_meta(expected)}",
                         counted=False, inputs=inputs)
            return None
        reused = self._memory.reused(outs, inputs)
        if reused is not None:
            self._demote(Demotion.BAD_OUTPUT, reused_detail(reused), counted=False, inputs=inputs)
            return None
        return outs

    def _write_counts(self, inputs: Sequence[Any]) -> list[int]:
        """torch's count of writes into each input at `_counted`: the inputs it may not
        write, less those a call held as something torch counts no writes of (a size; an
        inference tensor: under inference_mode, its activations; its weights stay). The
        usual call reads the counts alone: 0.45 us for five inputs."""
        try:
            return list(map(_VERSION, map(inputs.__getitem__, self._counted)))
        except (AttributeError, RuntimeError):  # a size; an inference tensor ("does not track version counter")
            self._counted = tuple(p for p in self._unwritable if _counted(inputs[p]))
            return list(map(_VERSION, map(inputs.__getitem__, self._counted)))

    def _judge_call(self, inputs: Sequence[Any], call: str) -> Sequence[Any]:
        """Inside judging(): the artifact beside native on this call's inputs (runtime/gates/judge.py)."""
        with self._lock:
            if self.demoted:
                return self._run_native(inputs)
            return self._judge.judge_call(layout_key(inputs), inputs, call, self._demoter.inputs(inputs))

    @property
    def artifact(self) -> str:
        """The artifact's id."""
        return self._record.artifact

    @property
    def tolerant(self) -> bool:
        """Its parity is allclose and it serves: inside a graph's check against eager it
        answers natively (demoted, it answers natively everywhere)."""
        return self._tolerant and not self.demoted

    def replayed(self, native: bool = False) -> None:
        """The runner served one call of this region from a captured graph: one recorded
        with the artifact's kernels, or (`native`) with the native region's."""
        if native:
            with self._record.lock:
                self._record.native_calls += 1
        else:  # inside a whole-graph check the replay's outputs are compared with eager's
            self._checks.served(checked=self._in_graph_check(), replayed=True)

    def _reference_call(self, inputs: Sequence[Any]) -> Sequence[Any]:
        """Inside native_regions() (a check of its graph against eager): judged beside its
        native region, answering natively; its gate if this shape key is new, else a
        re-check, which closes the run of calls it served unchecked (replays included: the
        graph's checks are made on this artifact's schedule too, eager_check.py)."""
        key = layout_key(inputs)
        with self._lock:
            if self.demoted:
                return self._run_native(inputs)
            if key not in self._passed:
                self._checks.due(key, inputs)  # the key's first call: its schedule starts here
                return self._judge.judge(key, inputs, native_answer=True)
            return self._judge.judge(key, inputs, recheck=True, native_answer=True)

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
            return self._judge.judge(key, inputs, seen=seen)
        finally:
            if self._timing.enabled:
                self._timing.add("artifact_gate", self._timing.now() - start)

    def _demote(self, reason: Demotion, detail: str, mismatch: Mismatch | None = None, **how: Any) -> None:
        """Serve native from now on, the demotion recorded and said (runtime/gates/demote.py;
        under strict it raises instead)."""
        self.demoted = True
        try:  # said first, then its kin (the demoter raises under strict: they are demoted all the same)
            self._demoter(reason, detail, mismatch, **how)
        finally:
            if self._kin is not None:
                self._kin.demoted(self, self._record.region, reason, detail)

    def kin_demoted(self, region: str, reason: Demotion, detail: str) -> None:
        """This kernel was demoted at `region` for a fault of its own
        (runtime/gates/kin.py): not served here either. A plain write, no lock: a call that
        read the flag before it serves the kernel once more, as one racing a demotion here
        would; a runner sees the flag at its next call and captures again without it."""
        if self.demoted:
            return
        self.demoted = True
        self._demoter.elsewhere(region, reason, detail)


_VERSION = operator.attrgetter("_version")


def _counted(t: Any) -> bool:
    """torch counts the writes into it: a tensor, not an inference tensor (a size is none)."""
    return isinstance(t, torch.Tensor) and not t.is_inference()
