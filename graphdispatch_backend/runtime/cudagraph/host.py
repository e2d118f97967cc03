"""HostReplayEngine: the CPU model of a CUDA graph, faithful enough to fail a test when a
rule of the runtime is broken (tests, and `cuda_graphs="emulate"`).

- Capture pins the storage of every argument (as a graph pins addresses), runs the
  computation once, recording its ATen ops onto a Tape (cudagraph/tape.py: collectives
  are stand-ins, as a CUDA capture runs no NCCL kernel; what CUDA refuses while capturing
  raises), carves the static outputs out of the device's HostPool and poisons them: a
  CUDA capture computes nothing. Replay runs the tape, no Python of the graph's (values
  Python read at capture stay frozen; collectives run, as a replay launches the captured
  NCCL kernels), against the same storages and copies the results into the same pool
  bytes.
- HostPool: one arena per device, shared by every capture. Each capture carves its outputs
  from offset 0, as a CUDA pool hands the memory of outputs nobody owns to the next
  capture: a runner that returns a static output without cloning it, or lets two
  pool-sharing graphs replay out of order, gives a wrong value on CPU. The arena is sized
  to each capture's working set (outputs plus the peak of live intermediates, measured
  while capturing), so `pool_bytes` is what a CUDA pool would reserve. As the CUDA engine's
  MemPool (cudagraph/cuda.py), the pool is held by the graphs captured into it and only
  found by the engine: it is freed once no graph uses it, and the next capture starts one.
- Streams are HostStreams (cudagraph/streams.py): replays, copies and clones run only at
  synchronization points, in the order that exposes a missing wait.
- A device guard: a capture must run under `guard(device)` for the graph's device, as a
  CUDA capture must run on that device's stream; a model on a device other than the
  current one otherwise fails to capture (a replay needs none: CUDAGraph::replay guards
  its own device). CPU tensors carry no device index, so tests name the devices
  (`HostReplayEngine(devices=...)`); emulation accepts any device.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphdispatch_backend.runtime.cudagraph.engine import Fn, Like, recording, storage_group, view_bits, with_view_bits
from graphdispatch_backend.runtime.cudagraph.streams import HostStreams
from graphdispatch_backend.runtime.cudagraph.tape import Recorder, Tape, rebind

_ALIGN = 64  # bytes between carved blocks, so every dtype's element offset is whole


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class HostPool:
    """One arena per device (see module docstring)."""

    def __init__(self) -> None:
        # a storage, not a tensor: no grad mode sticks to it (a tensor made under
        # inference_mode could not be written by a graph captured under no_grad)
        self._arena: torch.UntypedStorage | None = None
        self._lock = threading.Lock()
        self._arenas: list[tuple[StorageWeakRef, int]] = []

    def arena(self, nbytes: int) -> torch.UntypedStorage:
        """The arena, grown to hold at least `nbytes`. A grown arena is a new segment:
        graphs carved from the old one keep it until they are reset."""
        with self._lock:
            if self._arena is None or self._arena.nbytes() < nbytes:
                self._arena = torch.UntypedStorage(_align(max(nbytes, 1)))
                self._arenas.append((StorageWeakRef(self._arena), self._arena.nbytes()))
            return self._arena

    @property
    def nbytes(self) -> int:
        """Bytes of every arena segment still held (by the pool or by a live graph)."""
        with self._lock:
            self._arenas = [(ref, n) for ref, n in self._arenas if not ref.expired()]
            return sum(n for _, n in self._arenas)


class _HostGraph:
    def __init__(self, tape: Tape, outputs: tuple[Any, ...], arena: torch.UntypedStorage,
                 blocks: list[tuple[int, torch.Tensor]], pool: HostPool,
                 layout: list[tuple[list[int], int, int]], working: int) -> None:
        self._tape: Tape | None = tape  # holds the pinned inputs it reads, as a graph holds their addresses
        self.outputs = outputs
        self.layout, self.working = layout, working  # where its outputs lie in the pool, and its bytes
        self._pool: HostPool | None = pool  # the graphs captured into a pool keep it (module docstring)
        self._arena = arena  # kept alive: the blocks are views of it
        self._blocks = blocks  # (output index, its storage's bytes in the arena, as uint8)

    def replay(self) -> None:
        if self._tape is None:
            raise RuntimeError("replay of a graph that was reset")
        # the ops as captured, with no Python of the graph's (cudagraph/tape.py); autocast
        # off: the casts it made at capture are recorded ops. Inference mode whatever the
        # capture's: a graph replay does no autograd bookkeeping (none for the tensors it
        # makes, no view records: 8% of a decode step's replay), and those tensors never
        # reach the caller: the outputs are copied into the pool's blocks, made at capture.
        with recording(), torch.inference_mode(), torch.autocast("cpu", enabled=False):
            fresh = self._tape.replay()
            for index, block in self._blocks:
                storage = fresh[index].untyped_storage()
                if storage.nbytes() != block.numel():
                    raise RuntimeError(f"host replay: output {index} has {storage.nbytes()} bytes, "
                                       f"captured {block.numel()}")
                block.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))

    def reset(self) -> None:
        self._tape, self.outputs, self._arena, self._blocks, self._pool = None, (), None, [], None


class HostReplayEngine:
    """The CPU model of a CUDA graph (see module docstring)."""

    name = "host"

    def __init__(self, devices: Sequence[str] | None = None) -> None:
        """`devices`: the devices a test emulates, the first one current; the guard is then
        enforced. Without them (emulation) any device is accepted and no guard is needed."""
        self._devices = tuple(devices) if devices else ()
        # weak: the graphs captured into a pool hold it (module docstring)
        self._pools: weakref.WeakValueDictionary[str, HostPool] = weakref.WeakValueDictionary()
        self._streams: dict[str, HostStreams] = {}
        self._local = threading.local()
        self._lock = threading.Lock()

    def _key(self, device: Any) -> str:
        key = str(device)
        if self._devices and key not in self._devices:
            raise RuntimeError(f"host engine: no device {key} (devices: {', '.join(self._devices)})")
        with self._lock:
            if key not in self._streams:
                self._streams[key] = HostStreams(key)
        return key

    def streams(self, device: Any) -> HostStreams:
        return self._streams[self._key(device)]

    def pool(self, device: Any) -> HostPool:
        """The device's pool: the one its live graphs share, or a new one when none lives."""
        key = self._key(device)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = HostPool()
            return pool

    def pool_bytes(self) -> int:
        with self._lock:
            pools = list(self._pools.values())
        return sum(p.nbytes for p in pools)

    @contextlib.contextmanager
    def guard(self, device: Any) -> Iterator[None]:
        previous = getattr(self._local, "device", None)
        self._local.device = self._key(device)
        try:
            yield
        finally:
            self._local.device = previous

    def require(self, device: str, what: str) -> None:
        """A capture runs on the current device's stream: anything else is an error."""
        if not self._devices:
            return
        current = getattr(self._local, "device", None) or self._devices[0]
        if current != device:
            raise RuntimeError(f"host engine: {what} of a graph on {device} while the current device is {current}")

    def capture(self, fn: Fn, args: Sequence[Any], device: Any = "cpu", warmup: bool = True,
                rewind: Callable[[], None] | None = None, like: Like | None = None) -> _HostGraph:
        """`warmup`: one run before recording, as the CUDA engine's side-stream run (and
        cudagraph trees' warmup): a kernel that caches on the host at its first call (a
        descriptor keyed by address, a memo) serves the capture from that cache, on a GPU
        and here alike. `like`: (a graph of this engine, the arguments it was captured
        with) when these arguments are the same graph's at other addresses (a relocation,
        runtime/runner/relocate.py): its tape is rebound to them, the arguments that moved
        read where they are now, nothing run or recorded. That is what a CUDA capture at
        the new addresses records, the same kernels reading other memory; the recording
        is this model's own cost (Python dispatch per op, about six runs of the graph),
        which a CUDA capture does not pay, so relocations cost here what they cost on a GPU
        less the capture's launches (docs/design.md)."""
        key = self._key(device)
        self.require(key, "capture")
        # detach() aliases the storage live now; a later `param.data = new` or a new
        # tensor in the caller leaves this alias on the old storage, like an address.
        pinned = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        if like is not None and isinstance(like[0], _HostGraph) and like[0]._tape is not None:
            return self._rebound(like[0], like[1], pinned, key)
        held = {a.untyped_storage().data_ptr() for a in pinned if isinstance(a, torch.Tensor)}
        recorder = Recorder(held)
        with recording(), torch.no_grad():
            if warmup:
                fn(*pinned)
                if rewind is not None:  # the recording runs from the caller's state, as CUDA's records
                    rewind()
            fresh = recorder.record(fn, pinned)
        groups: dict[Any, list[int]] = {}  # storage -> indices of the outputs viewing it
        for i, out in enumerate(fresh):
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in held:
                groups.setdefault(storage_group(out, i), []).append(i)
        layout, offset = [], 0
        for indices in groups.values():
            layout.append((indices, offset, fresh[indices[0]].untyped_storage().nbytes()))
            offset = _align(offset + layout[-1][2])
        return self._carve(recorder.tape, list(fresh), layout, max(offset, recorder.peak), key)

    def _rebound(self, old: _HostGraph, old_args: Sequence[Any], pinned: Sequence[Any], key: str) -> _HostGraph:
        moves = {a.untyped_storage().data_ptr(): b for a, b in zip(old_args, pinned)
                 if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() != b.data_ptr()}
        assert old._tape is not None
        tape = old._tape.rebound(moves)
        outputs = [rebind(out, moves) for out in old.outputs]  # the carved ones are carved anew below
        return self._carve(tape, outputs, old.layout, old.working, key)

    def _carve(self, tape: Tape, fresh: list[Any], layout: list[tuple[list[int], int, int]], working: int,
               key: str) -> _HostGraph:
        """The graph, its outputs carved out of the device pool's arena (module docstring)."""
        pool = self.pool(key)
        arena = pool.arena(working)
        outputs = list(fresh)
        blocks = []
        for indices, start, nbytes in layout:
            # each output storage is its own storage over the arena's bytes, not owning
            # them, as a CUDA graph's static outputs are blocks of its pool
            block = torch._C._construct_storage_from_data_pointer(arena.data_ptr() + start, arena.device, nbytes)
            made: dict[int, torch.Tensor] = {}  # a tensor returned twice stays one tensor, as on CUDA
            for i in indices:
                out = fresh[i]
                if id(out) not in made:
                    made[id(out)] = torch.empty(0, dtype=out.dtype).set_(block, out.storage_offset(), out.shape,
                                                                         out.stride())
                    _poison(made[id(out)])  # a capture computes nothing
                    made[id(out)] = with_view_bits(made[id(out)], view_bits(out))
                outputs[i] = made[id(out)]
            blocks.append((indices[0], torch.empty(0, dtype=torch.uint8).set_(block)))
        return _HostGraph(tape, tuple(outputs), arena, blocks, pool, layout, working)

