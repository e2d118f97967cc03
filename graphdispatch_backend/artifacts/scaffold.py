"""`artifacts scaffold DIR --region PATTERN OUT`: a complete bundle that reproduces a region.

From a report directory (any compile with `report_dir` set) it takes the kind of region
PATTERN names (see `report DIR --regions`) and its ATen graph, as the report keeps it,
and writes OUT/kernel.py, which calls the same ATen ops in the same order on the same
arguments (`torch.ops.aten.addmm.default(...)`, casts included: the graph was lowered
under the observed autocast, and artifacts run with autocast off), and OUT/artifact.json
with the region's pattern, signature and hashed files. So the bundle passes bitwise parity
as written, and an author edits from a known-good start. Under dynamic shapes the kernel
computes the region's sizes from its tensor inputs' dims. Its comments give every value's
dtype, shape and stride, the inputs' and outputs' included: parity compares the outputs'
strides, so an author sees them before a failure says so.

The manifest pins `region.fingerprint` only when `--fingerprint` is given, and not where it
only picks among the same modules compiled again with other shapes (the kernel should
serve those too): a fingerprint covers the boundary's shapes, so a pinned bundle never
serves a new batch size nor the recompile with a symbolic one, which writing `null` in the
signature's dims is for (docs/artifacts.md, dynamic shapes). The pattern and the signature
choose the regions, and parity is checked at the first call of each shape.

The manifest lists both devices: the kernel is torch ops, which run on either, parity is
checked at run time on the device it runs on, and a region's fingerprint taken on one
device fits the same graph on the other (artifacts/match.py), so a bundle scaffolded in
CPU CI serves on a GPU. A graph that spells a device (`arange(..., device=cpu)`) is
another graph on the other device: its bundle lists the device it spells alone.

Pure: no torch is imported to write the bundle (the kernel imports it when it runs).
"""

from __future__ import annotations

import json
import keyword
import re
import sys
from pathlib import Path
from typing import Any

from graphdispatch_backend.artifacts.bundle import sha256_file, verify_bundle
from graphdispatch_backend.artifacts.catalog import Kind, kinds, named_elsewhere, signature, spec_text
from graphdispatch_backend.artifacts.manifest import MANIFEST_NAME, version_tuple
from graphdispatch_backend.diagnostics.report_file import expand
from graphdispatch_backend.errors import BundleRejected
from graphdispatch_backend.patterns import matches, suggest

KERNEL_NAME = "kernel.py"
_RESERVED = {"torch", "operator", "math", "forward"}
DEVICES = ("cpu", "cuda")  # what a kernel of torch ops runs on (manifest.py's device types)


class ScaffoldError(Exception):
    """The scaffold cannot write this bundle; the message says why and what to do."""


def select(report: dict[str, Any], pattern: str, fingerprint: str | None = None) -> Kind:
    """The one kind of region `pattern` names (narrowed by a fingerprint prefix)."""
    every = kinds(report)
    named = [k for k in every if any(matches(pattern, n.split("#", 1)[0]) for n in k.names)]
    if fingerprint:
        named = [k for k in named if k.fingerprint.startswith(fingerprint)]
    if not named:
        hint = suggest(pattern, [n for k in every for n in k.names]).text()
        raise ScaffoldError(f"`{pattern}`{' with fingerprint ' + fingerprint if fingerprint else ''} names no "
                            f"region of the report; {hint}")
    if len(named) > 1:
        listed = "; ".join(f"{k.cls} x{len(k.regions)} ({', '.join(k.patterns)}) fingerprint {k.fingerprint}"
                           for k in named)
        raise ScaffoldError(f"`{pattern}` names {len(named)} kinds of region: {listed}; narrow the pattern or "
                            "pick one with --fingerprint")
    return named[0]


def _identifier(name: str, used: set[str]) -> str:
    ident = re.sub(r"\W", "_", name)
    if not ident or ident[0].isdigit() or keyword.iskeyword(ident):
        ident = f"_{ident}"
    base, k = ident, 1
    while ident in used:
        ident, k = f"{base}_{k}", k + 1
    used.add(ident)
    return ident


def _float(text: str) -> str:
    return f"float({text!r})" if text in ("inf", "-inf", "nan") else text


