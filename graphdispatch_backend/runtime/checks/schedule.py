"""Recheck: on which calls a graph, or an artifact, is checked, for as long as it lives.

A check of a graph runs the Dynamo graph eagerly beside the served call and compares, bit
for bit (runtime/checks/eager_check.py): it judges the capture, the lowering and every artifact
inside at once. A check of an artifact runs its native region beside it on the call's own
inputs (runtime/gates/gate.py). Checks never stop: an artifact or a lowering wrong for some
values only is met when such values come, not only in the first calls. Two options pick
the calls, per shape key: `recheck` for the graph (the lowering, the capture), and
`artifact_recheck` for each artifact's region. Both take the same values:

- "doubling" (`recheck`'s default): the 1st, 2nd, 4th, 8th, ... call; the interval doubles
  up to CAP calls and stays there. From JITTER_FROM on, each position moves by up to a
  quarter of its interval, drawn from a generator seeded by the graph and the key (the
  same on every rank, so ranks check the same calls): inputs that repeat with a period
  cannot hide from it. A check costs one eager run, so this costs 1/CAP of an eager run
  per call for good.
- "dense" (`artifact_recheck`'s default): a hand-written kernel is far more likely to be
  wrong on some inputs than torch's lowering, so its schedule starts as doubling's (1, 2,
  4, 8), then checks four times per doubling up to call DENSE_QUARTER_UNTIL (10, 12, 14,
  16, 20, 24, 28, 32, 40, 48, 56, 64: the interval is the largest power of two at most a
  quarter of the call's number, so a kernel wrong on calls 9 to 12 serves one wrong call,
  the 9th, before the 10th catches it), then twice per doubling (96, 128, 192, 256, ...,
  768, 1024: at most half), the interval capped at DENSE_CAP calls, jittered the same way
  around those positions. The denser start costs nothing in steady state: past call 64
  the positions are what they were. DENSE_CAP is the densest
  power of two whose measured steady cost stays within 2% of a call on the bench stack
  with every block an artifact (`bench/recheck.py`, "artifact steady": 256 costs 1.4%
  where every call is eager, where each check judges every region beside its native
  one; 128 cost 2.4% there).
- an integer N: the first call and every Nth after it;
- "every": every call (artifact authors' CI; what `timing="shadow"` implies).

Per state, too. Blocks compiled one by one (`block.compile()`, diffusers'
`compile_repeated_blocks`) share one graph and one shape key, each block with its own
parameters. Counted together, a schedule's positions fall on the blocks in a fixed
rotation: with 6 blocks, "dense" checked block 2 on no call before the 96th, and a kernel
wrong for that block's weights only was served on every call. So each schedule is kept per
state a call runs with (`Instances`: its first parameter's storage, numbered in the order
they come), each block's first call checked, up to INSTANCES states per schedule.

A graph whose artifacts are served from CUDA-graph replays (which run no Python, so no
gate sees them) is checked on both schedules at once (`graph_schedule`): the union of the
two, written "A|B" for `Due`.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from graphdispatch_backend.options import is_recheck_mode
from graphdispatch_backend.runtime.call.keys import layout_key

CAP = 1024  # the longest interval between two checks of "doubling", in calls
JITTER_FROM = 16  # intervals from this long on are jittered
DENSE_FROM = 8  # "dense" follows doubling's positions up to this call, then checks four times per doubling
DENSE_QUARTER_UNTIL = 64  # ... up to this call, then twice per doubling
DENSE_CAP = 256  # the longest interval of "dense", in calls (bench/recheck.py: its cost <= 2%)
MAX_KEYS = 4096  # shape keys whose schedules are kept: past it they start over (a bound on memory)
# states (blocks' parameters) given a schedule each, per schedule: past it, new ones share one
# (parameters at a new address every call, as an offloading loader's, would otherwise check every call)
INSTANCES = 256
# why a call off the schedules is checked when the weights an artifact reads were written in place
WRITTEN = "weights written in place since the last call"


def graph_schedule(recheck: str | int, artifact_recheck: str | int, replayed_artifacts: bool) -> str | int:
    """The schedule of a graph's eager check: the lowering's, and where the graph's
    artifacts may be served from replays (no gate runs there), the artifacts' too."""
    if not replayed_artifacts or recheck == "every" or recheck == artifact_recheck:
        return recheck
    return f"{recheck}|{artifact_recheck}"


