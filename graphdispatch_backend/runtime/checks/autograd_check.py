"""GradientCheck: the gradients of an autograd graph's lowering, against eager's, bit for bit.

EagerCheck (runtime/checks/eager_check.py) runs the Dynamo graph eagerly next to the compiled
graph on the 1st, 2nd, 4th, 8th, ... call per shape key and compares the outputs. When
the call records autograd history (grad mode on, an input that requires grad), the
outputs are not all the user gets: aot's backward will run on them. So, once the outputs
matched, one backward runs on each side and their gradients are compared:

- the outputs that require grad are differentiated, each against a fixed pseudo-random
  cotangent of its dtype and layout, drawn from a private generator: the user's random
  stream is never advanced;
- with respect to every input of the graph that requires grad (parameters by their names,
  other inputs by their access paths), through `torch.autograd.grad`, which never writes
  `.grad` nor runs the hooks that accumulating into it would (DDP's, post-accumulate
  hooks); tensor hooks registered on the inputs do run, on both sides, and see the
  check's cotangents, each backward from the global generators as they stood and putting
  them back after (a hook's draws repeat on every run; the user's stream is untouched);
- `retain_graph=True` on both sides: the user's own backward still runs on the outputs
  served (the compiled ones, or eager's when the check gives a verdict).

Values are compared bit for bit; strides too for inputs that are not leaves (a gradient
flowing on into another graph), not for leaves, whose `.grad` AccumulateGrad lays out as
the parameter is, whatever layout the backward produced. Verdicts (EagerCheck applies
them: the graph then runs as the Dynamo graph, with eager autograd, for the session):

- `lowering_mismatch`: an output records history on one side only, or the gradients
  differ while eager's backward agrees with itself; the inputs whose gradients differ are
  named (aot traces some backward formulas otherwise than eager runs them: `prod`'s, which
  eager picks by whether the input holds a zero, a value a trace cannot see);
- `eager_nondeterministic`: eager's backward, run twice, disagrees with itself;
- `lowering_failed`: the lowered backward raises where eager's does not;
- `check_failed`: a cotangent or a comparison raised.
An out-of-memory in the lowered backward is no verdict. Eager's backward runs right after
eager's forward (`reference`), before the check puts back what eager wrote and runs the
compiled forward: then its raising means the user's would too, and leaves nothing to
compare. Everything runs inside `contain`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.errors import Contain, Decline
from graphdispatch_backend.runtime.checks.draws import Start
from graphdispatch_backend.runtime.checks.parity import Mismatch, compare
from graphdispatch_backend.runtime.cudagraph.engine import is_out_of_memory

COTANGENT_SEED = 0x6D15  # the private generator's seed: the same cotangents on every check
NAMED = 3  # gradients described in full in a verdict's detail; the rest are counted


class GradientVerdict(NamedTuple):
    reason: Decline
    detail: str
    gradients: tuple[str, ...] = ()  # the inputs whose gradients differ


class EagerGradients(NamedTuple):
    """Eager's side of a gradient check (GradientCheck.reference)."""

    wrt: list[tuple[str, torch.Tensor]]  # the inputs that require grad, by name
    want_diff: list[int]  # eager's outputs that record history
    cots: list[torch.Tensor]  # their cotangents
    want: tuple[torch.Tensor, ...]  # eager's gradients
    failed: GradientVerdict | None  # the check could not be made
    raised: bool = False  # eager's own backward raised: nothing to compare
    start: Start | None = None  # where the call's draws began (runtime/checks/draws.py), None: it draws nothing


def _grads(outputs: Sequence[Any], want_diff: Sequence[int], wrt: Sequence[tuple[str, torch.Tensor]],
           cots: Sequence[torch.Tensor], start: Start | None = None) -> tuple[torch.Tensor, ...]:
    """One backward of the check, from the global generators where the user's own backward
    would find them, putting them back after: the backward of eager's outputs from where
    eager's forward left its private copies (`start.where_eager_left`, for a graph that
    draws), the others from where the compiled forward left the user's (it drew from them;
    `_draws_put_back`)."""
    differentiated = [outputs[i] for i in want_diff]
    with start.where_eager_left() if start is not None else _draws_put_back([*differentiated, *(t for _, t in wrt)]):
        return torch.autograd.grad(differentiated, [t for _, t in wrt], cots, retain_graph=True,
                                   allow_unused=True, materialize_grads=True)


