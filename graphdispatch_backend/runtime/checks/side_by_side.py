"""SideBySide: a reference and a candidate run from one world, compared, and the reference
run again to tell its nondeterminism. The one place that takes, swaps and restores a World.

Every judge graphdispatch has is this comparison under its own schedule and policy:

- the eager check (eager_check.py): the Dynamo graph run eagerly (reference) against the
  served call (candidate); its policy (lowering.py, isolate.py `blame`): the lowering is
  declined, or the culprit isolated;
- a capture's verification (runner/verify.py): the piece run eagerly against its replay
  (on the live inputs the replay runs first); the capture is declined;
- an artifact's gate (gates/beside.py): the native region against the kernel; the
  artifact is demoted;
- the culprit's run (isolate.py): eager's first run, kept, against the served path run
  again eagerly; a party is named.

The world is what a run changes besides its outputs (runtime/checks/world.py): taken before
the first party runs (`take`), set aside once it ran and put back for the other (`set_aside`),
kept where the second party left it (`keep`, `trade`), and put back as either party, or
as before, left it (`back`). The written inputs compare bit for bit or within a fused
graph's declared tolerance (runtime/checks/tolerance.py, `within`) or an artifact's parity
(`by_parity`); the outputs compare by the judge's own function (a print, a Reference). On
a mismatch `again` runs the reference once more from the world before: a reference that
disagrees with itself is `NONDETERMINISTIC` (its message written here once), with the op
whose bits differed named (runtime/checks/suspects.py).

The world holds the rows a call writes, not the caches around them. Where an artifact that
writes its inputs serves inside the candidate (a hand-written attention writing its KV cache
rows), the judge also names those inputs `whole`: each is fingerprinted whole
(runtime/checks/digest.py: a read, no copy) once the reference ran and again once the
candidate did, with the reference's rows in place, and where a fingerprint differs the
candidate wrote beyond the rows (`beyond`): a mismatch, said before whatever else differs (a
kernel that wrote a past row only from some position on, caught at the first check after,
where comparing the rows alone passed it on every call; one that wrote it before reading the
cache made its own output differ too, and eager run again on the cache it left disagreed
with itself: 2026-12-07). The inputs such kernels read and do not declare writing (a
weight) are named `whole` too. Those inputs are copied before either party runs where the
copies fit (`kept`, max_snapshot_bytes in all): a write beyond the rows is put back, and
every world put back after it starts from the copies (the eager runs that tell who wrote it
run on the world before, and the cache is left as eager left it). Where they do not fit, the
write stays (said: not undone).

A result is a `Compared`: equal; a mismatch with its detail; the reference nondeterministic;
raised (a party, or graphdispatch's own step); the snapshot refused.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.errors import Contain
from graphdispatch_backend.runtime.checks.digest import digests
from graphdispatch_backend.runtime.checks.parity import BEYOND, Mismatch, compare
from graphdispatch_backend.runtime.checks.suspects import NONE_KNOWN, Suspects
from graphdispatch_backend.runtime.checks.world import Region, World


class Kind(enum.Enum):
    EQUAL = "equal"
    MISMATCH = "mismatch"
    NONDETERMINISTIC = "reference_nondeterministic"  # the reference disagrees with itself
    RAISED = "raised"  # `party` raised `error`
    REFUSED = "snapshot_refused"  # the world could not be taken (`error`): nothing was compared


REFERENCE, CANDIDATE, BEFORE, OWN = "reference", "candidate", "before", "graphdispatch"


@dataclasses.dataclass(frozen=True)
class Compared:
    kind: Kind
    detail: str = ""
    mismatch: Mismatch | None = None  # MISMATCH: what differed first
    error: Exception | None = None  # RAISED, REFUSED: what raised
    party: str = ""  # RAISED: CANDIDATE (its run) or OWN (a comparison)

    @property
    def equal(self) -> bool:
        return self.kind is Kind.EQUAL

    @property
    def raised(self) -> Exception:
        """What raised (RAISED, REFUSED)."""
        assert self.error is not None, self.kind
        return self.error


EQUAL = Compared(Kind.EQUAL)

Judge = Callable[[Sequence[Any], Sequence[Any]], "Mismatch | None"]  # (expected, actual): strides not compared
Extra = Callable[[Callable[..., Any]], Any]  # runs a function on the call's inputs as an extra run


def bitwise(expected: Sequence[Any], actual: Sequence[Any]) -> Mismatch | None:
    return compare(expected, actual, check_strides=False)


def within(tolerance: Any) -> Judge:
    """Within a fused graph's declared tolerance (runtime/checks/tolerance.py); None: bit for bit."""
    if tolerance is None:
        return bitwise
    return lambda expected, actual: tolerance.compare(expected, actual, check_strides=False)


