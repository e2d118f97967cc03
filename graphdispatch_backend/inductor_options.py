"""The keys of Inductor's config a caller passes in `options`: taken apart from graphdispatch's
own, each value checked against the type the config declares for its key, and held as one
hashable value (`InductorKeys`) so that Options stays a compile identity.

Frameworks pass `torch.compile` arguments meant for Inductor to whatever backend they are
given (FastVideo's regional compile always adds `emulate_precision_casts` to `options`).
torch.compile checks plain types only, so a generic one took anything (`cpp.simdlen`,
`int | None`, took "x" and reported it applied, where `max_autotune`, `bool`, refused
"yes"). Reads Inductor's config, never sets it.
"""

from __future__ import annotations

import collections.abc
import types
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Union, get_args, get_origin

from graphdispatch_backend.errors import OptionsError, did_you_mean


class InductorKeys:
    """Inductor config keys for the fusion compile (sorted `(key, value)` pairs), kept apart
    from graphdispatch's own: hashable by their text, so Options stays a compile identity
    even where a value (a list) is not. `given`: the ones the caller wrote in `options` (the
    rest are a mode's own settings, MODES)."""

    __slots__ = ("given", "items")

    def __init__(self, items: Mapping[str, Any] | None = None, given: Iterable[str] | None = None) -> None:
        self.items: tuple[tuple[str, Any], ...] = tuple(sorted((items or {}).items()))
        self.given: tuple[str, ...] = tuple(sorted(given if given is not None else (items or {})))

    def __bool__(self) -> bool:
        return bool(self.items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InductorKeys) and repr((self.items, self.given)) == repr((other.items, other.given))

    def __hash__(self) -> int:
        return hash(repr((self.items, self.given)))

    def __repr__(self) -> str:
        return f"InductorKeys({dict(self.items)!r})"

    def to_dict(self) -> dict[str, Any]:
        return {k: reported(v) for k, v in self.items}


def reported(value: Any) -> Any:
    """An Inductor setting as the report holds it: a JSON scalar as it is, else its repr."""
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


def inductor_keys(given: dict[str, Any], own: tuple[str, ...]) -> dict[str, Any]:
    """Take the keys of Inductor's config out of `given` (not graphdispatch's own), `-` read
    as `_` as torch.compile reads them, each value checked against the type the config
    declares for its key (`inductor_type_fits`); any other key stays in `given`, for the
    unknown-key error. Reads the config, never sets it."""
    candidates = [k for k in given if k not in own and isinstance(k, str)]
    if not candidates:
        return {}
    from torch._inductor import config

    known = config.get_config_copy()
    taken: dict[str, Any] = {}
    for key in candidates:
        name = key.replace("-", "_")
        if name not in known:
            continue
        value = given.pop(key)
        kind = config.get_type(name)  # type: ignore[attr-defined]
        fits = inductor_type_fits(value, kind)
        if fits is None and known[name] is not None:  # a type written as text: its default's type
            kind = type(known[name])
            fits = inductor_type_fits(value, kind)
        if fits is False:
            choices = [a for a in _literals(kind) if isinstance(a, str)]
            near = did_you_mean(value, choices) if isinstance(value, str) else ""
            raise OptionsError(f"Inductor option {key!r} must be {_type_text(kind)}, got {value!r} "
                               f"({type(value).__name__}){near}")
        taken[name] = value
    return taken


def inductor_type_fits(value: Any, kind: Any) -> bool | None:
    """Whether `value` is of `kind`, a type Inductor's config declares: plain types as
    isinstance says (but a bool is no int), unions, Optional, Literal, containers with their
    elements, callables. torch.compile checks plain types only, so a generic one took
    anything (`cpp.simdlen`, `int | None`, took "x" and reported it applied, where
    `max_autotune`, `bool`, refused "yes"). None where it cannot be told (a type written as
    text, a type variable)."""
    if kind is Any:
        return True
    if kind is None or kind is type(None):
        return value is None
    origin, args = get_origin(kind), get_args(kind)
    if origin is None:
        if not isinstance(kind, type):
            return None
        return isinstance(value, kind) and not (isinstance(value, bool) and kind is int)
    if origin is Literal:  # by type too: 1 is not '1', True is not 1
        return any(type(value) is type(a) and value == a for a in args)
    if origin is Union or origin is types.UnionType:
        return _all_or_any([inductor_type_fits(value, a) for a in args], all_of=False)
    if origin is collections.abc.Callable:
        return callable(value)
    if origin is type:
        return isinstance(value, type)
    if not isinstance(origin, type):
        return None
    if not isinstance(value, origin):
        return False
    if origin is tuple:
        # tuple[int, ...], and tuple[X] as torch writes it for a tuple of any length
        # (triton.cudagraph_capture_sizes: (1, 2, 4) is what it takes)
        if len(args) == 2 and args[1] is Ellipsis or len(args) == 1:
            parts = [(v, args[0]) for v in value]
        elif len(args) == len(value):
            parts = list(zip(value, args))
        else:
            return False
    elif issubclass(origin, Mapping) and len(args) == 2:
        parts = [(k, args[0]) for k in value] + [(v, args[1]) for v in value.values()]
    elif len(args) == 1:  # list[str], set[int]
        parts = [(v, args[0]) for v in value]
    else:
        return True
    return _all_or_any([inductor_type_fits(v, k) for v, k in parts], all_of=True)


def _all_or_any(fits: list[bool | None], all_of: bool) -> bool | None:
    """Combine verdicts that may be None (cannot be told): all of them, or any of them."""
    if all_of:
        return False if False in fits else None if None in fits else True
    return True if True in fits else None if None in fits else False


def _literals(kind: Any) -> list[Any]:
    """The values a Literal type (or an Optional one) allows: for a near miss's "did you mean"."""
    if get_origin(kind) is Literal:
        return list(get_args(kind))
    if get_origin(kind) in (Union, types.UnionType):
        return [v for a in get_args(kind) for v in _literals(a)]
    return []


def _type_text(kind: Any) -> str:
    """An Inductor setting's type as an error says it: "of type int | None", "one of 'a', 'b'"."""
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(map(repr, get_args(kind)))
    if isinstance(kind, type) and get_origin(kind) is None:
        return f"of type {kind.__name__}"
    return "of type " + str(kind).replace("typing.", "").replace("collections.abc.", "").replace("NoneType", "None")
