"""Demoter: what a gate does when its artifact is found wrong, and how it says it.

The substitution's record takes the verdict (reason, detail, the largest difference and
where it is); the timing notes and the trace take the decision; a WARNING names the
region (once per artifact, region and reason: every demoted region is named, where one
line per kind named only its first); under `strict` the same becomes an error,
`ArtifactDemoted`, naming the artifact, the region, the call and its inputs, chained to
what the kernel raised, instead of the demotion's WARNING.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import SubstitutionRecord
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Demotion, StrictModeError
from graphdispatch_backend.runtime.checks.parity import Mismatch
from graphdispatch_backend.runtime.cudagraph.engine import in_recording
from graphdispatch_backend.runtime.cudagraph.refusals import where


class ArtifactDemoted(StrictModeError):
    """Raised instead of demoting when `strict` is set."""


class Demoter:
    """One gate's demotions (module docstring); `names` are its region's input names."""

    def __init__(self, record: SubstitutionRecord, events: Events, timing: Timing, strict: bool,
                 names: Sequence[str]) -> None:
        self._record, self._events, self._timing, self._strict = record, events, timing, strict
        self._names = tuple(names)

    def __call__(self, reason: Demotion, detail: str, mismatch: Mismatch | None = None, *,
                 cause: BaseException | None = None, counted: bool = True, at: str | None = None,
                 inputs: Sequence[Any] | None = None) -> None:
        """Demote the artifact for this region, recorded and said (a WARNING per region);
        under strict, raise that instead, naming the artifact, the region, the call (`at`;
        by default the region's call: `counted`, it is in the record's counts already) and
        its `inputs`, from what the kernel raised (`cause`)."""
        record = self._record
        if at is None:  # the inputs' values are not read inside a capture (a host sync)
            at = self._at(counted) + (f" (inputs {self.inputs(inputs)})" if inputs is not None
                                      and not in_recording() else "")
        where = self._recorded(reason, detail, mismatch, at)
        if self._strict:
            raise ArtifactDemoted(f"strict: artifact {record.artifact} failed {where}: {detail}") from cause
        self._said(reason, where, detail)

    def elsewhere(self, region: str, reason: Demotion, detail: str) -> None:
        """The same kernel was demoted at `region`, another region it serves, for `reason`
        (runtime/gates/kin.py): recorded and said here too; never raised (under strict, the
        region that met the fault raises)."""
        said = f"its kernel was demoted at region {region} ({reason.value}): {detail}"
        self._said(Demotion.DEMOTED_ELSEWHERE, self._recorded(Demotion.DEMOTED_ELSEWHERE, said, None, ""), said)

    def _recorded(self, reason: Demotion, detail: str, mismatch: Mismatch | None, at: str) -> str:
        """The demotion in the record, the timing notes and the trace; returns where it was."""
        record = self._record
        with record.lock:
            record_fields.demotion(record, reason.value, detail, reason in (Demotion.PARITY, Demotion.MUTATED_INPUT),
                                   (mismatch.max_abs_diff, mismatch.first_index) if mismatch is not None else None)
        where = f"for region {record.region} ({reason.value}){' ' + at if at else ''}"
        self._timing.note(f"artifact {record.artifact} demoted to native {where}: {detail}")
        self._events.decision("demotion", {"region": record.region, "artifact": record.artifact,
                                           "reason": reason.value, "detail": detail})
        return where

    def _said(self, reason: Demotion, where: str, detail: str) -> None:
        """The WARNING, once per artifact, region and reason."""
        record = self._record
        # under strict the region that met the fault raises instead; its kin are said (after it), and the call raises
        then = "the call that met it raises (strict)" if self._strict else "the run goes on"
        self._events.warn_once(f"demote:{record.artifact}:{record.region}:{reason.value}", "graphdispatch: %s; %s",
                               f"artifact {record.artifact} demoted to native {where}: {detail}", then)

    def inputs(self, inputs: Sequence[Any]) -> str:
        """The call's tensor inputs that are no parameters: name, shape, dtype, max |x|."""
        said = []
        for name, t in zip(self._names, inputs):
            if isinstance(t, torch.Tensor) and re.fullmatch(r"input\d+", name or "input0"):
                peak = f"{t.detach().abs().max().item():.4g}" if t.numel() and (
                    t.is_floating_point() or t.is_complex()) else "-"
                said.append(f"{name or '?'} {list(t.shape)} {str(t.dtype).replace('torch.', '')} max|x| {peak}")
        return "; ".join(said) or "(parameters only)"

    def _at(self, counted: bool) -> str:
        """The call a demotion happened at: the region's call (eager or replayed), counted
        in its record already or not yet; or the recording of a CUDA graph."""
        r = self._record
        with r.lock:
            n = r.calls + r.replays + r.native_calls
        if in_recording():  # inside a call not counted yet, and no call of the region's own
            return f"at the region's call {n + 1}, while a CUDA graph was recorded"
        return f"at the region's call {n + (0 if counted else 1)}"


def raised(exc: BaseException) -> str:
    """A `raised` demotion's detail: the error, and the kernel's line that raised it (as a
    capture's refusal says it: `forward (<graphdispatch artifact mlp:kernel.py>:10)`)."""
    origin = where(exc)
    return f"{type(exc).__name__}: {exc}" + (f", at {origin}" if origin else "")


def describe(outs: Sequence[Any] | None) -> str:
    """What an artifact returned, for a `bad_output` detail."""
    if outs is None:
        return "nothing"
    return ", ".join(
        f"Tensor{list(o.shape)} {o.dtype} stride {o.stride()}" if isinstance(o, torch.Tensor) else type(o).__name__
        for o in outs
    ) or "an empty tuple"


def describe_meta(meta: tuple[Any, ...]) -> str:
    """What the native region returned (its outputs' metadata), for a `bad_output` detail."""
    return ", ".join(
        f"Tensor{list(m[0])} {m[2]} stride {m[1]}" if isinstance(m, tuple) else getattr(m, "__name__", str(m))
        for m in meta
    )
