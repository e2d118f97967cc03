"""Module and parameter names exactly as the compiled root module's `named_modules()` spells them.

Dynamo writes module paths as Python access expressions rooted at a variable of the frame
it compiles, and that variable depends on how the model reached Dynamo: `L['self'].layers.0`
for a plain `forward`, `L['args'][0].layers.0` for a forward decorated as
`wrapper(*args, **kwargs)` (transformers' Llama), `G['orig'].__self__.layers.0` for an
instance forward that closes over the original, `L['mod']` in a hook, and
`L['self'].__dict__['_modules']['blocks'].0` or `._parameters['weight']` inside.

While Dynamo compiles, its frame is live: `resolve_graph_names` walks each path on the
frame's own objects, takes the first `nn.Module` on it as the root the path is anchored
at, and names every module by identity in the root's `named_modules()` (the root most
paths are anchored at wins when there are several). So the name is the one
`model.get_submodule(name)` accepts, however Dynamo spelled the path. Without a frame
(a graph built by hand or by make_fx), or for a module the root does not register, the
path is cleaned as text: the frame variable, subscripts and `__self__` right after it,
and the `__dict__`/`_modules`/`_parameters`/`_buffers` containers are dropped.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

_ROOT = re.compile(r"""^(?:L|G)\[(?:'[^']*'|"[^"]*")\]""")
_TOKEN = re.compile(r"""\.([^.\[\]]+)|\[\s*'([^']*)'\s*\]|\[\s*"([^"]*)"\s*\]|\[\s*(-?\d+)\s*\]""")
_GETATTR = re.compile(r"""^getattr\((.*),\s*(?:'([^']*)'|"([^"]*)")\)""")
_CONTAINERS = {"_modules": "module", "_parameters": "parameter", "_buffers": "buffer"}
_BOUND = ("__self__",)  # a bound method's owner: `G['orig'].__self__` is the module itself


@dataclasses.dataclass(frozen=True)
class _Token:
    text: str
    item: bool  # `[...]` rather than `.name`


def _chain(rest: str) -> list[_Token]:
    """Tokens of an access chain (`.a['b'][0]`)."""
    tokens: list[_Token] = []
    pos = 0
    while pos < len(rest):
        m = _TOKEN.match(rest, pos)
        if m is None:  # not an access chain we understand: keep it whole, readable
            tokens.append(_Token(rest[pos:].lstrip("."), False))
            break
        tokens.append(_Token(next(g for g in m.groups() if g is not None), m.group(1) is None))
        pos = m.end()
    return tokens


def _parse(path: str) -> tuple[str | None, list[_Token]]:
    """(frame variable access `L['x']` or None, the access chain after it)."""
    m = _GETATTR.match(path)
    if m is not None:  # Dynamo spells a non-identifier attribute `getattr(base, 'k-1')`
        root, tokens = _parse(m.group(1))
        member = m.group(2) if m.group(2) is not None else m.group(3)
        return root, tokens + [_Token(member, False)] + _chain(path[m.end():])
    match = _ROOT.match(path)
    if match is None:
        if path.startswith((".", "[")):
            return None, _chain(path)
        # a bare dotted path (already clean, as named_modules() gives it): one token per part
        return None, [_Token(t, False) for t in path.split(".") if t]
    return match.group(0), _chain(path[match.end():])


def _clean(tokens: list[_Token]) -> tuple[str, str]:
    """Dotted name and kind (parameter, buffer or attribute) of an access chain below a module."""
    out: list[str] = []
    kind = "attribute"
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1].text if i + 1 < len(tokens) else None
        if tok.text == "__dict__" and not tok.item and nxt in _CONTAINERS:
            continue
        if tok.text in _CONTAINERS and nxt is not None:  # `._modules[...]` or `__dict__['_modules']`
            kind = _CONTAINERS[tok.text] if i + 2 == len(tokens) else kind
            continue
        if tok.text in _BOUND and not tok.item:
            continue
        out.append(tok.text)
    return ".".join(out), "attribute" if kind == "module" else kind


def clean_path(path: str) -> tuple[str, str]:
    """(clean dotted name, kind) of a path, as text: kind is parameter, buffer or attribute.

    The frame variable is dropped, with the subscripts right after it (`L['args'][0]` is
    the module `forward(*args)` was called on) and `__self__`; the kind is read from the
    container holding the last name (`_parameters[...]`, `_buffers[...]`).
    """
    root, tokens = _parse(path)
    if root is not None:
        while tokens and (tokens[0].item or tokens[0].text in _BOUND):
            tokens = tokens[1:]
    return _clean(tokens)


def access_name(path: str) -> str:
    """A non-module input's name, every step kept: `L['kwargs']['ids']` -> `kwargs.ids`."""
    root, tokens = _parse(path)
    return ".".join(p for p in ((root[3:-2] if root else ""), _clean(tokens)[0]) if p)


def root_name(path: str) -> str | None:
    """`L['x']` -> `x`: the frame variable an access chain starts from."""
    match = _ROOT.match(path)
    return match.group(0)[3:-2] if match else None


def clean_module_name(stack_path: str) -> str:
    """`L['self'].__dict__['_modules']['blocks'].0.ff` -> `blocks.0.ff` (text only)."""
    return clean_path(stack_path)[0]


def instance_of(stack_key: str) -> int:
    """nn_module_stack keys are `id(module)` or `id(module)@k` for the k-th call."""
    _, sep, tail = stack_key.rpartition("@")
    return int(tail) if sep and tail.isdigit() else 0


