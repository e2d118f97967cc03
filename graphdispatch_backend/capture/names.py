"""Clean module and parameter names, exactly as `model.named_modules()` spells them.

Dynamo writes module paths as Python access expressions rooted at a frame variable:
`L['self'].transformer_blocks.0.ff`, `L['self'].__dict__['_modules']['blocks'].0`,
`G['model'].d.a`, and parameter sources as `L['self']._modules['l']._parameters['weight']`.
Everything downstream (regions, manifests, reports) uses the clean dotted form.
"""

from __future__ import annotations

import re

_ROOT = re.compile(r"""^(?:L|G)\[(?:'[^']*'|"[^"]*")\]""")
_TOKEN = re.compile(r"""\.([^.\[\]]+)|\[\s*'([^']*)'\s*\]|\[\s*"([^"]*)"\s*\]|\[\s*(-?\d+)\s*\]""")
_CONTAINERS = {"_modules": "module", "_parameters": "parameter", "_buffers": "buffer"}


def _tokens(path: str) -> list[str]:
    match = _ROOT.match(path)
    rest = path[match.end() :] if match else path
    tokens: list[str] = []
    pos = 0
    while pos < len(rest):
        m = _TOKEN.match(rest, pos)
        if m is None:  # not an access chain we understand: keep it whole, readable
            tokens.append(rest[pos:].lstrip("."))
            break
        tokens.append(next(g for g in m.groups() if g is not None))
        pos = m.end()
    if not match and tokens and rest and not rest.startswith((".", "[")):
        # a bare dotted path (already clean) parses as one leading token chain
        return [t for t in path.split(".") if t]
    return tokens


def clean_path(path: str) -> tuple[str, str]:
    """Return (clean dotted name, kind); kind is parameter, buffer or attribute.

    The kind is read from the container holding the last name (`_parameters[...]`,
    `_buffers[...]`); anything else reached by attribute access is an attribute.
    """
    tokens = _tokens(path)
    out: list[str] = []
    kind = "attribute"
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if tok == "__dict__" and nxt in _CONTAINERS:
            continue
        if tok in _CONTAINERS and nxt is not None:
            kind = _CONTAINERS[tok] if i + 2 == len(tokens) else kind
            continue
        out.append(tok)
    return ".".join(out), "attribute" if kind == "module" else kind


def root_name(path: str) -> str | None:
    """`L['x']` -> `x`: the frame variable an access chain starts from."""
    match = _ROOT.match(path)
    return match.group(0)[3:-2] if match else None


def clean_module_name(stack_path: str) -> str:
    """`L['self'].__dict__['_modules']['blocks'].0.ff` -> `blocks.0.ff`."""
    return clean_path(stack_path)[0]


def instance_of(stack_key: str) -> int:
    """nn_module_stack keys are `id(module)` or `id(module)@k` for the k-th call."""
    _, sep, tail = stack_key.rpartition("@")
    return int(tail) if sep and tail.isdigit() else 0


def region_name(module: str, instance: int) -> str:
    """The region instance name: `blocks.0.ff`, or `blocks.0.ff#1` for its second call."""
    return f"{module}#{instance}" if instance else module
