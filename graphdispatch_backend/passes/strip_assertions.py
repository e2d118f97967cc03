"""strip_assertions: remove dead tensor-metadata assertions, counted.

`torch.export` emits one `aten._assert_tensor_metadata` per dtype cast (29 in a 2-block LTX
transformer); they compute nothing, and the placeholder contract already checks inputs once
per call. Nodes are matched by their op schema name, never by `str()` (which differs
between builds). A node with users is kept; `_assert_scalar` and `_assert_async` are kept
because they check values, not metadata.

Before::

    _assert_tensor_metadata = aten._assert_tensor_metadata.default(x, dtype=torch.float32)
    to = aten.to.dtype(x, torch.bfloat16)

After::

    to = aten.to.dtype(x, torch.bfloat16)
"""

from __future__ import annotations

import torch.fx as fx

from graphdispatch_backend.passes.context import PassContext

ASSERTION_SCHEMAS = frozenset({"aten::_assert_tensor_metadata"})


def is_metadata_assertion(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.name in ASSERTION_SCHEMAS


def strip_assertions(gm: fx.GraphModule, ctx: PassContext) -> None:
    removed = 0
    for node in reversed(list(gm.graph.nodes)):
        if is_metadata_assertion(node) and not node.users:
            gm.graph.erase_node(node)
            removed += 1
    if removed:
        gm.recompile()
    ctx.stripped_assertions += removed
