"""Find a matmul aot traced unfolded where eager folds it: a lowering eager's on some inputs only.

ATen's `matmul` of a 3-D input by a matrix folds the input's batch into its rows and calls
`mm` when the matrix requires grad, or when the input's strides allow a view; otherwise it
expands the matrix and calls `bmm`. Under autocast, eager's matrix is autocast's cached
cast of a parameter, and a parameter that requires grad makes that cast count as requiring
grad even under `torch.no_grad()` (measured, torch 2.13 CPU: `cache_enabled=False` or
`requires_grad_(False)` and eager calls `bmm` too). aot traces an inference graph with
grad off: its cast requires none, so a Linear on a transposed activation (a diffusers
attention block's `to_q` on `hidden_states.transpose(1, 2)`) is traced as `bmm` where
eager runs `mm`. The two kernels accumulate otherwise: in bfloat16 their results differ by
one rounding step on a few inputs only (a tiny UNet2DModel under bf16 autocast: its 11th
of 30 calls), so the checks pass on the calls they check and the calls between them may
be served otherwise than eager.

Such a graph is not served lowered: its lowering is declined before its first call
(`lowering_unfaithful`, runtime/checks/eager_check.py), the Dynamo graph answers, and the
detail names the parameter and the fix. Pure: reads the graph, changes nothing.

Found::    w16 = aten._to_copy.default(w, dtype=torch.bfloat16)   # w: a parameter that requires grad
           t = aten.t.default(w16);  e = aten.expand.default(t, [2, 32, 32])
           bmm = aten.bmm.default(view(expand(x, ...)), view(e, [2, 32, 32]))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

aten = torch.ops.aten
_LAYOUT = frozenset({aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default,
                     aten._unsafe_view.default})


def _expanded_matrix(node: object) -> fx.Node | None:
    """The 2-D tensor `node` (bmm's right operand) was expanded from: view(expand(m)), else None."""
    if isinstance(node, fx.Node) and node.target is aten.view.default:
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target is aten.expand.default):
        return None
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, fx.Node) else None
    return source if isinstance(value, torch.Tensor) and value.dim() == 2 else None


def _cast_parameter(node: fx.Node) -> tuple[fx.Node, torch.dtype] | None:
    """The placeholder and dtype of a lower-precision cast `node` is a layout of, else None."""
    while node.target in _LAYOUT:
        node = node.args[0]  # type: ignore[assignment]
        if not isinstance(node, fx.Node):
            return None
    if node.target is not aten._to_copy.default:
        return None
    source, dtype = node.args[0], node.kwargs.get("dtype")
    if not isinstance(source, fx.Node) or source.op != "placeholder" or dtype not in (torch.bfloat16, torch.float16):
        return None
    return source, dtype


def unfolded_matmul(gm: fx.GraphModule, requires_grad: Sequence[bool], names: Sequence[str]) -> str | None:
    """What makes an inference graph's lowering differ from eager on some inputs (module
    docstring), said with its fix; None where nothing does. `requires_grad`, `names`: per
    placeholder of `gm`, as the compiled call passes them (aot's positions)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(requires_grad):
        return None
    grad = {p: i for i, (p, rg) in enumerate(zip(placeholders, requires_grad)) if rg}
    if not grad:
        return None
    for bmm in gm.graph.find_nodes(op="call_function", target=aten.bmm.default):
        matrix = _expanded_matrix(bmm.args[1])
        cast = _cast_parameter(matrix) if matrix is not None else None
        if cast is None or cast[0] not in grad:
            continue
        i = grad[cast[0]]
        name = names[i] if i < len(names) and names[i] else cast[0].name
        return (f"{bmm.name} multiplies a 3-D input by {name} cast to {cast[1]} by autocast: aot traced it as a "
                f"batched matmul (bmm), where eager, whose autocast cast of a parameter that requires grad counts "
                f"as requiring grad, folds it into one mm; the two round otherwise on some inputs only. For "
                f"inference, call `model.requires_grad_(False)` (or use `torch.autocast(..., "
                f"cache_enabled=False)`): eager then runs the bmm aot traced")
    return None
