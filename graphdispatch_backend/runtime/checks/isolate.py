"""Isolate: which party made a checked call differ from eager, found by running, never guessed.

A checked call (runtime/checks/eager_check.py) compares what was served (a replay, eager pieces,
artifacts serving) with the Dynamo graph run eagerly, the reference. When they differ and
eager agrees with itself, three parties can be at fault, and this module tells them apart
on the call's own inputs, from the world before the call:

1. the graph runs again through the same compiled path, but eagerly (no piece replays:
   `isolating()`), and every artifact gate judges its kernel beside its native region on
   the inputs that region gets in this call, answering natively (runtime/gates/gate.py
   `judging`): an artifact that differs is demoted there, naming the call and its inputs.
   Then the artifact was the culprit: the captures holding it re-capture without it.
2. else, for a fused graph (runtime/program/fused.py), the graph runs again the same way with its
   ATen kernels, unfused: if that matches the reference, the fusion is at fault, and the
   ops whose fused result differs are found by running (bisection over the fused ops, a
   compile and a run per step) and kept as ATen calls for the graph;
3. else, if that eager, native run still differs from the reference, the lowering is;
4. else the capture is: the pieces that replayed in the checked call are declined.

Where the graph holds collectives, running it again on one rank alone would put that rank's
collectives out of step with the others': every rank isolates at once and the ranks agree on
what they found (`across_ranks`).

While a thread isolates, every runner's hot path steps aside (one global read: the flag is
set only for these rare runs) and the thread's runners run their pieces eagerly, counting
nothing; other threads' calls take their runners' slow path, and are served as usual.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.errors import Contain, Decline
from graphdispatch_backend.runtime.checks.agree import Agreement
from graphdispatch_backend.runtime.checks.modes import judging
from graphdispatch_backend.runtime.checks.parity import Mismatch
from graphdispatch_backend.runtime.checks.side_by_side import CANDIDATE, REFERENCE, SideBySide, within


class Isolation:
    active = 0  # threads isolating now: read on every hot path, so a plain class attribute


class _Local(threading.local):
    on = False  # a class default (runtime/cudagraph/engine.py `_Recording`)


_local = _Local()


def isolating_here() -> bool:
    """This thread runs an isolation: pieces run eagerly and nothing is counted."""
    return _local.on


@contextlib.contextmanager
def isolating(call: str) -> Iterator[None]:
    Isolation.active += 1
    _local.on = True
    try:
        with judging(call):
            yield
    finally:
        _local.on = False
        Isolation.active -= 1


ARTIFACT, FUSION, LOWERING, CAPTURE = "artifact", "fusion", "lowering", "capture"
_LAYOUT = frozenset({"stride", "view"})  # Mismatch.what of an output's layout (strides, aliasing)


@dataclasses.dataclass
class Culprit:
    party: str  # ARTIFACT, FUSION, LOWERING or CAPTURE
    detail: str = ""  # what it did
    demoted: list[Any] = dataclasses.field(default_factory=list)  # ARTIFACT: the substitutions demoted
    ops: list[str] | None = None  # FUSION: the ops whose fused result differs (None: none explains it)
    layout: bool = False  # FUSION: the fused code lays an output out otherwise than eager (no op is at fault)


def culprit(compiled: Callable[..., Any], args: Sequence[Any], side: SideBySide,
            differs: Callable[[list[Any]], Mismatch | None], substitutions: Sequence[Any], call: str,
            contain: Contain, fusion: Any = None, tolerance: Any = None,
            demoted: Sequence[bool] | None = None) -> Culprit:
    """The party at fault (see module docstring); `side` holds the checked call's world before
    and eager's (runtime/checks/side_by_side.py); `fusion` is the graph's runtime/program/fused.py
    Fusion, if it serves fused code, and `tolerance` its declared tolerance (runtime/checks/tolerance.py),
    which judges every run here as it judged the call. `demoted`: the substitutions' flags
    before the served run: a gate that demoted its artifact within the served call (its own
    re-check, on an eager call) found the culprit already (one that wrote beyond its rows
    leaves a world no run here starts from as eager did). The world is left as eager left it."""
    demoted = list(demoted) if demoted is not None else [s.demoted for s in substitutions]
    judge = within(tolerance)

    def again() -> Mismatch | None | Exception:
        """The call run again from the world before, compared (an exception: it raised)."""
        _, exc = contain(side.back)
        if exc is not None:
            return exc
        with isolating(call):
            out, raised = contain(lambda: compiled(*args))
        if raised is not None:
            return raised
        mismatch, exc = contain(lambda: differs(list(out) if isinstance(out, (list, tuple)) else [out])
                                or side.writes(judge))
        return exc if exc is not None else mismatch

    found = again()
    contain(lambda: side.back(REFERENCE))
    newly = [s for s, was in zip(substitutions, demoted) if s.demoted and not was]
    if newly:
        return Culprit(ARTIFACT, "; ".join(f"artifact {s.artifact} at {s.region}: {s.detail}" for s in newly), newly)
    if found is None:
        return Culprit(CAPTURE, "the lowered graph run again without its captures matches eager: the replay differed")
    if fusion is not None and fusion.active:
        party = _fusion(fusion, again, found)
        contain(lambda: side.back(REFERENCE))
        if party is not None:
            return party
    if isinstance(found, Exception):
        return Culprit(LOWERING, f"the lowered graph run again without captures and fusion raised "
                                 f"{type(found).__name__}: {found}")
    return Culprit(LOWERING, f"the lowered graph run again without captures and fusion differs from eager too: {found}")


def _fusion(fusion: Any, again: Callable[[], Any], fused: Any) -> Culprit | None:
    """The fused graph differs: the fusion's fault if the graph unfused matches; then the
    ops at fault, found by running. None: the lowering's (unfused, it differs too)."""
    with fusion.trying(None):
        unfused = again()
    if unfused is not None:
        return None
    what = f"fused, it differs from eager ({fused}); unfused, it matches"
    if isinstance(fused, Mismatch) and fused.what in _LAYOUT:
        # where the fused code lays an output out (a convolution's channels-last choice), not an
        # op's numerics: no op is learned, for this graph nor, through the verdict cache, for
        # every graph of the device (a UNet's layout once kept add, mul and view off everywhere)
        return Culprit(FUSION, f"{what}: a layout, not an op's values; nothing is learned for other graphs", ops=None,
                       layout=True)
    ops, runs = fusion.isolate(lambda keep: _trying(fusion, keep, again))
    if ops is None:
        return Culprit(FUSION, f"{what}; no set of fused ops explains it ({runs} runs)", ops=None)
    return Culprit(FUSION, f"{what}; kept as ATen calls, it matches: {', '.join(ops)} ({runs} runs)", ops=ops)


