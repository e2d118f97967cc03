"""Record one runner entry's graph: classify its inputs, bind static buffers, capture.

Given an entry's warmup observations and the live inputs of the capture call:
- scalars are constants (they are in the shape key);
- tensors whose layout identity never changed, backed by one storage kept alive through
  warmup (the same tensor passed again, not a new one the allocator put at the old
  address), are pinned (read in place, checked on every replay); parameters and buffers
  must be pinned, or the capture is refused (`parameter_moved`);
- the rest, and inputs an earlier re-capture found moving, are moving: copied into the
  session's shared static buffers, under the replay lock (another runner may be replaying
  from the same buffers);
- outputs must be tensors (copied out on replay) or None/bool/int/float constants.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.errors import CudaGraphUnavailable, Decline
from graphdispatch_backend.runtime.contract import LayoutIdentity
from graphdispatch_backend.runtime.entry import CONSTANT_OUTPUTS, TENSOR, Entry, State
from graphdispatch_backend.runtime.scope import RuntimeScope


def _kept(entry: Entry, args: Sequence[Any], i: int) -> bool:
    """The tensor at `i` is backed by the storage the first warmup call saw, kept alive since."""
    ref = entry.first_storages[i] if i < len(entry.first_storages) else None
    return ref is not None and not ref.expired() and ref.cdata == args[i].untyped_storage()._cdata


def record(entry: Entry, args: Sequence[Any], fn: Callable[..., Sequence[Any]], scope: RuntimeScope,
           state: dict[int, str], gates: Sequence[Any]) -> list[tuple[int, torch.Tensor]]:
    """Capture `entry` (state CAPTURED on return) and return its (position, buffer) pairs;
    raise CudaGraphUnavailable with the reason otherwise."""
    first = entry.observations[0]
    stable = {i for i, ident in enumerate(first)
              if ident is not None and all(o[i] == ident for o in entry.observations) and _kept(entry, args, i)}
    for pos, name in state.items():
        if pos not in stable:
            raise CudaGraphUnavailable(Decline.PARAMETER_MOVED, f"{name} changed address or layout during warmup")
    tensors = [i for i, ident in enumerate(first) if ident is not None]
    moving = [i for i in tensors if (i not in stable or i in entry.forced_moving) and i not in state]
    pinned = [i for i in tensors if i not in moving]
    static_args = list(args)
    buffers = []
    for pos in moving:
        buf = scope.buffers.get(pos, args[pos])
        static_args[pos] = buf
        buffers.append((pos, buf))
    with scope.replay_lock:  # the buffers are shared: no other runner may be mid-replay
        for pos, buf in buffers:
            buf.copy_(args[pos])
        graph, exc = scope.contain(lambda: scope.engine.capture(fn, static_args))
    if exc is not None:
        raise CudaGraphUnavailable(Decline.CAPTURE_FAILED, f"{type(exc).__name__}: {exc}")
    template = []
    for i, out in enumerate(graph.outputs):
        if isinstance(out, torch.Tensor):
            template.append(TENSOR)
        elif isinstance(out, CONSTANT_OUTPUTS):
            template.append(out)
        else:
            graph.reset()
            raise CudaGraphUnavailable(Decline.NON_TENSOR_OUTPUT, f"output {i} is a {type(out).__name__}")
    entry.graph, entry.static_args, entry.moving = graph, static_args, tuple(buffers)
    # parameters are in the key (addresses): the identity checks their layout only
    entry.identity = LayoutIdentity(pinned, args, addressed=[p for p in pinned if p not in state])
    entry.template = tuple(template)
    entry.gate_state = tuple(g.demoted for g in gates)
    entry.state, entry.verified, entry.waits = State.CAPTURED, 0, 0
    return buffers
