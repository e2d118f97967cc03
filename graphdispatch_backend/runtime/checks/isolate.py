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

from graphdispatch_backend.errors import Contain
from graphdispatch_backend.runtime.checks.modes import judging
from graphdispatch_backend.runtime.checks.parity import Mismatch
from graphdispatch_backend.runtime.checks.world import World


class Isolation:
    active = 0  # threads isolating now: read on every hot path, so a plain class attribute


_local = threading.local()


def isolating_here() -> bool:
    """This thread runs an isolation: pieces run eagerly and nothing is counted."""
    return bool(getattr(_local, "on", False))


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


@dataclasses.dataclass
class Culprit:
    party: str  # ARTIFACT, FUSION, LOWERING or CAPTURE
    detail: str = ""  # what it did
    demoted: list[Any] = dataclasses.field(default_factory=list)  # ARTIFACT: the substitutions demoted
    ops: list[str] | None = None  # FUSION: the ops whose fused result differs (None: none explains it)


def culprit(compiled: Callable[..., Any], args: Sequence[Any], before: World, after: World,
            differs: Callable[[list[Any]], Mismatch | None], substitutions: Sequence[Any], call: str,
            contain: Contain, fusion: Any = None, tolerance: Any = None) -> Culprit:
    """The party at fault (see module docstring); `fusion` is the graph's runtime/program/fused.py
    Fusion, if it serves fused code, and `tolerance` its declared tolerance (runtime/checks/tolerance.py),
    which judges every run here as it judged the call. The world is left as eager left it (`after`)."""
    demoted = [s.demoted for s in substitutions]

    def again() -> Mismatch | None | Exception:
        """The call run again from the world before, compared (an exception: it raised)."""
        _, exc = contain(before.restore)
        if exc is not None:
            return exc
        with isolating(call):
            out, raised = contain(lambda: compiled(*args))
        if raised is not None:
            return raised
        mismatch, exc = contain(lambda: differs(list(out) if isinstance(out, (list, tuple)) else [out])
                                or after.compare(tolerance))
        return exc if exc is not None else mismatch

    found = again()
    contain(after.restore)
    newly = [s for s, was in zip(substitutions, demoted) if s.demoted and not was]
    if newly:
        return Culprit(ARTIFACT, "; ".join(f"artifact {s.artifact} at {s.region}: {s.detail}" for s in newly), newly)
    if found is None:
        return Culprit(CAPTURE, "run eagerly, it matches eager: the replay differed")
    if fusion is not None and fusion.active:
        party = _fusion(fusion, again, found)
        contain(after.restore)
        if party is not None:
            return party
    if isinstance(found, Exception):
        return Culprit(LOWERING, f"run eagerly, it raised {type(found).__name__}: {found}")
    return Culprit(LOWERING, f"run eagerly, it differs from eager too: {found}")


def _fusion(fusion: Any, again: Callable[[], Any], fused: Any) -> Culprit | None:
    """The fused graph differs: the fusion's fault if the graph unfused matches; then the
    ops at fault, found by running. None: the lowering's (unfused, it differs too)."""
    with fusion.trying(None):
        unfused = again()
    if unfused is not None:
        return None
    ops, runs = fusion.isolate(lambda keep: _trying(fusion, keep, again))
    what = f"fused, it differs from eager ({fused}); unfused, it matches"
    if ops is None:
        return Culprit(FUSION, f"{what}; no set of fused ops explains it ({runs} runs)", ops=None)
    return Culprit(FUSION, f"{what}; kept as ATen calls, it matches: {', '.join(ops)} ({runs} runs)", ops=ops)


def _trying(fusion: Any, keep: Any, again: Callable[[], Any]) -> bool:
    with fusion.trying(keep):
        return again() is None
