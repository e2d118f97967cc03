"""Verify before publish: a captured entry becomes verified, or gets its verdict.

    captured --(replay == eager, bit for bit, on `verify_inputs` distinct input sets: the
                capture call's own, then sets derived from them in the same call)--> verified
             --(a mismatch, a failed replay, an artifact demoted, another rank's verdict)--> declined
             --(the caller repeats the verified values)--> a derived set (runner/derive.py),
               or, after NOT_DISTINCT_LIMIT such calls without one, eager calls counted
               verify_inputs_not_distinct until a call with other values verifies it

On a piece holding artifacts, a verifying call whose replay differs from eager (or eager
from itself), and every verifying call of a piece holding an allclose artifact, also runs
the piece with each artifact judged beside its region (answering natively): one demoted
there is the fault, the call is answered natively and the piece captured again without it.
Each verifying call is answered by the user's own eager run; its steps (the live set, a
derived set) are a Trial's (runner/verify.py); a verdict that would change the
schedule of a piece holding collectives is agreed over its ranks first (`agreed`).
The entry's verification progress is its `Captured` phase's (runner/phase.py), which the
Publisher alone advances; the phases that follow a verdict, and `Verified`, are the
runner's Transitions' to give (runner/transitions.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.call.calls import answer_eagerly
from graphdispatch_backend.runtime.checks.agree import Agreement, agreed, agreed_verdict
from graphdispatch_backend.runtime.checks.digest import digest
from graphdispatch_backend.runtime.checks.modes import judging
from graphdispatch_backend.runtime.runner.entry import Entry
from graphdispatch_backend.runtime.runner.phase import Capture, Captured
from graphdispatch_backend.runtime.runner.serve import serve
from graphdispatch_backend.runtime.runner.transitions import Transitions
from graphdispatch_backend.runtime.runner.verify import NO_SET, Trial, Verdict, Verifier

NOT_DISTINCT_LIMIT = 8
# a verification's verdicts an artifact of the piece may be at fault for
_SUSPECT = (Decline.VERIFY_MISMATCH, Decline.EAGER_NONDETERMINISTIC)


class Publisher:
    """Verifies a runner's captured entries and publishes them (`Verified`). Each call
    it takes is answered by the user's own eager run (or, after a verdict, by the Decline
    the runner answers eagerly with); the inputs were checked where the capture read them
    by the caller."""

    def __init__(self, fn: Callable[..., Sequence[Any]], verifier: Verifier, verify_inputs: int, scope: Any,
                 device: Any, stats: Any, gates: Sequence[Any], transitions: Transitions,
                 agreement: Agreement | None) -> None:
        self._fn, self._verifier, self._verify_inputs = fn, verifier, verify_inputs
        self._scope, self._device, self._stats = scope, device, stats
        self._gates = tuple(gates)  # the artifacts in the piece: one demoted while verifying re-captures
        self._transitions = transitions
        self._agreement = agreement  # the piece holds collectives: every verdict is agreed over the ranks

    def verify(self, entry: Entry, captured: Captured, args: Sequence[Any], first: bool) -> Sequence[Any] | Decline:
        """A call to a captured entry (`captured`, its phase): `first`, the call that captured it."""
        moving = captured.capture.moving
        trial = Trial(self._verifier, args, functools.partial(self._serve_locked, captured.capture),
                      functools.partial(answer_eagerly, self._fn, self._stats, reason=Decline.VERIFYING))
        repeats = False
        if not first:
            repeated = trial.repeats(moving, captured.last_inputs)
            if repeated is None:
                self._transitions.decline(entry, Decline.CHECK_FAILED, "comparing with the verified inputs raised")
                return Decline.CHECK_FAILED
            repeats = bool(agreed(self._agreement, int(repeated)))  # one rank repeating: every rank derives a set
        if repeats and captured.waits > NOT_DISTINCT_LIMIT:
            # no derived set came of the last tries: the call is answered eagerly, no set tried
            # (each try runs eager again), the capture kept for the first call with other values
            return Decline.VERIFY_NOT_DISTINCT
        if repeats:  # the caller repeats the verified values: verify on a set derived from them
            expected = trial.answer()
            verdict = trial.derived(moving, expected, salt=captured.verified)
            if agreed(self._agreement, 2 if verdict is NO_SET else int(verdict is not None)) == 2:
                verdict = NO_SET  # some rank has no derived set: every rank waits for distinct values
            if verdict is NO_SET:
                self._wait(entry, captured)
                return expected
            verdicts, live = [verdict], False
        else:
            derived: Verdict = NO_SET
            printed: list[Any] = []
            if first and self._verify_inputs > 1 and moving:
                # the capture call verifies a set derived from its values too, so the next call
                # replays; derived first, while the call's own answer is not held yet
                derived = trial.derived(moving, None, salt=0, printed=printed)
                if agreed(self._agreement, 2 if derived is NO_SET else int(derived is not None)) == 2:
                    derived = NO_SET  # some rank has no derived set: every rank waits for distinct values
            expected, verdict = trial.live()
            if derived is None and printed and not trial.tells(printed[-1], expected):
                derived = NO_SET  # the derived set's outputs are the live ones: it verified nothing more
            verdicts, live = [verdict] if derived is NO_SET else [verdict, derived], True
        return self._conclude(entry, captured, args, expected, verdicts, live)

    def _judge_artifacts(self, entry: Entry, args: Sequence[Any]) -> Sequence[Any] | None:
        """The replay differed from eager (or eager from itself) on a piece holding
        artifacts: each judged beside its region on this call, answering natively (a
        trial's allclose kernel drifted from its 7th run, inside the capture: the call was
        answered 0.05 off, beyond its tolerance, and the capture blamed for good). The
        native answer where one was demoted (the entry captured again without it); None
        otherwise, or where the piece writes its inputs (a run would write them again)."""
        live = [g for g in self._gates if not g.demoted]
        if not live or self._verifier.writes_inputs or self._agreement is not None:  # (collectives: one rank's run)
            return None
        with judging("the call that verified its capture"):
            outs, exc = self._scope.contain(lambda: self._fn(*args))
        if exc is not None or not any(g.demoted for g in live):
            return None
        self._transitions.demoted(entry, "an artifact was demoted while verifying")
        return outs

    def _held_artifacts(self, judged: bool) -> str:
        """A verdict's words where the piece holds artifacts (`judged`: they passed beside
        their regions on this call): a kernel whose bits change between runs (an autotuner
        switching its configuration) fails this too."""
        held = sorted({g.artifact for g in self._gates if not g.demoted})
        if not held:
            return ""
        return (f"; the piece holds artifact(s) {', '.join(held)}"
                + (", each judged beside its region on this call and within its parity" if judged else "")
                + ": a kernel whose bits change between runs fails this check too")

    def _wait(self, entry: Entry, captured: Captured) -> None:
        """No derived set: wait for a call with distinct values. Past NOT_DISTINCT_LIMIT such
        calls, said once; the entry is not declined: a recurrent decode step fed one token
        id for a while (Mamba's, its state read in place) gets other ids later, and its
        first call with them verifies the capture. Only a verdict ends a capture."""
        captured.waits += 1
        if captured.waits == NOT_DISTINCT_LIMIT + 1:
            detail = (f"{captured.waits} calls in a row repeated the verified inputs' values, and no distinct set "
                      "could be derived from them (every moving input holds one repeated integer or bool value, or "
                      "eager raised on the derived values)")
            then = ("its capture is kept, eager meanwhile: the first call with other values verifies it (to replay "
                    "sooner, pass the same tensor object each call: it is then read in place, or verify_inputs=1)")
            self._transitions.report(Decline.VERIFY_NOT_DISTINCT, detail, then=then, held=True)

    def _conclude(self, entry: Entry, captured: Captured, args: Sequence[Any], expected: Sequence[Any],
                  verdicts: list[Verdict], live: bool) -> Sequence[Any]:
        """Each verdict of the call in turn (the live set's, then a derived set's): a failure
        declines or backs off; each success counts one input set verified, and the last of
        `verify_inputs` publishes the entry. A `live` set that did not publish it waits for
        distinct values: a fingerprint of each moving input is kept, not a copy (one hidden
        state kept per compiled block until its next call would be the whole model's
        activations; runtime/checks/digest.py)."""
        # a piece holding an allclose artifact: its captures are made on calls no check of the
        # graph picks, and its replays are the kernel's; judged beside native here, before
        # they serve (a trial's kernel drifted from a run inside the capture: replay and
        # eager agreed, and 3 replays were served beyond its tolerance)
        tried = any(g.tolerant and not g.demoted for g in self._gates)
        answer = self._judge_artifacts(entry, args) if tried else None
        if answer is not None:
            return answer
        for i, verdict in enumerate(verdicts):
            if i and entry.phase is not captured:
                return expected
            changed = captured.capture.gates_changed(self._gates)
            if changed and self._agreement is None:
                # an artifact in this piece failed a parity re-check during this very call: the
                # capture holds it, so capture again without it rather than declining for good
                self._transitions.demoted(entry, "an artifact was demoted while verifying")
                return expected
            if changed and verdict is None:
                verdict = Decline.ARTIFACT_DEMOTED, "an artifact was demoted while verifying"
            if verdict is not None and verdict[0] in _SUSPECT and self._agreement is None:
                if not tried:
                    tried, answer = True, self._judge_artifacts(entry, args)
                if answer is not None:  # an artifact was at fault: captured again without it
                    return answer
                verdict = verdict[0], verdict[1] + self._held_artifacts(judged=not self._verifier.writes_inputs)
            verdict = agreed_verdict(self._agreement, verdict)  # every rank, one reason
            if verdict is not None:
                if verdict[0] is not Decline.OUT_OF_MEMORY:
                    self._transitions.decline(entry, *verdict)
                elif self._agreement is not None:
                    self._transitions.decline(entry, Decline.OUT_OF_MEMORY,
                                              verdict[1] + " (in lockstep with other ranks: declined)")
                else:
                    self._transitions.backoff(entry, verdict[1])  # the capture stays; verification tries again
                return expected
            captured.verified, captured.waits = captured.verified + 1, 0
            if captured.verified >= self._verify_inputs:
                self._transitions.verified(entry, captured.capture)
        if live and entry.phase is captured:  # the next call's distinct values verify again
            last, exc = self._scope.contain(lambda: [digest(args[pos]) for pos, _ in captured.capture.moving])
            if exc is not None:
                self._transitions.decline(entry, Decline.CHECK_FAILED,
                                          f"fingerprinting the verified inputs raised {type(exc).__name__}")
            captured.last_inputs = last
        return expected

    def _serve_locked(self, capture: Capture, args: Sequence[Any]) -> list[Any]:
        with self._device.lock:
            return serve(capture, args, self._device.streams)
