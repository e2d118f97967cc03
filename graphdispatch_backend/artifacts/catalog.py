"""`report DIR --regions [PATTERN]`: every region of a report by kind, ready for a manifest (pure).

A kind is a class and a fingerprint (and the input names): regions of one kind compute
the same graph on the same boundary, so one artifact serves them all. Each kind is
listed with the pattern its names share (`layers.*.mlp`), how many regions it has, the
fingerprint, and the signature in manifest order: tensor inputs (what a kernel receives)
and outputs. Under PATTERN (an anchored fnmatch over module names, as a manifest's
`region.module`) only the kinds with a region it names are listed, each followed by the
manifest fields to copy. No torch: it reads dispatch.json only.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from graphdispatch_backend.artifacts.patterns import generalize, matches, suggest
from graphdispatch_backend.table import table

CELL = 64  # widest cell of the kinds table; the full signature is listed below it


@dataclasses.dataclass
class Kind:
    cls: str
    fingerprint: str
    regions: list[tuple[str, str]]  # (graph, region name)
    entry: dict[str, Any]  # the first region's report entry
    graph: str  # the graph that entry comes from

    @property
    def names(self) -> list[str]:
        return [name for _, name in self.regions]

    @property
    def patterns(self) -> list[str]:
        """The patterns its names share (`layers.*.mlp`): one per place the kind sits in
        the model (an RMSNorm kind: `layers.*.input_layernorm`, ..., `norm`)."""
        return sorted({generalize(n) for n in self.names})

    def own_patterns(self, every: list[Kind]) -> list[str]:
        """Patterns for this kind that name no region of another kind (what `artifacts
        scaffold` takes as is): the shared pattern where it is this kind's alone, else one
        with only the repeated index open (`blocks.*.ff.net.0` where `blocks.*.ff.net.*`
        also names the `net.2` kind), else the names themselves, else (another graph's kind
        with the same names) the shared pattern with the `--fingerprint` to add."""
        others = [n.split("#", 1)[0] for k in every if k is not self for n in k.names]
        found: set[str] = set()
        for name in {n.split("#", 1)[0] for n in self.names}:
            for candidate in (generalize(name), _first_index_open(name), name):
                if not any(matches(candidate, o) for o in others):
                    found.add(candidate)
                    break
            else:  # another kind has these very names (another graph): only the fingerprint tells
                found.add(f"{generalize(name)} --fingerprint {self.fingerprint[:8]}")
        return sorted(found)


def _first_index_open(name: str) -> str:
    """`blocks.3.ff.net.0` -> `blocks.*.ff.net.0`: the first numeric part open, the rest kept."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i] + ["*"] + parts[i + 1:])
    return name


def kinds(report: dict[str, Any]) -> list[Kind]:
    """Every region kind of the report, in first-seen order."""
    found: dict[tuple[Any, ...], Kind] = {}
    for graph in report["graphs"]:
        for region in graph["regions"]:
            key = (region["class"], region["fingerprint"], tuple(i["name"] for i in region["inputs"]))
            kind = found.get(key)
            if kind is None:
                kind = found[key] = Kind(region["class"], region["fingerprint"], [], region, graph["name"])
            kind.regions.append((graph["name"], region["name"]))
    return list(found.values())


def _spec(entry: dict[str, Any]) -> str:
    shape = ", ".join("null" if d is None else str(d) for d in entry.get("shape", []))
    return f"{entry.get('dtype')}[{shape}]"


def signature(entry: dict[str, Any]) -> dict[str, list[Any]]:
    """The manifest `signature` of a region report entry: tensor inputs and outputs, and the
    inputs it writes in place (`mutates`, only when it writes any)."""
    sig: dict[str, list[Any]] = {
        "inputs": [{"name": i["name"], "shape": i["shape"], "dtype": i["dtype"]} for i in entry["inputs"]],
        "outputs": [{"shape": o["shape"], "dtype": o["dtype"]} for o in entry["outputs"]],
    }
    if entry.get("mutates"):
        sig["mutates"] = list(entry["mutates"])
    return sig


def render(report: dict[str, Any], pattern: str = "*", source: str = "dispatch.json") -> str:
    every = kinds(report)
    shown = [k for k in every if any(matches(pattern, n.split("#", 1)[0]) for n in k.names)]
    total = sum(len(k.regions) for k in every)
    title = (f"Regions of {source} by kind: {total} regions, {len(every)} kinds"
             + (f"; {len(shown)} with a region `{pattern}` names" if pattern != "*" else ""))
    if not shown:
        hint = suggest(pattern, [n for k in every for n in k.names])
        return "\n".join([title, f"  none: `{pattern}` names no region; {hint.text()}"])
    rows = []
    for k in shown:
        sizes = k.entry.get("sizes") or []
        rows.append([", ".join(k.own_patterns(every)), k.cls, f"x{len(k.regions)}", k.fingerprint,
                     ", ".join(f"{i['name']} {_spec(i)}" for i in k.entry["inputs"]) or "-",
                     ", ".join(_spec(o) for o in k.entry["outputs"]),
                     ", ".join(f"{s['name']} = {s.get('expr')}" for s in sizes) or "-"])
    out = [title, "(a pattern is an anchored fnmatch over named_modules() names; a kernel receives the tensor "
                  "inputs, in this order, never the sizes)",
           table(["pattern", "class", "regions", "fingerprint", "inputs", "outputs", "sizes"], rows,
                 max_width=CELL)]
    if pattern == "*":
        example = next((k.own_patterns(every)[0] for k in shown if len(k.regions) > 1),
                       shown[0].own_patterns(every)[0])
        out.append(f"\nlist one kind's manifest fields with --regions PATTERN (e.g. --regions '{example}')")
        return "\n".join(out)
    for k in shown:
        names = [n for n in k.names if matches(pattern, n.split("#", 1)[0])]
        others = sum(1 for o in every if o is not k for n in o.names if matches(pattern, n.split("#", 1)[0]))
        out += ["", f"`{pattern}`: {k.cls}, {len(names)} of its {len(k.regions)} regions ({', '.join(names[:4])}"
                    + (", ..." if len(names) > 4 else "") + ")"]
        if others:
            own = ", ".join(f"`{p}`" for p in k.own_patterns(every))
            out.append(f"  `{pattern}` also names {others} region(s) of other kinds: keep the fingerprint (scaffold "
                       f"with --fingerprint {k.fingerprint[:8]}), or name this kind alone: {own}")
        region = {"module": pattern, "fingerprint": k.fingerprint}
        out.append(f'  "region": {json.dumps(region)},')
        out.append(f'  "signature": {json.dumps(signature(k.entry))},')
    return "\n".join(out)


def catalog_command(directory: str, pattern: str = "*") -> int:
    # the renderer's loader and messages for a missing, foreign or mistyped report
    from graphdispatch_backend.diagnostics.render import run_command

    return run_command(directory, lambda report, _timing, _missing, source: render(report, pattern, source),
                       "the region listing")