def by_parity(mode: str, rtol: float, atol: float) -> Judge:
    """An artifact's parity (bitwise, or allclose with NaN and inf in place)."""
    return lambda expected, actual: compare(expected, actual, mode, rtol, atol, check_strides=False)


def nondeterministic(differs: Any, named: str | None) -> Compared:
    return Compared(Kind.NONDETERMINISTIC, f"eager disagrees with itself ({differs}); suspects: {named or NONE_KNOWN}")


def held(regions: Sequence[Region]) -> Callable[[], None]:
    """The regions now, kept: the function returned puts them back (a capture's runs, a speed
    gate's timed runs: extra runs compared with nothing)."""
    return World.take(regions).restore


class SideBySide:
    """One comparison's world: the world before, and each party's once it ran."""

    __slots__ = ("_contain", "_kept", "_moved", "_prints", "_whole", "_worlds")

    def __init__(self, before: World, contain: Contain, whole: Sequence[Any] = (),
                 kept: Sequence[Any] = ()) -> None:
        self._contain = contain  # graphdispatch's own steps (a rerun, the suspects' runs)
        self._worlds: dict[str, World] = {BEFORE: before}
        self._whole = tuple(whole)  # inputs fingerprinted whole after each party (module docstring)
        self._prints: dict[str, list[Any]] = {}
        # `whole` inputs with their copies from before (module docstring): put back where a
        # party wrote one beyond the rows, and from then on under every world put back (`_moved`)
        self._kept = [(t, t.clone()) for t in kept]
        self._moved = False

    @classmethod
    def take(cls, regions: Sequence[Region], contain: Contain, whole: Sequence[Any] = (),
             kept: Sequence[Any] = ()) -> SideBySide:
        """The world before either party runs (raises SnapshotRefused past max_snapshot_bytes)."""
        return cls(World.take(regions), contain, whole, kept)

    @classmethod
    def open(cls, regions: Callable[[], Sequence[Region]], contain: Contain,
             whole: Callable[[], Sequence[Any]] | None = None,
             kept: Callable[[], Sequence[Any]] | None = None) -> SideBySide | Compared:
        """The world before either party runs, or REFUSED with what raised (SnapshotRefused past
        max_snapshot_bytes, an allocation failure): nothing ran yet."""
        side, exc = contain(lambda: cls.take(regions(), contain, whole() if whole is not None else (),
                                             kept() if kept is not None else ()))
        return side if exc is None else Compared(Kind.REFUSED, f"{type(exc).__name__}: {exc}", error=exc)

    def run(self, fn: Callable[[], Any]) -> tuple[Any, Compared | None]:
        """The candidate's run, contained: (its result, None), or (None, RAISED with what it raised)."""
        out, exc = self._contain(fn)
        if exc is not None:
            return None, Compared(Kind.RAISED, f"{type(exc).__name__}: {exc}", error=exc, party=CANDIDATE)
        return out, None

    def set_aside(self, party: str) -> None:
        """`party` ran first: its world kept aside, the world before put back for the other."""
        if self._whole:
            self._prints[party] = digests(self._whole)
        self._worlds[party] = self._worlds[BEFORE].swap()

    def keep(self, party: str) -> None:
        """`party` ran second: its world kept as it is now (it stays)."""
        self._worlds[party] = self._worlds[BEFORE].now()

    def trade(self, party: str, back: str) -> None:
        """`party` ran second: its world kept aside, and `back`'s put back."""
        self._worlds[party] = self._worlds[back].swap()

    @property
    def restorable(self) -> bool:
        """Every `whole` input has its copy: a write beyond the rows is put back, and a
        reference run again from the world before sees what the first saw."""
        copied = {id(t) for t, _ in self._kept}
        return all(id(t) in copied for t in self._whole)

    @property
    def writes_inputs(self) -> bool:
        """The graph writes some of its inputs: putting a world back writes them in place."""
        return not self._worlds[BEFORE].empty

    def back(self, party: str = BEFORE) -> None:
        """The world put back as it was before, or as `party` left it (after a write beyond
        the rows, the copies first: the rows a party wrote go onto the inputs as they were)."""
        if self._moved:
            for t, copy in self._kept:
                t.copy_(copy)
        self._worlds[party].restore()

    def pairs(self) -> tuple[list[Any], list[Any]]:
        """(the reference's writes, the candidate's: kept, or as it left them, now)."""
        reference, candidate = self._worlds[REFERENCE], self._worlds.get(CANDIDATE)
        return reference.pairs() if candidate is None else (reference.values, candidate.values)

    def writes(self, judge: Judge = bitwise) -> Mismatch | None:
        """The candidate's writes against the reference's."""
        return judge(*self.pairs())

    def beyond(self) -> Mismatch | None:
        """The candidate, as it left the world now, wrote a `whole` input beyond the rows the
        reference wrote: with the reference's rows in place (the candidate's kept and put back
        after), a fingerprint differs from the reference's (module docstring)."""
        before = self._prints.get(REFERENCE)
        if before is None:
            return None
        candidate = self._worlds[REFERENCE].swap()
        try:
            now = digests(self._whole)
        finally:
            candidate.restore()
        found = None
        for t, printed, printed_now in zip(self._whole, before, now):
            if not torch.equal(printed_now, printed):
                copy = next((c for k, c in self._kept if k is t), None)
                if copy is not None:  # as it was before either party ran: the rows go back onto it
                    t.copy_(copy)
                    self._moved = True
                found = found or Mismatch(-1, BEYOND, f"{list(t.shape)} {t.dtype} differs beyond the rows the graph "
                                          "writes: the served call wrote where eager does not "
                                          f"({'undone' if copy is not None else 'not undone'})")
        return found

    def compare(self, outputs: Callable[[], Mismatch | None], judge: Judge = bitwise) -> Compared:
        """The candidate's outputs (`outputs` compares them with the reference's), then its
        writes, and whether it wrote beyond the rows (`beyond`), whatever the outputs and rows
        said: a write beyond them moved the world the reference would run on again (a kernel
        that writes a past row before it reads the cache makes its own output differ too),
        so it is said first, and the judge runs no reference again on a world it cannot put back."""
        def judged() -> Mismatch | None:
            found = outputs() or self.writes(judge)
            wide = self.beyond() if self._whole else None
            if wide is None or found is None:
                return wide or found
            return dataclasses.replace(wide, detail=f"{wide.detail}; and {found}")

        mismatch, exc = self._contain(judged)
        if exc is not None:
            return Compared(Kind.RAISED, f"{type(exc).__name__}: {exc}", error=exc, party=OWN)
        return EQUAL if mismatch is None else Compared(Kind.MISMATCH, str(mismatch), mismatch)

    def again(self, extra: Extra, reference: Callable[..., Any], differs: Callable[[Any], Mismatch | None],
              suspects: Suspects) -> Compared | None:
        """The reference once more from the world before (`extra(reference)` runs it), its
        outputs against its first run's (`differs`), its writes bit for bit: NONDETERMINISTIC,
        naming the op whose bits differed, or None (it agrees with itself, or the rerun raised).
        The world is left as the reference's first run left it."""
        output = [-1]  # the output that differed (-1: none, the written inputs did)

        def rerun() -> Mismatch | None:
            try:
                self.back()
                found = differs(extra(reference))
                if found is not None:
                    output[0] = found.output
                return found or self._worlds[REFERENCE].compare()
            finally:
                self.back(REFERENCE)

        def run(fn: Callable[..., Any]) -> Any:  # the suspects' runs, op by op, each from the world before
            self.back()
            return extra(fn)

        def name() -> str:
            try:
                return suspects.name(output[0], run)
            finally:
                self.back(REFERENCE)

        differs_, exc = self._contain(rerun)
        if exc is not None or differs_ is None:
            return None
        named, _ = self._contain(name)
        return nondeterministic(differs_, named)

    def judge(self, outputs: Callable[[], Mismatch | None], extra: Extra, reference: Callable[..., Any],
              differs: Callable[[Any], Mismatch | None], suspects: Suspects) -> Compared:
        """`compare`, and on a mismatch `again`: equal, a mismatch, the reference
        nondeterministic, or raised (graphdispatch's own step)."""
        compared = self.compare(outputs)
        if compared.kind is not Kind.MISMATCH:
            return compared
        return self.again(extra, reference, differs, suspects) or compared
