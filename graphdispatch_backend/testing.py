"""Helpers for tests (ours and artifact authors'): graphs to golden-test, bundles to write.

- `aten_graph(fn, *args)`: the lowered ATen inference graph graphdispatch's passes see,
  with the input origins, through Dynamo and aot (no passes run).
- `regions(lowered)`: `tag_regions` run on it, as {region name: Region}.
- `normalize(gm)`: small, stable text of a graph for `assertExpectedInline`.
- `op_counts(gm)`: op histogram by schema name, to pair with goldens.
- `cut_pieces(gm, device, before=())`: `split_pieces` run on a lowered graph (after the
  passes `before`), its pieces recorded: (the PassContext, the piece graphs made).
- `write_bundle(...)`: a bundle folder with a correct manifest (sizes, sha256).
- `manifest_from_region(region, ...)`: a manifest signature copied from a region report
  entry, exactly as a new user would write it.
- `only_graph()`: the latest report's one graph, its calls checked as accounted for.
- `uninitialized_memory()`: while it is entered, every CPU `new_empty` and `empty_like`
  returns memory holding a new value each time, as uninitialized memory may.
- `region_entry(fn, *args, name=..., **options)`: a region's report entry from one call
  compiled in a fresh session (reset before and after), to write a manifest from.

Small models the tests share (seed before building them; class names show in reports):

- `Mlp` (fc1 dim -> 2*dim, activation, fc2 2*dim -> dim), `Block` (x + mlp(x)) and
  `Stack` (`blocks`, a ModuleList of Blocks): regions `mlp`, `blocks.<i>.mlp`, ... The
  activation is `torch.relu`, or a module given as `act` (its own region, `mlp.act`).
- `MLP_INPUTS`, `MLP_OUTPUTS` (`mlp_inputs(batch)`): the dim-8 `Mlp` region's manifest
  signature, batch left free, inputs in the region report's order; `MLP_SOURCE`: an exact
  kernel for the relu `Mlp` region.
- `LinearBlock` (x + relu(lin(x)), or relu(lin(x)) with residual=False) and
  `linear_stack(depth, dim, seed)`: a seeded nn.Sequential of them in eval mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch import nn

import graphdispatch_backend
from graphdispatch_backend.artifacts.catalog import signature
from graphdispatch_backend.artifacts.fingerprint import op_key
from graphdispatch_backend.capture.autocast import AutocastState
from graphdispatch_backend.capture.lower import InputOrigin, input_origins, lower
from graphdispatch_backend.passes.context import PassContext, PieceInfo, PieceSpec
from graphdispatch_backend.passes.split_pieces import split_pieces
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


def cut_pieces(gm: fx.GraphModule, device: str, before: Sequence[Callable[[fx.GraphModule, PassContext], None]] = (),
               ) -> tuple[PassContext, list[fx.GraphModule]]:
    """`split_pieces` on `gm` for a graph on `device`, after the passes `before` (in the
    pipeline's order); each piece a plain call of its graph, named as backend.py names
    its runners (FX code generation names a call target by them)."""
    made: list[fx.GraphModule] = []

    def make_piece(piece: fx.GraphModule, info: PieceInfo) -> Callable[..., Any]:
        made.append(piece)

        def run(*args: Any) -> Any:
            return piece(*args)

        run.__name__ = run.__qualname__ = f"gd_piece_{info.index}"
        run.__module__ = "graphdispatch"
        return run

    ctx = PassContext(pieces_spec=PieceSpec(device, make_piece))
    for step in (*before, split_pieces):
        step(gm, ctx)
    return ctx, made


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


def manifest_from_region(region: dict[str, Any]) -> dict[str, list[Any]]:
    """A `signature` block copied from a region report entry (names, order, shapes, dtypes,
    and the inputs it writes in place)."""
    return signature(region)


def accounted_graphs(report: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The graphs of `report` (the latest by default), every graph and every backward
    checked to add up: its calls are replays or eager calls, each with its reason."""
    report = graphdispatch_backend.latest_report() if report is None else report
    assert report is not None
    for graph in report["graphs"]:
        for record in (graph, graph.get("backward")):
            if record:
                cg = record["cuda_graph"]
                assert record["calls"] == cg["replays"] + cg["eager_calls"], record["name"]
                assert sum(cg["eager_by_reason"].values()) == cg["eager_calls"], record["name"]
    return report["graphs"]


def generates_like_eager(model: Any, prompt: torch.Tensor, kw: dict[str, Any], times: int) -> None:
    """A transformers model's `generate` (`kw` asks for its logits), compiled as transformers'
    docs compile a static-cache decode (`forward`, emulate, `dynamic=False`): `times`
    generates, each with eager's tokens and logits, bit for bit."""
    with torch.no_grad():
        ref = model.generate(prompt, **kw)
        model.forward = torch.compile(model.forward, backend="graphdispatch", options={"cuda_graphs": "emulate"},
                                      dynamic=False)
        for _ in range(times):
            out = model.generate(prompt, **kw)
            assert torch.equal(out.sequences, ref.sequences)
            assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))