def _draws_put_back(tensors: Sequence[torch.Tensor]) -> Any:
    """The global generators (the CPU's, and each CUDA device's among `tensors`) as they
    were, once the backward ran. A tensor hook runs in the check's backwards too, and one
    that draws (gradient noise: `g + 1e-3 * randn_like(g)`) drew there from the user's
    stream: eager's second backward drew other numbers and looked nondeterministic, the
    compiled forward after eager's backward drew another dropout mask (a mismatch blamed on
    the lowering), and the user's own backward drew other noise than eager's would (a
    trial, 2026-12-07). Put back, each backward of the check draws what the user's would,
    and the user's stream is where the check found it (a draw another thread makes during
    the check's backward is drawn again after it)."""
    devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
    return torch.random.fork_rng(devices=devices)


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def cotangents(outputs: Sequence[torch.Tensor], seed: int = COTANGENT_SEED) -> list[torch.Tensor]:
    """One tensor per output, of its shape, dtype, device and (when dense) strides, with
    standard-normal values from a generator of its own."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in outputs:
        wide = torch.complex128 if t.is_complex() else torch.float64
        values = torch.randn(t.shape, generator=gen, dtype=wide)
        out.append(torch.empty_like(t, memory_format=torch.preserve_format).copy_(values))
    return out


class GradientCheck:
    def __init__(self, lifted: Sequence[torch.Tensor], names: Sequence[str], contain: Contain,
                 record: GraphRecord) -> None:
        self._lifted = tuple(lifted)  # the Dynamo graph's own parameters and buffers (aot lifts them first)
        self._names = tuple(names)  # per aot input: parameter names, inputs' access paths
        self._contain = contain
        self._record = record

    def needed(self, args: Sequence[Any]) -> bool:
        """The call records autograd history: its gradients are what the user gets too."""
        return torch.is_grad_enabled() and any(_differentiable(t) for t in (*self._lifted, *args))

    def reference(self, args: Sequence[Any], expected: Sequence[Any], start: Start | None = None) -> EagerGradients:
        """Eager's gradients, taken right after eager's forward (`expected`, its flat
        outputs), before anything else runs: the check then puts back the inputs eager
        wrote (a batch norm's running statistics, which eager's backward saved) and runs
        the compiled forward, which writes them again; eager's backward taken after that
        raised on the version counters, where the user's own backward would not. Where no
        output or no input records history, nothing is run (nothing to compare)."""
        flat = (*self._lifted, *args)
        wrt = [(self._name(i), t) for i, t in enumerate(flat) if _differentiable(t)]
        want_diff = [i for i, t in enumerate(expected) if _differentiable(t)]
        if not want_diff or not wrt:
            return EagerGradients(wrt, want_diff, [], (), None)
        cots, exc = self._contain(lambda: cotangents([expected[i] for i in want_diff]))
        if exc is not None:
            return EagerGradients(wrt, want_diff, [], (), GradientVerdict(
                Decline.CHECK_FAILED, f"making cotangents raised {type(exc).__name__}: {exc}"))
        want, exc = self._contain(lambda: _grads(expected, want_diff, wrt, cots, start))
        # eager's own backward raises, on what eager's forward left: so would the user's; nothing to compare
        return EagerGradients(wrt, want_diff, cots, want, None, raised=exc is not None, start=start)

    def judge(self, eager: EagerGradients, expected: Sequence[Any], got: Sequence[Any]) -> GradientVerdict | None:
        """The compiled graph's flat outputs against eager's, and their gradients against
        `eager`'s (see module docstring)."""
        have_diff = [i for i, t in enumerate(got) if _differentiable(t)]
        if eager.want_diff != have_diff:
            return GradientVerdict(Decline.LOWERING_MISMATCH, (
                f"differs from eager in which outputs record autograd history: outputs {have_diff}, "
                f"eager's {eager.want_diff}"))
        if eager.failed is not None:
            return eager.failed
        if not eager.want_diff or not eager.wrt or eager.raised:
            return None
        wrt = eager.wrt
        have, exc = self._contain(lambda: _lowered(lambda: _grads(got, eager.want_diff, wrt, eager.cots)))
        if exc is not None:
            if is_out_of_memory(exc):  # memory was short this once: no verdict on the lowering
                return None
            return GradientVerdict(Decline.LOWERING_FAILED, f"raised in its backward: {type(exc).__name__}: {exc}")
        backward = self._record.backward
        if backward is not None:
            with backward.lock:
                backward.checks += 1
        differs, exc = self._contain(lambda: _differ(wrt, eager.want, have))
        if exc is not None:
            return GradientVerdict(Decline.CHECK_FAILED, f"comparing gradients raised {type(exc).__name__}: {exc}")
        if not differs:
            return None
        names = tuple(name for name, _ in differs)
        again, exc = self._contain(lambda: _differ(wrt, eager.want, _grads(expected, eager.want_diff, wrt, eager.cots,
                                                                           eager.start)))
        if exc is None and again:
            return GradientVerdict(Decline.EAGER_NONDETERMINISTIC, (
                f"eager's backward disagrees with itself ({again[0][1].describe(again[0][0])}); the lowered backward's "
                f"gradients of {', '.join(names)} differ from eager's first run"), names)
        described = "; ".join(m.describe(name) for name, m in differs[:NAMED])
        more = f"; and {len(differs) - NAMED} more: {', '.join(names[NAMED:])}" if len(differs) > NAMED else ""
        return GradientVerdict(Decline.LOWERING_MISMATCH,
                               f"differs from eager in its backward: the gradients of {described}{more}", names)

    def _name(self, position: int) -> str:
        return self._names[position] if position < len(self._names) else f"input {position}"


def _lowered(run: Callable[[], Any]) -> Any:
    """Run the lowered backward with `retain_graph=True`. aot refuses that on a backward
    it compiled with donated buffers (saved tensors whose memory Inductor may reuse), as it
    does at once under dynamic shapes; graphdispatch's backward runs the ATen graph, which
    never writes into what it was saved."""
    with torch._functorch.config.patch(donated_buffer=False):
        return run()


def _differ(wrt: Sequence[tuple[str, torch.Tensor]], want: Sequence[torch.Tensor],
            have: Sequence[torch.Tensor]) -> list[tuple[str, Mismatch]]:
    out = []
    for (name, t), w, h in zip(wrt, want, have):
        mismatch = compare([w], [h], check_strides=not t.is_leaf)
        if mismatch is not None:
            out.append((name, mismatch))
    return out