class _Track:
    """One schedule's positions (see the module docstring)."""

    __slots__ = ("_cap", "_dense", "_every", "_gap", "_nominal", "_rng", "_seed", "next")

    def __init__(self, mode: str | int, seed: str) -> None:
        if isinstance(mode, str) and mode.isdigit():  # "A|B" carries integers as text
            mode = int(mode)
        if not is_recheck_mode(mode):
            raise ValueError(f"unknown recheck schedule {mode!r}")
        self.next = self._nominal = 1  # the next call it checks
        self._every = 1 if mode == "every" else mode if isinstance(mode, int) else 0
        self._dense = mode == "dense"
        self._cap = DENSE_CAP if self._dense else CAP
        self._gap = 1
        self._seed = seed
        # made at the first jittered interval: a shape key called a few times (a growing
        # cache's) never holds a generator's state (2.5 KB)
        self._rng: random.Random | None = None

    def __call__(self, n: int) -> bool:
        if n < self.next:
            return False
        if self._every:
            self.next = n + self._every
            return True
        if self._dense:
            # positions are computed from the nominal ones (1, 2, 4, 8, 12, 16, 24, ...), and
            # each is jittered around its own: what the docs list is where checks fall
            nominal = self._nominal
            share = 4 if nominal < DENSE_QUARTER_UNTIL else 2  # the interval: at most a quarter, then a half
            gap = nominal if nominal < DENSE_FROM else min(1 << ((nominal // share).bit_length() - 1), self._cap)
            self._nominal = nominal + gap
            self.next = max(n + 1, self._nominal + self._jitter(gap))
            return True
        gap = self._gap = min(max(self._gap, n), self._cap)  # 1, 2, 4, ... then CAP
        self.next = n + gap + self._jitter(gap)
        return True

    def _jitter(self, gap: int) -> int:
        if gap < JITTER_FROM:
            return 0
        if self._rng is None:
            self._rng = random.Random(self._seed)
        return self._rng.randint(-(gap // 4), gap // 4)


class Due:
    """One shape key's schedule: called once per call, true on a checked call. `mode` is a
    schedule (above) or "A|B", checked on either's calls."""

    __slots__ = ("_soonest", "_tracks", "last", "n", "previous")

    def __init__(self, mode: str | int, seed: str) -> None:
        self.n = 0
        self.last = self.previous = 0  # the last checked call, and the one before it
        parts = mode.split("|") if isinstance(mode, str) else [mode]
        # the first schedule keeps the plain seed: a graph's lowering checks fall on the same
        # calls with or without artifacts, and on every rank
        self._tracks = tuple(_Track(m, seed if i == 0 else f"{seed}|{m}") for i, m in enumerate(parts))
        self._soonest = 1  # the first call any schedule checks: before it, none needs asking

    def __call__(self) -> bool:
        n = self.n = self.n + 1
        if n < self._soonest:  # the usual call: no schedule's frame entered (it runs on every call)
            return False
        due = False
        for track in self._tracks:  # every schedule sees every call from its next position on
            due = track(n) or due
        self._soonest = min(track.next for track in self._tracks)
        if due:
            self.previous, self.last = self.last, n
        return due

    def checked_now(self) -> None:
        """The call just counted was checked off the schedule (its inputs were new:
        runtime/checks/novelty.py); the schedule's own positions go on as they were."""
        self.previous, self.last = self.last, self.n


class KeyedDue:
    """A Due per shape key, made at the key's first call (seeded `seed:key`); at most
    MAX_KEYS are kept, and past it they start over (a bound on memory)."""

    __slots__ = ("_dues", "_mode", "_seed")

    def __init__(self, mode: str | int, seed: str) -> None:
        self._mode, self._seed = mode, seed
        self._dues: dict[tuple[object, ...], Due] = {}

    def __call__(self, key: tuple[object, ...]) -> Due:
        due = self._dues.get(key)
        if due is None:
            if len(self._dues) >= MAX_KEYS:
                self._dues.clear()
            due = self._dues[key] = Due(self._mode, f"{self._seed}:{key}")
        return due

    def get(self, key: tuple[object, ...]) -> Due | None:
        """The key's schedule, if it has had a call since the last start-over."""
        return self._dues.get(key)


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})  # a storage of their own, always (the usual call)


class Instances:
    """Which state a call runs with (module docstring), and whether its weights were written
    since its last call.

    A state is the input at the first of `positions` (a parameter), by its storage's
    address (by identity where it has none: a tensor subclass's wrapper), numbered in the
    order states came: `key(key, inputs)` extends a shape key with that number. The number,
    not the address, goes into the key: a schedule's jitter is seeded by its key, and an
    address differs between runs and between ranks, where the checked calls must not. The
    first state keeps the shape key as it is, so a graph with one set of weights is checked
    on the calls it was without per-state schedules.

    An address is not a state for good: a model dropped and a new one built puts its
    weights where the old ones were. So each state holds its tensor weakly, and a call whose
    tensor at a known address is not the state's (it died, or moved) starts a new state.

    `written` says, after `key`, whether the call's `watched` inputs (the weights an
    artifact reads) were written in place since the state's last call: torch counts such
    writes (`Tensor._version`: `copy_`, `mul_`, `load_state_dict`), and a write through
    `.data` it does not count. Only calls without grad are watched (inference: in training
    every step writes the weights, and the schedules judge those calls).
    """

    __slots__ = ("_count", "_known", "_position", "_watched", "written")

    def __init__(self, positions: Sequence[int], watched: Sequence[int] = ()) -> None:
        self._position = positions[0] if positions else None
        self._watched = tuple(watched)
        # address (or id) -> [its number, the tensor (weakly), the watched inputs' version sum,
        # the watched positions that count writes (an inference tensor keeps no count: it is
        # written only inside inference_mode)]
        self._known: dict[int, list[Any]] = {}
        self._count = 0  # states numbered so far (a new one after a dead one gets a new number)
        self.written = False

    @property
    def on(self) -> bool:
        return self._position is not None

    def key(self, key: tuple[object, ...], inputs: Sequence[Any]) -> tuple[object, ...]:
        if self._position is None:
            return key
        t = inputs[self._position]
        if type(t) in _PLAIN:  # the usual call
            state = t.data_ptr()
        elif isinstance(t, torch.Tensor):
            state = t.data_ptr() if torch._C._has_storage(t) else id(t)
        else:  # a size (a symbol at a region's boundary): no weights to tell apart
            return key
        entry = self._known.get(state)
        if entry is not None and (held := entry[1]()) is not t and not _same_storage(held, state):
            entry = None  # another tensor at a dead state's address: a new state
            del self._known[state]
        if entry is None:
            self.written = False  # a new state: its first call is checked anyway
            if len(self._known) >= INSTANCES:
                self._known = {k: e for k, e in self._known.items() if e[1]() is not None}
                if len(self._known) >= INSTANCES:
                    return (*key, None)
            number, self._count = self._count, self._count + 1
            counted = tuple(p for p in self._watched if isinstance(inputs[p], torch.Tensor)
                            and not inputs[p].is_inference())
            self._known[state] = [number, weakref.ref(t), _versions(inputs, counted), counted]
            return key if number == 0 else (*key, number)
        if entry[3] and not torch.is_grad_enabled():
            versions = _versions(inputs, entry[3])
            self.written = versions != entry[2]
            entry[2] = versions
        return key if entry[0] == 0 else (*key, entry[0])


def _same_storage(held: Any, state: int) -> bool:
    """A state's tensor, alive and still at the address `state` (another tensor there is a
    view of it: the same weights)."""
    return held is not None and torch._C._has_storage(held) and held.data_ptr() == state


def _versions(inputs: Sequence[Any], positions: tuple[int, ...]) -> int:
    """The writes torch counted into the inputs at `positions`, summed (a write adds one)."""
    return sum(inputs[p]._version for p in positions)


class GraphDue:
    """Which calls of one graph its eager check judges (runtime/checks/eager_check.py): its
    `recheck` schedule, per shape key for a dynamic graph (keyed by the layouts of the call
    inputs at `keyed`; Dynamo guards a static graph's one key), and the calls whose inputs
    leave what the checked calls saw (`novelty`: runtime/checks/novelty.py)."""

    def __init__(self, recheck: str | int, name: str, dynamic: bool, keyed: Sequence[int], novelty: Any,
                 state: Sequence[int] = (), watched: Sequence[int] = ()) -> None:
        self._keyed = tuple(keyed) if dynamic else None  # positions of call inputs (parameters are not keyed)
        # the parameters' positions among them: a schedule per state; `watched`: the weights
        # artifacts read, where they serve from replays (no gate sees those calls)
        self._instances = Instances(state, watched)
        self._schedules = KeyedDue(recheck, name)
        self._last: tuple[tuple[object, ...], Due] | None = None  # the last call's key and schedule
        self._schedule = Due(recheck, name)
        self._novelty = novelty if novelty is not None and novelty.on else None
        self.n = self.previous = 0  # the checked call's number in its shape key, and the last check's

    def __call__(self, args: Sequence[Any]) -> tuple[Any, str | None] | None:
        """None, or why this call is checked: (what it saw, to widen what the checked calls
        saw; a description of its new inputs when they, not the `recheck` schedule of its
        shape key, made it due)."""
        due = self._due(args)
        scheduled = due()
        seen = self._novelty.observe(args) if self._novelty is not None else None
        novel = None if scheduled or seen is None else seen.why
        if novel is None and not scheduled and self._instances.written:
            novel = WRITTEN
        if novel is not None:
            due.checked_now()
        elif not scheduled:
            return None
        self.n, self.previous = due.n, due.previous
        return seen, novel

    def _due(self, args: Sequence[Any]) -> Due:
        """The schedule of the call's shape key and state."""
        if self._keyed is None and not self._instances.on:
            return self._schedule
        key = () if self._keyed is None else layout_key(map(args.__getitem__, self._keyed))
        key = self._instances.key(key, args)
        last = self._last
        if last is not None and last[0] == key:  # the usual call: the same block and shape as the last
            return last[1]
        due = self._schedules(key)
        self._last = (key, due)
        return due

    def novel(self, args: Sequence[Any]) -> None:
        """This call, which its schedule did not pick, is checked after it ran: the statistics
        its graph took itself were new (runtime/checks/posted.py)."""
        due = self._due(args)
        due.checked_now()
        self.n, self.previous = due.n, due.previous