class _Writer:
    """Python source for one region graph; `refs` maps graph references to variable names."""

    def __init__(self, graph: dict[str, Any], entry: dict[str, Any]) -> None:
        self.graph, self.entry = graph, entry
        self.used = set(_RESERVED)
        self.imports = {"torch"}
        sizes = {s["name"]: s for s in entry.get("sizes") or []}
        self.params = {i["name"]: _identifier(i["name"], self.used) for i in entry["inputs"]}
        self.inputs: list[str] = []
        self.prologue: list[str] = []
        symbols: dict[str, str] = {}
        for name in graph["inputs"]:
            if name in self.params:
                self.inputs.append(self.params[name])
                continue
            size = sizes.get(name)
            if size is None or size.get("expr") is None:
                raise ScaffoldError(f"region input {name!r} is neither a tensor input nor a known size")
            for sym, where in sorted(size["symbols"].items()):
                if where is None:
                    raise ScaffoldError(f"size {name} = {size['expr']}: symbol {sym} is no dim of a tensor input; "
                                        "scaffold from a compile with static shapes")
                if sym not in symbols:
                    symbols[sym] = _identifier(sym, self.used)
                    self.prologue.append(f"{symbols[sym]} = {self.params[where[0]]}.shape[{where[1]}]")
            expr = re.sub(r"\b[a-z]\d+\b", lambda m: symbols.get(m.group(0), m.group(0)), size["expr"])
            if "math." in expr:
                self.imports.add("math")
            var = _identifier(name, self.used)
            self.prologue.append(f"{var} = {expr}")
            self.inputs.append(var)
        self.nodes: list[str] = []

    def arg(self, value: Any) -> str:
        if isinstance(value, dict):
            if "input" in value:
                return self.inputs[value["input"]]
            if "node" in value:
                return self.nodes[value["node"]]
            if "float" in value:
                return _float(value["float"])
            if "dtype" in value:
                return f"torch.{value['dtype']}"
            if "device" in value:
                return f"torch.device({value['device']!r})"
            if "layout" in value:
                return f"torch.{value['layout']}"
            if "memory_format" in value:
                return f"torch.{value['memory_format']}"
            if "tuple" in value:
                items = [self.arg(v) for v in value["tuple"]]
                return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
            raise ScaffoldError(f"an argument the scaffold cannot write: {value.get('unsupported', value)}")
        if isinstance(value, list):
            return f"[{', '.join(self.arg(v) for v in value)}]"
        return repr(value)

    def call(self, node: dict[str, Any]) -> str:
        target = node.get("target")
        args = [self.arg(a) for a in node["args"]] + [f"{k}={self.arg(v)}" for k, v in node["kwargs"].items()]
        if target is None:
            raise ScaffoldError(f"node {node['name']} calls something that is not a torch op; the scaffold writes "
                                "ATen and operator calls only")
        if target == "operator.getitem" and len(args) == 2:
            return f"{args[0]}[{args[1]}]"
        if target.startswith("operator."):
            self.imports.add("operator")
            return f"{target}({', '.join(args)})"
        return f"torch.ops.{target}({', '.join(args)})"

    def body(self) -> list[str]:
        lines = ["    # inputs (dtype[shape] stride), as the region receives them:"]
        lines += [f"    #   {self.params[i['name']]}: {spec_text(i)}" for i in self.entry["inputs"]]
        lines += [f"    {line}" for line in self.prologue]
        for node in self.graph["nodes"]:
            var = _identifier(node["name"], self.used)
            value = self.call(node)
            self.nodes.append(var)
            comment = f"  # {spec_text(node)}" if "dtype" in node else ""
            lines.append(f"    {var} = {value}{comment}")
        outs = [self.arg(o) for o in self.graph["outputs"]]
        lines.append("    # outputs: parity compares their dtype, shape, stride and values with the region's:")
        lines += [f"    #   {var}: {spec_text(o)}" for var, o in zip(outs, self.entry["outputs"])]
        lines.append(f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
        return lines


def kernel_source(kind: Kind, graph: dict[str, Any], artifact_id: str, source: str) -> str:
    writer = _Writer(graph, kind.entry)
    body = writer.body()
    params = ", ".join(writer.params.values())
    doc = [f'"""{artifact_id}: scaffolded from region {kind.entry["name"]} ({kind.cls}, fingerprint '
           f'{kind.fingerprint}) of {source}.',
           "",
           "Calls the region's ATen ops in the native order on the same arguments, casts included",
           "(artifacts run with autocast off), so it passes bitwise parity as written: edit from here,",
           "and keep the signature (the region's tensor inputs, in the report's order)."]
    runs_on = devices(kind, graph)
    if len(runs_on) == len(DEVICES):
        doc += ["",
                f"artifact.json lists devices {json.dumps(runs_on)}: these torch ops run on either, and parity is",
                "checked on the device they run on; narrow it when an edit runs on one (Triton: [\"cuda\"])."]
    else:
        doc += ["",
                f"artifact.json lists devices {json.dumps(runs_on)} alone: the region's graph spells its device,",
                "so on another device it is another graph (another fingerprint), scaffolded there."]
    if kind.entry.get("mutates"):
        doc += ["",
                f"It writes {', '.join(kind.entry['mutates'])} in place, as the region does (its `_` ops): keep",
                "those writes in place and return only the region's outputs (signature.mutates)."]
    doc.append('"""')
    imports = [f"import {m}" for m in sorted(writer.imports)]
    return "\n".join(doc + [""] + imports + ["", "", f"def forward({params}):"] + body) + "\n"


def _spelled_devices(value: Any) -> set[str]:
    """The device types a region graph's arguments spell (`device=torch.device('cpu')`)."""
    if isinstance(value, dict):
        if "device" in value and isinstance(value["device"], str):
            return {value["device"].split(":", 1)[0]}
        return set().union(*(_spelled_devices(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_spelled_devices(v) for v in value))
    return set()


def devices(kind: Kind, graph: dict[str, Any]) -> list[str]:
    """The manifest's `devices`: both, unless the graph spells a device (then its graph, and
    the kernel, differ on the other device: the region's own device alone)."""
    if not _spelled_devices(graph["nodes"]):
        return list(DEVICES)
    device = next((i["device"].split(":")[0] for i in [*kind.entry["inputs"], *kind.entry["outputs"]]
                   if i.get("device")), "cpu")
    return [device if device in DEVICES else "cpu"]


def _manifest(kind: Kind, pattern: str, artifact_id: str, report: dict[str, Any], files: list[dict[str, Any]],
              graph: dict[str, Any], pin: bool) -> dict[str, Any]:
    env = report.get("environment") or {}
    major, minor, _ = version_tuple(str(env.get("torch", "")))
    runs_on = devices(kind, graph)
    description = f"scaffolded from region {kind.entry['name']} ({kind.cls}): the native ATen ops, bitwise"
    if len(runs_on) < len(DEVICES):
        description += f"; {runs_on[0]} only: its graph spells the device"
    manifest: dict[str, Any] = {
        "schema_version": 1,
        "id": artifact_id,
        "description": description,
        # pinned only to pick one kind among several (module docstring): a pin fits no other size
        "region": {"module": pattern, **({"fingerprint": kind.fingerprint} if pin else {})},
        "signature": signature(kind.entry),
        "entry_point": {"file": KERNEL_NAME, "symbol": "forward"},
        "files": files,
        "parity": {"mode": "bitwise"},
        # torch ops run on either device, and parity is checked where they run: narrow this
        # for a kernel that runs on one (a Triton kernel: ["cuda"])
        "devices": runs_on,
        "capturable": True,
    }
    if major:  # ATen schemas change between releases: the op calls hold for this one
        manifest["torch"] = {"min": f"{major}.{minor}", "max_exclusive": f"{major}.{minor + 1}"}
    return manifest


def scaffold(report: dict[str, Any], pattern: str, out: Path, *, fingerprint: str | None = None,
             artifact_id: str | None = None, source: str = "dispatch.json") -> dict[str, Any]:
    """Write the bundle for the kind `pattern` names into `out`; return its manifest."""
    kind = select(report, pattern, fingerprint)
    graphs = {g["name"]: g for g in expand(report)["graphs"]}  # region_graphs: stored compressed in the file
    graph = (graphs[kind.graph].get("region_graphs") or {}).get(kind.fingerprint)
    if graph is None:
        raise ScaffoldError(f"the report holds no graph for {kind.entry['name']} (a report written before region "
                            "graphs were recorded, or a training graph): compile again with report_dir set")
    artifact_id = artifact_id or re.sub(r"[^A-Za-z0-9._-]", "-", out.resolve().name).lstrip("._-") or "scaffold"
    text = kernel_source(kind, graph, artifact_id, source)
    compile(text, KERNEL_NAME, "exec")  # a scaffold that does not parse is our bug: never write it
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ScaffoldError(f"{out} exists and is not an empty folder: the scaffold never overwrites a bundle")
    out.mkdir(parents=True, exist_ok=True)
    (out / KERNEL_NAME).write_text(text, "utf-8")
    kernel = out / KERNEL_NAME
    files = [{"path": KERNEL_NAME, "sha256": sha256_file(kernel), "bytes": kernel.stat().st_size}]
    # pinned where a fingerprint was given, unless it only picked among the kind's own modules
    # compiled again with other shapes, which the kernel should serve too (catalog.py `named_elsewhere`)
    again, others = named_elsewhere(kinds(report), kind, pattern)
    pin = fingerprint is not None and not (again and not others)
    manifest = _manifest(kind, pattern, artifact_id, report, files, graph, pin=pin)
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", "utf-8")
    verify_bundle(out)  # what the registry will check, now
    return manifest


def scaffold_command(directory: str, pattern: str, out: str, fingerprint: str | None = None,
                     artifact_id: str | None = None) -> int:
    from graphdispatch_backend.diagnostics.report_dir import ReportError, load

    try:
        report, _, _ = load(directory)
        manifest = scaffold(report, pattern, Path(out), fingerprint=fingerprint, artifact_id=artifact_id,
                            source=str(Path(directory) / "dispatch.json"))
    except (ReportError, ScaffoldError, BundleRejected, OSError) as exc:
        print(f"graphdispatch artifacts scaffold: error: {exc}", file=sys.stderr)
        return 1
    sig = manifest["signature"]
    counts = ", ".join(f"{len(sig[k])} {k[:-1] if len(sig[k]) == 1 else k}" for k in ("inputs", "outputs"))
    if sig.get("mutates"):
        counts += f", writes {', '.join(sig['mutates'])} in place"
    pinned = manifest["region"].get("fingerprint")
    print(f"wrote {Path(out) / KERNEL_NAME} and {Path(out) / MANIFEST_NAME}: artifact {manifest['id']} for "
          f"`{pattern}`" + (f" (fingerprint {pinned}, pinned)" if pinned else "") + f", {counts}, parity bitwise")
    print(f"next: python -m graphdispatch_backend artifacts verify {out}; then compile with "
          f"options={{'artifacts': {str(Path(out).parent)!r}}}")
    return 0
