"""tape_code: a recorded tape as one straight-line Python function, for its replays.

A CUDA graph replay runs no Python; the host model's replay runs the tape's steps. Read
step by step from a list (unpack the step, copy its argument lists, fill the slots,
store the outputs, free what no later step reads), a step costs ~2 us of bookkeeping
beside its op: 0.5 ms per replay of a 2-layer transformers decode step (about 250 ops),
more than the Python of the eager forward it stands for, so a replayed decode step was
slower than eager's. Generated once per tape, a replay is one call of a function whose
lines are the steps, slots its local variables:

    s0 = o0(k0, k1)                # mm(held weight, held input)
    r = o1(s0, 1)
    s1 = r[0]; s2 = r[1]; r = None # a flat tuple of tensors
    s0 = None                      # no later step reads s0
    return [s1, _view(s2, 0, (4, 4), (4, 1), k2)]

`o*` are the ops' C++ entries, `k*` the constants a step holds (tensors made before the
capture, read where the capture read them, as a graph holds their addresses), both in
the function's globals. Same steps, same order, same frees as the tape: only the
bookkeeping is compiled away.

One step runs no op at replay: a view of held tensors only (a weight's `t`, a slice of a
pinned cache) is made once, here, and is a constant of the function, as a CUDA graph
holds the strided address and launches nothing for a view (15 of a decode step's 200
ops: 4% of its replay). Only a view that shares its storage with what it was made of: an
op whose schema merely allows aliasing (`to`, `reshape`, `contiguous`) copies when it
must, and a copy made once would serve the capture's values forever. Not in a tape that
reshapes a tensor in place (`unsqueeze_`, `set_`: `torch.Tag.inplace_view`), where a view
made once would carry the change into the next replay.
"""

from __future__ import annotations

import keyword
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

SLOT, VIEW = 0, 1  # a tensor argument made during the capture: itself, or a view rebuilt over its storage
TENSOR, FLAT, NESTED = 0, 1, 2  # what an op returned: a tensor, a flat sequence of tensors, anything else


def view_over(base: torch.Tensor, offset: int, size: Sequence[int], stride: Sequence[int],
              dtype: torch.dtype) -> torch.Tensor:
    """A tensor over `base`'s storage (reached at capture without an op, as `.data` is)."""
    return torch.empty(0, dtype=dtype, device=base.device).set_(base.untyped_storage(), offset, size, stride)


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[str, Any] = {"_view": view_over, "_leaves": pytree.tree_leaves}

    def const(self, value: Any) -> str:
        if value is None or isinstance(value, bool) or (isinstance(value, int) and not isinstance(value, bool)):
            return repr(value)
        name = f"k{len(self.names)}"
        self.names[name] = value
        return name

    def filled(self, kind: int, what: Any) -> str:
        if kind == SLOT:
            return f"s{what}"
        slot, offset, size, stride, dtype = what
        return f"_view(s{slot}, {offset}, {tuple(size)!r}, {tuple(stride)!r}, {self.const(dtype)})"


def straight_line(steps: Sequence[tuple[Any, ...]], outputs: Sequence[tuple[int | None, Any]]
                  ) -> Callable[[], list[Any]]:
    """The function that replays `steps` (Tape.steps) and returns `outputs` anew."""
    w = _Writer()
    # a view that a step reshapes in place (`unsqueeze_`, `t_`, `set_`) would carry that
    # change into the next replay if it were made once: then every view is made per replay
    fold = not any(torch.Tag.inplace_view in getattr(op, "tags", ()) for op, *_ in steps)
    for op, args, kwargs, lists, fills, outs, form, free in steps:
        views = _folded(op, args, kwargs, form) if fold and not fills and outs and form != NESTED else None
        if views is not None:
            w.lines.append("; ".join(f"s{slot} = {w.const(views[i])}" for i, slot in outs))
        else:
            w.lines.append(_call(w, op, args, kwargs, lists, fills, outs, form))
        if free:
            w.lines.append("; ".join(f"s{slot} = None" for slot in free))
    returned = [w.filled(kind, what) if kind is not None else w.const(what) for kind, what in outputs]
    w.lines.append(f"return [{', '.join(returned)}]")
    source = "def replay():\n" + "".join(f"    {line}\n" for line in w.lines)
    namespace = dict(w.names)
    exec(_compiled(source), namespace)  # our own generated code
    return namespace.pop("replay")  # its globals do not hold it (Tape.rebound copies them)


def _folded(op: Any, args: Sequence[Any], kwargs: dict[str, Any], form: int) -> list[torch.Tensor] | None:
    """A step of held tensors only that makes views of them, run once: its outputs, the
    same views at every replay. None where it must run at every replay: an op that is no
    view, or one whose schema only allows aliasing (`Tensor(a)`: `to`, `reshape`,
    `contiguous`, `flatten`, `type_as`) and made a copy this time (a weight cast to float32
    inside a custom op: made once, it was the capture's values forever, and a replay after
    the weight changed in place returned a stale result; a CUDA graph launches the copy)."""
    if not getattr(op, "is_view", False):
        return None
    with torch.inference_mode():  # as every replay runs (cudagraph/host.py): no autograd record
        made = op(*args, **kwargs)
    views = [made] if form == TENSOR else list(made)
    held = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    if not all(isinstance(v, torch.Tensor) and v.untyped_storage()._cdata in held for v in views):
        return None
    return views


def _call(w: _Writer, op: Any, args: Sequence[Any], kwargs: dict[str, Any], lists: Sequence[Any],
          fills: Sequence[Any], outs: Sequence[tuple[int, int]], form: int) -> str:
    """The line of one step that runs its op."""
    fill = {(where, key, index): w.filled(kind, what) for where, key, index, kind, what in fills}
    listed = set(lists)

    def expr(where: int, key: Any, value: Any) -> str:
        if (where, key) in listed:
            items = [fill.get((where, key, i)) or w.const(v) for i, v in enumerate(value)]
            return "[" + ", ".join(items) + "]"
        return fill.get((where, key, None)) or w.const(value)

    parts = [expr(0, i, v) for i, v in enumerate(args)]
    for key, value in kwargs.items():
        text = expr(1, key, value)
        parts.append(f"{key}={text}" if key.isidentifier() and not keyword.iskeyword(key)
                     else f"**{{{key!r}: {text}}}")
    # an OpOverload's C++ entry: its __call__ is a Python frame around it
    call = f"{w.const(getattr(op, '_op', op))}({', '.join(parts)})"
    if not outs:
        return call
    if form == TENSOR:
        return f"s{outs[0][1]} = {call}"
    # r dropped at once: held until the next such step, it would keep the outputs no
    # slot keeps (a layer norm's normalized output: one more hidden state per replay)
    got = f"r = {call}" if form == FLAT else f"r = _leaves({call})"
    return f"{got}; " + "; ".join(f"s{slot} = r[{i}]" for i, slot in outs) + "; r = None"


_CODE: OrderedDict[str, Any] = OrderedDict()  # source -> code: another capture of one graph has the same text
_CODE_KEPT = 16
_CODE_LOCK = threading.Lock()


def _compiled(source: str) -> Any:
    """Compiling is most of the generation's cost (4 ms for a 200-op decode step): the code
    of a tape that differs from one before only in the tensors it holds is reused."""
    with _CODE_LOCK:
        code = _CODE.get(source)
        if code is not None:
            _CODE.move_to_end(source)
            return code
    code = compile(source, "<graphdispatch tape>", "exec")
    with _CODE_LOCK:
        _CODE[source] = code
        while len(_CODE) > _CODE_KEPT:
            _CODE.popitem(last=False)
    return code
