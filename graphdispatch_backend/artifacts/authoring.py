"""Authoring checks over a session's graphs: enabled artifacts that name no region, and the
words of an artifact that names a region and does not fit it (pure).

An artifact is unmatched when its pattern matched no region of any graph compiled so far
and, when the compiled root module is known, none of the model's module names either: a
pattern that names a module of the model may still meet its region in a graph Dynamo has
not compiled yet (after a graph break, or after a hook's own frame), so it is not judged
until then. The report's artifact status (`unmatched`) covers what is never compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from graphdispatch_backend.patterns import Suggestion, generalize, matches, suggest


@dataclasses.dataclass(frozen=True)
class Unmatched:
    artifact: str
    pattern: str
    regions: int  # region names compiled so far, none of which the pattern matched
    suggestion: Suggestion

    def message(self) -> str:
        return (f"artifact {self.artifact} matched no region: pattern `{self.pattern}` matches none of the "
                f"{self.regions} region names compiled so far (anchored fnmatch over named_modules() names); "
                f"{self.suggestion.text()}")


def unmatched(patterns: Mapping[str, str], hits: Mapping[str, int], region_names: Sequence[str],
              model_modules: Sequence[str] | None) -> list[Unmatched]:
    """The artifacts (id -> pattern) with no hit (id -> regions its pattern named, over all
    graphs so far) that also name no module of the model (when it is known)."""
    names = sorted({n.split("#", 1)[0] for n in region_names})
    if not names and model_modules is None:
        return []  # nothing compiled to judge against (a graph with no module in it)
    out = []
    for artifact, pattern in sorted(patterns.items()):
        if hits.get(artifact, 0):
            continue
        if model_modules is not None and any(matches(pattern, m) for m in model_modules):
            continue
        out.append(Unmatched(artifact, pattern, len(names), suggest(pattern, names or list(model_modules or ()))))
    return out


def signature_failure(artifact: str, region: str, module: str, cls: str, detail: str) -> tuple[str, str]:
    """(key, message) of a signature rejection: one per artifact and region kind
    (`layers.*.mlp`), so 28 layers refused for one reason are one line."""
    kind = generalize(module)
    return f"{artifact}:{kind}", (f"artifact {artifact} does not fit region {region} ({cls}; once per kind `{kind}`, "
                                  f"every region is in the report): signature: {detail}")


PIN_FIX = ("a fingerprint pins one graph, its shapes included, so it fits no other size: delete region.fingerprint "
           "(the pattern and signature then choose the regions, null dims included, and parity is checked per shape)")


def fingerprint_failure(artifact: str, region: str, module: str, cls: str, pinned: str, found: str,
                        miss: str | None, dynamic: bool) -> tuple[str, str]:
    """(key, message) of a pinned `region.fingerprint` that refuses a region the rest of the
    manifest describes, once per artifact and region kind: what differs and the fix. `miss`:
    the signature's own miss, which null dims where the region's are symbolic would mend (a
    recompile with dynamic shapes), or None where the signature fits; `dynamic`: the region
    has symbolic dims or the manifest null ones. A fingerprint covers the boundary's shapes:
    a pin never fits the recompile that a manifest's null dims are written for."""
    kind = generalize(module)
    if miss is not None:
        why = f"the region's sizes are not the ones the manifest was written for ({miss}); {PIN_FIX}"
    elif dynamic:
        why = f"the signature fits (its null dims included), the pin does not: {PIN_FIX}"
    else:
        why = (f"the signature fits, so the graph itself differs from the one pinned (an op, an argument or a "
               f"stride): if this region is the one to serve, pin {found} or delete region.fingerprint")
    return f"{artifact}:{kind}", (f"artifact {artifact} does not fit region {region} ({cls}; once per kind `{kind}`, "
                                  f"every region is in the report): fingerprint: manifest {pinned}, region {found}: "
                                  f"{why}")