def only_graph() -> dict[str, Any]:
    """The latest report's only graph; its calls are replays or counted eager calls."""
    (graph,) = accounted_graphs()
    return graph


def region_entry(fn: Callable[..., Any], *args: Any, name: str, **options: Any) -> dict[str, Any]:
    """The report entry of region `name` after one no_grad call of `fn` compiled with
    graphdispatch (`options`). Dynamo and graphdispatch are reset before and after, so
    what the caller compiles next (with a bundle written from the entry) starts fresh."""
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    with torch.no_grad():
        torch.compile(fn, backend="graphdispatch", options=options)(*args)
    report = graphdispatch_backend.latest_report()
    assert report is not None
    (graph,) = report["graphs"]
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    return next(r for r in graph["regions"] if r["name"] == name)


# -- small models ----------------------------------------------------------------------------


class Mlp(nn.Module):
    """fc1 (dim -> 2*dim), activation, fc2 (2*dim -> dim). The activation is `torch.relu`
    unless `act` is given: a module, or a factory of one (`nn.GELU`), registered as `act`."""

    def __init__(self, dim: int = 8, act: nn.Module | Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.act = act if act is None or isinstance(act, nn.Module) else act()
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(torch.relu(h) if self.act is None else self.act(h))


class Block(nn.Module):
    """x + mlp(x); `act` (a factory, `nn.GELU`) as for `Mlp`."""

    def __init__(self, dim: int = 8, act: Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        self.mlp = Mlp(dim, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Stack(nn.Module):
    """`depth` Blocks in `blocks`, one after the other; `act` (a factory) gives each its own."""

    def __init__(self, depth: int = 2, dim: int = 8, act: Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, act) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def mlp_inputs(batch: int | None = None) -> list[dict[str, Any]]:
    """A fresh copy of the dim-8 `Mlp` region's signature inputs, in the region report's order."""
    return [
        {"name": "fc1.weight", "shape": [16, 8], "dtype": "float32"},
        {"name": "fc1.bias", "shape": [16], "dtype": "float32"},
        {"name": "input0", "shape": [batch, 8], "dtype": "float32"},
        {"name": "fc2.weight", "shape": [8, 16], "dtype": "float32"},
        {"name": "fc2.bias", "shape": [8], "dtype": "float32"},
    ]


MLP_INPUTS = mlp_inputs()
MLP_OUTPUTS = [{"shape": [None, 8], "dtype": "float32"}]
MLP_SOURCE = """
import torch
def forward(w1, b1, x, w2, b2):
    return torch.addmm(b2, torch.relu(torch.addmm(b1, x, w1.t())), w2.t())
"""


class LinearBlock(nn.Module):
    """x + relu(lin(x)), lin: dim -> dim; relu(lin(x)) alone when not `residual`."""

    def __init__(self, dim: int = 8, residual: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.lin(x))
        return x + y if self.residual else y


def linear_stack(depth: int = 2, dim: int = 8, seed: int = 0) -> nn.Sequential:
    """`depth` LinearBlocks in an nn.Sequential (children `0`, `1`, ...), seeded, in eval mode."""
    torch.manual_seed(seed)
    return nn.Sequential(*[LinearBlock(dim) for _ in range(depth)]).eval()


def serve_patches(fn: Callable[..., Any]) -> tuple[tuple[Any, str, Any], ...]:
    """`(module, "serve", fn)` for every runner module that calls `serve` (the replay path,
    the hot path and verification): a test that replaces the serve replaces it everywhere."""
    from graphdispatch_backend.runtime.runner import hot, publish

    return tuple((module, "serve", fn) for module in (hot, publish))


def perturbed(op: str, above: float | None = None, by: float | None = None) -> Any:
    """A patch of fusion/inductor.py under which every node of `op` (`aten.mul.Tensor`) that
    Inductor fuses computes one ulp above its ATen kernel (`nextafter(x, inf)` after it;
    with `above`, only where the result is larger; with `by`, `x * (1 + by)` instead: beyond
    a declared tolerance on purpose), while the same op kept as an ATen call stays exact: a
    fused op off, for the tests of isolation and learning. Use with
    `unittest.mock.patch.object(*perturbed(op))`."""
    from graphdispatch_backend.fusion import inductor

    original = inductor.rewrite

    def rewrite(gm: fx.GraphModule, nodes: set[fx.Node]) -> set[fx.Node]:
        chosen = original(gm, nodes)
        for node in list(gm.graph.nodes):
            val = node.meta.get("val")
            if node not in chosen or str(node.target) != op or not isinstance(val, torch.Tensor) \
                    or not val.is_floating_point():
                continue
            aten = torch.ops.aten
            if by is not None:
                with gm.graph.inserting_after(node):
                    up = gm.graph.call_function(aten.mul.Tensor, (node, 1.0 + by))
                injected = {up}
            else:
                with gm.graph.inserting_after(node):
                    inf = gm.graph.call_function(aten.scalar_tensor.default, (float("inf"),), {"dtype": val.dtype})
                inf.meta = {"val": torch.empty((), dtype=val.dtype, device=val.device)}
                with gm.graph.inserting_after(inf):
                    up = gm.graph.call_function(torch.ops.aten.nextafter.default, (node, inf))
                injected = {inf, up}
            up.meta = dict(node.meta)
            if above is not None:
                with gm.graph.inserting_after(up):
                    big = gm.graph.call_function(aten.gt.Scalar, (node, above))
                with gm.graph.inserting_after(big):
                    up = gm.graph.call_function(aten.where.self, (big, up, node))
                big.meta = {"val": torch.empty(val.shape, dtype=torch.bool, device=val.device)}
                up.meta = dict(node.meta)
                injected |= {big, up}
            node.replace_all_uses_with(up, delete_user_cb=lambda user, injected=injected: user not in injected)
            chosen |= injected
        gm.recompile()
        return chosen

    return inductor, "rewrite", rewrite


@contextlib.contextmanager
def uninitialized_memory() -> Iterator[None]:
    """Every CPU `new_empty` and `empty_like` holds other values, as uninitialized memory
    may (not what the allocator happened to reuse). Kernels registered for the block's
    span, not a dispatch mode: a mode puts the Python dispatch key in the key set Dynamo's
    guards compare (one recompile per call, so no graph reached its capture)."""
    values = itertools.count(1)

    def filled(out: torch.Tensor) -> torch.Tensor:
        return out.fill_(next(values) % (2 if out.dtype == torch.bool else 251))

    def new_empty(self: torch.Tensor, size: Sequence[int], *, dtype: torch.dtype | None = None,
                  layout: Any = None, device: Any = None, pin_memory: bool | None = None) -> torch.Tensor:
        return filled(torch.empty(size, dtype=self.dtype if dtype is None else dtype,
                                  device=self.device if device is None else device))

    def empty_like(self: torch.Tensor, *, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
                   pin_memory: bool | None = None, memory_format: Any = None) -> torch.Tensor:
        dtype = self.dtype if dtype is None else dtype
        device = self.device if device is None else device
        # the strides ATen gives (kernels lay their outputs out by them), from its meta kernel
        like = torch.empty_strided(self.shape, self.stride(), dtype=dtype, device="meta")
        strides = torch.empty_like(like, memory_format=memory_format or torch.preserve_format).stride()
        return filled(torch.empty_strided(self.shape, strides, dtype=dtype, device=device))

    lib = torch.library.Library("aten", "IMPL")  # scoped: destroyed when the block ends
    try:
        lib.impl("new_empty", new_empty, "CPU")
        lib.impl("empty_like", empty_like, "CPU")
        yield
    finally:
        lib._destroy()

