"""How a runner entry leaves the fast path: re-capture, back off, or decline.

- A pinned input of a verified entry that moved with its layout and alignment class, with
  nothing else (a pipeline's new prompt embeddings and attention mask per request), never
  gets here: it relocates (runner/relocate.py), at once, copied in from then on (or, by
  the rule below, read in place at its new address). Any other pinned input that moves (an
  activation the allocator put at the same address during warmup; one that moved with
  another layout) becomes moving for good, with every other pinned input that moved too:
  each such re-capture makes progress, so they are bounded by the number of inputs and
  never end in a decline. Except when it stayed put for REPIN_AFTER replays
  first: a buffer that lives for a while and is then replaced (a static KV cache that
  `generate` allocates anew for each request) is re-captured pinned at its new address
  (at most MAX_REPINS times per entry), since as a moving input every replay would copy it
  whole, in and back (cudagraph trees re-record on a static input's new address the same
  way, up to `cudagraph_unexpected_rerecord_limit`).
- An input the piece writes in place (a KV cache), or one its owner marked with
  `torch._dynamo.mark_static_address` (runner/record.py), is never made moving: copying a
  cache in and back on every replay costs its whole size per call, more than eager and
  growing with it. When it moves it is re-captured at its new address, without a limit
  (each re-capture was paid for by REPIN_AFTER replays); when it moved sooner (requests of
  a few tokens, each with a new cache) the entry first answers 2, 4, 8, ... calls
  eagerly, counted `pinned_input_moved`, so re-captures stay rare against its calls. (An
  activation the piece writes moves during warmup already: it is moving from its first
  capture, copied at an activation's size.) A verified entry whose held inputs only moved
  never gets here: it relocates (runner/relocate.py).
- An artifact demoted after capture (its kernels are in the graph) re-captures, at most
  MAX_RECAPTURES times.
- An allocation failure backs off: the entry answers 2, 4, 8, ... calls eagerly, then
  tries again. It is never a verdict on the graph.
- A key that would evict while captures are thrashing (runner/book.py) declines
  `max_captures`, reported once, naming the scalar inputs whose values the keys differ in.
- Anything else declines the entry for the session, counted, logged once at WARNING.

Transitions is an object of its runner's and the one writer of an entry's phase
(runner/phase.py; tests/test_layout.py checks that no other file assigns one): every
transition is one of its methods, asked for by the part that found the reason (a capture,
a verdict, a relocation, an eviction). It reports; the call is answered by its caller
(runner/runner.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.call.contract import layout_identity
from graphdispatch_backend.runtime.cudagraph.engine import is_out_of_memory
from graphdispatch_backend.runtime.runner.book import THRASH_LIMIT
from graphdispatch_backend.runtime.runner.entry import Entry
from graphdispatch_backend.runtime.runner.hints import input_label, thrash_detail
from graphdispatch_backend.runtime.runner.inputs import fixed_address
from graphdispatch_backend.runtime.runner.phase import Capture, Captured, Eager, State, Verified, Warming

MAX_RECAPTURES = 2
MAX_BACKOFF = 1 << 10  # calls
REPIN_AFTER = 16  # replays a moved input stayed at its address: a buffer replaced, not an activation
MAX_REPINS = 16


class Transitions:
    """Where an entry goes when it leaves the fast path: every state change the verdicts
    above make, counted and reported. It runs no graph and answers no call: its caller
    answers the call eagerly with the reason."""

    def __init__(self, name: str, scope: Any, stats: Any, book: Any, device: Any, lookup: Any, writes: Any,
                 names: Sequence[str], lockstep: bool = False) -> None:
        self.name = name
        self._scope = scope
        self._stats = stats
        self._book = book
        self._device = device  # its lock: no thread may be replaying what is released
        self._lookup = lookup  # runner/lookup.py: the parameter names, the key positions
        self._writes = writes  # runtime/checks/world.py Writes: the inputs the piece writes
        self._names = names
        self._lockstep = lockstep  # the piece holds collectives: a replay's failure waits for the agreement
        # a lockstep piece's verdict found in steady state, raised at its next agreement
        self._pending: tuple[Decline, str] | None = None

    def hold(self, reason: Decline, detail: str) -> None:
        """A lockstep piece's verdict found in steady state: raised at its next agreement."""
        self._pending = reason, detail

    def take_pending(self) -> tuple[Decline, str] | None:
        pending, self._pending = self._pending, None
        return pending

    def states_changed(self) -> None:
        """The piece's state in the stats: its most advanced entry's, and its live captures."""
        order = (State.EAGER, State.WARMING, State.CAPTURED, State.VERIFIED)
        states = self._book.states()
        record_fields.piece_state(self._stats, max(states, key=order.index).value if states else State.EAGER.value,
                                  sum(1 for slot in list(self._book.slots.values()) if slot.captured))

    def thrashing(self, entry: Entry) -> Decline:
        """A warm key that would evict while captures thrash: eager for good (it holds no
        capture yet), the captured keys go on replaying."""
        entry.phase = Eager(Decline.MAX_CAPTURES)
        detail = thrash_detail(THRASH_LIMIT, self._book.max_captures, list(self._book.slots),
                               self._lookup.key_positions or (), self._names)
        self._book.limit(Decline.MAX_CAPTURES, detail, kind="thrashing")
        self.states_changed()
        return Decline.MAX_CAPTURES

    def transition(self, entry: Entry, capture: Capture, args: Sequence[Any], reason: Decline, detail: str,
                   pos: int) -> None:
        """The call's inputs are not where `capture` (the entry's) reads them: the rules above."""
        state = self._lookup.state
        if reason is Decline.PINNED_INPUT_MOVED:
            moved = {p for p, ident in zip(capture.pinned, _identities(capture))
                     if p not in state and ident is not None and layout_identity(args[p]) != ident}
            stayed = self._stats.replays - capture.replays_at >= REPIN_AFTER
            held = never_moving(moved | {pos}, args, self._writes.positions)
            if held:
                entry.held |= held
                self._repin_held(entry, detail, stayed, moved - held)
            elif stayed and entry.repins < MAX_REPINS:
                entry.repins += 1  # it stayed put for a while: pinned again, at its new address
                self.recapture(entry, reason, f"{detail}; captured again reading it in place", set())
            else:
                self.recapture(entry, reason, detail, moved | {pos})
        elif reason is Decline.ARTIFACT_DEMOTED:
            self.demoted(entry, detail)
        else:
            self.decline(entry, reason, detail)

    # -- the phases a capture goes through ------------------------------------------------
    def captured(self, entry: Entry, capture: Capture) -> Captured:
        """A warming entry captured: verified next (runner/publish.py)."""
        phase = entry.phase = Captured(capture)
        entry.out_of_memory = 0
        self.states_changed()
        return phase

    def verified(self, entry: Entry, capture: Capture) -> Verified:
        """Replayed from now on: a capture that verified, or one a relocation put in place."""
        phase = entry.phase = Verified(capture)
        self.states_changed()
        return phase

    def take_off(self, entry: Entry, verified: Verified, warming: Warming) -> bool:
        """A relocation takes a verified entry's capture off it (not released: parked, or
        the graph the new capture is made like); the entry warms meanwhile, so no replay
        serves it. False where the entry left `verified` meanwhile (a replay failed on
        another thread). The caller holds the device lock."""
        if entry.phase is not verified:
            return False
        entry.phase = warming
        return True

    def evicted(self, entry: Entry) -> None:
        """Dropped from its book (runner/book.py): what it holds is freed; a thread that
        still holds it finds it warming (or eager, as it was). The caller holds the device lock."""
        entry.release()
        if not isinstance(entry.phase, Eager):
            entry.phase = Warming()

    def relocated(self, moved: set[int], repinned: bool, held: set[int]) -> None:
        """Inputs the graph only reads moved, alone or with `held` ones: captured again at
        once (runner/relocate.py), said in the timing notes by name."""
        what = ", ".join(input_label(p, self._names) for p in sorted(moved))
        then = "read in place at the new address" if repinned else "copied in from now on"
        also = "".join(f", with {input_label(p, self._names)} (read in place)" for p in sorted(held))
        self._scope.timing.note(f"relocate {self.name}: {what} moved{also}, nothing else (same layout and "
                                f"alignment class): captured again at once, {then}")

    def demoted(self, entry: Entry, detail: str) -> None:
        """An artifact in the captured graph was demoted: captured again without it, at most
        MAX_RECAPTURES times, then declined."""
        if entry.recaptures < MAX_RECAPTURES:
            entry.recaptures += 1
            self.recapture(entry, Decline.ARTIFACT_DEMOTED, detail, set())
        else:
            self.decline(entry, Decline.ARTIFACT_DEMOTED, detail)

    def _repin_held(self, entry: Entry, detail: str, stayed: bool, others: set[int]) -> None:
        """An input never copied whole moved: captured again reading it at its new address;
        after backing off first when its last address served fewer than REPIN_AFTER
        replays. `others`, ordinary inputs that moved with it quickly, become moving."""
        entry.repins += 1
        entry.quick_moves = 0 if stayed else entry.quick_moves + 1
        then = "captured again reading it in place"
        if entry.quick_moves:
            wait = min(1 << entry.quick_moves, MAX_BACKOFF)
            then = f"moved after fewer than {REPIN_AFTER} replays: eager for {wait} calls, then {then}"
        self.recapture(entry, Decline.PINNED_INPUT_MOVED, f"{detail} (never copied whole); {then}",
                       set() if stayed else others)
        if entry.quick_moves:
            _skip(entry, entry.quick_moves, Decline.PINNED_INPUT_MOVED)

    def recapture(self, entry: Entry, reason: Decline | str, detail: str, now_moving: set[int]) -> None:
        """Warm the entry up again; `reason` (a Decline, or the cause of a re-capture that
        is no decline: `fusion_changed`) goes to the timing notes."""
        with self._device.lock:
            entry.release()
            entry.forced_moving |= now_moving
            entry.phase = Warming()
        with self._stats.lock:
            self._stats.recaptures += 1
        self._scope.timing.note(f"recapture {self.name}: {getattr(reason, 'value', reason)}: {detail}")
        self.states_changed()

    def out_of_memory(self, entry: Entry, detail: str) -> Decline:
        """A capture ran out of memory: warm up again after backing off."""
        with self._device.lock:
            entry.release()
            entry.phase = Warming()
        self.backoff(entry, detail)
        return Decline.OUT_OF_MEMORY

    def backoff(self, entry: Entry, detail: str) -> None:
        entry.out_of_memory += 1
        _skip(entry, entry.out_of_memory, Decline.OUT_OF_MEMORY)
        self._stats.decline(Decline.OUT_OF_MEMORY.value, detail)
        self._scope.timing.note(f"out_of_memory {self.name}: {detail}; trying again in {entry.skip} calls")
        self._scope.events.warn_once(
            f"decline:{Decline.OUT_OF_MEMORY.value}",
            "graphdispatch: CUDA graph for %s ran out of memory (%s); eager meanwhile, trying again in %d calls",
            self.name, detail, entry.skip)
        self.states_changed()

    def replay_failed(self, entry: Entry, exc: BaseException) -> Decline:
        """A verified graph raised on replay: an allocation failure is transient (the call
        is answered eagerly); a lockstep piece raises it at its next agreement; anything
        else goes through the session's contain() (under strict it raises) and the entry
        declines."""
        if is_out_of_memory(exc):
            return Decline.OUT_OF_MEMORY
        if self._lockstep:
            self.hold(Decline.REPLAY_FAILED, f"{type(exc).__name__}: {exc}")
            return Decline.REPLAY_FAILED

        def reraise() -> None:
            raise exc

        _, contained = self._scope.contain(reraise)
        self.decline(entry, Decline.REPLAY_FAILED, f"{type(contained).__name__}: {contained}")
        return Decline.REPLAY_FAILED

    def decline(self, entry: Entry, reason: Decline, detail: str) -> None:
        with self._device.lock:
            entry.release()
            entry.phase = Eager(reason)
        self.report(reason, detail)
        self.states_changed()

    def decline_all(self, reason: Decline, detail: str) -> None:
        """Every entry not eager yet declines (the ranks agreed on a verdict: runner/policy.py)."""
        for entry in list(self._book.entries.values()):
            if not isinstance(entry.phase, Eager):
                self.decline(entry, reason, detail)

    def recapture_all(self, reason: str, detail: str) -> None:
        """Every captured entry records again (the piece's code changed)."""
        for entry in list(self._book.entries.values()):
            if isinstance(entry.phase, (Captured, Verified)):
                self.recapture(entry, reason, detail, set())

    def report(self, reason: Decline, detail: str, then: str | None = None, held: bool = False) -> None:
        """Count and log a decline; `then` says what becomes of the calls (by default the
        shape key runs eager for good); `held`: the capture is kept, not declined (it waits)."""
        self._stats.decline(reason.value, detail)
        self._scope.timing.note(f"cuda_graph_declined {self.name}: {reason.value}: {detail}")
        self._scope.events.warn_once(
            f"decline:{reason.value}", "graphdispatch: CUDA graph %s for %s (%s): %s; %s",
            "held back" if held else "declined", self.name, reason.value, detail,
            then or "that shape key runs eager from now on",
        )
        self._scope.events.decision("decline", {"runner": self.name, "reason": reason.value, "detail": detail})


def _skip(entry: Entry, times: int, reason: Decline) -> None:
    """The entry answers the next 2**times calls (at most MAX_BACKOFF) eagerly, counted `reason`."""
    entry.skip, entry.skip_reason = min(1 << times, MAX_BACKOFF), reason


def never_moving(positions: set[int], args: Sequence[Any], written: Sequence[int]) -> set[int]:
    """The inputs among `positions` that are never copied whole on a replay: the ones the
    piece writes in place, and the ones marked with a static address (module docstring)."""
    return {p for p in positions if p in written or fixed_address(args[p])}


def _identities(capture: Capture) -> list[Any]:
    """The layout identity each pinned position had at capture (the first observation)."""
    first = capture.seen
    return [first[p] if p < len(first) else None for p in capture.pinned]
