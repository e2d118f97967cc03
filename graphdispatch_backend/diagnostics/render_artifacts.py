"""The report's artifact sections as tables (`report DIR`, diagnostics/render.py puts them
in its reading order): the bundles loaded or rejected, the authoring failures, the
artifacts with their status, parity verdicts, demotions and speed against native, the
artifact checks per graph (region calls served since each region's last check, the
largest gap, what caught a demotion), and the regions that matched or were rejected."""

from __future__ import annotations

from typing import Any

from graphdispatch_backend.table import CELL, counts, plural, table

_CAUGHT_BY = {
    "artifact_recheck": "its artifact_recheck schedule",
    "novelty": "a check for novel inputs (they left what the checked calls had seen)",
    "recheck": "the graph's check against eager, on its schedule",
    "shadow": "timing='shadow'",
}


def _parity(entry: dict[str, Any]) -> str:
    """Its verdicts; for an allclose artifact, so marked, with the largest difference a passing check saw."""
    said = counts(entry["parity"])
    if entry.get("parity_mode", "bitwise") == "bitwise":
        return said
    gap = entry.get("largest_diff_passed")
    return f"{said} ({entry['parity_mode']}" + (f", passed up to {gap:.3g})" if gap is not None else ")")


def _speed(entry: dict[str, Any]) -> str:
    """Time against native, as native/artifact (above 1.00x the artifact is faster)."""
    parts = []
    for s in entry.get("speed") or []:
        ratio = f"{s['speedup']:.2f}x" if s.get("speedup") else "?"
        parts.append(f"gate {ratio} ({s['artifact_ms']:.3f} vs {s['native_ms']:.3f} ms)")
    if len(parts) > 1:
        ratios = [s["speedup"] for s in entry["speed"] if s.get("speedup")]
        parts = [f"gate {min(ratios):.2f}-{max(ratios):.2f}x over {len(entry['speed'])} regions"] if ratios else parts
    shadow = entry.get("shadow") or {}
    if shadow.get("calls"):
        per_call = ""
        if shadow.get("artifact_ms_per_call") is not None:
            per_call = f", {shadow['artifact_ms_per_call']:.3f} vs {shadow['native_ms_per_call']:.3f} ms/call"
        ratio = f"{shadow['speedup']:.2f}x" if shadow.get("speedup") else "?"
        parts.append(f"shadow {ratio} ({shadow['calls']} calls{per_call})")
    return "; ".join(parts) or "-"


def registry(report: dict[str, Any]) -> list[str]:
    reg = report.get("registry", {})
    out = ["", "Artifact bundles"]
    if not reg.get("roots") and not reg.get("loaded"):
        return out + ["  none (options['artifacts'] not set)"]
    out.append(f"  roots: {', '.join(reg.get('roots', [])) or '-'}")
    enable = reg.get("enabled_filter")
    out.append(f"  loaded: {', '.join(reg.get('loaded', [])) or 'none'}; "
               f"enable: {', '.join(enable) if enable is not None else 'all verified'}; "
               f"excluded by enable: {', '.join(reg.get('excluded_ids', [])) or 'none'}")
    for err in reg.get("errors", []):
        out.append(f"  REJECTED bundle {err.get('bundle')}: {err.get('reason')}: {err.get('message')}")
    return out


def artifacts(report: dict[str, Any]) -> list[str]:
    artifacts = report.get("artifacts", {})
    if not artifacts:
        return ["", "Artifacts", "  none"]
    rows, demotions, unmatched, explained = [], [], [], []
    patterns = report.get("registry", {}).get("patterns") or {}
    for aid, a in sorted(artifacts.items()):
        reasons: dict[str, int] = {}
        for d in a["demotions"]:
            reasons[d["reason"]] = reasons.get(d["reason"], 0) + 1
            demotions.append(f"  {aid} on {d['graph']} {d['region']}: {d['reason']}: {d['detail']}")
        rows.append([aid, a.get("status", "-"), len(a["regions_matched"]), a["calls"], a.get("replays", 0),
                     a["native_calls"], _parity(a), counts(reasons), counts(a["rejections"]), _speed(a)])
        if a.get("why"):
            explained.append(f"  {aid} ({a['status']}): {a['why']}")
        if a.get("status") == "unmatched":
            hint = (a.get("suggestion") or {}).get("text", "")
            unmatched.append(f"  {aid}: pattern `{patterns.get(aid, '?')}` matched no region"
                             + (f"; {hint}" if hint else ""))
    out = ["", "Artifacts (calls / replays: region calls the artifact answered eagerly / from a captured graph; "
               "native: region calls the native region answered instead, eagerly or from a captured graph "
               "(a failing gate, a demotion); runs made only to check or record are not calls; "
               "rejections: regions refused, by reason, `module` where the pattern does not name them)",
           table(["artifact", "status", "regions", "calls", "replays", "native", "parity", "demotions", "rejections",
                  "time vs native (>1.00x: artifact faster)"], rows)]
    if not any(a["speed"] or (a.get("shadow") or {}).get("calls") for a in artifacts.values()):
        out.append("  no timings: set speed_gate=True or timing='shadow' to time each artifact against native")
    out += explained
    if unmatched:
        out += ["", "Unmatched artifacts (patterns are fnmatch over the compiled module's named_modules() names, "
                    "anchored at both ends)"] + unmatched
    if demotions:
        out += ["", "Demotions (the artifact serves no more calls for that region this session)"] + demotions
    return out


