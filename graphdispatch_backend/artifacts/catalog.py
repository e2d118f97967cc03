"""`report DIR --regions [PATTERN]`: every region of a report by kind, ready for a manifest (pure).

A kind is a class and a fingerprint (and the input names): regions of one kind compute
the same graph on the same boundary, so one artifact serves them all. Each kind is
listed with the pattern its names share (`layers.*.mlp`), how many regions it has, the
fingerprint, and the signature in manifest order: tensor inputs (what a kernel receives)
and outputs, each with its stride (not a manifest field, but parity compares the outputs'
strides, so an author needs them before the first failure says so). Under PATTERN (an
anchored fnmatch over module names, as a manifest's `region.module`) only the kinds with a
region it names are listed, each followed by the manifest fields to copy and the
`artifacts scaffold` command that writes its bundle. Every command printed is one to copy
as is: the real report directory, shell-quoted. No torch: it reads dispatch.json only.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path
from typing import Any

from graphdispatch_backend.diagnostics.report_file import expand
from graphdispatch_backend.errors import GraphKind
from graphdispatch_backend.patterns import generalize, matches, suggest
from graphdispatch_backend.table import table

CELL = 64  # widest cell of the kinds table; the full signature is listed below it
COMMAND = "python -m graphdispatch_backend"
BUNDLES = "my_kernels"  # where the printed scaffold commands write (a root for options={'artifacts': ...})


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

    def own_choices(self, every: list[Kind]) -> list[tuple[str, str | None]]:
        """(pattern, fingerprint prefix or None) for this kind, naming no region of another
        kind (what `artifacts scaffold` takes as is): the shared pattern where it is this
        kind's alone, else one with only the repeated index open (`blocks.*.ff.net.0` where
        `blocks.*.ff.net.*` also names the `net.2` kind), else the names themselves, else
        (another graph's kind with the same names) the shared pattern and the fingerprint
        that `--fingerprint` must add."""
        others = [n.split("#", 1)[0] for k in every if k is not self for n in k.names]
        found: set[tuple[str, str | None]] = set()
        for name in {n.split("#", 1)[0] for n in self.names}:
            for candidate in (generalize(name), _first_index_open(name), name):
                if not any(matches(candidate, o) for o in others):
                    found.add((candidate, None))
                    break
            else:  # another kind has these very names (another graph): only the fingerprint tells
                found.add((generalize(name), self.short_fingerprint(every)))
        return sorted(found, key=lambda c: (c[0], c[1] or ""))

    def own_patterns(self, every: list[Kind]) -> list[str]:
        """own_choices as the table shows them: `blocks.*.mlp`, or `blocks.*.mlp --fingerprint
        7370df48` (the scaffold's arguments; `report --regions` takes the pattern alone)."""
        return [p if fp is None else f"{p} --fingerprint {fp}" for p, fp in self.own_choices(every)]

    def short_fingerprint(self, every: list[Kind]) -> str:
        """The shortest prefix (8 characters at least) that no other kind's fingerprint
        starts with: what `--fingerprint` takes."""
        for n in (8, 12, 16):
            prefix = self.fingerprint[:n]
            if not any(k is not self and k.fingerprint.startswith(prefix) for k in every):
                return prefix
        return self.fingerprint


def _first_index_open(name: str) -> str:
    """`blocks.3.ff.net.0` -> `blocks.*.ff.net.0`: the first numeric part open, the rest kept."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i] + ["*"] + parts[i + 1:])
    return name


def kinds(report: dict[str, Any]) -> list[Kind]:
    """Every region kind of the report's inference graphs, in first-seen order (from the
    file's brief entries too: `expand` gives each region its kind's detail). A training
    graph's regions are not listed: artifacts never serve a graph that records autograd
    history (manifests declare no backward), and the same modules' regions of a training
    graph read as "compiled again, with other shapes" to a reader, whose scaffold then found
    no graph for them (a trial, 2026-12-07)."""
    found: dict[tuple[Any, ...], Kind] = {}
    for graph in expand(report)["graphs"]:
        if graph.get("kind") in _TRAINING:
            continue
        for region in graph["regions"]:
            key = (region["class"], region["fingerprint"], tuple(i["name"] for i in region["inputs"]))
            kind = found.get(key)
            if kind is None:
                kind = found[key] = Kind(region["class"], region["fingerprint"], [], region, graph["name"])
            kind.regions.append((graph["name"], region["name"]))
    return list(found.values())


def training_regions(report: dict[str, Any]) -> int:
    """The regions of the report's training graphs, which `kinds` leaves out."""
    return sum(len(g.get("regions") or ()) for g in report.get("graphs", ()) if g.get("kind") in _TRAINING)


_TRAINING = (GraphKind.AUTOGRAD.value, GraphKind.BACKWARD.value)


def _dims(values: list[Any]) -> str:
    return ", ".join("null" if d is None else str(d) for d in values)


def stride_text(entry: dict[str, Any]) -> str:
    """`(32, 8, 1)`, as `Tensor.stride()` prints it (`null`: a symbolic stride); empty for a
    report entry written before strides were recorded."""
    if "stride" not in entry:
        return ""
    stride = list(entry["stride"])
    return f"({_dims(stride)}{',' if len(stride) == 1 else ''})"


def spec_text(entry: dict[str, Any]) -> str:
    """`float32[2, 4, 8] stride (32, 8, 1)`: a report entry's dtype, shape and stride."""
    stride = stride_text(entry)
    return f"{entry.get('dtype')}[{_dims(entry.get('shape', []))}]" + (f" stride {stride}" if stride else "")


def command(*args: str) -> str:
    """A command line to copy as is: the arguments shell-quoted (`'blocks.*.mlp'`)."""
    return " ".join([COMMAND, *(shlex.quote(a) for a in args)])


def scaffold_hint(directory: str, pattern: str, fingerprint: str | None = None) -> str:
    """The `artifacts scaffold` command that writes a bundle for `pattern`'s kind (narrowed by
    `fingerprint`) into a folder of BUNDLES named after the pattern."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", pattern).strip("-") or "kernel"
    out = f"{BUNDLES}/{name}" + (f"-{fingerprint}" if fingerprint else "")
    return command("artifacts", "scaffold", directory, "--region", pattern,
                   *(("--fingerprint", fingerprint) if fingerprint else ()), out)


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


def named_elsewhere(every: list[Kind], kind: Kind, pattern: str) -> tuple[int, int]:
    """The regions `pattern` names outside `kind`: (those of its own modules in other graphs
    with its layout, those of other modules or of another layout). The first are no other
    kind to a reader (Dynamo compiled the same modules again, with other shapes): a pin would
    keep the kernel from them (a trial followed "keep the fingerprint" there, and its kernel
    served 25 of 40 calls). Its own modules in another graph with another layout (other
    inputs, dtypes or writes: a static-cache Llama's prefill attention takes 11 inputs, its
    decode step 9) are no sizes its kernel could serve: each is a `signature` rejection, and
    under `strict` the scaffolded bundle failed the compile (a trial, 2026-12-07), so they
    count with the other kinds, and the fingerprint is kept."""
    mine = {n.split("#", 1)[0] for n in kind.names}
    layout = _layout(kind.entry)
    again = others = 0
    for o in every:
        if (o.fingerprint, o.names) == (kind.fingerprint, kind.names):
            continue
        for n in o.names:
            base = n.split("#", 1)[0]
            if matches(pattern, base):
                if base in mine and _layout(o.entry) == layout:
                    again += 1
                else:
                    others += 1
    return again, others


def _layout(entry: dict[str, Any]) -> tuple[Any, ...]:
    """What a region's signature holds besides its sizes: its inputs' names and dtypes, its
    outputs' dtypes, the inputs it writes."""
    return (tuple((i["name"], i["dtype"]) for i in entry["inputs"]), tuple(o["dtype"] for o in entry["outputs"]),
            tuple(entry.get("mutates") or ()))


def render(report: dict[str, Any], pattern: str = "*", source: str = "dispatch.json",
           directory: str | None = None) -> str:
    """The listing; `directory` (default: the folder of `source`) goes into the commands it prints."""
    directory = str(Path(source).parent) if directory is None else directory
    every = kinds(report)
    shown = [k for k in every if any(matches(pattern, n.split("#", 1)[0]) for n in k.names)]
    total = sum(len(k.regions) for k in every)
    trained = training_regions(report)
    title = (f"Regions of {source} by kind: {total} regions, {len(every)} kinds"
             + (f"; {len(shown)} with a region `{pattern}` names" if pattern != "*" else "")
             + (f" ({trained} regions of training graphs not listed: artifacts serve graphs that record no "
                "autograd history, under torch.no_grad() or inference_mode)" if trained else ""))
    if not shown:
        hint = suggest(pattern, [n for k in every for n in k.names])
        return "\n".join([title, f"  none: `{pattern}` names no region; {hint.text()}"])
    rows = []
    for k in shown:
        sizes = k.entry.get("sizes") or []
        rows.append([", ".join(k.own_patterns(every)), k.cls, f"x{len(k.regions)}", k.fingerprint,
                     ", ".join(f"{i['name']} {spec_text(i)}" for i in k.entry["inputs"]) or "-",
                     ", ".join(spec_text(o) for o in k.entry["outputs"]),
                     ", ".join(f"{s['name']} = {s.get('expr')}" for s in sizes) or "-"])
    out = [title, "(a pattern is an anchored fnmatch over named_modules() names; a kernel receives the tensor "
                  "inputs, in this order, never the sizes)",
           table(["pattern", "class", "regions", "fingerprint", "inputs", "outputs", "sizes"], rows,
                 max_width=CELL)]
    if pattern == "*":
        # a kind that repeats is the one worth a kernel; its pattern may need the fingerprint
        # to name it alone, which the scaffold takes and `--regions` does not (it lists each kind)
        example, fingerprint = next((k.own_choices(every)[0] for k in shown if len(k.regions) > 1),
                                    shown[0].own_choices(every)[0])
        out += ["", f"next, for one kind (`{example}`): its manifest fields, then a bundle that reproduces it:",
                f"  {command('report', directory, '--regions', example)}",
                f"  {scaffold_hint(directory, example, fingerprint)}"]
        return "\n".join(out)
    for k in shown:
        names = [n for n in k.names if matches(pattern, n.split("#", 1)[0])]
        again, others = named_elsewhere(every, k, pattern)
        out += ["", f"`{pattern}`: {k.cls}, {len(names)} of its {len(k.regions)} regions ({', '.join(names[:4])}"
                    + (", ..." if len(names) > 4 else "") + ")"]
        if again and not others:
            out.append(f"  `{pattern}` also names {again} region(s) of these modules in other graphs (Dynamo compiled "
                       "them again, with other shapes): no fingerprint, so the kernel serves every graph its "
                       "signature fits (write null for a size that varies)")
        if others:
            alone = ", ".join(f"`{p}`" for p, fp in k.own_choices(every) if fp is None)
            out.append(f"  `{pattern}` also names {others} region(s) of other kinds (other modules, or these with "
                       "other inputs, dtypes or writes): keep the fingerprint (as the scaffold command below does)"
                       + (f", or name this kind alone: {alone}" if alone else ""))
        # a fingerprint only where it must pick this kind among other modules: a pin fits no
        # other size (scaffold.py); the scaffold command takes one to pick the kind either way
        region = {"module": pattern, **({"fingerprint": k.fingerprint} if others else {})}
        out.append(f'  "region": {json.dumps(region)},')
        out.append(f'  "signature": {json.dumps(signature(k.entry))},')
        strides = "; ".join(", ".join(f"{e['name']} {stride_text(e)}" for e in k.entry[side] if stride_text(e))
                            for side in ("inputs", "outputs"))
        if strides.strip("; "):
            out.append(f"  strides (not manifest fields; parity compares the outputs'): {strides}")
        fingerprint = k.short_fingerprint(every) if others or again else None  # the pattern alone names this kind
        out.append(f"  scaffold: {scaffold_hint(directory, pattern, fingerprint)}")
    return "\n".join(out)


def catalog_command(directory: str, pattern: str = "*") -> int:
    # the renderer's loader and messages for a missing, foreign or mistyped report
    from graphdispatch_backend.diagnostics.report_dir import run_command

    return run_command(directory, lambda report, _timing, _missing, source: render(report, pattern, source, directory),
                       "the region listing")
