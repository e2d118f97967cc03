"""The report as a file: `dispatch.json`'s schema, its compact form and its expansion, the
JSON layout (a value that fits on a line is written on one), atomic writes, and the file
names of each rank where several share a report directory (`rank_file_names`).

The file is sized to what a reader needs (`compact`): a region with news (an artifact, a
rejection, an export) keeps its whole entry; the others, most of a model, keep their name,
module and fingerprint, and the detail they share with their kind (class, boundary, ops)
is stored once per fingerprint in the graph's `region_kinds`. `region_graphs`, the ATen
graphs only `artifacts scaffold` reads, are stored compressed. `expand` gives every entry
back whole: what `SessionReport.to_dict()` (and `latest_report()`) holds, and what every
reader of the file (`report`, `--regions`, the scaffold) reads. Importing this module
imports no torch: the command line reads reports with it.
"""

from __future__ import annotations

import base64
import enum
import json
import os
import re
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

# 2: regions without news are brief, their kind's detail in `region_kinds`; `region_graphs`
# compressed (`compact`). Readers take 1 too: `expand` leaves a whole report as it is.
SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
# The detail a region shares with every region of its fingerprint (one graph on one boundary)
KIND_KEYS = ("class", "inputs", "sizes", "outputs", "nodes", "ops", "convex", "deterministic", "mutates")
# A region entry's keys, in the order Region.to_dict() and graph_artifacts.py write them
REGION_KEYS = ("name", "module", "instance", "class", "fingerprint", "inputs", "sizes", "outputs", "nodes", "ops",
               "convex", "deterministic", "mutates", "artifact", "rejections")
ENCODING = "zlib+base64"  # of compact JSON: `region_graphs` in the file
WIDTH = 120  # a JSON value that fits on a line of this width is written on one
REPORT_NAME, TIMING_NAME = "dispatch.json", "timing.json"
RANK_REPORT = re.compile(r"dispatch\.rank([1-9][0-9]*)\.json")  # another rank's report (rank_file_names)


def rank_file_names(rank: int | None) -> tuple[str, str]:
    """(report, timing) file names of a rank in a report directory that several ranks may
    share: rank 0, or a process without torch.distributed (None), keeps `dispatch.json` and
    `timing.json`, so every reader finds it where a single process writes it; rank N>0
    writes `dispatch.rankN.json` and `timing.rankN.json`."""
    if not rank:
        return REPORT_NAME, TIMING_NAME
    return f"dispatch.rank{rank}.json", f"timing.rank{rank}.json"


def json_default(value: Any) -> Any:
    """What json.dumps writes for a value it does not know. A tensor that reached a record
    by mistake becomes its metadata, never its values: reports are shared with people who
    must not see weights or activations (and `str(tensor)` would print them)."""
    torch = sys.modules.get("torch")  # where torch was never imported, no value is a tensor
    if torch is not None and isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).replace('torch.', '')} {value.device}"
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(map(str, value))
    return str(value)


def _lines(value: Any, column: int) -> str:
    """`value` (plain JSON data) as JSON text starting at `column`: on one line where that
    fits in WIDTH, else one item per line, indented by two. A shape, a spec, an op count
    takes a line, not one per number, and the file still reads as a tree."""
    if isinstance(value, dict) and value:
        items = [f"{json.dumps(k)}: {_lines(v, column + 2)}" for k, v in value.items()]
        open_, close = "{", "}"
    elif isinstance(value, list) and value:
        items = [_lines(v, column + 2) for v in value]
        open_, close = "[", "]"
    else:
        return json.dumps(value)
    one = open_ + ", ".join(items) + close
    if column + len(one) <= WIDTH and "\n" not in one:
        return one
    pad = " " * (column + 2)
    if isinstance(value, list) and not any(isinstance(v, (dict, list)) for v in value):
        rows = [items[0]]  # numbers and strings: as many on a line as fit
        for item in items[1:]:
            if len(pad) + len(rows[-1]) + len(item) + 3 <= WIDTH:  # ", " and the line's own ","
                rows[-1] += f", {item}"
            else:
                rows.append(item)
        items = rows
    return f"{open_}\n{pad}" + f",\n{pad}".join(items) + f"\n{' ' * column}{close}"


