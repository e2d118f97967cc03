"""lift_scalars: make the tensors a graph builds from Python-number inputs before its capture.

A Python int or float argument that changes from call to call (a diffusion timestep passed
as `t=981`, a step counter) reaches the lowered graph as a SymInt/SymFloat placeholder. A
CUDA graph bakes such a number into its kernels, so a capture serves one value only: a
denoising loop over 50 distinct timesteps would capture 50 times and replay never (cudagraph
trees, too, re-record per distinct int). Most such numbers enter tensor math through one
factory (`torch.tensor([t])` lowers to `aten.scalar_tensor`, `torch.full(size, t)` to
`aten.full`): where every use of a scalar input is such a factory, the factories are moved
to the top of the graph and marked to run eagerly (split reason `scalar_input`, see
split_pieces.py). The captured piece then takes their tensor as a moving input, copied into
its static buffer on each call: one capture serves every value. A scalar input with any
other use (`x * t`, a size) is left alone: the piece stays keyed by its value.

Only pure factories move: their inputs are placeholders, so the move keeps the graph valid,
and they draw no random numbers and allocate no uninitialized memory (those keep their own
split reasons and their place in the graph's order).

Before::

    mm = aten.mm.default(x, w)
    t = aten.scalar_tensor.default(s0, dtype=torch.int64)
    mul = aten.mul.Tensor(mm, t)

After (`scalar_tensor` marked `gd_scalar_input`: inline, ahead of the one piece)::

    t = aten.scalar_tensor.default(s0, dtype=torch.int64)
    mm = aten.mm.default(x, w)
    mul = aten.mul.Tensor(mm, t)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.ops import allocates_uninitialized, draws_random, is_collective, is_effectful

SCALAR_INPUT_META = "gd_scalar_input"


def _is_scalar_input(node: fx.Node) -> bool:
    return node.op == "placeholder" and isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, int, float))


def _is_factory(node: fx.Node) -> bool:
    """A pure call that makes one tensor out of scalar inputs (and constants) alone."""
    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.is_mutable or allocates_uninitialized(node):
        return False
    if draws_random(node) or is_effectful(node) or is_collective(node):
        return False
    return bool(node.all_input_nodes) and all(_is_scalar_input(n) for n in node.all_input_nodes)


def lift_scalars(gm: fx.GraphModule, ctx: PassContext) -> None:
    if ctx.pieces_spec is None:  # nothing is captured: nothing to keep a value out of
        return
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    # scalar inputs used by factories only (any other use keeps the scalar in the piece)
    scalars = [n for n in placeholders if _is_scalar_input(n) and n.users and all(map(_is_factory, n.users))]
    # their factories, in order, bar those that also read a scalar used elsewhere: no gain
    lifted = list(dict.fromkeys(u for s in scalars for u in s.users if all(n in scalars for n in u.all_input_nodes)))
    if not lifted:
        return
    anchor = placeholders[-1]
    for node in lifted:
        anchor.append(node)
        node.meta[SCALAR_INPUT_META] = True
        anchor = node
    gm.recompile()
