"""Add the novelty statistics of a fused graph's watched inputs to the graph itself.

The eager check takes, per call, each watched input's largest magnitude (NaN where one is
NaN, inf where one is infinite) to check the calls whose inputs leave what the checked
calls saw (runtime/checks/novelty.py). Taken by a separate reduction, that is one ATen
dispatch per input per call, which the model's kernels have made cold: on the fused
families about as much as the distance to default Inductor. Computed inside the graph,
the reductions are Inductor's, fused into the kernels the graph runs anyway, and the
values come out as one more output: a float64 vector in the order of `positions`. The
fused unit strips it (runtime/program/fused_unit.py) and the check reads it after the call.

Exact: `abs` and `amax` (a maximum, in any order) of the input's own dtype, then a cast to
float64, which holds every float32, bfloat16 and float16 value, and keeps the order of
integers (a binade compared against a power of two is decided the same, or earlier).
`amax` propagates NaN (as `aminmax` does) and `abs(-inf)` is inf.

Pure: a graph rewrite, no Inductor, no runtime.

Before::   def forward(w, x):  y = aten.mm.default(x, w);  return (y,)
After::    def forward(w, x):  y = aten.mm.default(x, w)
               s = cat([unsqueeze(convert(amax(abs(x), []), float64), 0)])
               return (y, s)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphdispatch_backend.codegen import unrun

aten, prims = torch.ops.aten, torch.ops.prims
# marks the nodes added here: not the graph's own ops (no fused op to report, verdict or bisect)
STATISTIC = "gd_statistic"


def watchable(value: object) -> bool:
    """An input the graph can take the statistics of, of those the check watches (their
    dtypes are runtime/checks/novelty.py's): a strided tensor with a static shape of at
    least one element (`amax` of nothing raises)."""
    if not isinstance(value, torch.Tensor) or value.layout is not torch.strided:
        return False
    return all(isinstance(s, int) for s in value.shape) and value.numel() > 0


def add_statistics(gm: fx.GraphModule, positions: Sequence[int]) -> fx.GraphModule:
    """A copy of `gm` that also returns, last, the statistics of its placeholders at
    `positions` (each `watchable` by its fake value, of a dtype the check watches)."""
    graph = copy.deepcopy(gm.graph)
    placeholders = list(graph.find_nodes(op="placeholder"))
    output = graph.find_nodes(op="output")[0]
    vals = [placeholders[p].meta["val"] for p in positions]
    fake = detect_fake_mode(vals)

    def add(target: object, args: tuple, val: torch.Tensor) -> fx.Node:
        node = graph.call_function(target, args)
        node.meta["val"] = val
        node.meta[STATISTIC] = True
        return node

    parts = []
    with graph.inserting_before(output), fake if fake is not None else torch.no_grad():
        for p, val in zip(positions, vals):
            x = placeholders[p]
            a = add(aten.abs.default, (x,), aten.abs.default(val))
            m = add(aten.amax.default, (a, []), aten.amax.default(a.meta["val"], []))
            f = add(prims.convert_element_type.default, (m, torch.float64),
                    prims.convert_element_type.default(m.meta["val"], torch.float64))
            parts.append(add(aten.unsqueeze.default, (f, 0), aten.unsqueeze.default(f.meta["val"], 0)))
        stats = add(aten.cat.default, (parts,), aten.cat.default([p.meta["val"] for p in parts]))
    outs = output.args[0]
    # the same container, one longer (the unit strips it by a slice, which keeps the type)
    output.args = ([*outs, stats] if isinstance(outs, list) else (*outs, stats),)
    graph.lint()
    return unrun(gm, graph)  # read and cut (runtime/program/fused.py), not run as it is