def region_name(module: str, instance: int) -> str:
    """The region instance name: `blocks.0.ff`, or `blocks.0.ff#1` for its second call."""
    return f"{module}#{instance}" if instance else module


# -- live resolution ------------------------------------------------------------------------------


def current_frame() -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(locals, globals) of the frame Dynamo is compiling, or None outside a compile.
    Backends run while Dynamo's translator is still current (torch 2.13)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # no compile has set it on this thread
        return None
    if tx is None:
        return None
    root = tx.output.root_tx
    return dict(root.f_locals), dict(root.f_globals)


def _step(obj: Any, tok: _Token) -> Any:
    if isinstance(obj, torch.nn.Module) and not tok.item:
        for container in ("_modules", "_parameters", "_buffers"):
            table = obj.__dict__.get(container, {})
            if tok.text in table:
                return table[tok.text]
    if tok.item:
        if isinstance(obj, (list, tuple, torch.nn.ModuleList, torch.nn.Sequential)):
            return obj[int(tok.text)]
        return obj[tok.text]
    if tok.text == "__dict__":
        return vars(obj)
    return getattr(obj, tok.text)


@dataclasses.dataclass(frozen=True)
class _Walk:
    anchor: torch.nn.Module  # the first module on the path: the root it is anchored at
    owner: torch.nn.Module  # the last module on the path
    rest: list[_Token]  # the chain below `owner` (a parameter's `_parameters['weight']`)


def _walk(path: str, frame: tuple[dict[str, Any], dict[str, Any]]) -> _Walk | None:
    root, tokens = _parse(path)
    if root is None:
        return None
    scope = frame[0] if root.startswith("L") else frame[1]
    if root[3:-2] not in scope:
        return None
    obj = scope[root[3:-2]]
    anchor: torch.nn.Module | None = None
    owner, rest = None, tokens
    for i in range(len(tokens) + 1):
        if isinstance(obj, torch.nn.Module):
            anchor = anchor if anchor is not None else obj
            owner, rest = obj, tokens[i:]
        if i == len(tokens):
            break
        try:
            obj = _step(obj, tokens[i])
        except (AttributeError, KeyError, IndexError, TypeError, ValueError, RuntimeError):
            break  # the objects changed since Dynamo read them: what was walked still names it
    if anchor is None or owner is None:
        return None
    return _Walk(anchor, owner, rest)


def _module_names(root: torch.nn.Module) -> dict[int, str]:
    """id(module) -> its first named_modules() name under `root` (the root itself is "")."""
    return {id(m): name for name, m in root.named_modules()}


def _calls(gm: torch.fx.GraphModule) -> dict[tuple[str, str], str]:
    """Per nn_module_stack (key, path) of `gm`: the key of that call of the module, `id` or
    `id@k` for its k-th call (`instance_of`). Dynamo counts a module's calls through one
    path (`mlp`, then `mlp` again: `id@1`) but gives one module reached through two paths
    (one MLP in two ModuleList slots: `blocks.0.mlp`, `blocks.1.mlp`) the same key twice,
    and both paths clean to its one name: its calls were one region (a trial, 2026-12-07).
    Counted here in the order they come, per module."""
    seen: dict[str, list[tuple[str, str]]] = {}
    out: dict[tuple[str, str], str] = {}
    for node in gm.graph.nodes:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            if (key, path) in out:
                continue
            base = key.rpartition("@")[0] if instance_of(key) else key
            order = seen.setdefault(base, [])
            out[(key, path)] = f"{base}@{len(order)}" if order else base
            order.append((key, path))
    return out


def resolve_graph_names(gm: torch.fx.GraphModule, paths: Iterable[str] = (),
                        frame: tuple[dict[str, Any], dict[str, Any]] | None = None) -> dict[str, tuple[str, str]]:
    """Clean (name, kind) of every nn_module_stack path of `gm` and of `paths` (parameter
    and buffer sources), and rewrite each node's nn_module_stack, in place, to the clean
    names, one key per call of a module (`_calls`): lowering copies that meta onto the
    ATen nodes, so every later reader (regions, region export, substitution) sees one
    spelling. Also sets `gm.meta["gd_model_modules"]`
    to the root module's named_modules() names (None without a frame)."""
    frame = frame if frame is not None else current_frame()
    stack_paths = {path for node in gm.graph.nodes for path, _ in (node.meta.get("nn_module_stack") or {}).values()}
    every = sorted(stack_paths | set(paths))
    walks = {p: _walk(p, frame) for p in every} if frame is not None else {}
    anchors = Counter(id(w.anchor) for w in walks.values() if w is not None)
    tables: dict[int, dict[int, str]] = {}
    objects = {id(w.anchor): w.anchor for w in walks.values() if w is not None}
    for key in anchors:
        tables[key] = _module_names(objects[key])
    main = tables[anchors.most_common(1)[0][0]] if anchors else {}
    resolved: dict[str, tuple[str, str]] = {}
    for path in every:
        walk = walks.get(path)
        owner_name = None
        if walk is not None:
            owner_name = main.get(id(walk.owner), tables[id(walk.anchor)].get(id(walk.owner)))
        if walk is None or owner_name is None:
            resolved[path] = clean_path(path)
            continue
        below, kind = _clean(walk.rest)
        resolved[path] = (".".join(p for p in (owner_name, below) if p), kind)
    calls = _calls(gm)
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {calls[(k, p)]: (resolved[p][0], cls) for k, (p, cls) in stack.items()}
    gm.meta["gd_model_modules"] = tuple(n for n in main.values() if n) if anchors else None
    return resolved
