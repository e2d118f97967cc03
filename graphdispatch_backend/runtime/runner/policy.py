"""How a runner's call takes its first step: the policies a GraphRunner is handed.

A call first asks for the hot entry's replay (runner/hot.py `replay_in_place`), and when
there is none takes the full path (the runner's `_dispatch`). A runner without timing and
collectives takes that step as it is: its call pays for no policy. The two others wrap it:

- `Timed`: under `timing`, the look for the entry (the pointer check, else the shape key)
  is the `shape_key` phase (diagnostics/timing.py); the replay's own phases are timed by
  runner/serve.py's `serve_timed`.
- `Lockstep`: a piece that holds collectives (NCCL, captured inside, as vLLM does): every
  rank must capture, verify and replay it on the same calls, or the collectives go out of
  step. Every decision that would change the schedule is agreed (checks/agree.py's
  `agreed`); a rank that finds a problem in steady state (a moved input, a failed replay)
  answers eagerly, which runs the same collectives, and holds it (runner/transitions.py)
  until its next agreement point, the runner's 1st, 2nd, 4th, 8th, ... call: then every
  rank declines the piece (every rank with the reason the rank at fault found:
  checks/agree.py's `agreed_verdict`). No hot path: every call counts toward the
  agreement schedule, bar the calls an isolation makes (runtime/checks/isolate.py: run
  eagerly, counted nowhere, on the rank that isolates alone).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.checks.agree import Agreement, agreed_verdict
from graphdispatch_backend.runtime.runner.hot import Replayer
from graphdispatch_backend.runtime.runner.lookup import Lookup
from graphdispatch_backend.runtime.runner.transitions import Transitions

Answer = Sequence[Any] | Decline | None  # outputs; the eager answer's reason; look again
Dispatch = Callable[[Sequence[Any], "tuple[Any, ...] | None"], Answer]  # the full path, given the key if known


class Timed:
    """The first step with the look for the entry timed as `shape_key`; the full path is
    handed the key it computed (`dispatch`, held weakly: the runner holds this policy)."""

    def __init__(self, timing: Timing, replayer: Replayer, lookup: Lookup, dispatch: Dispatch) -> None:
        self._timing, self._replayer, self._lookup = timing, replayer, lookup
        self._dispatch = weakref.WeakMethod(dispatch)

    def first(self, args: Sequence[Any]) -> Answer:
        timing = self._timing
        start = timing.now()
        found = self._replayer.hot_in_place(args)
        if found is not None:
            timing.add("shape_key", timing.now() - start)
            return self._replayer.replay(found[0], found[1], args)
        key = self._lookup.key(args)
        timing.add("shape_key", timing.now() - start)
        dispatch = self._dispatch()
        return None if dispatch is None else dispatch(args, key)


class Lockstep:
    """The first step of a piece's call on every rank at once (module docstring): at each
    agreement point, the verdict any rank holds declines the piece on all of them."""

    def __init__(self, agreement: Agreement, replayer: Replayer, transitions: Transitions) -> None:
        self._agreement, self._replayer, self._transitions = agreement, replayer, transitions
        self._calls = 0

    def first(self, args: Sequence[Any]) -> Answer:
        n = self._calls = self._calls + 1
        if n & (n - 1) == 0:
            self._settle()
        return self._replayer.replay_in_place(args)

    def _settle(self) -> None:
        verdict = agreed_verdict(self._agreement, self._transitions.take_pending())  # the rank at fault's reason
        if verdict is None:
            return
        self._replayer.forget()
        self._transitions.decline_all(*verdict)
