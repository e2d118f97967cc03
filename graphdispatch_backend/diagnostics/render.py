"""`python -m graphdispatch_backend report DIR`: a report directory as readable tables.

Graphs with their CUDA-graph state and decline reasons, captured pieces, substituted and
rejected regions, artifacts with verdicts and timings, and timing phases. A missing or
corrupt report is a clear message and a non-zero exit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from graphdispatch_backend.table import table


class ReportError(Exception):
    pass


def load(directory: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    path = Path(directory) / "dispatch.json"
    if not path.is_file():
        raise ReportError(f"no report at {path} (run with options={{'report_dir': ...}} first)")
    try:
        report = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path} is not a valid report: {exc}") from None
    if not isinstance(report, dict) or report.get("schema_version") != 1 or not isinstance(report.get("graphs"), list):
        raise ReportError(f"{path} is not a graphdispatch report (schema_version 1 with graphs[])")
    timing_path = path.with_name("timing.json")
    timing = None
    if timing_path.is_file():
        try:
            timing = json.loads(timing_path.read_text("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            timing = None
    return report, timing


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "-"


def render(report: dict[str, Any], timing: dict[str, Any] | None = None) -> str:
    out: list[str] = []
    reg = report.get("registry", {})
    totals = report.get("totals", {})
    out.append(f"graphdispatch report: {totals.get('graphs', 0)} graphs, {totals.get('calls', 0)} calls, "
               f"{totals.get('replays', 0)} replays, {totals.get('eager_calls', 0)} eager")
    out.append(f"artifacts: loaded {reg.get('loaded', [])}, enable {reg.get('enabled_filter')}, "
               f"excluded {reg.get('excluded_ids', [])}")
    for err in reg.get("errors", []):
        out.append(f"  rejected bundle {err.get('bundle')}: {err.get('reason')}: {err.get('message')}")
    rows = []
    for g in report["graphs"]:
        cg = g["cuda_graph"]
        balanced = "ok" if g["calls"] == cg["replays"] + cg["eager_calls"] else "MISMATCH"
        rows.append([g["name"], g["kind"], g["nodes"], g["calls"], cg["replays"], cg["eager_calls"], balanced,
                     cg["mode"], cg["state"], _reasons(cg["eager_by_reason"]), _reasons(cg["declines"])])
    out += ["", "Graphs", table(["graph", "kind", "nodes", "calls", "replays", "eager", "calls=r+e", "cuda graph",
                                  "state", "eager calls by reason", "declines"], rows)]
    details = [[g["name"], k, v] for g in report["graphs"] for k, v in g["cuda_graph"]["decline_details"].items()]
    if details:
        out += ["", "Decline reasons", table(["graph", "reason", "detail"], details)]
    pieces = [[g["name"], p["index"], "captured" if p["capturable"] else "eager", p["nodes"],
               _reasons(p.get("split_reasons", {})), p.get("cuda_graph", {}).get("state", "-")]
              for g in report["graphs"] for p in g.get("pieces", []) if len(g.get("pieces", [])) > 1]
    if pieces:
        out += ["", "Pieces (piecewise capture)", table(["graph", "piece", "kind", "nodes", "split by", "state"], pieces)]
    rows = []
    for g in report["graphs"]:
        for r in g["regions"]:
            if r.get("artifact") or r.get("rejections"):
                why = "; ".join(f"{j['artifact']}: {j['reason']} ({j['detail']})" for j in r.get("rejections", []))
                rows.append([g["name"], r["name"], r["class"], r["fingerprint"][:12], r.get("artifact") or "-", why or "-"])
    out += ["", "Regions with matches or rejections (all regions are in dispatch.json)",
            table(["graph", "region", "class", "fingerprint", "artifact", "rejections"], rows) if rows else "  none"]
    rows = []
    for aid, a in sorted(report.get("artifacts", {}).items()):
        demotions = "; ".join(f"{d['region']}: {d['reason']} ({d['detail']})" for d in a["demotions"]) or "-"
        speed = "; ".join(f"{s['region']}: {s['artifact_ms']:.3f} vs {s['native_ms']:.3f} ms" for s in a["speed"])
        shadow = a["shadow"]
        if shadow.get("calls"):
            speed = (speed + "; " if speed else "") + f"shadow x{shadow['speedup']:.2f} over {shadow['calls']} calls"
        rows.append([aid, "yes" if a["enabled"] else "no", len(a["regions_matched"]), a["calls"], a["native_calls"],
                     _reasons(a["parity"]), demotions, speed or "-", _reasons(a["rejections"])])
    out += ["", "Artifacts", table(["artifact", "enabled", "regions", "calls", "native calls", "parity", "demotions",
                                     "timing", "rejections"], rows) if rows else "  none"]
    if timing and timing.get("phases"):
        rows = [[k, v["calls"], f"{v['mean_ms']:.4f}", f"{v['total_seconds']:.4f}"] for k, v in timing["phases"].items()]
        out += ["", f"Timing ({timing.get('mode')})", table(["phase", "calls", "mean ms", "total s"], rows)]
    if timing and timing.get("notes"):
        rows = [[v, k] for k, v in sorted(timing["notes"].items(), key=lambda kv: -kv[1])[:20]]
        out += ["", "Notes", table(["count", "note"], rows)]
    return "\n".join(out)


def report_command(directory: str) -> int:
    try:
        report, timing = load(directory)
        print(render(report, timing))
    except ReportError as exc:
        print(f"error: {exc}")
        return 2
    except (KeyError, TypeError) as exc:
        print(f"error: {Path(directory) / 'dispatch.json'} is missing a field the renderer needs: {exc}")
        return 2
    return 0
