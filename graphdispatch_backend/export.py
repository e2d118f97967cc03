"""export_regions: deferred `torch.export` of every region, for kernel authors.

While the model runs, the exporter only keeps references: per graph and shape key, one
set of the Dynamo graph's example inputs and the AutocastState observed at compile. At
finalize (`flush()` or process exit) it recomputes each region's boundary values, builds
the region as a small module (its parameters and buffers registered under their names
relative to the region, so they match manifest names), and exports it non-strict with no
decompositions (attention stays one op) **inside the replayed autocast state**; without
that replay a deferred trace silently changes matmul dtypes. Then every reference kept is
dropped. A region whose export fails gets its reason in the report; nothing is raised.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.artifacts.fingerprint import op_key
from graphdispatch_backend.capture.autocast import AutocastState
from graphdispatch_backend.capture.lower import InputOrigin
from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.errors import Contain
from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.strip_assertions import strip_assertions
from graphdispatch_backend.passes.subgraph import extract
from graphdispatch_backend.passes.tag_regions import tag_regions

MAX_KEYS = 8


@dataclasses.dataclass
class _Kept:
    record: Any  # the GraphRecord the results go to
    gm: fx.GraphModule | None
    origins: tuple[InputOrigin, ...]
    autocast: AutocastState
    n_lifted: int  # aot lifts the Dynamo graph's own parameters before its placeholders
    examples: dict[tuple[Any, ...], list[Any]] = dataclasses.field(default_factory=dict)


def _key(args: Sequence[Any]) -> tuple[Any, ...]:
    return tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else (type(a), a) for a in args)


def _folder(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._#-]", "_", name)


class RegionExporter:
    def __init__(self, report_dir: str | None) -> None:
        self._root = Path(report_dir) / "regions" if report_dir else None
        self._kept: list[_Kept] = []

    def register(self, record: Any, gm: fx.GraphModule, origins: tuple[InputOrigin, ...],
                 autocast: AutocastState, n_lifted: int) -> Callable[[Sequence[Any]], None]:
        kept = _Kept(record, gm, origins, autocast, n_lifted)
        self._kept.append(kept)

        def observe(args: Sequence[Any]) -> None:
            if kept.gm is not None and len(kept.examples) < MAX_KEYS:
                kept.examples.setdefault(_key(args), list(args))

        return observe

    def finalize(self, events: Any, contain: Contain) -> None:
        try:
            for kept in self._kept:
                for index, args in enumerate(kept.examples.values()):
                    # regions are contained one by one inside; this catches what fails around them
                    # (tagging the Dynamo graph), so one graph never stops the others or raises
                    out, exc = contain(lambda k=kept, i=index, a=args: self._export_graph(k, i, a, contain))
                    if exc is not None:
                        out = [{"shape_key": index, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}]
                    record_fields.exported(kept.record, out)
                    events.decision("export", {"graph": kept.record.name, "shape_key": index})
        finally:
            for kept in self._kept:  # every reference goes, whatever happened
                kept.examples.clear()
                kept.gm = None
            self._kept.clear()

    def _export_graph(self, kept: _Kept, index: int, args: list[Any], contain: Contain) -> list[dict[str, Any]]:
        assert kept.gm is not None
        gm = kept.gm
        ctx = PassContext(input_origins=kept.origins[kept.n_lifted:])
        tag_regions(gm, ctx)
        values, exc = contain(lambda: _values(gm, args, kept.autocast))
        if exc is not None:
            return [{"shape_key": index, "status": "failed", "reason": f"replay: {type(exc).__name__}: {exc}"}]
        results = []
        done: dict[str, str] = {}
        aten = {r["name"]: r for r in kept.record.regions}
        for region in ctx.regions:
            fingerprint = aten.get(region.name, {}).get("fingerprint", region.fingerprint)
            entry: dict[str, Any] = {"region": region.name, "shape_key": index, "fingerprint": fingerprint}
            if fingerprint in done:
                entry.update(status="same_as", same_as=done[fingerprint])
            else:
                out, exc = contain(
                    lambda r=region: self._export_region(r, values, kept, index, aten.get(r.name)))
                entry.update(out or {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"})
                if entry.get("status") == "exported":
                    done[fingerprint] = region.name
            results.append(entry)
        return results

    def _export_region(self, region: Any, values: dict[fx.Node, Any], kept: _Kept, index: int,
                       report: dict[str, Any] | None) -> dict[str, Any]:
        prefix = region.module + "."
        root = torch.nn.Module()
        state: dict[int, str] = {}
        placeholders = {n: i for i, n in enumerate(kept.gm.graph.find_nodes(op="placeholder"))}
        for k, node in enumerate(region.inputs):
            origin = kept.origins[kept.n_lifted + placeholders[node]] if node in placeholders else None
            if origin is not None and origin.is_state and origin.name.startswith(prefix):
                _register(root, origin.name[len(prefix):], values[node])
                state[k] = origin.name[len(prefix):]
        sub = extract(region.nodes, region.inputs, region.outputs, region.input_names)
        graph = sub.graph
        for k, ph in enumerate(list(graph.find_nodes(op="placeholder"))):
            if k in state:
                with graph.inserting_before(ph):
                    # create_node, not get_attr: the attribute lives on `root`, which owns the
                    # graph only below; get_attr would warn about every parameter
                    attr = graph.create_node("get_attr", state[k])
                ph.replace_all_uses_with(attr)
                graph.erase_node(ph)
        module = fx.GraphModule(root, graph)
        example = tuple(values[n] for k, n in enumerate(region.inputs) if k not in state)
        with kept.autocast.replay(), torch.no_grad():
            program = torch.export.export(module, example, strict=False)
        ctx = PassContext()
        strip_assertions(program.graph_module, ctx)
        result = {"status": "exported", "stripped_assertions": ctx.stripped_assertions,
                  "ops": _ops(program.graph_module)}
        if self._root is not None:
            folder = self._root / _folder(region.name) / (f"shape_{index}" if index else "")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "export_graph.txt").write_text(program.graph_module.print_readable(print_output=False), "utf-8")
            (folder / "graph.txt").write_text(module.print_readable(print_output=False), "utf-8")
            torch.export.save(program, str(folder / "export.pt2"))
            meta = {"region": report or {"name": region.name}, "shape_key": index,
                    "autocast": kept.autocast.to_dict(), **result}
            (folder / "region.json").write_text(json.dumps(meta, indent=2, default=str) + "\n", "utf-8")
            result["folder"] = str(folder)
        return result


def _register(root: torch.nn.Module, path: str, value: torch.Tensor) -> None:
    *parents, leaf = path.split(".")
    module = root
    for part in parents:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    module.register_buffer(leaf, value.detach()) if not isinstance(value, torch.nn.Parameter) else (
        module.register_parameter(leaf, torch.nn.Parameter(value.detach(), requires_grad=False)))


def _ops(gm: fx.GraphModule) -> dict[str, int]:
    """The exported graph's op histogram, spelled like a region's (`aten::linear.default`)."""
    return dict(sorted(Counter(op_key(n.target) for n in gm.graph.nodes if n.op == "call_function").items()))


def _values(gm: fx.GraphModule, args: Sequence[Any], autocast: AutocastState) -> dict[fx.Node, Any]:
    """Every node's value on one kept input set, under the observed autocast state."""
    values: dict[fx.Node, Any] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n] = out = super().run_node(n)
            return out

    with autocast.replay(), torch.no_grad():
        _Recorder(gm, garbage_collect_values=False).run(*args)
    return values
