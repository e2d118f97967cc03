"""Verify before publish: a captured entry becomes verified, or gets its verdict.

    captured --(replay == eager, bit for bit, on `verify_inputs` distinct input sets: the
                capture call's own, then sets derived from them in the same call)--> verified
             --(a mismatch, a failed replay, an artifact demoted, another rank's verdict)--> declined
             --(the caller repeats the verified values)--> a derived set (runner/derive.py),
               or, after NOT_DISTINCT_LIMIT such calls without one, verify_not_distinct

Each verifying call is answered by the user's own eager run (Verifier.live and
Verifier.judge_derived compare, runner/verify.py); a verdict that would change the
schedule of a piece holding collectives is agreed over its ranks first (`_agree`).

A mixin of GraphRunner: it uses the runner's verifier, book, scope, device and stats.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.checks.digest import digest
from graphdispatch_backend.runtime.runner.entry import Entry, State
from graphdispatch_backend.runtime.runner.serve import serve
from graphdispatch_backend.runtime.runner.verify import NO_SET, Verdict

NOT_DISTINCT_LIMIT = 8


class Publish:
    # provided by GraphRunner and Transitions (annotations only: a stub here would shadow
    # Transitions' methods, which come later in GraphRunner's bases)
    _verifier: Any
    _verify_inputs: int
    _scope: Any
    _device: Any
    _streams: Any
    _check: Callable[[Entry, Sequence[Any]], tuple[Decline, str, int] | None]
    _mismatch: Callable[..., Sequence[Any]]
    _agree: Callable[[int], int]
    _refuse: Callable[..., Sequence[Any]]
    _eager: Callable[[Sequence[Any], Decline], Sequence[Any]]
    _decline: Callable[..., None]
    _transition: Callable[..., None]
    _backoff: Callable[[Entry, str], None]
    _gates_changed: Callable[[Entry], bool]
    _set_state: Callable[[], None]

    def _verify(self, entry: Entry, args: Sequence[Any], first: bool) -> Sequence[Any]:
        if not first:
            problem = self._check(entry, args)
            if problem is not None:
                return self._mismatch(entry, args, *problem)
            repeats = self._verifier.repeats(entry.moving, args, entry.last_inputs)
            if repeats is None:
                return self._refuse(entry, args, Decline.CHECK_FAILED, "comparing with the verified inputs raised")
            if self._agree(int(repeats)):  # one rank repeating its values: every rank derives a set
                return self._verify_derived(entry, args)
        derived: Verdict = NO_SET
        printed: list[Any] = []
        if first and self._verify_inputs > 1 and entry.moving:
            # the capture call verifies a set derived from its values too, so the next call
            # replays; derived first, while the call's own answer is not held yet
            derived = self._verifier.judge_derived(entry.moving, args, None, lambda a: self._serve_locked(entry, a),
                                                   salt=0, printed=printed)
            if self._agree(2 if derived is NO_SET else int(derived is not None)) == 2:
                derived = NO_SET  # some rank has no derived set: every rank waits for distinct values
        expected, verdict = self._verifier.live(args, lambda a: self._serve_locked(entry, a),
                                                lambda a: self._eager(a, Decline.VERIFYING))
        if derived is None and printed and not self._verifier.tells(printed[-1], expected, args):
            derived = NO_SET  # the derived set's outputs are the live ones: it verified nothing more
        out = self._conclude(entry, args, expected, verdict)
        if verdict is None and derived is not NO_SET and entry.state is State.CAPTURED:
            return self._conclude(entry, args, expected, derived, live=False)
        return out

    def _verify_derived(self, entry: Entry, args: Sequence[Any]) -> Sequence[Any]:
        """The caller repeats the verified values: verify on a set derived from them."""
        expected = self._eager(args, Decline.VERIFYING)
        verdict = self._verifier.judge_derived(entry.moving, args, expected, lambda a: self._serve_locked(entry, a),
                                               salt=entry.verified)
        if self._agree(2 if verdict is NO_SET else int(verdict is not None)) == 2:
            verdict = NO_SET  # some rank has no derived set: every rank waits for distinct values
        if verdict is NO_SET:
            entry.waits += 1
            if entry.waits > NOT_DISTINCT_LIMIT:
                self._decline(entry, Decline.VERIFY_NOT_DISTINCT, (
                    f"{entry.waits} calls in a row repeated the verified inputs' values, and no distinct set could be "
                    "derived from them (every moving input holds one repeated integer or bool value, or eager raised "
                    "on the derived values): call once with other values, or pass the same tensor object each call "
                    "(it is then read in place)"))
            return expected
        return self._conclude(entry, args, expected, verdict, live=False)

    def _conclude(self, entry: Entry, args: Sequence[Any], expected: Sequence[Any], verdict: Verdict,
                  live: bool = True) -> Sequence[Any]:
        if self._gates_changed(entry) and self._agreement is None:
            # an artifact in this piece failed a parity re-check during this very call: the
            # capture holds it, so capture again without it rather than declining for good
            self._transition(entry, args, Decline.ARTIFACT_DEMOTED, "an artifact was demoted while verifying", -1)
            return expected
        if self._gates_changed(entry) and verdict is None:
            verdict = Decline.ARTIFACT_DEMOTED, "an artifact was demoted while verifying"
        if self._agree(int(verdict is not None)) and verdict is None:
            verdict = Decline.RANK_DISAGREEMENT, "another rank's verification failed"
        if verdict is not None and self._agreement is not None and verdict[0] is Decline.OUT_OF_MEMORY:
            verdict = Decline.OUT_OF_MEMORY, verdict[1] + " (in lockstep with other ranks: declined)"
            self._decline(entry, *verdict)
            return expected
        if verdict is not None:
            if verdict[0] is Decline.OUT_OF_MEMORY:
                self._backoff(entry, verdict[1])  # the capture stays; verification tries again later
            else:
                self._decline(entry, *verdict)
            return expected
        entry.verified, entry.waits = entry.verified + 1, 0
        if entry.verified >= self._verify_inputs:
            entry.state, entry.last_inputs = State.VERIFIED, None
            self._set_state()
        elif live:
            self._keep_live(entry, args)  # the next call's distinct values verify again
        return expected

    def _keep_live(self, entry: Entry, args: Sequence[Any]) -> None:
        """Wait for distinct live values: keep a fingerprint of each moving input, not a
        copy (one hidden state kept per compiled block until its next call would be the
        whole model's activations; runtime/checks/digest.py)."""
        last, exc = self._scope.contain(lambda: [digest(args[pos]) for pos, _ in entry.moving])
        if exc is not None:
            self._decline(entry, Decline.CHECK_FAILED,
                          f"fingerprinting the verified inputs raised {type(exc).__name__}")
        entry.last_inputs = last

    def _serve_locked(self, entry: Entry, args: Sequence[Any]) -> list[Any]:
        with self._device.lock:
            return serve(entry, args, self._streams)