def dumps(payload: dict[str, Any]) -> str:
    """The text of a report file: `payload` as JSON (unknown values through json_default),
    short values on one line (see _lines)."""
    plain = json.loads(json.dumps(payload, default=json_default, separators=(",", ":")))
    return _lines(plain, 0) + "\n"


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write `payload` as JSON so a reader sees the old file or the new one, never a part:
    serialize first, write a temp file in the same folder, then os.replace it over `path`.
    A failed write leaves no temp file behind."""
    text = dumps(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text, "utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# -- the file's shape: compact to write, expand to read ------------------------------------
def _instance(name: str) -> int:
    """A region's instance, from its name (`blocks.0.ff#1`: 1; capture/names.py region_name)."""
    _, sep, tail = name.rpartition("#")
    return int(tail) if sep and tail.isdigit() else 0


def _has_news(region: dict[str, Any], exported: set[str]) -> bool:
    """A region a reader looks at by itself: an artifact serves it, one was refused on it,
    its export was written or failed; or one whose entry the brief form would not give
    back exactly (not matched, an unusual key)."""
    return ("artifact" not in region or region["artifact"] is not None or bool(region.get("rejections"))
            or region.get("name") in exported or set(region) != set(REGION_KEYS)
            or region["instance"] != _instance(region["name"]))


def compact_graph(graph: dict[str, Any]) -> dict[str, Any]:
    """One graph's dict as the file holds it (module docstring); `expand_graph` inverts it.
    A brief region keeps `mutates` when it writes an input in place (cheap, and what a
    reader looking for a KV cache's attention filters on)."""
    exported = {e.get("region") for e in graph.get("export") or []
                if isinstance(e, dict) and e.get("status") != "same_as"}
    kinds: dict[str, dict[str, Any]] = {}
    regions = []
    for region in graph.get("regions") or []:
        if _has_news(region, exported):
            regions.append(region)
            continue
        detail = {k: region[k] for k in KIND_KEYS}
        if kinds.setdefault(region["fingerprint"], detail) != detail:  # another class or names, same graph
            regions.append(region)
            continue
        brief = {"name": region["name"], "module": region["module"], "fingerprint": region["fingerprint"]}
        regions.append({**brief, "mutates": region["mutates"]} if region["mutates"] else brief)
    out: dict[str, Any] = {}
    for key, value in graph.items():
        if key == "regions":
            out[key] = regions
            if kinds:
                out["region_kinds"] = kinds
        elif key == "region_graphs" and value and value.get("encoding") != ENCODING:
            text = json.dumps(value, separators=(",", ":"), default=json_default).encode()
            out[key] = {"encoding": ENCODING, "kinds": len(value),
                        "data": base64.b64encode(zlib.compress(text, 9)).decode("ascii")}
        else:
            out[key] = value
    return out


def expand_graph(graph: dict[str, Any]) -> dict[str, Any]:
    """One graph of a report file with every region entry whole and `region_graphs` as
    data; a graph already whole (schema 1, `to_dict()`) comes back equal."""
    kinds = graph.get("region_kinds") or {}
    out: dict[str, Any] = {}
    for key, value in graph.items():
        if key == "region_kinds":
            continue
        if key == "regions" and kinds:
            value = [_whole(r, kinds) for r in value]
        elif key == "region_graphs" and isinstance(value, dict) and value.get("encoding") == ENCODING:
            value = json.loads(zlib.decompress(base64.b64decode(value["data"])))
        out[key] = value
    return out


def _whole(region: dict[str, Any], kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    kind = kinds.get(region.get("fingerprint", ""))
    if kind is None or "inputs" in region:  # a whole entry
        return region
    values = {**kind, **region, "instance": _instance(region["name"]), "mutates": kind["mutates"],
              "artifact": None, "rejections": []}
    return {k: values[k] for k in REGION_KEYS}


def compact(report: dict[str, Any]) -> dict[str, Any]:
    """A report dict (`SessionReport.to_dict()`) as dispatch.json holds it."""
    return {**report, "graphs": [compact_graph(g) for g in report.get("graphs") or []]}


def expand(report: dict[str, Any]) -> dict[str, Any]:
    """A report as read from dispatch.json, every region entry whole (what `to_dict()`
    holds); readers call it on what they load. `report` itself is not changed (the new
    dict shares the entries that were whole already)."""
    graphs = report.get("graphs")
    if not isinstance(graphs, list):
        return report
    return {**report, "graphs": [expand_graph(g) if isinstance(g, dict) else g for g in graphs]}
