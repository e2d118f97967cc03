"""Keep eager's interpolation kernels in a lowered inference graph.

aot traces `F.interpolate(x, mode="bilinear")` through the Python decompositions torch
registers for the upsampling ops (`torch/_decomp/decompositions.py`: index arithmetic,
`_unsafe_index`, a lerp in a few elementwise ops), not through the CPU or CUDA kernel
eager calls. The two round differently: a SegFormer decode head's bilinear upsampling
came out 1 ulp off eager (2.4e-7), its lowering was `lowering_mismatch`, and the graph ran
as the Dynamo graph, never captured. Nearest modes index only and are exact; `linear`,
`bilinear`, `bicubic`, `trilinear` (antialiased or not) compute.

So before aot traces an inference graph, each such `F.interpolate` call of the Dynamo
graph (Dynamo keeps it as one call) becomes `graphdispatch::interpolate`, a custom op
whose kernel is `F.interpolate` itself: aot keeps it whole, and it runs eager's kernels
on the real tensors, bit for bit. Its fake kernel gives the size `F.interpolate`
computes (`floor(size * scale)`) laid out as the upsampling kernels lay their output
(the input's suggested memory format). A graph that records autograd history keeps the
decomposition (the op has no backward), as does one with a symbolic size. The Dynamo
graph itself is not changed: the check's reference is still what the user wrote, so a
size computed otherwise here would be a counted `lowering_mismatch`, not a wrong output.

Before::   interpolate = torch.nn.functional.interpolate(x, scale_factor=2.0, mode="bilinear")
After::    interpolate = graphdispatch.interpolate.default(x, None, [2.0, 2.0], "bilinear",
                                                           None, None, False)
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format

# the modes whose decomposition computes (nearest ones only index: exact as traced)
COMPUTING_MODES = frozenset({"linear", "bilinear", "bicubic", "trilinear"})
_SIGNATURE = inspect.signature(F.interpolate)


@torch.library.custom_op("graphdispatch::interpolate", mutates_args=())
def interpolate(x: torch.Tensor, size: list[int] | None, scale_factor: list[float] | None, mode: str,
                align_corners: bool | None, recompute_scale_factor: bool | None, antialias: bool) -> torch.Tensor:
    return F.interpolate(x, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)


@interpolate.register_fake
def _(x: torch.Tensor, size: list[int] | None, scale_factor: list[float] | None, mode: str,
      align_corners: bool | None, recompute_scale_factor: bool | None, antialias: bool) -> torch.Tensor:
    if size is not None:
        spatial = list(size)
    else:  # F.interpolate's and ATen's `compute_output_size`: the product, truncated
        spatial = [int(float(x.shape[i + 2]) * s) for i, s in enumerate(scale_factor or ())]
    return torch.empty((*x.shape[:2], *spatial), dtype=x.dtype, device=x.device,
                       memory_format=suggest_memory_format(x))


def _per_dim(value: object, dims: int, kind: type) -> list | None:
    """`size` or `scale_factor` as F.interpolate spreads it over the spatial dimensions;
    None where it is not a number or a sequence of numbers of `kind`."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [kind(value)] * dims
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in value):
        return [kind(v) for v in value]
    return None


def _arguments(node: fx.Node) -> tuple | None:
    """The custom op's arguments for an `F.interpolate` node it can stand in for, else None."""
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    x = a["input"]
    value = x.meta.get("example_value") if isinstance(x, fx.Node) else None
    if a["mode"] not in COMPUTING_MODES or not isinstance(value, torch.Tensor) or value.dim() < 3:
        return None
    if not all(type(s) is int for s in value.shape):  # a symbolic size: left to the decomposition
        return None
    if (a["size"] is None) == (a["scale_factor"] is None):
        return None  # both or neither: F.interpolate's own error, as traced
    dims = value.dim() - 2
    size = _per_dim(a["size"], dims, int)
    scale = _per_dim(a["scale_factor"], dims, float)
    if size is None and scale is None:
        return None  # the one given is not numbers: left as traced
    return (x, size, scale, a["mode"], a["align_corners"], a["recompute_scale_factor"], a["antialias"])


def keep_eager_interpolation(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm`, or a copy whose computing `F.interpolate` calls are `graphdispatch::interpolate`
    (module docstring); only for a graph traced without autograd history."""
    if torch.is_grad_enabled():
        return gm
    found = [(n, args) for n in gm.graph.find_nodes(op="call_function", target=F.interpolate)
             if (args := _arguments(n)) is not None]
    if not found:
        return gm
    graph = copy.deepcopy(gm.graph)
    nodes = dict(zip(gm.graph.nodes, graph.nodes))
    for node, args in found:
        twin = nodes[node]
        twin.target = torch.ops.graphdispatch.interpolate.default
        twin.args = (nodes[args[0]], *args[1:])
        twin.kwargs = {}
    return fx.GraphModule(gm, graph)
