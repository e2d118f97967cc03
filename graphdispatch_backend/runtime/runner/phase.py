"""A shape key's life as typed phases: what an entry holds in each, and nothing more.

    Warming --(warmup calls observed, captured)--> Captured --(verify_inputs sets agree)--> Verified
       ^                                              |                                      |
       +------(re-capture, out of memory, evicted)----+--------------------------------------+
                                                      |                                      |
                                                      +------(a verdict)-----> Eager(reason) <+

- `Warming`: the layout identities of its warmup calls, and the storages its first call saw
  (an input is pinned only if its storage stayed alive through warmup). No graph.
- `Captured`: a `Capture` (the graph, its input and output plans, the pinned addresses it
  reads) and the progress of its verification (input sets verified, calls that repeated
  the verified values, their fingerprints). Eager answers its calls.
- `Verified`: a `Capture`, replayed. Nothing optional: the replay path (runner/serve.py)
  reads it as it is. A relocation (runner/relocate.py) takes its capture off (the entry
  is Warming, one observation, while the capture for the new addresses is made or found
  parked) and makes it Verified again at once.
- `Eager`: the reason the entry runs eager for good (an eviction leaves it Eager).

The phase of an entry is written in one place, runner/transitions.py (`Transitions`, the
owner of every transition; tests/test_layout.py checks it); the other parts ask it. The
shape follows cudagraph trees, which keep one node class per phase (`CUDAWarmupNode` holds
no graph, `CUDAGraphNode` does: torch/_inductor/cudagraph_trees.py).
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphdispatch_backend.errors import Decline
from graphdispatch_backend.runtime.call.contract import LayoutIdentity, layout_identity
from graphdispatch_backend.runtime.cudagraph.engine import CapturedGraph
from graphdispatch_backend.runtime.runner.inputs import InputPlan
from graphdispatch_backend.runtime.runner.outputs import OutputPlan

Observation = tuple[Any, ...]  # per input: its layout identity (a tensor), or None


class State(str, enum.Enum):
    """A phase's name, as the report says it."""

    EAGER = "eager"
    WARMING = "warming"
    CAPTURED = "captured"
    VERIFIED = "verified"


def observe(args: Sequence[Any]) -> Observation:
    return tuple(layout_identity(a) if isinstance(a, torch.Tensor) else None for a in args)


@dataclasses.dataclass(eq=False)
class Warming:
    """Warmup calls seen so far (owned by runner/record.py's Capturer, which adds each)."""

    state: ClassVar[State] = State.WARMING
    observations: list[Observation] = dataclasses.field(default_factory=list)
    # the storages the first warmup call saw: an input is pinned only if its storage stayed
    # alive through warmup (the same tensor passed again), not if a new tensor happened to
    # land at the same address after the last one was freed
    first_storages: list[StorageWeakRef | None] = dataclasses.field(default_factory=list)

    def see(self, args: Sequence[Any]) -> int:
        """Record one warmup call; return how many were seen."""
        if not self.observations:
            self.first_storages = [StorageWeakRef(a.untyped_storage()) if isinstance(a, torch.Tensor) else None
                                   for a in args]
        self.observations.append(observe(args))
        return len(self.observations)

    @classmethod
    def seen_once(cls, args: Sequence[Any]) -> Warming:
        """A warmup of one call (a relocation: every tensor stable where it is)."""
        warming = cls()
        warming.see(args)
        return warming


@dataclasses.dataclass(frozen=True, eq=False)
class Capture:
    """One recorded graph and what a replay of it reads (runner/record.py makes it)."""

    graph: CapturedGraph
    # the arguments it reads (a moving input's static buffer in its place), as aliases: the
    # caller's tensors are not held, so a weak reference to one (`refs`) dies with the caller's
    static_args: list[Any]
    refs: list[weakref.ref[torch.Tensor] | None]  # per argument: the caller's tensor, weakly
    moving: tuple[tuple[int, torch.Tensor], ...]  # (position, its static buffer)
    inputs: InputPlan
    outputs: OutputPlan
    # the one check per replay: the addresses of the pinned inputs and parameters
    pinned: tuple[int, ...]
    pick_pinned: Callable[[Sequence[Any]], Any]
    ptrs: list[int]
    identity: LayoutIdentity | None  # their layouts too, where no Dynamo guard ensures them
    # per artifact gate of the piece: demoted when captured, so the capture holds its native
    # region (a piece holding an allclose artifact is never captured inside the graph's check,
    # where it answers natively: runner.py `__call__`)
    gate_state: tuple[bool, ...]
    seen: Observation  # the layout identities the classification started from
    replays_at: int  # the runner's replay count when captured

    @property
    def copy_bytes(self) -> int:
        """Bytes one replay copies: moving inputs in, mutated moving inputs back, outputs out."""
        return self.inputs.bytes_in + self.inputs.bytes_back + self.outputs.bytes_out

    def gates_changed(self, gates: Sequence[Any]) -> bool:
        """An artifact of the piece was demoted or promoted since this was captured."""
        return bool(gates) and tuple(g.demoted for g in gates) != self.gate_state

    def gates_replayed(self, gates: Sequence[Any]) -> None:
        for gate, native in zip(gates, self.gate_state):
            gate.replayed(native=native)  # captured with the artifact's kernels in it, or the native region's

    def release(self) -> None:
        self.graph.reset()

    def reading(self, args: Sequence[Any]) -> Capture:
        """This capture, bound to the call whose inputs it reads (a parked one put back)."""
        return dataclasses.replace(self, **bound(args))


def bound(args: Sequence[Any]) -> dict[str, Any]:
    """A capture's `static_args` and `refs` for the call `args`."""
    return {"static_args": [a.detach() if isinstance(a, torch.Tensor) else a for a in args],
            "refs": [weakref.ref(a) if isinstance(a, torch.Tensor) else None for a in args]}


@dataclasses.dataclass(eq=False)
class Captured:
    """A capture being verified; its progress is owned by runner/publish.py's Publisher."""

    state: ClassVar[State] = State.CAPTURED
    capture: Capture
    verified: int = 0  # input sets verified
    waits: int = 0  # calls in a row that repeated the verified values without a derived set
    last_inputs: list[torch.Tensor] | None = None  # digests of the moving inputs last verified on


@dataclasses.dataclass(frozen=True, eq=False)
class Verified:
    """A capture that agreed with eager on `verify_inputs` input sets: replayed."""

    state: ClassVar[State] = State.VERIFIED
    capture: Capture


@dataclasses.dataclass(frozen=True)
class Eager:
    """Declined for good, with its reason."""

    state: ClassVar[State] = State.EAGER
    reason: Decline


Phase = Warming | Captured | Verified | Eager
