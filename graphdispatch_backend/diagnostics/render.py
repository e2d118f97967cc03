"""`python -m graphdispatch_backend report DIR`: a report directory as readable tables.

In reading order: what ran (options, environment, the rank and the other ranks' reports
beside it), whether every call that reached graphdispatch is accounted for (a call Dynamo
runs outside the backend, past its `recompile_limit`, is in no report), the artifact
bundles, graphs with their CUDA-graph state and decline reasons, captured pieces, fused
graphs (kernels, the ops kept as ATen calls and why), artifacts with their status, parity
verdicts, demotions and timings against native, the regions that matched or were
rejected, timing phases and notes. Tables hold one line per row; long reasons are
listed in full under them.

The directory (or one rank's report file, `DIR/dispatch.rank1.json`) is read by
diagnostics/report_dir.py (`load`, `run_command`): a missing directory, a missing
`dispatch.json`, corrupt JSON or another schema is a message on stderr and exit status 2;
an unreadable `timing.json` is said, not fatal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphdispatch_backend.diagnostics.render_artifacts import artifact_checks, artifacts, authoring, regions, registry
from graphdispatch_backend.diagnostics.report_dir import rank_reports, run_command
from graphdispatch_backend.table import CELL, counts, plural, table

_OPTION_KEYS = ("cuda_graphs", "fuse", "timing", "speed_gate", "strict", "warmup", "verify_inputs", "max_captures",
                "recheck", "artifact_recheck")


# -- small formatters --------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3f}"


# -- sections ------------------------------------------------------------------------------
def _header(report: dict[str, Any], source: str, ranks: dict[int, str] | None) -> list[str]:
    env, opts = report.get("environment", {}), report.get("options", {})
    out = [f"graphdispatch report ({source})"]
    if env:
        out.append(f"torch {env.get('torch', '?')}, python {env.get('python', '?')}, "
                   f"CUDA {'available' if env.get('cuda_available') else 'not available'}")
    out += _ranks(report.get("distributed"), ranks or {})
    shown = [f"{k}={opts[k]!r}" for k in _OPTION_KEYS if k in opts]
    if shown:
        out.append("options: " + ", ".join(shown))
    return out


def _ranks(distributed: dict[str, Any] | None, ranks: dict[int, str]) -> list[str]:
    """Which rank wrote this report, and the other ranks' reports beside it (their files)."""
    rank = (distributed or {}).get("rank", 0)
    others = {r: path for r, path in ranks.items() if r != rank}
    out = []
    if distributed:
        backend = f" {distributed['backend']}" if distributed.get("backend") else ""
        out.append(f"rank {rank} of {distributed.get('world_size', '?')} (torch.distributed{backend})")
    if others:
        first = next(iter(others.values()))
        out.append(f"other ranks' reports here: {', '.join(f'rank {r} {Path(p).name}' for r, p in others.items())} "
                   f"(render one: python -m graphdispatch_backend report {first})")
    return out


def _summary(report: dict[str, Any]) -> list[str]:
    graphs = report["graphs"]
    calls = sum(g["calls"] for g in graphs)
    replays = sum(g["cuda_graph"]["replays"] for g in graphs)
    eager = sum(g["cuda_graph"]["eager_calls"] for g in graphs)
    by_reason: dict[str, int] = {}
    for g in graphs:
        for k, v in g["cuda_graph"]["eager_by_reason"].items():
            by_reason[k] = by_reason.get(k, 0) + v
    subs = [s for g in graphs for s in g["substitutions"]]
    demoted = sum(1 for s in subs if s["demoted"])
    broken = [g["name"] for g in _with_backwards(graphs) if not _balanced(g)]
    fell_back = sum(1 for g in graphs if g["kind"] == "fallback")
    strict = report.get("options", {}).get("strict")  # then a compile error raised into the user's call
    failing = "raised a compile error (strict)" if strict else "fell back on a compile error"
    backwards = [g["backward"] for g in graphs if g.get("backward")]
    out = ["", "Summary",
           f"  {plural(len(graphs), 'graph')}, {plural(calls, 'call')}: {replays} replayed from a captured graph, "
           f"{eager} eager" + (f" ({counts(by_reason)})" if eager else ""),
           f"  {plural(len(subs), 'substitution')}, {demoted} demoted to native; "
           + (f"{plural(fell_back, 'graph')} {failing}" if fell_back else "no graph fell back on a compile error")]
    if subs:  # what the artifacts' check schedule left unjudged (see "Artifact checks")
        unchecked = sum(s.get("served_since_check", 0) for s in subs)
        gap = max(s.get("largest_gap", 0) for s in subs)
        ever = sum(s.get("served_unchecked", 0) for s in subs)
        out.append(f"  artifacts: {plural(unchecked, 'region call')} served since their last check "
                   f"({ever} unchecked in all), at most {plural(gap, 'call')} served unchecked in a row")
    if backwards:
        b_calls = sum(b["calls"] for b in backwards)
        b_replays = sum(b["cuda_graph"]["replays"] for b in backwards)
        out.append(f"  {plural(len(backwards), 'backward')} of autograd graphs, {plural(b_calls, 'run')} "
                   f"({sum(b['checks'] for b in backwards)} by the lowering check): {b_replays} replayed, "
                   f"{b_calls - b_replays} eager")
    if broken:
        out.append(f"  ACCOUNTING MISMATCH (calls != replays + eager) in: {', '.join(broken)}")
    else:
        out.append("  every call that reached graphdispatch accounted for: calls == replays + eager on each graph")
    hits = report.get("totals", {}).get("dynamo_recompile_limit_hits", 0)
    if hits:
        out.append(f"  but Dynamo hit its recompile_limit {plural(hits, 'time')} in this process (any backend): "
                   "those functions' later calls ran without it, outside every backend, and are in no report "
                   "(raise torch._dynamo.config.recompile_limit, or give the model static shapes: docs/report.md)")
    return out


