"""Relocation: a verified graph whose held inputs only moved is the same graph at another address.

A server makes a KV cache per request (transformers' `generate` does by default) or
rotates a few (one per slot). The decode step's graph holds the cache in place (an input
it writes, or one marked `mark_static_address`, is never copied whole: runner/transitions.py),
so a new cache is a new address, and a capture reads addresses. What changed is the
address and nothing else: same shapes, strides, dtypes, storage offsets, parameters, and
the same alignment class (ALIGNMENT), so the kernels a capture records are the ones the
verified capture recorded, reading other memory. So:

- the capture made for those addresses is kept beside the entry (`Parked`), at most
  `max_captures` per entry, the least recently used released first, and one whose held
  inputs the caller has dropped (a weak reference to each) released as soon as it is seen;
- a call whose held inputs are where a parked capture reads them swaps it in and replays:
  a rotation of caches replays without capturing again;
- a call with new addresses captures at once, with the classification the verified entry
  had (the same pinned and moving inputs, the moving ones in the verified capture's static
  buffers: the graph's own memory, whatever alignment this call's inputs have), and
  replays to answer: the graph runs as many
  times as a capture runs it (the host model: its warmup run and its recording; CUDA: its
  side-stream warmup), plus the replay. No warmup calls, no verification again: it was
  verified at the first addresses, the same kernels on the same layouts and alignment class
  were recorded. The `recheck` schedule of the shape key goes on (runtime/checks/eager_check.py
  checks the served call, replayed or not).

ALIGNMENT: kernels choose by address, so relocation requires the same address modulo it.
On CUDA, ATen's cuBLASLt calls pass each operand's alignment to the algorithm heuristics,
computed as the largest power of two up to 256 bytes dividing the address
(`_getAlignment` in ATen/cuda/CUDABlas.cpp), and cuDNN and Triton kernels pick vector
widths from alignments up to 16 bytes: 256 covers both (the caching allocator hands out
512-byte aligned blocks, so fresh caches of one size share their class). On the CPU,
oneDNN and MKL pick paths from cache-line alignment: 64 bytes, c10's CPU allocator's own.
Anything else that moved (a parameter, an input the entry copies) takes the usual paths.

Inputs the graph only reads that moved alone, with their layout and alignment class (a
diffusers pipeline's prompt embeddings and attention masks, new per request) relocate
too (`_reread`): captured at once, copied in from then on, or past REPIN_AFTER replays at
their address read in place at the new one (runner/transitions.py's rule), and the
request's steps replay instead of warming up, capturing and verifying again.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.errors import CudaGraphUnavailable
from graphdispatch_backend.runtime.call.contract import layout_identity
from graphdispatch_backend.runtime.checks.world import Writes
from graphdispatch_backend.runtime.runner import transitions
from graphdispatch_backend.runtime.runner.entry import Entry
from graphdispatch_backend.runtime.runner.phase import Capture, Verified, Warming
from graphdispatch_backend.runtime.runner.record import Capturer
from graphdispatch_backend.runtime.runner.transitions import Transitions

ALIGNMENT = {"cuda": 256, "cpu": 64}
_data_ptr = torch.Tensor.data_ptr


def alignment(device: torch.device) -> int:
    return ALIGNMENT.get(device.type, 256)


@dataclasses.dataclass(eq=False)
class Parked:
    """One capture of an entry for other held addresses, off duty."""

    capture: Capture
    held: list[weakref.ref[torch.Tensor]]  # the held inputs it reads, as the caller passed them

    @property
    def alive(self) -> bool:
        return all(ref() is not None for ref in self.held)

    def release(self) -> None:
        self.capture.release()


class Relocator:
    """Relocates a runner's verified entries (module docstring). It owns nothing but the
    alignment class; the parked captures live on their entries, and their phases change
    through the runner's Transitions."""

    def __init__(self, device: Any, stats: Any, book: Any, lookup: Any, capturer: Capturer,
                 transitions: Transitions, writes: Writes, gates: Sequence[Any]) -> None:
        self._device = device
        self._align = alignment(torch.device(device.device))
        self._stats, self._book, self._lookup = stats, book, lookup
        self._capturer, self._transitions = capturer, transitions
        self._writes, self._gates = writes, tuple(gates)

    def relocate(self, entry: Entry, args: Sequence[Any]) -> Verified | None:
        """The entry's new phase where it now serves the call's addresses (verified, ready
        to replay): only held inputs moved, and the capture parked for their new addresses,
        or one made now as the verified one was, is in place; or only inputs it reads moved
        (`_reread`). None: not a relocation, or its capture failed (the usual paths decide)."""
        phase = entry.phase
        if not isinstance(phase, Verified):  # another thread moved it on
            return None
        verified = phase.capture
        state = self._lookup.state
        moved = {p for p, ptr in zip(verified.pinned, verified.ptrs) if p not in state and _data_ptr(args[p]) != ptr}
        held = transitions.never_moving(moved, args, self._writes.positions)
        if not moved or verified.gates_changed(self._gates):
            return None
        if held != moved:  # inputs it only reads moved, alone or with a cache (an encoder output per request)
            return self._reread(entry, phase, args, moved - held, held)
        entry.held |= held
        if not only_held_moved(entry, verified, args, list(state), self._align):
            return None
        key = held_key(entry, args)
        warming = Warming.seen_once(args)
        with self._device.lock:  # no replay of it may be running while it is taken off
            if not self._transitions.take_off(entry, phase, warming):
                return None
            # aliases, not the caller's tensors: a cache the caller dropped dies at park (`keep`)
            old_key, old_args = held_key(entry, verified.static_args), verified.static_args
            old = park(entry, verified)
            found = take(entry.parked, key)
            if found is not None:
                now = self._transitions.verified(entry, found.capture.reading(args))
        if found is None:
            entry.forced_moving |= {p for p, _ in verified.moving}  # classified as the verified capture was
            try:  # the same graph, other addresses: its static buffers too
                made = self._capturer.capture(entry, warming, args, like=(old.capture.graph, old_args),
                                              buffers=dict(old.capture.moving))
            except CudaGraphUnavailable:  # still warming: the usual paths re-capture it, or decline
                old.release()
                return None
            if made.capture.pinned != verified.pinned:  # not the verified classification: verify it as any capture
                old.release()
                return None
            now = self._transitions.verified(entry, made.capture)
            with self._stats.lock:
                self._stats.relocations += 1
        with self._device.lock:
            keep(entry.parked, old_key, old, self._book.max_captures - 1)
            record_fields.parked(self._stats, sum(len(e.parked) for e in list(self._book.entries.values())))
        return now

    def _reread(self, entry: Entry, phase: Verified, args: Sequence[Any], moved: set[int],
                held: set[int]) -> Verified | None:
        """Inputs the graph only reads moved (a pipeline's new prompt embeddings and
        attention mask per request), alone or with `held` inputs (an encoder-decoder's new
        encoder output beside its new cache per request): the graph only moved. Captured
        again at once, as a relocation is (no warmup, no verification: the same kernels on
        the same layouts and alignment class), held inputs and the inputs that moved with
        them read in place at their new addresses; inputs that moved alone moving from now on
        (copied in, as any input that moves: cheap, and no capture per request), or, where
        one stayed put for REPIN_AFTER replays first (a buffer that lives long), read in place
        at its new address (at most MAX_REPINS times, as runner/transitions.py repins). Their
        copies must lie as the verified capture read them (offset, strides, alignment class),
        and none may share memory with a held input, or this is no relocation: the usual
        paths re-capture and verify. The old capture is released, and so is every parked one
        (they read these inputs where they were)."""
        verified, state = phase.capture, list(self._lookup.state)
        if not only_moved(verified, args, state, self._align, moved | held):
            return None
        if held and _shares_memory([args[p] for p in moved], [args[p] for p in held]):
            return None
        # read in place at the new address: inputs that moved with a held one live as long as it
        # (an encoder output, the cross-attention keys of its request), and the relocation
        # captures anyway, so reading them costs no capture and saves a copy per replay (2 MiB
        # a decode step for a small T5 at 512 encoder tokens: bench/serving.py); others once
        # they stayed put REPIN_AFTER replays
        repin = bool(held) or (self._stats.replays - verified.replays_at >= transitions.REPIN_AFTER
                               and entry.repins < transitions.MAX_REPINS)
        ptrs = dict(zip(verified.pinned, verified.ptrs))
        if not repin and not all(_lies_as(self._capturer.buffer(p, args[p]), args[p], ptrs[p], self._align)
                                 for p in moved):
            return None
        pinned = verified.pinned if repin else tuple(p for p in verified.pinned if p not in moved)
        moving = [p for p, _ in verified.moving] + ([] if repin else sorted(moved))
        warming = Warming.seen_once(args)
        with self._device.lock:  # no replay of it may be running while it is taken off
            if not self._transitions.take_off(entry, phase, warming):
                return None
            for stale in entry.parked.values():
                stale.release()
            entry.parked.clear()
        entry.forced_moving |= set(moving)  # the next capture classifies as meant
        entry.held |= held
        try:
            # the same graph, other addresses (its arguments: aliases, not the caller's tensors)
            made = self._capturer.capture(entry, warming, args, like=(verified.graph, verified.static_args),
                                          buffers=dict(verified.moving))
        except CudaGraphUnavailable:
            verified.release()
            return None
        verified.release()
        if made.capture.pinned != pinned:  # not the classification meant: verified as any capture
            return None
        now = self._transitions.verified(entry, made.capture)
        entry.repins += repin and not held  # MAX_REPINS bounds the captures repins add: these add none
        self._transitions.relocated(moved, repin, held)
        with self._stats.lock:
            self._stats.relocations += 1
            record_fields.parked(self._stats, sum(len(e.parked) for e in list(self._book.entries.values())))
        return now