def regions(report: dict[str, Any]) -> list[str]:
    rows, rejections, total = [], [], 0
    for g in report["graphs"]:
        subs = {s["region"]: s for s in g["substitutions"]}
        total += len(g["regions"])
        for r in g["regions"]:
            rejected = r.get("rejections") or []
            sub = subs.get(r["name"])
            if not sub and not rejected:
                continue
            if sub is None:
                verdict, served, native = "-", "-", "-"
            else:
                verdict = f"demoted ({sub['reason']})" if sub["demoted"] else f"parity {sub['parity']}"
                served, native = sub["calls"] + sub.get("replays", 0), sub["native_calls"]
            rows.append([g["name"], r["name"], r["class"], r["fingerprint"][:12], r.get("artifact") or "-", verdict,
                         served, native, ", ".join(f"{j['artifact']}:{j['reason']}" for j in rejected) or "-"])
            rejections += [f"  {g['name']} {r['name']} x {j['artifact']}: {j['reason']}: {j['detail']}"
                           for j in rejected]
    title = f"Regions with an artifact or a rejection ({len(rows)} of {total}; every region is in dispatch.json)"
    if not rows:
        return ["", title, "  none"]
    out = ["", title, table(["graph", "region", "class", "fingerprint", "artifact", "verdict", "served", "native",
                             "rejected"], rows, max_width=CELL)]
    if rejections:
        out += ["", "Rejections (why an artifact does not substitute a region)"] + rejections
    return out


def authoring(report: dict[str, Any]) -> list[str]:
    failures = report.get("authoring") or []
    errors = report.get("registry", {}).get("errors") or []
    demoted = [s for g in report["graphs"] for s in g["substitutions"] if s["demoted"]]
    if not failures and not errors and not demoted:
        return []
    out = ["", "Authoring failures (each logged once at WARNING; strict=True fails the compile on each)"]
    out += [f"  {e.get('reason')}: {e.get('bundle')}: {e.get('message')}" for e in errors]
    out += [f"  {f['failure']}: {f['message']}" for f in failures]
    if demoted:
        out.append(f"  demoted: {plural(len(demoted), 'substitution')} (see Demotions)")
    return out


def artifact_checks(report: dict[str, Any]) -> list[str]:
    """Per graph and per artifact: the calls its artifacts served since their last check and
    the largest gap (calls served unchecked in a row), from the substitution records; and
    the call that caught a demoted one, with the calls it had served unchecked before."""
    rows: list[list[Any]] = []
    per_artifact: dict[str, list[int]] = {}  # graphs, regions, served, unchecked, largest gap
    caught: list[str] = []
    for g in report["graphs"]:
        for other in g.get("lowering_check", {}).get("caught_on_other_ranks", ()):  # collectives: not this rank's
            caught.append(f"  {g['name']}: at call {other['at_call']} another rank of the graph's process groups found "
                          f"its kernel off; {plural(other['unchecked_calls'], 'call')} served here before it may have "
                          "differed from eager's too (this rank's outputs come through the collectives)")
        by_artifact: dict[str, list[dict[str, Any]]] = {}
        for s in g["substitutions"]:
            by_artifact.setdefault(s["artifact"], []).append(s)
        for aid, subs in sorted(by_artifact.items()):
            served = sum(s["calls"] + s.get("replays", 0) for s in subs)
            unchecked = sum(s.get("served_since_check", 0) for s in subs)
            gap = max(s.get("largest_gap", 0) for s in subs)
            novel = sum(s.get("novelty_checks", 0) for s in subs)
            rows.append([g["name"], aid, len(subs), served, unchecked, gap, novel])
            total = per_artifact.setdefault(aid, [0, 0, 0, 0, 0, 0])
            total[0] += 1
            total[1] += len(subs)
            total[2] += served
            total[3] += unchecked
            total[4] = max(total[4], gap)
            total[5] += novel
            for s in subs:
                if s.get("caught_at_call") is not None:
                    by = _CAUGHT_BY.get(s.get("caught_by") or "", "a check")
                    caught.append(f"  {aid} on {g['name']} {s['region']}: caught at call {s['caught_at_call']} of its "
                                  f"shape key by {by}; {plural(s.get('unchecked_calls') or 0, 'call')} served "
                                  "unchecked since the check before it" + (
                                      f"; what they wrote into {', '.join(s['stale_state'])} (state the graph "
                                      "writes) stays, and may hold values computed from the kernel's: the calls "
                                      "that read it differ from eager's until it is written anew"
                                      if s.get("stale_state") else ""))
    if not rows:
        return []
    rows += [["all graphs", aid, *t[1:]] for aid, t in sorted(per_artifact.items()) if t[0] > 1]
    opts = report.get("options", {})
    schedule = f"artifact_recheck={opts['artifact_recheck']!r}" if "artifact_recheck" in opts else "recheck"
    out = ["", f"Artifact checks ({schedule}; served: region calls the artifact answered, eagerly or replayed; "
               "since last check: those served since each region's last check, unchecked; largest gap: the most one "
               "region served unchecked in a row; novelty checks: eager calls its gates checked beyond the schedule "
               "because their inputs left what the checked calls had seen)",
           table(["graph", "artifact", "regions", "served", "since last check", "largest gap", "novelty checks"],
                 rows)]
    return out + ["", "Caught at a check (the calls before it were served as computed)"] + caught if caught else out
