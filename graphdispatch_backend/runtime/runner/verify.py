"""Verifier: is a captured entry's replay bit for bit what eager gives, on inputs it was
not captured with?

- A `Trial` is one verifying call: its live inputs, the replay that serves them and the
  user's eager run that answers them. Its steps are what runner/publish.py asks of a call:
  - `repeats`: do the live moving inputs hold the values already verified?
  - `live`: a replay on the live inputs against the user's own eager run;
  - `derived`: when the caller repeats the values already verified, a set derived from
    them (runner/derive.py): eager and a replay run on it in the runner's own tensors,
    never the caller's, the world (mutated inputs, RNG) put back after each. Eager raising
    on a derived set (a data-dependent check) means there is none;
  - `tells`: did a derived set's outputs differ from the live ones (else it tested nothing)?
- `Verifier.judge` compares one set's replay with eager's output (outputs: values,
  strides, views; and the tensors the piece writes into) side by side
  (runtime/checks/side_by_side.py, which owns the world of both runs). On a mismatch eager
  runs a second time from the same world: an eager that disagrees with itself is
  `eager_nondeterministic` (atomics, `index_add_`), not the capture's fault.

A verdict is None (verified) or (Decline, detail); graphdispatch's own steps run inside
`contain`, and a failure there is the verdict `check_failed`, never an error in the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.errors import Contain, Decline, SnapshotRefused
from graphdispatch_backend.runtime.checks.digest import same_values
from graphdispatch_backend.runtime.checks.parity import Mismatch, differ
from graphdispatch_backend.runtime.checks.prints import PRINTED, Printed, differs, outputs_differ, take_print
from graphdispatch_backend.runtime.checks.side_by_side import CANDIDATE, REFERENCE, Compared, Kind, SideBySide
from graphdispatch_backend.runtime.checks.suspects import Suspects
from graphdispatch_backend.runtime.checks.world import Writes
from graphdispatch_backend.runtime.cudagraph.engine import is_out_of_memory, recording
from graphdispatch_backend.runtime.runner.derive import derive

Verdict = tuple[Decline, str] | None
NO_SET = (Decline.VERIFY_NOT_DISTINCT, "")  # no derived set could be made or run
Serve = Callable[[Sequence[Any]], Sequence[Any]]  # runs the piece (replayed or eager) on a set of inputs


class Verifier:
    """How one piece is verified (its eager function, where it writes, what may make eager
    disagree with itself); each verifying call is a Trial of it."""

    def __init__(self, fn: Callable[..., Sequence[Any]], contain: Contain, writes: Writes | None = None,
                 suspects: Suspects | None = None, wide: Sequence[int] = (), unwritten: Sequence[int] = ()) -> None:
        self.fn = fn  # the piece, run eagerly
        self.contain = contain
        self._writes = writes if writes is not None else Writes(())  # where the piece writes its inputs
        self._suspects = suspects if suspects is not None else Suspects()  # who to name when eager disagrees
        self.wide = frozenset(wide)  # inputs read with as_strided: derived over their whole storage
        # outputs that are memory the piece made uninitialized and never wrote: metadata only
        self.skip = frozenset(unwritten)

    def live(self, args: Sequence[Any], serve: Serve, eager: Serve) -> tuple[Sequence[Any], Verdict]:
        """A call's live set alone, without the publisher's other steps (Trial.live)."""
        return Trial(self, args, serve, eager).live()

    @property
    def writes_inputs(self) -> bool:
        """The piece writes some of its inputs (a cache's rows)."""
        return bool(self._writes.positions)

    def world(self, args: Sequence[Any]) -> SideBySide | Compared:
        """The world before a replay and eager run beside each other on `args` (or REFUSED)."""
        return SideBySide.open(lambda: self._writes.regions(args), self.contain)

    def judge(self, args: Sequence[Any], expected: Sequence[Any] | Printed, replayed: Sequence[Any] | Printed,
              side: SideBySide, serve: Serve | None = None) -> Verdict:
        """Eager's outputs against the replay's (either side may be a print, runtime/checks/prints.py),
        and eager's writes against the replay's (runtime/checks/side_by_side.py); on a mismatch,
        eager again from the world before. The world is left as eager left it."""
        def extra(fn: Callable[..., Any]) -> Any:
            with recording():  # an extra run: gates neither count nor re-check it
                return fn(*args)

        compared = side.judge(lambda: outputs_differ(expected, replayed, args, self.skip), extra, self.fn,
                              lambda second: outputs_differ(expected, second, args, self.skip), self._suspects)
        if compared.kind is Kind.EQUAL:
            return None
        if compared.kind is Kind.RAISED:
            return Decline.CHECK_FAILED, f"comparing the replay raised {compared.detail}"
        if compared.kind is Kind.NONDETERMINISTIC:
            return Decline.EAGER_NONDETERMINISTIC, compared.detail
        mismatch = compared.mismatch
        if mismatch is PRINTED and serve is not None:
            mismatch = self._replayed_again(args, expected, serve, side) or mismatch
        return Decline.VERIFY_MISMATCH, str(mismatch)

    def _replayed_again(self, args: Sequence[Any], expected: Sequence[Any] | Printed,
                        serve: Serve, side: SideBySide) -> Mismatch | None:
        """The replay's outputs were printed: replay once more for a mismatch's values (the
        max abs diff, the first index), the world put back as eager left it."""
        def replay() -> Mismatch | None:
            side.back()
            try:
                return outputs_differ(expected, serve(args), args, self.skip)
            finally:
                side.back(REFERENCE)

        detail, _ = self.contain(replay)
        return detail


class Trial:
    """One verifying call: its live inputs, how a replay serves them (`serve`) and the
    user's eager run that answers the call (`eager`); the steps runner/publish.py takes."""

    def __init__(self, verifier: Verifier, args: Sequence[Any], serve: Serve, eager: Serve) -> None:
        self._verifier, self._contain = verifier, verifier.contain
        self._args, self._serve, self._eager = args, serve, eager

    def repeats(self, moving: Sequence[tuple[int, torch.Tensor]], last: Sequence[torch.Tensor] | None) -> bool | None:
        """True when the live moving inputs hold the values of the last verified set (`last`:
        their digests); None when comparing them raised."""
        if not moving or last is None:
            return False
        args = self._args
        same, exc = self._contain(lambda: all(same_values(args[pos], prev) for (pos, _), prev in zip(moving, last)))
        return None if exc is not None else bool(same)

    def answer(self) -> Sequence[Any]:
        """The user's own eager run, which answers the call."""
        return self._eager(self._args)

    def tells(self, printed: Printed, outputs: Sequence[Any]) -> bool:
        """A derived set's outputs (printed) differ from the live ones: it tested something."""
        told, exc = self._contain(lambda: differs(printed, list(outputs), self._args) is not None)
        return bool(told) if exc is None else False

    def live(self) -> tuple[Sequence[Any], Verdict]:
        """A replay on the live inputs, then the user's own eager run (which answers the
        call and advances the world once); the replay's effect on the world is undone."""
        args, verifier = self._args, self._verifier
        side = verifier.world(args)
        if isinstance(side, Compared):
            return self.answer(), unsnapshotted(side.raised)
        replayed, failed = side.run(lambda: self._serve(args))
        if failed is None:  # printed and freed: eager's run beside holds no second set of outputs
            # (printed before the world goes back: an output may view an input it puts back)
            printed, oops = self._contain(lambda: take_print(replayed, args, verifier.skip))
            replayed = printed if oops is None else replayed
        _, exc = self._contain(lambda: side.set_aside(CANDIDATE))
        try:  # the user's own run: it must not fail for the memory the replay's outputs hold
            expected = self.answer()
        except (RuntimeError, MemoryError) as oom:  # torch.OutOfMemoryError is a RuntimeError
            if not is_out_of_memory(oom):
                raise  # the user's own error, as eager raises it
            del replayed, side  # freed before eager runs again
            return verifier.fn(*args), (Decline.OUT_OF_MEMORY, f"eager beside the replay: {type(oom).__name__}: {oom}")
        if failed is not None:
            reason = Decline.OUT_OF_MEMORY if is_out_of_memory(failed.raised) else Decline.REPLAY_FAILED
            return expected, (reason, failed.detail)
        if exc is not None:
            return expected, (Decline.CHECK_FAILED, f"snapshot raised {type(exc).__name__}: {exc}")
        _, exc = self._contain(lambda: side.keep(REFERENCE))
        if exc is not None:
            return expected, unsnapshotted(exc)
        return expected, verifier.judge(args, expected, replayed, side, self._serve)

    def derived(self, moving: Sequence[tuple[int, torch.Tensor]], live: Sequence[Any] | None, salt: int,
                printed: list[Printed] | None = None) -> Verdict:
        """Verify on a set derived from the live moving inputs (see module docstring);
        NO_SET when none could be made or eager raised on it. The world is left as it was.
        Without `live` (the capture call, before its live run), the derived eager outputs'
        print goes into `printed`: the caller tells afterwards whether they differ from the
        live ones (outputs that ignore the change would hide a stale read)."""
        verdict, exc = self._contain(lambda: self._derived(moving, live, salt, printed))
        if exc is not None:
            return unsnapshotted(exc, "a derived verification set")
        return verdict

    def _derived(self, moving: Sequence[tuple[int, torch.Tensor]], live: Sequence[Any] | None, salt: int,
                 printed: list[Printed] | None) -> Verdict:
        verifier = self._verifier
        # made one at a time, in memory of their own: the replay copies them in as any call's
        candidates = derive([self._args[pos] for pos, _ in moving], salt, [pos in verifier.wide for pos, _ in moving])
        values = next(candidates, None)
        while values is not None:
            derived = list(self._args)
            for (pos, _), value in zip(moving, values):
                derived[pos] = value
            side = verifier.world(derived)
            if isinstance(side, Compared):
                return unsnapshotted(side.raised, "a derived verification set")
            try:
                with recording():  # an extra run: gates neither count nor re-check it
                    expected, exc = self._contain(lambda: verifier.fn(*derived))  # noqa: B023 (run at once)
                if exc is not None:  # eager rejects these values (a data-dependent check)
                    return NO_SET
                # outputs that ignore the change: a stale read hides
                if live is not None and not differ(expected, live, verifier.skip):
                    following = next(candidates, None)
                    if following is not None:
                        values = following
                        continue
                expected = take_print(expected, derived, verifier.skip)  # freed before the replay runs
                if printed is not None:
                    printed.append(expected)
                side.set_aside(REFERENCE)
                replayed = self._serve(derived)
                side.trade(CANDIDATE, back=REFERENCE)
                return verifier.judge(derived, expected, replayed, side)
            finally:
                side.back()
        return NO_SET


def unsnapshotted(exc: Exception, doing: str = "snapshot") -> tuple[Decline, str]:
    """The verdict when a snapshot (or a step around it) raised: too large for
    max_snapshot_bytes (for good), out of memory (this once), else check_failed."""
    if isinstance(exc, SnapshotRefused):
        return Decline.SNAPSHOT_TOO_LARGE, exc.detail
    if is_out_of_memory(exc):
        return Decline.OUT_OF_MEMORY, f"{doing}: {type(exc).__name__}: {exc}"
    return Decline.CHECK_FAILED, f"{doing} raised {type(exc).__name__}: {exc}"

