"""KV cache: the bytes a decode step's replay copies, against the rows it writes.

Model: a small decoder of `LAYERS` attention layers (dim 256, 4 heads) with a static KV
cache per layer (`MAX_LEN` x dim for keys and for values, registered buffers: 2 x 4 x 2048
x 256 x 4 bytes = 16 MiB), decoding one token per call: each layer writes its key and
value row at the position (`index_copy_`) and attends over the cache with a mask up to the
position. Compiled with `backend="graphdispatch", options={"cuda_graphs": "emulate"}` (the
whole capture, verify, replay state machine on CPU); every call is compared with the same
model run eagerly, cache included, bit for bit.

Two variants, each in a fresh session, run side by side:
- `in place` (the default): aot keeps the cache writes in the graph
  (`keep_inference_input_mutations`), so the replay writes the rows into the caller's cache.
- `copied back`: the same model with aot told otherwise (as before this was the rule): the
  graph returns the updated cache as extra outputs, and the runtime copies it back each call.

Figures, from the report after `STEPS` decode steps: per replay, the bytes the runtime
copied (`copy_bytes`: moving inputs in, mutated inputs back, outputs out), against the
bytes of the rows the step writes (2 x LAYERS x dim x 4) plus the token in and the logits
out. Target: `in place` copies no more than the written rows and the step's own input and
output, never the cache. (No timing here: the eager check's re-checks on the 2nd, 4th,
8th, ... call run eager twice on those calls; bench/overhead.py times the runtime.)

`--smoke` (CI): both variants with 2 layers of dim 64, a 64-row cache and 8 steps: the
script's plumbing, no figure.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Target, emit, parse_args

import graphdispatch_backend
from graphdispatch_backend.capture import lower as lower_mod

LAYERS, DIM, HEADS, MAX_LEN = 4, 256, 4, 2048
SMOKE = {"LAYERS": 2, "DIM": 64, "HEADS": 4, "MAX_LEN": 64}
SMOKE_STEPS = 8
OPTIONS = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 2}


def smoke_sizes() -> None:
    """The tiny model of `--smoke` (module globals: the model reads them when built and called)."""
    global LAYERS, DIM, HEADS, MAX_LEN
    LAYERS, DIM, HEADS, MAX_LEN = SMOKE["LAYERS"], SMOKE["DIM"], SMOKE["HEADS"], SMOKE["MAX_LEN"]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.register_buffer("k_cache", torch.zeros(MAX_LEN, DIM))
        self.register_buffer("v_cache", torch.zeros(MAX_LEN, DIM))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        self.k_cache.index_copy_(0, pos, k)
        self.v_cache.index_copy_(0, pos, v)
        heads = DIM // HEADS
        qh = q.view(1, HEADS, 1, heads)
        kh = self.k_cache.view(1, MAX_LEN, HEADS, heads).transpose(1, 2)
        vh = self.v_cache.view(1, MAX_LEN, HEADS, heads).transpose(1, 2)
        att = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return x + self.out(att.transpose(1, 2).reshape(1, DIM))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        mask = (torch.arange(MAX_LEN) <= pos).view(1, 1, 1, MAX_LEN)  # the written positions only
        for layer in self.layers:
            x = layer(x, pos, mask)
        return x


def _step(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(1, DIM, generator=gen), torch.tensor([step])


def run_variant(in_place: bool, steps: int) -> dict[str, Any]:
    """Decode `steps` tokens compiled and eagerly; the report's copy figures and a timed loop."""
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    real = lower_mod.aot_module_simplified
    if not in_place:
        lower_mod.aot_module_simplified = lambda *a, **kw: real(  # type: ignore[assignment]
            *a, **{**kw, "keep_inference_input_mutations": False})
    try:
        torch.manual_seed(0)
        model, ref = Decoder().eval(), Decoder().eval()
        ref.load_state_dict(model.state_dict())
        compiled = torch.compile(model, backend="graphdispatch", options=OPTIONS)
        bitwise = True
        with torch.no_grad():
            for step in range(steps):
                x, pos = _step(step)
                bitwise &= torch.equal(compiled(x, pos), ref(x, pos))
                bitwise &= all(torch.equal(a, b) for a, b in zip(model.buffers(), ref.buffers()))
        report = graphdispatch_backend.latest_report()
        graphs = report["graphs"]
        pieces = [p["cuda_graph"] for g in graphs for p in g["pieces"] if "cuda_graph" in p]
        replays = sum(p["replays"] for p in pieces)
        copied = sum(p["copy_bytes"] for p in pieces)
        balanced = all(g["calls"] == g["cuda_graph"]["replays"] + g["cuda_graph"]["eager_calls"] for g in graphs)
        return {"variant": "in place" if in_place else "copied back", "bitwise": bool(bitwise),
                "graphs": len(graphs), "replays": replays, "copy_bytes_per_replay": copied / max(replays, 1),
                "balanced": balanced}
    finally:
        lower_mod.aot_module_simplified = real


def main() -> None:
    args = parse_args(__doc__)
    if args.smoke:
        smoke_sizes()
    steps = SMOKE_STEPS if args.smoke else 16 if args.quick else 32
    start = time.perf_counter()
    results = [run_variant(True, steps), run_variant(False, steps)]
    rows_bytes = 2 * LAYERS * DIM * 4  # the key and value rows a step writes
    cache_bytes = 2 * LAYERS * MAX_LEN * DIM * 4
    io_bytes = DIM * 4 * 2 + 8  # the token in, the hidden state out, the position
    rows = [[r["variant"], r["bitwise"], r["replays"], round(r["copy_bytes_per_replay"]), rows_bytes, cache_bytes]
            for r in results]
    inplace = results[0]
    targets = [
        Target("kv cache: bitwise with eager, cache included", "every step", str(all(r["bitwise"] for r in results)),
               all(r["bitwise"] for r in results)),
        Target("kv cache in place: copy bytes per replay", f"<= rows + io ({rows_bytes + io_bytes} B), not the cache",
               f"{inplace['copy_bytes_per_replay']:.0f} B (cache {cache_bytes} B)",
               inplace["replays"] > 0 and inplace["copy_bytes_per_replay"] <= rows_bytes + io_bytes),
        Target("kv cache: every call accounted for", "calls == replays + eager_calls",
               str(all(r["balanced"] for r in results)), all(r["balanced"] for r in results)),
    ]
    payload = {"steps": steps, "layers": LAYERS, "dim": DIM, "max_len": MAX_LEN, "row_bytes": rows_bytes,
               "cache_bytes": cache_bytes, "results": results,
               "seconds": round(time.perf_counter() - start, 1)}
    emit("kv_cache", payload, [(
        f"static KV cache decode, emulate ({LAYERS} layers, cache {cache_bytes / (1 << 20):g} MiB, {steps} steps)",
        ["variant", "bitwise", "replays", "copied B/replay", "rows written B", "cache B"], rows)], targets, args)


if __name__ == "__main__":
    main()
