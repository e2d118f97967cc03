"""Helpers for tests (ours and artifact authors'): graphs to golden-test, bundles to write.

- `aten_graph(fn, *args)`: the lowered ATen inference graph graphdispatch's passes see,
  with the input origins, through Dynamo and aot (no passes run).
- `regions(lowered)`: `tag_regions` run on it, as {region name: Region}.
- `normalize(gm)`: small, stable text of a graph for `assertExpectedInline`.
- `op_counts(gm)`: op histogram by schema name, to pair with goldens.
- `write_bundle(...)`: a bundle folder with a correct manifest (sizes, sha256).
- `manifest_from_region(region, ...)`: a manifest signature copied from a region report
  entry, exactly as a new user would write it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func

from graphdispatch_backend.artifacts.fingerprint import op_key
from graphdispatch_backend.capture.autocast import AutocastState
from graphdispatch_backend.capture.lower import InputOrigin, input_origins, lower
from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.tag_regions import tag_regions
from graphdispatch_backend.region import Region


@dataclasses.dataclass
class Lowered:
    gm: fx.GraphModule
    origins: tuple[InputOrigin, ...]
    dynamo_gm: fx.GraphModule


def aten_graph(fn: Callable[..., Any], *args: Any, index: int = 0, dynamic: bool | None = None) -> Lowered:
    """Compile `fn` with a recording backend; return the `index`-th lowered graph.
    `dynamic` is torch.compile's (True: symbolic sizes from the first call)."""
    seen: list[Lowered] = []

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        origins = input_origins(gm, example_inputs)

        def keep(aten: fx.GraphModule, _inputs: Sequence[Any]) -> Callable[..., Any]:
            seen.append(Lowered(aten, origins, gm))
            return make_boxed_func(aten.forward)

        return lower(gm, example_inputs, AutocastState.observe(), inference_compiler=keep,
                     forward_compiler=keep, backward_compiler=lambda bw, _inputs: make_boxed_func(bw.forward))

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    torch._dynamo.reset()
    return seen[index]


def regions(lowered: Lowered) -> dict[str, Region]:
    """Run `tag_regions` on a lowered graph (annotating its nodes); regions by name."""
    ctx = PassContext(input_origins=lowered.origins)
    tag_regions(lowered.gm, ctx)
    return {r.name: r for r in ctx.regions}


def normalize(gm: fx.GraphModule) -> str:
    """The graph's Python code without comments, blank lines or `= None` frees."""
    lines = []
    for line in gm.code.splitlines():
        line = re.sub(r"\s*#.*$", "", line).rstrip()
        # FX frees dead values with `;  a = None` or, for several, `;  a = b = None`
        line = re.sub(r";\s+[\w, ]+(?: = [\w, ]+)* = None$", "", line)
        if line.strip():
            lines.append(line)
    return "\n".join(lines)


def op_counts(gm: fx.GraphModule) -> dict[str, int]:
    return dict(sorted(Counter(op_key(n.target) for n in gm.graph.nodes if n.op == "call_function").items()))


def write_bundle(
    folder: str | Path,
    artifact_id: str,
    module: str,
    inputs: Sequence[dict[str, Any]],
    outputs: Sequence[dict[str, Any]],
    source: str,
    symbol: str = "forward",
    extra_files: dict[str, bytes] | None = None,
    fingerprint: str | None = None,
    **fields: Any,
) -> Path:
    """Write `folder/kernel.py` (+ extra files) and a manifest declaring them correctly;
    `fingerprint` (copied from the region report) pins the region beyond its name."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = {"kernel.py": source.encode(), **(extra_files or {})}
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    manifest = {
        "schema_version": 1,
        "id": artifact_id,
        "region": {"module": module, **({"fingerprint": fingerprint} if fingerprint else {})},
        "signature": {"inputs": list(inputs), "outputs": list(outputs)},
        "entry_point": {"file": "kernel.py", "symbol": symbol},
        "files": [{"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                  for rel, data in sorted(files.items())],
        **fields,
    }
    (folder / "artifact.json").write_text(json.dumps(manifest, indent=2))
    return folder


def manifest_from_region(region: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """A `signature` block copied from a region report entry (names, order, shapes, dtypes)."""
    return {
        "inputs": [{"name": i["name"], "shape": i["shape"], "dtype": i["dtype"]} for i in region["inputs"]],
        "outputs": [{"shape": o["shape"], "dtype": o["dtype"]} for o in region["outputs"]],
    }
