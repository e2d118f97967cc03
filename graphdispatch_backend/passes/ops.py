"""What a node's op is, read from its schema (shared by tag_regions and split_pieces)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def _argument(node: fx.Node, name: str) -> Any:
    """The value a call node passes for schema argument `name` (positional or keyword),
    the schema default if it passes none, or None if the op has no such argument."""
    schema = node.target._schema
    for index, arg in enumerate(schema.arguments):
        if arg.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            if index < len(node.args):
                return node.args[index]
            return arg.default_value if arg.has_default_value() else None
    return None


def draws_random(node: fx.Node) -> bool:
    """True if the node consumes the RNG. Ops tagged `nondeterministic_seeded` for an
    optional dropout (attention, dropout with train=False or p=0) do not when it is off."""
    tags = getattr(node.target, "tags", ())
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in tags:
        return False
    names = {a.name for a in node.target._schema.arguments}
    if "dropout_p" in names:
        return _argument(node, "dropout_p") not in (0, 0.0, None)
    if {"p", "train"} <= names:
        train = _argument(node, "train")  # native_dropout's `bool? train`: None means training
        return (train is None or bool(train)) and _argument(node, "p") not in (0, 0.0)
    return True