def _trying(fusion: Any, keep: Any, again: Callable[[], Any]) -> bool:
    with fusion.trying(keep):
        return again() is None


def beside(compiled: Callable[..., Any], args: Sequence[Any], side: SideBySide, substitutions: Sequence[Any],
           checked: Checked, contain: Contain, events: Any, in_step: bool = False) -> bool:
    """A check of the whole graph passed, but it judged the kernels inside only through the
    graph's outputs: within a tolerance (a bitwise kernel 1e-3 off passed a tolerance of
    1e-2: a trial, 2026-12-07), or inside a replay, where no gate sees the call and a
    kernel's difference can stop short of the outputs (a trial's patch embedding one ulp off
    in its last element for large latents, rounded away downstream at the check that saw
    them first: that check widened what counts as seen and the next call was served wrong,
    unchecked). So each kernel still serving is judged now beside its native region on this
    call's inputs: the call run again from the world before with every gate judging
    (`culprit`'s run). True: one was demoted (caught at this call, said), and eager's values
    answer the call; else the served call's world is put back. `in_step`: the graph holds
    collectives and every rank runs the call again, judging kernels or not."""
    subs = [s for s in substitutions if not s.demoted]
    if not subs and not in_step:
        return False
    contain(lambda: side.keep(CANDIDATE))
    _, exc = contain(side.back)
    if exc is None:
        with isolating(checked.call):
            contain(lambda: compiled(*args))
    newly = [s for s in subs if s.demoted]
    contain(lambda: side.back(REFERENCE if newly else CANDIDATE))
    for sub in newly:
        checked.caught(sub)
    if newly:
        events.warn_once(f"beside:{checked.record.name}:{','.join(s.artifact for s in newly)}",
                         "graphdispatch: %s: the graph's outputs matched eager's at %s, but judged beside its "
                         "region %s; eager's values answered it", checked.record.name, checked.call,
                         "; ".join(f"artifact {s.artifact} at {s.region} differs ({s.detail})" for s in newly))
    return bool(newly)


