"""Suspects: which op made an eager run disagree with itself.

An eager that disagrees with itself (`eager_nondeterministic`) is nobody's fault, but it
costs the graph its fast path for good, so the verdict names the op to look at: the one
whose output bits differed. The graph runs twice more from the same state, op by op (an
`fx.Interpreter`), each op's outputs printed as a 128-bit digest (runtime/checks/digest.py),
and the first op whose prints differ is named, with the memory it read when that memory
was made uninitialized (`empty` and its kin). An allocation itself is never the difference
(its bytes are nobody's until something writes them); what reads them unwritten is.
Measured on the form people write a collective in, before split_pieces placed its buffer
(`out = torch.empty_like(x); dist.all_to_all_single(out, x)`): the piece that made the
buffer returned it, and the old list of every op that may be nondeterministic named the
all-to-all and its wait, ops of another piece.

Where the graph may not run again on this rank alone (it holds collectives: the other
ranks would not run them with it), the graph is read instead: the ops the differing output
depends on that may give other bits (known nondeterministic kernels, custom ops, memory
made uninitialized), never a collective (every rank gets the bits it sends).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

from graphdispatch_backend.passes.ops import (
    allocates_uninitialized,
    is_collective,
    nondeterministic_ops,
    op_label,
    torch_allocation,
)
from graphdispatch_backend.runtime.checks.digest import digest

NONE_KNOWN = "no known nondeterministic op (a custom op?)"
Run = Callable[[Callable[..., Any]], Any]  # runs a function on the call's inputs, from the state before it


def _made_uninitialized(node: fx.Node) -> bool:
    return allocates_uninitialized(node) or torch_allocation(node)


# writes that set every element of the tensor they are given (`copy_` broadcasts its source
# to the destination's shape): an allocation whose first use is one of them is never read unwritten
_WHOLE_WRITES = frozenset({"copy_", "fill_", "zero_"})
_ATEN_WHOLE_WRITES = frozenset({torch.ops.aten.copy_.default, torch.ops.aten.copy.default, torch.ops.aten.fill_.Scalar,
                                torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default})


def _written_whole_first(node: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether the first op to use allocation `node` writes all of it (`out = empty_like(x);
    dist.all_to_all_single(out, x)`, traced as the collective and a `copy_` into `out`):
    then no op reads its memory unwritten, and it is no suspect."""
    if not node.users:
        return False
    first = min(node.users, key=order.__getitem__)
    if not first.args or first.args[0] is not node:
        return False
    if first.op == "call_method":
        return first.target in _WHOLE_WRITES
    return first.op == "call_function" and (first.target in _ATEN_WHOLE_WRITES
                                            or getattr(first.target, "__name__", None) in _WHOLE_WRITES)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class _Printer(fx.Interpreter):
    """Runs a graph op by op and keeps a print of every op's outputs, in node order, with
    the allocations (made uninitialized) whose memory each op read. An output over such
    memory (the allocation, a view of it, a write into it) is not printed: what it holds
    may still be unwritten; what an op computes from it is."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.prints: list[tuple[fx.Node, list[Any], list[fx.Node]]] = []
        self._made: dict[int, tuple[StorageWeakRef, fx.Node]] = {}  # storage -> the allocation that made it

    def _allocation(self, t: torch.Tensor) -> fx.Node | None:
        found = self._made.get(t.untyped_storage().data_ptr())
        return found[1] if found is not None and not found[0].expired() else None

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op not in ("call_function", "call_method", "call_module"):
            return out
        if _made_uninitialized(n):
            for t in _tensors(out):
                self._made[t.untyped_storage().data_ptr()] = (StorageWeakRef(t.untyped_storage()), n)
            return out
        inputs = _tensors(self.fetch_args_kwargs_from_env(n))
        read = [a for a in map(self._allocation, inputs) if a is not None]
        printed = [None if self._allocation(t) is not None or not t.numel() else digest(t) for t in _tensors(out)]
        self.prints.append((n, printed, read))
        return out


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None
                                                                 and torch.equal(x, y)) for x, y in zip(a, b))


class Suspects:
    """How one graph (a Dynamo graph, or a captured piece's ATen graph) names the op that
    made eager disagree with itself. `rerun`: it may run again on this rank alone."""

    def __init__(self, gm: fx.GraphModule | None = None, rerun: bool = False, listed: Sequence[str] = ()) -> None:
        self._gm = gm
        self._rerun = rerun and gm is not None
        self._listed = tuple(listed)  # without a graph: the ops that may give other bits, as given

    @property
    def reruns(self) -> bool:
        """`name` runs the graph again (twice), given a way to."""
        return self._rerun

    def name(self, output: int, run: Run | None) -> str:
        """The suspects of a difference at `output` (its position; -1: unknown). `run(fn)`
        runs `fn` on the call's inputs from the state before the call (the caller puts the
        state back afterwards)."""
        if self._rerun and run is not None:
            found = self._differing(run)
            if found is not None:
                return found
        return self._read(output)

    def _differing(self, run: Run) -> str | None:
        """The first op whose outputs differ between two runs (see module docstring)."""
        runs = []
        for _ in range(2):
            printer = _Printer(self._gm)
            run(printer.run)
            runs.append(printer.prints)
        for (node, first, read), (_, second, _) in zip(*runs):
            if not _same(first, second):
                said = f"{op_label(node)} (its output bits differed between two runs"
                if read:
                    said += f"; it reads memory made uninitialized by {', '.join(dict.fromkeys(map(op_label, read)))}"
                return said + ")"
        return None

    def _read(self, output: int) -> str:
        """The ops the output at `output` depends on that may give other bits, read from the graph."""
        gm = self._gm
        if gm is None:
            return ", ".join(self._listed) or NONE_KNOWN
        outs = gm.graph.output_node().args[0]
        outs = outs if isinstance(outs, (list, tuple)) else (outs,)
        start = [outs[output]] if 0 <= output < len(outs) and isinstance(outs[output], fx.Node) else \
            [o for o in outs if isinstance(o, fx.Node)]
        seen: set[fx.Node] = set()
        while start:
            node = start.pop()
            if node not in seen:
                seen.add(node)
                start.extend(node.all_input_nodes)
        nodes = [n for n in gm.graph.nodes if n in seen]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        names = [f"{op_label(n)} (memory made uninitialized)" for n in nodes
                 if _made_uninitialized(n) and not _written_whole_first(n, order)]
        names += nondeterministic_ops(n for n in nodes if not is_collective(n))
        return ", ".join(dict.fromkeys(names)) or NONE_KNOWN
