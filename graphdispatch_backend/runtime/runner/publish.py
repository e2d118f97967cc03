"""Verify before publish: a captured entry becomes verified, or gets its verdict.

    captured --(replay == eager, bit for bit, on `verify_inputs` distinct input sets: the
                capture call's own, then sets derived from them in the same call)--> verified
             --(a mismatch, a failed replay, an artifact demoted, another rank's verdict)--> declined
             --(the caller repeats the verified values)--> a derived set (runner/derive.py),
               or, after NOT_DISTINCT_LIMIT such calls without one, verify_not_distinct

Each verifying call is answered by the user's own eager run; its steps (the live set, a
derived set) are a Trial's (runner/verify.py); a verdict that would change the
schedule of a piece holding collectives is agreed over its ranks first (`agreed`).
The verdicts' state changes are the runner's Transitions' (runner/transitions.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.call.calls import answer_eagerly
from graphdispatch_backend.runtime.checks.agree import Agreement, agreed, agreed_verdict
from graphdispatch_backend.runtime.checks.digest import digest
from graphdispatch_backend.runtime.runner.entry import Entry, State
from graphdispatch_backend.runtime.runner.serve import serve
from graphdispatch_backend.runtime.runner.transitions import Transitions
from graphdispatch_backend.runtime.runner.verify import NO_SET, Trial, Verdict, Verifier

NOT_DISTINCT_LIMIT = 8


class Publisher:
    """Verifies a runner's captured entries and publishes them (state VERIFIED). Each call
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

    def verify(self, entry: Entry, args: Sequence[Any], first: bool) -> Sequence[Any] | Decline:
        """A call to a captured entry: `first`, the call that captured it."""
        trial = Trial(self._verifier, args, functools.partial(self._serve_locked, entry),
                      functools.partial(answer_eagerly, self._fn, self._stats, reason=Decline.VERIFYING))
        repeats = False
        if not first:
            repeated = trial.repeats(entry.moving, entry.last_inputs)
            if repeated is None:
                self._transitions.decline(entry, Decline.CHECK_FAILED, "comparing with the verified inputs raised")
                return Decline.CHECK_FAILED
            repeats = bool(agreed(self._agreement, int(repeated)))  # one rank repeating: every rank derives a set
        if repeats:  # the caller repeats the verified values: verify on a set derived from them
            expected = trial.answer()
            verdict = trial.derived(entry.moving, expected, salt=entry.verified)
            if agreed(self._agreement, 2 if verdict is NO_SET else int(verdict is not None)) == 2:
                verdict = NO_SET  # some rank has no derived set: every rank waits for distinct values
            if verdict is NO_SET:
                self._wait(entry)
                return expected
            verdicts, live = [verdict], False
        else:
            derived: Verdict = NO_SET
            printed: list[Any] = []
            if first and self._verify_inputs > 1 and entry.moving:
                # the capture call verifies a set derived from its values too, so the next call
                # replays; derived first, while the call's own answer is not held yet
                derived = trial.derived(entry.moving, None, salt=0, printed=printed)
                if agreed(self._agreement, 2 if derived is NO_SET else int(derived is not None)) == 2:
                    derived = NO_SET  # some rank has no derived set: every rank waits for distinct values
            expected, verdict = trial.live()
            if derived is None and printed and not trial.tells(printed[-1], expected):
                derived = NO_SET  # the derived set's outputs are the live ones: it verified nothing more
            verdicts, live = [verdict] if derived is NO_SET else [verdict, derived], True
        return self._conclude(entry, args, expected, verdicts, live)

    def _wait(self, entry: Entry) -> None:
        """No derived set: wait for a call with distinct values, NOT_DISTINCT_LIMIT calls at most."""
        entry.waits += 1
        if entry.waits > NOT_DISTINCT_LIMIT:
            self._transitions.decline(entry, Decline.VERIFY_NOT_DISTINCT, (
                f"{entry.waits} calls in a row repeated the verified inputs' values, and no distinct set could be "
                "derived from them (every moving input holds one repeated integer or bool value, or eager raised "
                "on the derived values): call once with other values, or pass the same tensor object each call "
                "(it is then read in place)"))

    def _conclude(self, entry: Entry, args: Sequence[Any], expected: Sequence[Any], verdicts: list[Verdict],
                  live: bool) -> Sequence[Any]:
        """Each verdict of the call in turn (the live set's, then a derived set's): a failure
        declines or backs off; each success counts one input set verified, and the last of
        `verify_inputs` publishes the entry. A `live` set that did not publish it waits for
        distinct values: a fingerprint of each moving input is kept, not a copy (one hidden
        state kept per compiled block until its next call would be the whole model's
        activations; runtime/checks/digest.py)."""
        for i, verdict in enumerate(verdicts):
            if i and entry.state is not State.CAPTURED:
                return expected
            changed = entry.gates_changed(self._gates)
            if changed and self._agreement is None:
                # an artifact in this piece failed a parity re-check during this very call: the
                # capture holds it, so capture again without it rather than declining for good
                self._transitions.demoted(entry, "an artifact was demoted while verifying")
                return expected
            if changed and verdict is None:
                verdict = Decline.ARTIFACT_DEMOTED, "an artifact was demoted while verifying"
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
            entry.verified, entry.waits = entry.verified + 1, 0
            if entry.verified >= self._verify_inputs:
                entry.state, entry.last_inputs = State.VERIFIED, None
                self._transitions.states_changed()
        if live and entry.state is State.CAPTURED:  # the next call's distinct values verify again
            last, exc = self._scope.contain(lambda: [digest(args[pos]) for pos, _ in entry.moving])
            if exc is not None:
                self._transitions.decline(entry, Decline.CHECK_FAILED,
                                          f"fingerprinting the verified inputs raised {type(exc).__name__}")
            entry.last_inputs = last
        return expected

    def _serve_locked(self, entry: Entry, args: Sequence[Any]) -> list[Any]:
        with self._device.lock:
            return serve(entry, args, self._device.streams)
