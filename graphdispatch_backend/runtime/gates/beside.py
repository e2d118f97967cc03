"""Beside: a region's native run and its artifact's, on the same live inputs, from the same state.

An artifact is judged against its native region on the inputs of a live call (runtime/gates/gate.py).
Both may write into those inputs: the ones the manifest declares (`signature.mutates`, a KV
cache's rows) they must write alike; any other write is the artifact's fault. So:

1. what the region writes is snapshotted where it writes it (runtime/checks/side_by_side.py, the
   native region the reference and the artifact the candidate; world.py: the rows);
   every tensor input is also guarded: copied while the copies fit `max_snapshot_bytes`
   (a write the artifact should not have made is then undone, wherever it wrote), past
   that fingerprinted only (runtime/checks/digest.py: the write is caught, not undone, and the
   report says so);
2. native runs; its writes are kept aside (and, for a bitwise artifact, the fingerprint of
   each declared input: a kernel writing beyond the rows the region writes is caught);
3. the inputs are put back, and the artifact runs from the same state;
4. the outcome says what differs: an undeclared write (`touched`), the declared writes
   (`writes`), a write outside them (`outside`); `keep_native()` then leaves the inputs as
   the native run left them, else they stay as the artifact left them.

A declared input is copied whole (a KV cache: its size, not its rows) only when `whole` is
asked: the gate asks at the first call of a shape key and when isolating a culprit. Every
check of a bitwise artifact fingerprints the declared inputs whole after each run (two reads
of the cache, no copy: runtime/checks/digest.py), re-checks included: a kernel that writes
a row it should not only at some positions (an off-by-one past a block boundary, a stray
write once the position passes some value) does so first on a call long after the first,
and a re-check that compared only the rows the region writes passed it on every call while
the cache it left behind changed every later call's output. What a re-check finds there is
not undone (no copy was kept, and the calls served unchecked before it may have written
there too), and it says so.

Every allocation here is graphdispatch's own: the gate runs this inside `contain`. The
kernel runs inside `contain_artifact`, which hands back what it raised even under `strict`:
the gate demotes it, and under `strict` raises that, naming the artifact, region and call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.errors import Contain
from graphdispatch_backend.runtime.checks.digest import digest
from graphdispatch_backend.runtime.checks.draws import undrawn
from graphdispatch_backend.runtime.checks.parity import Mismatch, compare
from graphdispatch_backend.runtime.checks.side_by_side import REFERENCE, SideBySide, by_parity, held
from graphdispatch_backend.runtime.checks.world import Writes
from graphdispatch_backend.runtime.gates.settings import unchanged


@dataclasses.dataclass
class Guard:
    """One tensor input the artifact must not write: a copy (undoable) or a fingerprint."""

    position: int
    tensor: torch.Tensor
    copy: torch.Tensor | None
    print_: torch.Tensor | None

    def touched(self) -> bool:
        if self.copy is not None:
            return compare([self.copy], [self.tensor], check_strides=False) is not None
        return not torch.equal(digest(self.tensor), self.print_)

    def undo(self) -> bool:
        """Put the values back; False when only a fingerprint was kept."""
        if self.copy is None:
            return False
        self.tensor.copy_(self.copy)
        return True


@dataclasses.dataclass
class Outcome:
    native: Sequence[Any] | None  # None: native did not run (unjudged before it)
    result: Any = None
    raised: Exception | None = None
    touched: list[int] = dataclasses.field(default_factory=list)  # undeclared inputs the artifact wrote
    undone: bool = True  # every such write was put back
    writes: Mismatch | None = None  # the declared writes against native's
    outside: bool = False  # a declared input differs from native's beyond the regions compared
    outside_undone: bool = True  # ... and a whole copy of it puts that back
    unjudged: str | None = None  # a snapshot step failed: nothing was judged; the inputs are native's
    side: SideBySide | None = None  # the world before, and native's (runtime/checks/side_by_side.py)

    copied: list[Guard] = dataclasses.field(default_factory=list)  # declared inputs copied whole
    copying: bool = True  # whole copies were asked for (not at a re-check)
    drew: bool = False  # the artifact drew from a default generator (put back)
    changed: str | None = None  # the process-wide settings the artifact changed (put back), said

    def keep_native(self) -> None:
        """Leave the declared inputs as the native run wrote them (wherever the artifact
        wrote, where a whole copy was kept; else on the regions the region writes)."""
        if self.side is not None:
            for guard in self.copied:
                guard.undo()
            self.side.back()
            self.side.back(REFERENCE)


class Beside:
    def __init__(self, writes: Writes, limit: int | None, contain: Contain, contain_artifact: Contain) -> None:
        self._writes = writes  # where the region writes its declared inputs
        self._limit = limit  # bytes of copies for undoing an undeclared write
        self._contain = contain  # graphdispatch's own steps
        self._contain_artifact = contain_artifact  # the kernel: never raises, even under strict (the gate does)
        self.mutates = bool(writes)

    def run(self, inputs: Sequence[Any], native: Callable[..., Sequence[Any]], artifact: Callable[..., Any],
            parity: Any, whole: bool = True) -> Outcome:
        """`native` is the user's own computation: what it raises propagates, as in eager;
        the artifact and every step of graphdispatch's own are contained. `whole`: the
        declared inputs are also copied whole (to undo a write beyond the rows); a bitwise
        artifact's are fingerprinted whole either way, to catch one (module docstring)."""
        declared = sorted(self._writes.positions)
        # a bitwise artifact's declared inputs are fingerprinted whole after each run (SideBySide.beyond)
        printed = [inputs[p] for p in declared] if parity.mode == "bitwise" else []
        prepared, exc = self._contain(lambda: (self._guards(inputs, set(declared), whole),
                                               SideBySide.take(self._writes.regions(inputs), self._contain, printed)))
        if exc is not None:
            return Outcome(None, unjudged=_failed("guarding the inputs", exc))
        (guards, copied), side = prepared
        native_out = native(*inputs)
        _, exc = self._contain(lambda: side.set_aside(REFERENCE))
        if exc is not None:
            return Outcome(native_out, unjudged=_failed("snapshotting the native run's writes", exc))
        # the generators as native's run left them: the kernel may not move them (a draw of
        # its own would shift every later draw of the caller's), and they are put back
        # ... nor torch's process-wide settings (runtime/gates/settings.py), put back too
        ((result, raised), drew), changed = unchanged(
            lambda: undrawn(lambda: self._contain_artifact(lambda: artifact(*inputs))))
        judged, exc = self._contain(lambda: self._judge(declared, guards, side, parity))
        if exc is not None:
            outcome = Outcome(native_out, side=side, copied=copied,
                              unjudged=_failed("comparing the artifact's writes", exc))
            self._contain(outcome.keep_native)
            return outcome
        touched, undone, writes, outside = judged
        return Outcome(native_out, result, raised, touched, undone, writes, outside,
                       not outside or len(copied) == len(declared), None, side, copied, whole, drew, changed)

    def _judge(self, declared: list[int], guards: list[Guard], side: SideBySide,
               parity: Any) -> tuple[list[int], bool, Any, bool]:
        touched = [g for g in guards if g.touched()]
        undone = all([g.undo() for g in touched])
        writes = side.writes(by_parity(parity.mode, parity.rtol, parity.atol)) if declared else None
        outside = writes is None and side.beyond() is not None
        return [g.position for g in touched], undone, writes, outside

    def snapshot(self, inputs: Sequence[Any]) -> Callable[[], None]:
        """The declared writes' regions now, kept: calling the result puts them back (the
        speed gate's repeated runs)."""
        return held(self._writes.regions(inputs))

    def _guards(self, inputs: Sequence[Any], declared: set[int], whole: bool) -> tuple[list[Guard], list[Guard]]:
        """Guards of the undeclared tensor inputs, and (`whole`) whole copies of the declared
        ones, while the copies fit the limit (declared first: they are written for sure)."""
        guards, copied, room = [], [], self._limit
        tensors = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]
        order = sorted(tensors, key=lambda i: i not in declared)
        for i in order:
            t = inputs[i]
            size = t.numel() * t.element_size()
            fits = room is None or size <= room
            if fits and (whole or i not in declared):
                room = None if room is None else room - size
            if i in declared:
                if fits and whole:
                    copied.append(Guard(i, t, t.clone(), None))
            else:
                guards.append(Guard(i, t, t.clone(), None) if fits else Guard(i, t, None, digest(t)))
        return guards, copied


def _failed(doing: str, exc: Exception) -> str:
    return f"{doing} raised {type(exc).__name__}: {exc}"
