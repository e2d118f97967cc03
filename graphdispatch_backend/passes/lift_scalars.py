"""lift_scalars: compute what a graph derives from Python-number inputs before its capture.

A Python int or float argument that changes from call to call (a diffusion timestep passed
as `t=981`, a step counter) reaches the lowered graph as a SymInt/SymFloat placeholder. A
CUDA graph bakes such a number into its kernels, so a capture serves one value only: a
denoising loop over 50 distinct timesteps would capture 50 times and replay never (cudagraph
trees, too, re-record per distinct int). Two uses need no kernel to hold the number:

- a factory (`torch.tensor([t])` lowers to `aten.scalar_tensor`, `torch.full(size, t)` to
  `aten.full`): its tensor becomes the piece's input instead, a moving input copied into
  its static buffer on each call;
- host arithmetic on the number (`operator.add`, `torch.sym_max`, ...) whose result is
  returned or feeds such a factory. transformers' sliding-window cache layers keep a Python
  int counter per layer and add one to it in every decode step: the graph takes the int and
  returns it plus one, and no kernel reads it.

Where every use of a scalar input (through such arithmetic) is one of these, the nodes are
moved to the top of the graph and marked to run eagerly (split reason `scalar_input`, see
split_pieces.py): one capture serves every value. A scalar input with any other use
(`x * t`, a size) is left alone, with everything derived from it: the piece stays keyed by
its value, and lifting the rest would only add a split.

Only pure nodes move (factories that draw no random numbers and allocate no uninitialized
memory, arithmetic on host numbers); their inputs are placeholders or moved nodes, so the
move keeps the graph valid.

Before::

    mm = aten.mm.default(x, w)
    t = aten.scalar_tensor.default(s0, dtype=torch.int64)
    mul = aten.mul.Tensor(mm, t)
    add = operator.add(s1, 1)
    return (mul, add)

After (`scalar_tensor` and `add` marked `gd_scalar_input`: inline, ahead of the one piece)::

    t = aten.scalar_tensor.default(s0, dtype=torch.int64)
    add = operator.add(s1, 1)
    mm = aten.mm.default(x, w)
    mul = aten.mul.Tensor(mm, t)
    return (mul, add)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.ops import allocates_uninitialized, draws_random, is_collective, is_effectful

SCALAR_INPUT_META = "gd_scalar_input"
_NUMBERS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
# host arithmetic on numbers, as Dynamo writes it into a graph: pure, no kernel
_SYM_FUNCTIONS = frozenset({torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_float, torch.sym_int,
                            torch.sym_ite, torch.sym_sum})
_PURE_MODULES = frozenset({"_operator", "operator", "math"})


def _is_scalar_input(node: fx.Node) -> bool:
    return node.op == "placeholder" and isinstance(node.meta.get("val"), _NUMBERS)


def _is_arithmetic(node: fx.Node) -> bool:
    """Host arithmetic making a number (`s0 + 1`, `sym_max(s0, 4)`)."""
    if node.op != "call_function" or not isinstance(node.meta.get("val"), _NUMBERS):
        return False
    target = node.target
    return target in _SYM_FUNCTIONS or getattr(target, "__module__", None) in _PURE_MODULES


def _is_factory(node: fx.Node) -> bool:
    """A pure call that makes one tensor (its inputs are checked by the caller)."""
    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.is_mutable or allocates_uninitialized(node):
        return False
    if draws_random(node) or is_effectful(node) or is_collective(node):
        return False
    return bool(node.all_input_nodes)


def _liftable(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes to move, in graph order: the factories and the arithmetic computed from
    scalar inputs alone, for the scalar inputs none of whose values reaches anything else."""
    numbers: dict[fx.Node, frozenset[fx.Node]] = {}  # a host number -> the scalar inputs it is made of
    candidates: dict[fx.Node, frozenset[fx.Node]] = {}  # a node that could move -> the same
    for node in gm.graph.nodes:
        if _is_scalar_input(node):
            numbers[node] = frozenset([node])
            continue
        inputs = node.all_input_nodes
        if not inputs or not all(n in numbers for n in inputs):
            continue
        if _is_arithmetic(node) or _is_factory(node):
            sources = frozenset().union(*(numbers[n] for n in inputs))
            candidates[node] = sources
            if _is_arithmetic(node):
                numbers[node] = sources
    # a scalar input is kept (keys the piece) when a number made of it reaches a node that
    # cannot move, or a node made of a kept input too
    kept = {source for number, sources in numbers.items() for source in sources
            if any(u not in candidates and u.op != "output" for u in number.users)}
    while True:
        spread = {s for sources in candidates.values() if sources & kept for s in sources} - kept
        if not spread:
            break
        kept |= spread
    return [n for n, sources in candidates.items() if not sources & kept]


def lift_scalars(gm: fx.GraphModule, ctx: PassContext) -> None:
    if ctx.pieces_spec is None:  # nothing is captured: nothing to keep a value out of
        return
    lifted = _liftable(gm)
    if not lifted:
        return
    anchor = list(gm.graph.find_nodes(op="placeholder"))[-1]
    for node in lifted:
        anchor.append(node)
        node.meta[SCALAR_INPUT_META] = True
        anchor = node
    gm.recompile()
