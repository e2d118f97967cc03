"""Per-artifact attribution: which regions each artifact matched, served and lost, and why.

Built from the graph records at report time, so a regression (the origin runtime's 0.83x
run with four artifacts) points at the artifact that caused it: its parity verdicts, its
demotions with reasons, and its measured time against native (speed gate or shadow).

`status` sums it up: serving (every region its pattern named, of its fingerprint when the
manifest pins one, is served by it), pending
(matched, never called yet), partly_rejected (it serves some regions, a check refused
others its pattern named: a signature that stopped fitting after Dynamo recompiled with
dynamic shapes, say; see `rejections`; a `fingerprint` rejection counts only for a module
it serves elsewhere, since a pinned fingerprint, like the pattern, says which regions the
artifact is for), native (reached and passed, yet every call was answered natively: an
allclose artifact inside its graph's checks against eager, which under `recheck="every"`
are every call; `why` says so), partly_demoted, demoted, rejected (its pattern
named regions but a check refused them all), unmatched (its pattern named no region:
`suggestion` says what would), not_enabled, unused (its graphs run as the Dynamo graph:
torch's lowering was not bitwise equal to eager).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from graphdispatch_backend.errors import Rejection
from graphdispatch_backend.patterns import suggest

# Rejections that refuse a region the artifact's pattern named (not another artifact's win,
# not a larger region's substitution): an artifact serving elsewhere is `partly_rejected`
# (`autograd`: the region is in a graph that needs autograd, where artifacts never serve).
REFUSALS = frozenset({"fingerprint", "signature", "device", "torch_version", "not_convex", "nondeterministic",
                      "load_failed", "autograd"})
# A manifest that pins a fingerprint names the regions it is for: its pattern's regions of
# other kinds (a wide `*.mlp` over two widths) were never its own. A `fingerprint` rejection
# is a refusal only where the artifact serves the same module elsewhere (a recompile that
# changed the module's graph: it stopped serving it there).
PINNED = Rejection.FINGERPRINT.value


def _blank(enabled: bool) -> dict[str, Any]:
    return {
        "enabled": enabled,
        "regions_matched": [],
        "calls": 0,
        "replays": 0,
        "native_calls": 0,
        "parity": Counter(),
        "demotions": [],
        "rejections": Counter(),
        "speed": [],
        "shadow": {"calls": 0, "artifact_s": 0.0, "native_s": 0.0},
    }


def attribute(graphs: list[dict[str, Any]], registry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    loaded = set(registry.get("loaded", []))
    ids = loaded | set(registry.get("excluded_ids", []))
    out: dict[str, dict[str, Any]] = {i: _blank(i in loaded) for i in sorted(ids)}
    pinned_out: dict[str, set[str]] = {}  # artifact -> modules of regions its fingerprint refused
    served: dict[str, set[str]] = {}  # artifact -> modules of regions substituted by it
    for g in graphs:
        modules = {r["name"]: r.get("module", r["name"]) for r in g["regions"]}
        for region in g["regions"]:
            for rej in region.get("rejections", []):
                if rej["artifact"] in out:
                    out[rej["artifact"]]["rejections"][rej["reason"]] += 1
                    if rej["reason"] == PINNED:
                        pinned_out.setdefault(rej["artifact"], set()).add(modules[region["name"]])
        for sub in g["substitutions"]:
            served.setdefault(sub["artifact"], set()).add(modules.get(sub["region"], sub["region"]))
        for artifact, count in g.get("module_rejections", {}).items():
            if artifact in out:
                out[artifact]["rejections"]["module"] += count
        for sub in g["substitutions"]:
            entry = out.setdefault(sub["artifact"], _blank(True))
            entry["regions_matched"].append(f"{g['name']}:{sub['region']}")
            entry["calls"] += sub["calls"]
            entry["replays"] += sub.get("replays", 0)
            entry["native_calls"] += sub["native_calls"]
            entry["parity"][sub["parity"]] += 1
            entry["parity_mode"] = sub.get("parity_mode", "bitwise")
            gap = sub.get("largest_diff_passed")
            if gap is not None and (entry.get("largest_diff_passed") is None or gap > entry["largest_diff_passed"]):
                entry["largest_diff_passed"] = gap
            if sub["demoted"]:
                entry["demotions"].append({
                    "graph": g["name"], "region": sub["region"], "reason": sub["reason"], "detail": sub["detail"],
                })
            if sub["speed"]:
                entry["speed"].append({"region": sub["region"], **sub["speed"]})
            shadow = sub.get("shadow") or {}
            for key in ("calls", "artifact_s", "native_s"):
                entry["shadow"][key] += shadow.get(key, 0)
    names = [r.get("module", r["name"]) for g in graphs for r in g["regions"]]
    patterns = registry.get("patterns") or {}
    for aid, entry in out.items():
        entry["parity"] = dict(entry["parity"])
        entry["rejections"] = dict(entry["rejections"])
        s = entry["shadow"]
        s["speedup"] = (s["native_s"] / s["artifact_s"]) if s["artifact_s"] else None
        s["artifact_ms_per_call"] = 1e3 * s["artifact_s"] / s["calls"] if s["calls"] else None
        s["native_ms_per_call"] = 1e3 * s["native_s"] / s["calls"] if s["calls"] else None
        refusals = REFUSALS & set(entry["rejections"])
        if not pinned_out.get(aid, set()) & served.get(aid, set()):
            refusals -= {PINNED}  # it refused only regions it was never meant for
        entry["status"] = _status(entry, refusals)
        if entry["status"] == "unmatched" and aid in patterns:
            hint = suggest(patterns[aid], names)
            entry["suggestion"] = {"pattern": hint.pattern, "regions": hint.count, "closest": list(hint.closest),
                                   "text": hint.text()}
    return out


# reached and passed, and no call served: an allclose artifact answers natively inside a
# graph's check against eager, bit for bit (runtime/checks/modes.py)
NATIVE_WHY = ("every call of its regions was answered natively, none failed: an allclose artifact answers natively "
              "inside a graph's check against eager, bit for bit, and every call was one (it serves the calls, "
              "eager or replayed, the checks do not pick; recheck='every' picks all)")


def _status(entry: dict[str, Any], refusals: set[str]) -> str:
    """One word a reader can act on: is this artifact doing anything, and if not, why
    (`refusals`: the reasons that refused regions it is for)."""
    if not entry["enabled"]:
        return "not_enabled"  # excluded by the `enable` allowlist
    matched = len(entry["regions_matched"])
    if not matched:
        return "rejected" if set(entry["rejections"]) - {"module"} else "unmatched"
    demoted = len(entry["demotions"])
    if demoted == matched:
        return "demoted"
    if demoted:
        return "partly_demoted"
    if entry["calls"] or entry["replays"]:
        return "partly_rejected" if refusals else "serving"
    if entry["native_calls"] and "passed" in entry["parity"]:
        entry["why"] = NATIVE_WHY
        return "native"
    return "unused" if set(entry["parity"]) == {"unused"} else "pending"