@dataclasses.dataclass
class Checked:
    """The checked call a culprit is blamed at: its graph's record, its number in its shape
    key and the last check's before it, and why it was checked (`novel`: its new inputs,
    runtime/checks/novelty.py; else the recheck schedule)."""

    record: Any  # the graph's GraphRecord
    n: int
    previous: int
    novel: str | None = None

    @property
    def unchecked(self) -> int:
        """The calls served since the last check, which passed."""
        return self.n - self.previous - 1

    def caught(self, sub: Any) -> None:
        """A kernel (its SubstitutionRecord) demoted at this check: the call, the calls it
        served unchecked before, by which check, and the state those calls wrote from its
        values (the inputs the graph writes: a cache), which stays."""
        with sub.lock:
            record_fields.substitution_caught(sub, self.n, self.unchecked,
                                              "novelty" if self.novel is not None else "recheck",
                                              self.state if self.unchecked else [])

    @property
    def state(self) -> list[str]:
        """What the graph writes that outlives a call: the inputs it writes (a cache's rows,
        its length counters), and the tensors it makes and writes in place (a cache a prefill
        creates and returns: a trial's K/V was made so, and only the counters were named)."""
        made = self.record.buffer_writes_in_place
        return [w["input"] for w in self.record.input_writes] + (
            [f"{made} tensor(s) the graph makes and writes in place (a cache it creates and returns is one)"]
            if made else [])

    @property
    def call(self) -> str:
        why = f"checked for novel inputs: {self.novel}" if self.novel is not None else "checked by the recheck schedule"
        return f"call {self.n} of {self.record.name} ({why})"


def blame(found: Culprit, checked: Checked, verdict: tuple[Decline, str], events: Any, fusion: Any,
          runners: Sequence[Any], replays: Sequence[int]) -> tuple[Decline, str] | None:
    """The policy over a culprit: an artifact was demoted by its gate, a fusion learns (keeps
    the ops as ATen calls, recompiles) or gives up (runtime/program/fused.py), the pieces that
    replayed in the checked call are declined (`verify_mismatch`): each time the
    graph keeps its lowering (None) and eager's values answer. The lowering's fault stays the
    verdict, naming the call."""
    record, call, n = checked.record, checked.call, checked.n
    party, detail = found.party, found.detail
    unchecked = checked.unchecked
    message = f"{record.name}: a served call differed from eager at {call}: the {party} was at fault"
    if checked.previous:
        message += f"; the {unchecked} call(s) since the last check (call {checked.previous}) were served unchecked"
    state = checked.state
    if unchecked and state and party == ARTIFACT:
        # what they wrote may come from the kernel's values (through the native ops after it
        # too): later calls read it, eager's reference included, so no check finds it (a
        # trial: 3 unchecked decode steps, 13 of 16 steps of the request off)
        message += (f", and what they wrote into {', '.join(state)} (state the graph writes: a cache) stays, "
                    "and may hold values computed from the kernel's: the calls that read it differ from eager's "
                    "until it is written anew")
    for sub in found.demoted:
        checked.caught(sub)
    if party == ARTIFACT:
        events.warn_once(f"culprit:{record.name}:{detail}", "graphdispatch: %s (%s; the call: %s); eager's values "
                         "answered it", message, detail, verdict[1])
        return None
    if party == FUSION:  # learned (kept as ATen calls, recompiled) or given up: runtime/program/fused.py
        fusion.learn(found.ops, n, f"{verdict[1]}; {detail}", layout=found.layout)
        return None
    if party == CAPTURE:
        now = [s.replays for s in record.piece_stats]
        for runner, was, is_ in zip(runners, replays, now):
            if is_ > was:  # it replayed in the checked call
                runner.distrust(Decline.VERIFY_MISMATCH,
                                f"a replay differed from eager at {call}: {verdict[1]}; {detail}")
        events.warn_once(f"culprit:{record.name}:capture", "graphdispatch: %s; eager's values answered it, and the "
                         "pieces that replayed run eager", message)
        return None
    return verdict[0], f"{verdict[1]} (at {call}; {detail})" if detail else verdict[1]


