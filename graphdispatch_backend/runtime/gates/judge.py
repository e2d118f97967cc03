"""GateJudge: an artifact's gate's policy over its side-by-side run with the native region.

The gate (runtime/gates/gate.py) decides which calls are judged; this decides what one
judged call means. The run itself is runtime/gates/beside.py (over runtime/checks/side_by_side.py:
the native region the reference, the kernel the candidate); its outcome is a demotion
(`verdict`: an undeclared write, a raise, a bad output, a parity failure of the outputs or
the declared writes, a write beyond the rows) or a pass, after which the speed gate may
still demote (`speed_gate`), and the call is answered by the artifact's outputs (a pass)
or the native ones. Under `timing="shadow"` every call runs both, and is judged on its
outputs (`shadow`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import SubstitutionRecord
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Contain, Demotion
from graphdispatch_backend.runtime.checks.novelty import Observation
from graphdispatch_backend.runtime.checks.parity import Mismatch, compare, compare_aliasing, largest_gap
from graphdispatch_backend.runtime.cudagraph.engine import in_recording
from graphdispatch_backend.runtime.gates.beside import Beside, Outcome
from graphdispatch_backend.runtime.gates.checked import CheckBook
from graphdispatch_backend.runtime.gates.demote import describe, describe_meta, raised
from graphdispatch_backend.runtime.gates.reuse import OutputMemory, reused_detail
from graphdispatch_backend.runtime.gates.speed import SpeedTrial

# what a structural mismatch is (runtime/checks/parity.py `Mismatch.what`): a wrong output, not a parity
# failure of its values (errors.py Demotion.BAD_OUTPUT), at the gate as at a later call
_STRUCTURE = frozenset({"count", "type", "shape", "dtype", "device", "stride", "aliasing"})

Demote = Callable[..., None]  # the gate's demotion: (reason, detail, mismatch, **how)


def meta(outs: Sequence[Any]) -> tuple[Any, ...]:
    return tuple([(o.shape, o.stride(), o.dtype, o.device) if isinstance(o, torch.Tensor) else type(o) for o in outs])


def as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def reason_of(mismatch: Mismatch) -> Demotion:
    return Demotion.BAD_OUTPUT if mismatch.what in _STRUCTURE else Demotion.PARITY


class GateJudge:
    """One region's judged calls: `passed` holds, per shape key, the outputs' metadata of
    the call that passed its gate."""

    def __init__(self, artifact: Callable[..., Any], run_native: Callable[[Sequence[Any]], Sequence[Any]],
                 record: SubstitutionRecord, parity: Any, beside: Beside, speed: SpeedTrial | None,
                 checks: CheckBook, contain: Contain, events: Events, timing: Timing, demote: Demote,
                 memory: OutputMemory | None = None) -> None:
        self._artifact, self._run_native = artifact, run_native
        self._record, self._parity = record, parity
        self._beside, self._speed = beside, speed  # speed: with speed_gate only
        self._checks = checks
        self._contain, self._events, self._timing = contain, events, timing
        self._demote = demote
        self._memory = memory if memory is not None else OutputMemory()  # the kernel's last outputs (reuse.py)
        self.passed: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.tolerant = parity.mode != "bitwise"

    def judge(self, key: tuple[Any, ...], inputs: Sequence[Any], recheck: bool = False,
              native_answer: bool = False, seen: Observation | None = None,
              novel: str | None = None) -> Sequence[Any]:
        """The artifact judged beside its native region on this call's inputs; `seen`: what
        the inputs hold (seen, once judged), `novel`: why they made the call due."""
        with self._record.lock:
            self._record.gates += 1
        # a re-check copies the declared inputs' rows the call writes, not the cache; it
        # fingerprints them whole as the first call does (runtime/gates/beside.py)
        o = self._beside.run(inputs, lambda *a: self._run_native(a), self._artifact, self._parity,
                             whole=not recheck)
        if o.unjudged is not None:  # graphdispatch's own step failed (memory): no verdict this call
            self._timing.note(f"artifact {self._record.artifact} not judged at {self._record.region}: {o.unjudged}")
            return o.native if o.native is not None else self._run_native(inputs)
        native = o.native
        assert native is not None
        verdict = self.verdict(key, o, recheck, inputs)
        if seen is not None:  # judged: what this call's inputs hold counts as seen
            seen.checked()
        if novel is not None:
            self._checks.novel_check()
        if verdict is not None:
            self._contain(o.keep_native)
            reason, detail, mismatch = verdict
            if o.outside and "beyond the rows" not in detail:
                detail += f"; {self._beyond(o)}"
            if recheck:  # on its schedule at an eager call, or (answering natively) at a check of its graph
                checks = self._checks
                detail += checks.caught_in_graph_check() if native_answer else checks.caught(key, inputs, novel)
            self._demote(reason, detail, mismatch, cause=o.raised, inputs=inputs)
            return native
        # Parity passed: say so before the speed gate, whose "slower" is no parity failure.
        p = self._parity
        # allclose: the difference it passed with, the error its served calls may carry
        gap = self._contain(lambda: largest_gap(as_tuple(native), as_tuple(o.result)))[0] if self.tolerant else None
        record_fields.parity_passed(self._record, gap)
        if self._speed is not None and not recheck and not self._faster(inputs):
            return native
        outs = as_tuple(o.result)
        reused = self._memory.reused(outs, inputs)
        if reused is not None:  # its values passed; the memory they are in is another output's
            self._contain(o.keep_native)
            self._demote(Demotion.BAD_OUTPUT, reused_detail(reused), None, cause=None, inputs=inputs)
            return native
        self.passed[key] = meta(outs)
        if not recheck:  # a passed re-check is routine; a failed one is a demotion event
            self._events.decision("parity", {"region": self._record.region, "artifact": self._record.artifact,
                                             "verdict": "passed", "mode": p.mode})
        if native_answer:  # the eager check wants the lowering's own bits (see native_regions)
            self._contain(o.keep_native)
            self._checks.judged()
            return native
        if not in_recording():
            with self._record.lock:
                self._record.native_calls -= 1  # the native run here was the reference, not a fallback
            self._checks.served(checked=True)
        return outs

    def judge_call(self, key: tuple[Any, ...], inputs: Sequence[Any], call: str, named: str) -> Sequence[Any]:
        """Inside judging(): the artifact beside native on this call's inputs (`named`: them,
        described); demoted if it differs, naming the call and the inputs; the native outputs
        answer either way."""
        with self._record.lock:
            self._record.gates += 1
        o = self._beside.run(inputs, lambda *a: self._run_native(a), self._artifact, self._parity)
        if o.unjudged is not None or o.native is None:
            return o.native if o.native is not None else self._run_native(inputs)
        verdict = self.verdict(key, o, False, inputs)
        self._contain(o.keep_native)
        if verdict is not None:
            reason, detail, mismatch = verdict
            if not self.tolerant:  # its serving in this check counted as checked: it failed the check
                self._checks.reopen()
            self._demote(reason, f"{detail}; caught at {call}, inputs {named}", mismatch, cause=o.raised, at="")
        return o.native

    def verdict(self, key: tuple[Any, ...], o: Outcome, recheck: bool,
                inputs: Sequence[Any]) -> tuple[Demotion, str, Any] | None:
        """Why the artifact is demoted after this side-by-side run, or None (it passed)."""
        if o.touched:
            names = ", ".join(f"input {i}" for i in o.touched)
            undone = "" if o.undone else (" (too large to copy beforehand: the write could not be undone; "
                                          "those inputs may hold what it wrote)")
            return Demotion.MUTATED_INPUT, f"wrote into {len(o.touched)} of its inputs ({names}){undone}", None
        if o.raised is not None:
            return Demotion.RAISED, raised(o.raised), None
        if o.drew:
            return Demotion.DREW, ("drew from torch's default generator, which its region does not (put back: "
                                   "the caller's later draws are eager's); a kernel's randomness needs a generator "
                                   "of its own"), None
        if o.changed:
            return Demotion.CHANGED_SETTINGS, (f"changed torch's process-wide settings: {o.changed} (put back: the "
                                               "rest of the process runs as it would without the kernel)"), None
        outs = as_tuple(o.result)
        if recheck and meta(outs) != self.passed.get(key, meta(outs)):  # what a later call would call bad
            expected = describe_meta(self.passed[key])
            return Demotion.BAD_OUTPUT, f"returned {describe(outs)}, expected {expected}", None
        if not all(isinstance(out, torch.Tensor) for out in outs):
            return Demotion.BAD_OUTPUT, f"returned {describe(outs)}; tensors expected", None
        p = self._parity
        assert o.native is not None
        # the memory its outputs share with its inputs and with each other, as native's: an
        # output that is its input (or a weight) is written by whoever writes the other later
        mismatch = compare(list(o.native), list(outs), p.mode, p.rtol, p.atol) or \
            compare_aliasing(list(o.native), list(outs), inputs)
        if mismatch is not None:
            return reason_of(mismatch), str(mismatch), mismatch
        if o.writes is not None:
            return Demotion.PARITY, o.writes.describe(f"the rows it writes in place ({self._written()})"), o.writes
        if o.outside:
            return Demotion.PARITY, self._beyond(o), None
        return None

    def _beyond(self, o: Outcome) -> str:
        undone = ("undone" if o.outside_undone else
                  "not undone: too large to copy within max_snapshot_bytes; it may hold what the artifact wrote"
                  if o.copying else "not undone: a re-check keeps no whole copy; it may hold what the artifact wrote "
                  "on this call and on the calls it served unchecked before")
        return f"it wrote {self._written()} beyond the rows the region writes ({undone})"

    def _written(self) -> str:
        return ", ".join(self._record.mutates) or "its declared inputs"

    def _faster(self, inputs: Sequence[Any]) -> bool:
        assert self._speed is not None
        speed, demotion = self._speed.judge(inputs)
        if speed is not None:
            record_fields.speed(self._record, speed)
        if demotion is not None:
            self._demote(*demotion, inputs=inputs)
        return demotion is None

    def shadow(self, inputs: Sequence[Any], outs: tuple[Any, ...] | None, time: Callable[[], float],
               t0: float, t1: float, seen: Observation | None = None) -> Sequence[Any]:
        """`timing="shadow"`: the artifact ran (`outs`; None: demoted) from t0 to t1; native
        runs now, timed beside it, and every call is a parity check of the outputs."""
        native = self._run_native(inputs)
        t2 = time()
        record_fields.shadow_timed(self._record, t1 - t0, t2 - t1)
        if outs is None:  # demoted; the native run above answers (not run a second time)
            return native
        p = self._parity
        mismatch = compare(list(native), list(outs), p.mode, p.rtol, p.atol)
        if seen is not None:
            seen.checked()
        if mismatch is not None:  # native ran anyway: every call is a parity check
            record_fields.caught_by(self._record, "shadow")
            self._demote(reason_of(mismatch), f"{mismatch} (shadow check)", mismatch, inputs=inputs)
            return native
        with self._record.lock:
            self._record.native_calls -= 1  # the shadow's native run was timing, not a fallback
        self._checks.served(checked=True)
        return outs
