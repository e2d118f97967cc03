"""Views of a fused segment's outputs, made as one alias per chain, per call.

A graph fused under a tolerance leaves the views of its outputs to ATen, after the fused
code (fusion/segments.py `_views_out`: so each has eager's strides); each ATen view call is
a dispatch per call (a `view`, `permute`, `select` chain of six on HunyuanVideo's output).
`chain_views` makes each chain one `ViewChain` call: the chain's ATen calls once per layout
of the value it views, then an alias of the same size, strides and offset, as Inductor's own
code makes its views (`reinterpret_tensor`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.codegen import entry
from graphdispatch_backend.passes.ops import is_view
from graphdispatch_backend.runtime.cudagraph.engine import RECORDING

_alias = torch._C._dynamo.guards._reinterpret_tensor  # (base, size, stride, offset from base's): Inductor's own


class ViewChain:
    """A chain of views of one segment output, as one alias: its first call per layout of
    the output runs the chain's ATen calls (eager's own view semantics, so eager's strides)
    and keeps the result's size, strides and offset; later calls make that alias directly
    (what Inductor's code does for its views, `reinterpret_tensor`). While an engine records
    or replays, the ATen calls run, as the capture's steps (runtime/cudagraph/engine.py)."""

    MAX_LAYOUTS = 8  # layouts kept (a dynamic graph's outputs change size); past it, the ATen calls

    def __init__(self, chain: Callable[[torch.Tensor], torch.Tensor], name: str) -> None:
        self._chain = chain
        self._layouts: dict[tuple[Any, ...], tuple[Any, Any, int]] = {}
        self.__name__ = self.__qualname__ = name

    def __call__(self, base: torch.Tensor) -> torch.Tensor:
        key = (base.shape, base.stride(), base.storage_offset(), base.dtype)
        found = self._layouts.get(key)
        if found is not None and not RECORDING.depth:  # (engine.in_recording, without its frame)
            return _alias(base, *found)
        out = self._chain(base)
        if len(self._layouts) < self.MAX_LAYOUTS and out.dtype == base.dtype and not out.is_conj() \
                and not out.is_neg() and out.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
            self._layouts[key] = (out.size(), out.stride(), out.storage_offset() - base.storage_offset())
        return out


def chain_views(graph: fx.Graph, made: set[fx.Node]) -> None:
    """Each chain of views (`select`, `slice`, `view`, `permute`, ...) of a segment's output
    `made`, each view reading only its base and keeping its dtype, becomes one `ViewChain`
    call: ATen's view calls cost a dispatch each, per call (a tolerance graph leaves the
    views of its outputs to ATen: fusion/segments.py `_views_out`)."""
    root: dict[fx.Node, fx.Node] = {}  # view -> the segment output it views
    steps: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if not is_view(node) or not isinstance(node.target, torch._ops.OpOverload):
            continue
        base = node.args[0] if node.args else None
        if not isinstance(base, fx.Node) or (base not in made and base not in root):
            continue
        if any(isinstance(a, fx.Node) for a in [*node.args[1:], *node.kwargs.values()]) or _nested_nodes(node):
            continue  # a size computed in the graph: not a view of its base alone
        val, base_val = node.meta.get("val"), base.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(base_val, torch.Tensor)) or val.dtype != base_val.dtype \
                or val.is_complex():
            continue  # (a view as another dtype, or a complex view's conjugate bit, is no alias of the same layout)
        root[node] = root.get(base, base)
        steps[node] = [*steps.get(base, []), node]
    for node, nodes in steps.items():
        if all(u in steps for u in node.users):
            continue  # only read by longer chains
        calls = [(entry(n.target), n.args[1:], dict(n.kwargs)) for n in nodes]

        def chain(base: torch.Tensor, _calls: list[tuple[Any, ...]] = calls) -> torch.Tensor:
            for op, args, kwargs in _calls:
                base = op(base, *args, **kwargs)
            return base

        with graph.inserting_before(node):
            alias = graph.call_function(ViewChain(chain, f"gd_views_{node.name}"), (root[node],))
        alias.meta = dict(node.meta)
        node.replace_all_uses_with(alias)
    for node in reversed(list(steps)):
        if not node.users:
            graph.erase_node(node)


def _nested_nodes(node: fx.Node) -> bool:
    """A list argument of `node` holds a node (a size computed in the graph)."""
    return any(isinstance(x, fx.Node) for a in [*node.args[1:], *node.kwargs.values()] if isinstance(a, (list, tuple))
               for x in a)