# what a rank's isolation found, agreed over the ranks (the largest wins, checks/agree.py): its
# call matched and so did its run again; its call differed and its run again (every piece run
# eagerly, every kernel beside its region) matched; a kernel its gate demoted; its run again differs
_NOTHING, _THE_CAPTURE, _AN_ARTIFACT, _THE_LOWERING = 0, 1, 2, 3


def across_ranks(agreement: Agreement, mine: bool | None, find: Callable[[], Culprit], checked: Checked,
                 verdict: tuple[Decline, str], events: Any) -> tuple[Decline, str] | None:
    """The isolation where the graph holds collectives and its agreed verdict is a lowering
    mismatch. Run on one rank alone, the graph's run again would put that rank's
    collectives out of step with the others'; so every rank runs it, in step, on its own
    call's inputs (`find`: `culprit`; the regions an artifact serves hold no collective,
    artifacts/match.py, so the gates' runs beside their kernels add none), and the ranks
    agree on what they found. `mine`: this rank's own check found a forward mismatch it can
    isolate (True), nothing (False), or one it cannot (None: it raised, it wrote beyond its
    rows, an artifact moved the world under it, eager disagreed with itself): then no rank
    isolates. A kernel wrong on one rank (a tensor-parallel shard's values) reaches the
    other ranks' outputs through the collectives after it: where the run again matched on
    every rank and some rank's gate demoted its kernel, the kernels explain every rank's
    difference: each was demoted, named, on its own rank (and keeps serving on the others),
    and the graph keeps its lowering on every rank (None). A run again that differs on
    any rank (the lowering), or a difference no kernel explains (a capture), declines the
    graph on every rank (the agreed verdict, saying what was found)."""
    if agreement.agree(int(mine is None)):  # one rank cannot tell: no rank runs the graph again
        where = "this rank" if mine is None else "another rank of the graph's process groups"
        return verdict[0], f"{verdict[1]}; not isolated: {where} could not tell its mismatch apart"
    found = find()
    if found.party == ARTIFACT:
        code = _AN_ARTIFACT
        blame(found, checked, verdict, events, None, (), ())  # its gate demoted it on this rank: caught, said
    elif found.party == CAPTURE:  # the run again matched: this rank's call differed (a capture, or a
        code = _THE_CAPTURE if mine else _NOTHING  # kernel on another rank through a collective) or did not
    else:
        code = _THE_LOWERING
    agreed = agreement.agree(code)
    if agreed == _AN_ARTIFACT:
        if code != _AN_ARTIFACT:
            caught_elsewhere(checked, events)
        return None
    party = "lowering" if agreed == _THE_LOWERING else "capture"
    found_here = f"this rank found the {found.party} at fault: {found.detail}" if code == agreed else \
        f"another rank of the graph's process groups found the {party} at fault"
    return verdict[0], f"{verdict[1]}; isolated on every rank at once, {found_here}"


def caught_elsewhere(checked: Checked, events: Any) -> None:
    """A check where only another rank of the graph's process groups found its kernel off:
    this rank's outputs came through the collectives from that rank's, so the calls served
    here since the last check may have been off too. Recorded (`lowering_check.
    caught_on_other_ranks`) and said, so that this rank's report does not read as clean."""
    record, n, unchecked = checked.record, checked.n, checked.unchecked
    with record.lock:
        record_fields.caught_on_another_rank(record, n, unchecked)
    events.warn_once(f"elsewhere:{record.name}:{n}", "graphdispatch: %s: at %s another rank of the graph's process "
                     "groups found its kernel off; this rank's outputs reach through the collectives, so the %d "
                     "call(s) served here since the last check may have differed from eager's too", record.name,
                     checked.call, unchecked)
