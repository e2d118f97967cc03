"""Region patterns: how a manifest's `region.module` matches names, and what to suggest when
it matches none (pure; no torch, so the CLI can use it).

A pattern is an `fnmatch` pattern anchored at both ends over the dotted module name, as
`named_modules()` spells it: `layers.*.mlp` matches `layers.0.mlp` but not
`model.layers.0.mlp` (write `*.layers.*.mlp`) nor `layers.0.mlp.act_fn`; `*` also
crosses dots. Matching is case-sensitive.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from collections import Counter
from collections.abc import Iterable

MIN_RATIO = 0.5  # how alike (difflib ratio) a generalized name must be to be suggested


def matches(pattern: str, name: str) -> bool:
    """Whether a manifest pattern matches a module name (anchored, case-sensitive)."""
    return fnmatch.fnmatchcase(name, pattern)


def generalize(name: str) -> str:
    """The pattern a repeated module's names share: every numeric part becomes `*`
    (`layers.3.mlp` -> `layers.*.mlp`); the `#k` of a second call is dropped."""
    module = name.split("#", 1)[0]
    return ".".join("*" if part.isdigit() else part for part in module.split("."))


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A pattern that would match `count` of the names, and the names closest to the
    pattern that matched none."""

    pattern: str | None
    count: int
    closest: tuple[str, ...]

    def text(self) -> str:
        parts = []
        if self.pattern is not None:
            parts.append(f"did you mean `{self.pattern}`: {self.count} region{'s' if self.count != 1 else ''}")
        if self.closest:
            parts.append("closest names: " + ", ".join(self.closest))
        return "; ".join(parts) or "no region names to compare with"


def suggest(pattern: str, names: Iterable[str], closest: int = 3) -> Suggestion:
    """What `pattern` was probably meant to be, given the names it matched none of.

    In order: the pattern under a prefix (`*.layers.*.mlp` when the model is compiled from
    a wrapper that holds it as `model`), the pattern without leading parts (when the
    manifest was written for a wrapper and the inner model is compiled), then the
    generalized name closest to the pattern as text.
    """
    pool = sorted({n.split("#", 1)[0] for n in names if n})
    near = tuple(difflib.get_close_matches(pattern, pool, n=closest, cutoff=0.0))
    # leading parts dropped, unless what is left starts with a wildcard (`*.mlp` names too much)
    tails = [pattern.split(".", k)[-1] for k in range(1, pattern.count(".") + 1)]
    candidates = [f"*.{pattern}"] + [t for t in tails if not t.startswith(("*", "?", "["))]
    for candidate in candidates:
        hits = [n for n in pool if matches(candidate, n)]
        if hits:  # the names it would match (the text's nearest may be none of them: `ff` by `attn.norm_k`)
            return Suggestion(candidate, len(hits), tuple(hits[:closest]))
    kinds = Counter(generalize(n) for n in pool)
    if not kinds:
        return Suggestion(None, 0, near)
    ratio = {k: difflib.SequenceMatcher(None, pattern, k).ratio() for k in kinds}
    best = max(kinds, key=lambda k: (ratio[k], kinds[k], k))
    if ratio[best] < MIN_RATIO:  # nothing alike: a guess would mislead
        return Suggestion(None, 0, near)
    return Suggestion(best, kinds[best], tuple(n for n in near if generalize(n) == best)
                      or tuple(n for n in pool if generalize(n) == best)[:closest])

