"""HostReplayEngine: the CPU model of a CUDA graph, faithful enough to fail a test when a
rule of the runtime is broken (tests, and `cuda_graphs="emulate"`).

- Capture pins the storage of every argument (as a graph pins addresses), runs the
  computation once (its collectives stand-ins: a CUDA capture runs no NCCL kernel),
  carves the static outputs out of the device's HostPool and poisons them: a CUDA
  capture computes nothing. Replay re-runs the computation (collectives included, as a
  replay launches the captured NCCL kernels) against the same storages and copies the
  results into the same pool bytes.
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
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from graphdispatch_backend.runtime.cudagraph.engine import Fn, recording, view_bits, with_view_bits
from graphdispatch_backend.runtime.cudagraph.streams import HostStreams

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


_COLLECTIVES = ("_c10d_functional", "c10d_functional")


class _Capturing(TorchDispatchMode):
    """What a capture does besides computing: it measures the peak bytes of live storages
    created meanwhile (the capture's working set), and it runs no collective. A CUDA
    capture records NCCL kernels without running them; here a collective returns an
    uninitialized tensor of its output's shape (vLLM's custom all-reduce does the same
    while warming up inside its capture context), so a rank whose capture fails early and
    one whose capture succeeds have run the same collectives: none."""

    def __init__(self, held: set[int]) -> None:
        super().__init__()
        self._held = held  # the arguments' storages: not the computation's own memory
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) in _COLLECTIVES:
            out = _stand_in(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self._held and key not in self._live:
                    self._live[key] = (StorageWeakRef(storage), storage.nbytes())
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self._live.values()))
        return out


def _stand_in(func: Any, args: Any, kwargs: Any) -> Any:
    """A collective's output, shaped by its meta kernel, never communicated."""
    if func is torch.ops._c10d_functional.wait_tensor.default:
        return args[0]
    real = next(t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor))
    meta = func(*pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), args),
                **pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), kwargs))
    return pytree.tree_map_only(torch.Tensor, lambda m: torch.empty(m.shape, dtype=m.dtype, device=real.device), meta)


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
    def __init__(self, fn: Fn, args: tuple[Any, ...], outputs: tuple[Any, ...], arena: torch.UntypedStorage,
                 blocks: list[tuple[int, torch.Tensor]], inference: bool, pool: HostPool) -> None:
        self._fn: Fn | None = fn
        self._args = args
        self.outputs = outputs
        self._pool: HostPool | None = pool  # the graphs captured into a pool keep it (module docstring)
        self._arena = arena  # kept alive: the blocks are views of it
        self._blocks = blocks  # (output index, its storage's bytes in the arena, as uint8)
        self._inference = inference  # the capture's mode: its pinned inputs may be inference tensors

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("replay of a graph that was reset")
        with recording(), torch.no_grad(), torch.inference_mode(self._inference):
            fresh = self._fn(*self._args)
            for index, block in self._blocks:
                storage = fresh[index].untyped_storage()
                if storage.nbytes() != block.numel():
                    raise RuntimeError(f"host replay: output {index} has {storage.nbytes()} bytes, "
                                       f"captured {block.numel()}")
                block.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))

    def reset(self) -> None:
        self._fn, self._args, self.outputs, self._arena, self._blocks, self._pool = None, (), (), None, [], None


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

    def capture(self, fn: Fn, args: Sequence[Any], device: Any = "cpu", warmup: bool = True) -> _HostGraph:
        """`warmup` is CUDA's side-stream run before capturing; the host model has none."""
        key = self._key(device)
        self.require(key, "capture")
        # detach() aliases the storage live now; a later `param.data = new` or a new
        # tensor in the caller leaves this alias on the old storage, like an address.
        pinned = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        held = {a.untyped_storage().data_ptr() for a in pinned if isinstance(a, torch.Tensor)}
        peak = _Capturing(held)
        with recording(), torch.no_grad(), peak:
            fresh = tuple(fn(*pinned))
        groups: dict[int, list[int]] = {}  # storage -> indices of the outputs viewing it
        for i, out in enumerate(fresh):
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in held:
                groups.setdefault(out.untyped_storage().data_ptr(), []).append(i)
        layout, offset = [], 0
        for indices in groups.values():
            layout.append((indices, offset, fresh[indices[0]].untyped_storage().nbytes()))
            offset = _align(offset + layout[-1][2])
        pool = self.pool(key)
        arena = pool.arena(max(offset, peak.peak))
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
        return _HostGraph(fn, pinned, tuple(outputs), arena, blocks, torch.is_inference_mode_enabled(), pool)