def _shares_memory(these: Sequence[torch.Tensor], those: Sequence[torch.Tensor]) -> bool:
    """Whether a tensor of `these` lies in the storage of one of `those`."""
    storages = {t.untyped_storage().data_ptr() for t in those}
    return any(t.untyped_storage().data_ptr() in storages for t in these)


def _lies_as(buffer: torch.Tensor, t: torch.Tensor, ptr: int, align: int) -> bool:
    """A static buffer holds `t` as the verified capture read it in place at `ptr`: the
    same view (offset, strides) and alignment class."""
    return (buffer.storage_offset() == t.storage_offset() and buffer.stride() == t.stride()
            and buffer.data_ptr() % align == ptr % align)


def only_moved(verified: Capture, args: Sequence[Any], state: Sequence[int], align: int, moved: set[int]) -> bool:
    """Whether the pinned inputs that are not where the verified capture reads them are
    all of `moved`, at another address of the same alignment class, with the same layout;
    and no parameter moved."""
    first = verified.seen
    for pos, ptr in zip(verified.pinned, verified.ptrs):
        t = args[pos]
        now = _data_ptr(t)
        if now == ptr:
            continue
        if pos in state or pos not in moved or now % align != ptr % align:
            return False
        seen = first[pos] if pos < len(first) else None
        if seen is None or layout_identity(t)[1:] != seen[1:]:
            return False
    return bool(moved)


