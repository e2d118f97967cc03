"""Isolate: which party made a checked call differ from eager, found by running, never guessed.

A checked call (runtime/eager_check.py) compares what was served (a replay, eager pieces,
artifacts serving) with the Dynamo graph run eagerly, the reference. When they differ and
eager agrees with itself, three parties can be at fault, and this module tells them apart
on the call's own inputs, from the world before the call:

1. the graph runs again through the same compiled path, but eagerly (no piece replays:
   `isolating()`), and every artifact gate judges its kernel beside its native region on
   the inputs that region gets in this call, answering natively (runtime/gate.py
   `judging`): an artifact that differs is demoted there, naming the call and its inputs.
   Then the artifact was the culprit: the captures holding it re-capture without it.
2. else, if that eager, native run still differs from the reference, the lowering is;
3. else the capture is: the pieces that replayed in the checked call are declined.

While a thread isolates, every runner's hot path steps aside (one global read: the flag is
set only for these rare runs) and the thread's runners run their pieces eagerly, counting
nothing; other threads' calls take their runners' slow path, and are served as usual.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from graphdispatch_backend.errors import Contain
from graphdispatch_backend.runtime.gate import judging
from graphdispatch_backend.runtime.parity import Mismatch
from graphdispatch_backend.runtime.world import World


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


ARTIFACT, LOWERING, CAPTURE = "artifact", "lowering", "capture"


def culprit(compiled: Callable[..., Any], args: Sequence[Any], before: World, after: World,
            differs: Callable[[list[Any]], Mismatch | None], substitutions: Sequence[Any], call: str,
            contain: Contain) -> tuple[str, str, list[Any]]:
    """(party, what it did, the substitutions demoted): ARTIFACT, LOWERING or CAPTURE (see
    module docstring). The world is left as eager left it (`after`)."""
    demoted = [s.demoted for s in substitutions]
    _, exc = contain(before.restore)
    if exc is not None:
        return LOWERING, "", []
    with isolating(call):
        out, raised = contain(lambda: compiled(*args))
    mismatch, exc = (None, None) if raised is not None else contain(
        lambda: differs(list(out) if isinstance(out, (list, tuple)) else [out]) or after.compare())
    contain(after.restore)
    newly = [s for s, was in zip(substitutions, demoted) if s.demoted and not was]
    if newly:
        return ARTIFACT, "; ".join(f"artifact {s.artifact} at {s.region}: {s.detail}" for s in newly), newly
    if raised is not None:
        return LOWERING, f"run eagerly, it raised {type(raised).__name__}: {raised}", []
    if exc is not None or mismatch is not None:
        return LOWERING, f"run eagerly, it differs from eager too: {mismatch}" if mismatch else "", []
    return CAPTURE, "run eagerly, it matches eager: the replay differed", []