def _with_backwards(graphs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each graph, followed by its backward's record when it has one."""
    return [r for g in graphs for r in (g, g.get("backward")) if r]


def _balanced(g: dict[str, Any]) -> bool:
    cg = g["cuda_graph"]
    return g["calls"] == cg["replays"] + cg["eager_calls"] and sum(cg["eager_by_reason"].values()) == cg["eager_calls"]


def _graphs(report: dict[str, Any]) -> list[str]:
    rows, details = [], []
    for g in _with_backwards(report["graphs"]):
        cg = g["cuda_graph"]
        lowering = g.get("lowering_check") or {}
        checks = "-" if "checked" not in lowering else (
            f"{lowering['checked']} ({lowering['novelty']} novel)" if lowering.get("novelty") else lowering["checked"])
        rows.append([g["name"], g["kind"], g["nodes"], len(g.get("substitutions", ())), g["calls"], cg["replays"],
                     cg["eager_calls"], "ok" if _balanced(g) else "MISMATCH", lowering.get("status", "-"), checks,
                     f"{cg['mode']}: {cg['state']}", cg["captures"], counts(cg["eager_by_reason"]),
                     counts(cg["declines"])])
        if lowering.get("detail"):
            details.append(f"  {g['name']}: {lowering['status']}: {lowering['detail']}")
        for reason, detail in sorted(cg["decline_details"].items()):
            details.append(f"  {g['name']}: {reason} (x{cg['declines'].get(reason, 1)}): {detail}")
        if g.get("contract_mismatches"):
            details.append(f"  {g['name']}: contract_mismatch (x{g['contract_mismatches']} calls ran the native "
                           f"graph): {g.get('contract_detail')}")
    out = ["", "Graphs (vs eager: the lowered graph checked against the Dynamo graph run eagerly, bit for bit, "
               "an autograd graph's gradients too; checks: the calls compared, those made because the inputs "
               "left what the checked calls had seen (novel) among them; <graph>.backward: its backward's runs, the "
               "check's among them; cuda graph = engine: state; engine host is the CPU emulation, off means no "
               "capture)",
           table(["graph", "kind", "nodes", "subst", "calls", "replays", "eager", "calls=r+e", "vs eager", "checks",
                  "cuda graph", "captures", "eager calls by reason", "declines"], rows, max_width=CELL)]
    if details:
        out += ["", "Why calls ran eager (declines, lowering checks and contract mismatches)"] + details
    return out


def _pieces(report: dict[str, Any]) -> list[str]:
    rows = []
    for g in _with_backwards(report["graphs"]):
        pieces = g.get("pieces", [])
        if len(pieces) <= 1:
            continue
        for p in pieces:
            cg = p.get("cuda_graph") or {}
            rows.append([g["name"], p["index"], "captured" if p["capturable"] else "eager", p["nodes"],
                         counts(p.get("split_reasons")), cg.get("state", "-"),
                         cg.get("replays", "-"), counts(cg.get("eager_by_reason"))])
    if not rows:
        return []
    return ["", "Pieces (piecewise capture: nodes a CUDA graph cannot hold run eager between them)",
            table(["graph", "piece", "kind", "nodes", "split by", "state", "replays", "eager by reason"], rows,
                  max_width=CELL)]


def _fusion(report: dict[str, Any]) -> list[str]:
    rows, details = [], []
    for g in report["graphs"]:
        f = g.get("fusion")
        if not f:
            continue
        kept = f.get("kept") or []
        learned = [k for k in kept if k.get("why") != "recipe"]
        recipe = [k["op"] for k in kept if k.get("why") == "recipe"]
        tol = f.get("tolerance")
        judged = f"rtol={tol['rtol']:g} atol={tol['atol']:g}" if tol else "bitwise"
        status = f"{f.get('status', '-')}, unused ({f['unused']})" if f.get("unused") else f.get("status", "-")
        rows.append([g["name"], status, judged,
                     f.get("kernels", "-"), sum((f.get("fused_ops") or {}).values()), f.get("aten_calls", "-"),
                     len(recipe), ", ".join(k["op"] for k in learned) or "-", f.get("rounds", "-"),
                     f.get("compile_seconds", "-")])
        if f.get("detail"):
            details.append(f"  {g['name']}: {f['status']}: {f['detail']}")
        if f.get("unused"):
            details.append(f"  {g['name']}: its fused code serves no call: the graph runs as the Dynamo graph "
                           f"({f['unused']}, see its lowering check)")
        if tol:
            details.append(f"  {g['name']}: {_tolerance(f, g['calls'])}")
        for k in learned:
            details.append(f"  {g['name']}: {k['op']} runs as an ATen call, {_why_kept(k)}: {k.get('detail', '')}")
        if recipe:
            details.append(f"  {g['name']}: left to ATen by the recipe: {', '.join(recipe)}")
    if not rows:
        return []
    out = ["", "Fusion (fuse: each graph's ops compiled by Inductor, bit for bit under an eager-numerics recipe or "
               "within a declared tolerance, checked against eager like any lowering; an op found off runs as its "
               "ATen kernel)",
           table(["graph", "status", "judged", "kernels", "fused nodes", "ATen calls", "recipe keeps",
                  "kept as learned", "rounds", "compile s"], rows, max_width=CELL)]
    return out + ["", "Fusion checks and ops kept as ATen calls, and why"] + details if details else out


def _tolerance(f: dict[str, Any], calls: int) -> str:
    """A tolerance-fused graph's checks, the calls served unchecked, and the largest error
    the checks saw (an unchecked call is not compared: a trial read "largest error served"
    as covering a call 7x beyond the tolerance that no check saw)."""
    tol, largest = f["tolerance"], f.get("largest_error")
    checks = f.get("checks", 0)
    text = (f"tolerance rtol={tol['rtol']:g} atol={tol['atol']:g}: {checks} checks, "
            f"{f.get('beyond', 0)} beyond it (answered with eager's values), "
            f"{max(calls - checks, 0)} calls served unchecked (not compared)")
    if not largest:
        return text + "; no checked call served within it yet"
    return (text + f"; largest error at a checked call: {largest['abs']:.3g} abs ({largest['abs_at']}), "
            f"{largest['rel']:.3g} rel ({largest['rel_at']}), {largest['budget']:.2f} of the budget "
            f"({largest['budget_at']})")


def _why_kept(k: dict[str, Any]) -> str:
    why = k.get("why")
    if why == "learned":
        return f"learned at call {k.get('at_call')}"
    if why == "device":
        where = k.get("learned_in") or "another graph"
        return f"learned on this device and recipe by {where} (call {k.get('at_call')})"
    return "from the verdict cache"


def _timing(timing: dict[str, Any] | None, missing: str | None) -> list[str]:
    if timing is None:
        return ["", f"Timing: {missing}"] if missing else []
    out = []
    if timing.get("phases"):
        clock = "synchronized around each phase" if timing.get("synchronized") else "host clock"
        phases = sorted(timing["phases"].items(), key=lambda kv: -kv[1]["total_seconds"])
        rows = [[k, v["calls"], _ms(v["total_seconds"]), f"{v['mean_ms']:.4f}"] for k, v in phases]
        out += ["", f"Timing phases (timing={timing.get('mode')!r}, {clock})",
                table(["phase", "calls", "total ms", "mean ms"], rows)]
    else:
        out += ["", f"Timing phases: none recorded (timing={timing.get('mode', 'off')!r}; "
                    "set timing='host', 'sync' or 'shadow')"]
    notes = timing.get("notes") or {}
    dropped = timing.get("notes_dropped", 0)
    if notes or dropped:
        rows = [[v, k] for k, v in sorted(notes.items(), key=lambda kv: (-kv[1], kv[0]))[:20]]
        title = f"Notes ({plural(len(notes), 'distinct note')}" + (f", {dropped} more dropped" if dropped else "")
        out += ["", title + (", top 20)" if len(notes) > 20 else ")"), table(["count", "note"], rows)]
    return out


# which check caught a demoted artifact (SubstitutionRecord.caught_by), as "Caught at a check" says it
def render(report: dict[str, Any], timing: dict[str, Any] | None = None, *, source: str = "dispatch.json",
           timing_missing: str | None = None, ranks: dict[int, str] | None = None) -> str:
    """The report as tables; `ranks`: the report files of every rank in its directory."""
    out = _header(report, source, ranks) + _summary(report) + registry(report) + authoring(report) + _graphs(report)
    out += _pieces(report) + _fusion(report) + artifacts(report) + artifact_checks(report) + regions(report)
    out += _timing(timing, timing_missing)
    return "\n".join(out)


def report_command(directory: str) -> int:
    """`report DIR` (rank 0's report where several ranks wrote there, naming the others'
    files) or `report DIR/dispatch.rankN.json` (rank N's)."""
    return run_command(directory, lambda report, timing, missing, source: render(
        report, timing, source=source, timing_missing=missing, ranks=_rank_files(source)), "the renderer")


def _rank_files(source: str) -> dict[int, str]:
    """Every rank's report file in the directory of `source` (the report being rendered)."""
    return {r: str(path) for r, path in rank_reports(Path(source).parent).items()}