def only_held_moved(entry: Entry, verified: Capture, args: Sequence[Any], state: Sequence[int], align: int) -> bool:
    """Whether the pinned inputs that are not where the verified capture reads them are
    all held inputs, at another address of the same alignment class, with the same layout;
    and no parameter moved."""
    first = verified.seen
    moved = False
    for pos, ptr in zip(verified.pinned, verified.ptrs):
        t = args[pos]
        now = _data_ptr(t)
        if now == ptr:
            continue
        if pos in state or pos not in entry.held or now % align != ptr % align:
            return False
        seen = first[pos] if pos < len(first) else None
        if seen is None or layout_identity(t)[1:] != seen[1:]:
            return False
        moved = True
    return moved


def held_key(entry: Entry, args: Sequence[Any]) -> tuple[int, ...]:
    return tuple(_data_ptr(args[p]) for p in sorted(entry.held))


def park(entry: Entry, capture: Capture) -> Parked:
    """A capture taken off the entry, to keep beside it: the held inputs it reads weakly
    (a cache the caller dropped lets it go), no other argument of its call."""
    held = [ref for p in sorted(entry.held) if (ref := capture.refs[p]) is not None]  # held: tensors
    return Parked(dataclasses.replace(capture, static_args=[], refs=[]), held)


def keep(shelf: OrderedDict[tuple[int, ...], Parked], key: tuple[int, ...], parked: Parked, most: int) -> None:
    """Shelve `parked` under its held addresses, most recently used last; release the
    captures whose held inputs are gone and, past `most`, the least recently used."""
    for k in [k for k, p in shelf.items() if not p.alive]:
        shelf.pop(k).release()
    if parked.alive and most > 0:
        shelf[key] = parked
        shelf.move_to_end(key)
    else:
        parked.release()
    while len(shelf) > most:
        shelf.popitem(last=False)[1].release()


def take(shelf: OrderedDict[tuple[int, ...], Parked], key: tuple[int, ...]) -> Parked | None:
    """The parked capture for these held addresses, if its held inputs are the caller's."""
    parked = shelf.pop(key, None)
    if parked is not None and not parked.alive:
        parked.release()
        return None
    return parked
