"""Fusion: per-call time of `fuse=True` against graphdispatch unfused, eager, aot_eager and
default Inductor, with each one's bits against eager.

Models (tiny random configs, batch as in tests): the demo (`examples/dit.py`), two
diffusers DiTs (LTX video, SD3 image) and a transformers LLM (Llama), each fp32 and bf16
(the demo under bf16 autocast, its weights fp32, as its users run it). CPU, one thread,
`torch.no_grad()`, `cuda_graphs=False` (what is timed is the kernels, not the host model of
a CUDA graph).

Method: every variant is compiled in this process (Dynamo reset between models), called
once (the first-call time: compile plus one run; Inductor's on-disk caches as they are,
or empty with `--cold`), then called on 5 fresh inputs and compared with eager, bit for
bit (`bitwise`), then 40 times more (past the checks of the first calls, which the
`recheck` schedule makes every 1024th call in steady state). Per-call time is A/B interleaved (common.interleaved: each repeat runs
every variant in a fresh shuffled order), median microseconds; ratios are the median of
per-repeat paired ratios. The fused graph's kernels, the ops Inductor lowered, the ops the
recipe left to ATen and the ops the graph learned to keep are read from the report.

Targets: on the DiT-like models (demo, LTX, SD3) fused <= 0.9x graphdispatch unfused per
call, fp32 and bf16; every fused variant bitwise equal to eager on every call.

    python bench/fusion.py            # every model, both dtypes (cold caches: --cold)
    python bench/fusion.py --quick    # fewer repeats
    python bench/fusion.py --smoke    # the demo, fp32, 3 repeats: the plumbing, in CI
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import Target, emit, fmt_us, interleaved, paired_ratio, parse_args, raise_dynamo_limits

import graphdispatch_backend
from graphdispatch_backend.examples import dit

TARGET = 0.9
DIT_LIKE = ("demo", "ltx", "sd3")
VARIANTS = ("eager", "aot_eager", "inductor", "graphdispatch", "fused")
WARM_CALLS = 40

Inputs = Callable[[int, torch.dtype], dict[str, Any]]


def _g(i: int) -> torch.Generator:
    return torch.Generator().manual_seed(i)


def demo() -> tuple[torch.nn.Module, Inputs]:
    return dit.TinyDiT(dit.DiTConfig()), lambda i, dt: {"x": torch.randn(2, 4, 16, 16, generator=_g(i)),
                                                        "t": torch.full((2,), 999.0 - i)}


def ltx() -> tuple[torch.nn.Module, Inputs]:
    import diffusers

    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=2, caption_channels=16)
    return model, lambda i, dt: {
        "hidden_states": torch.randn(1, 32, 8, generator=_g(i)).to(dt),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=_g(i + 100)).to(dt), "timestep": torch.tensor([3]),
        "encoder_attention_mask": torch.ones(1, 5), "num_frames": 2, "height": 4, "width": 4, "return_dict": False}


def sd3() -> tuple[torch.nn.Module, Inputs]:
    import diffusers

    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16)
    return model, lambda i, dt: {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=_g(i)).to(dt),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=_g(i + 100)).to(dt),
        "pooled_projections": torch.randn(1, 16, generator=_g(i + 200)).to(dt), "timestep": torch.tensor([3]),
        "return_dict": False}


def llama() -> tuple[torch.nn.Module, Inputs]:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaModel(cfg), lambda i, dt: {"input_ids": torch.randint(0, 64, (2, 8), generator=_g(i))}


MODELS = {"demo": demo, "ltx": ltx, "sd3": sd3, "llama": llama}


def _first(out: Any) -> torch.Tensor:
    while not isinstance(out, torch.Tensor):
        out = out.to_tuple()[0] if hasattr(out, "to_tuple") else out[0]
    return out


def _compiled(name: str, model: torch.nn.Module) -> Callable[..., Any]:
    if name == "eager":
        return model
    if name in ("aot_eager", "inductor"):
        return torch.compile(model, backend=name)
    options = {"cuda_graphs": False, "cache_dir": False, "fuse": name == "fused"}
    return torch.compile(model, backend="graphdispatch", options=options)


def measure(family: str, dtype: torch.dtype, repeats: int, inner: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs = MODELS[family]()
    autocast = family == "demo" and dtype == torch.bfloat16  # the demo's users run bf16 under autocast
    model = model.to(torch.float32 if autocast else dtype).eval()
    feed = torch.float32 if autocast else dtype

    def under(fn: Callable[..., Any], i: int) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            return _first(fn(**inputs(i, feed)))

    row: dict[str, Any] = {"model": family, "dtype": "bf16" if dtype == torch.bfloat16 else "fp32"}
    callables: dict[str, Callable[[], Any]] = {}
    for name in VARIANTS:
        torch._dynamo.reset()
        graphdispatch_backend.reset()
        fn = _compiled(name, model)
        start = time.perf_counter()
        under(fn, 0)
        row[f"{name}_first_s"] = time.perf_counter() - start
        row[f"{name}_bitwise"] = all(torch.equal(under(fn, i), under(model, i)) for i in range(1, 6))
        if name == "fused":
            fusions = [g["fusion"] for g in graphdispatch_backend.latest_report()["graphs"] if g.get("fusion")]
            row["kernels"] = sum(f.get("kernels", 0) for f in fusions)
            row["status"] = ",".join(sorted({f["status"] for f in fusions}))
            row["fused_ops"] = sorted({op for f in fusions for op in f.get("fused_ops", {})})
            row["recipe_keeps"] = sorted({k["op"] for f in fusions for k in f.get("kept", []) if k["why"] == "recipe"})
            row["learned"] = sorted({k["op"] for f in fusions for k in f.get("kept", []) if k["why"] != "recipe"})
        args = inputs(9, feed)
        callables[name] = lambda fn=fn, args=args: under(lambda **_: fn(**args), 9)
        for _ in range(WARM_CALLS):  # past the checks of the first calls (1st, 2nd, 4th, ... 32nd)
            callables[name]()
    times = interleaved(callables, repeats=repeats, inner=inner, baseline="graphdispatch")
    for name in VARIANTS:
        row[f"{name}_us"] = times[name]["median_us"]
    row["fused_vs_graphdispatch"] = paired_ratio(times, "fused", "graphdispatch")
    row["fused_vs_eager"] = paired_ratio(times, "fused", "eager")
    row["inductor_vs_graphdispatch"] = paired_ratio(times, "inductor", "graphdispatch")
    torch._dynamo.reset()
    return row


def main() -> None:
    args = parse_args(__doc__, lambda p: (p.add_argument("--smoke", action="store_true", help="the demo, fp32"),
                                          p.add_argument("--cold", action="store_true",
                                                         help="Inductor's caches empty (a temp folder)")))
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gd-fusion-bench-")
    torch.set_num_threads(1)
    raise_dynamo_limits()
    cases = [("demo", torch.float32)] if args.smoke else [
        (m, dt) for m in MODELS for dt in (torch.float32, torch.bfloat16)]
    repeats, inner = (3, 3) if args.smoke else (9, 5) if args.quick else (21, 10)
    rows = [measure(m, dt, repeats, inner) for m, dt in cases]
    header = ["model", "dtype", *(f"{v} us" for v in VARIANTS), "fused/gd", "fused/eager", "inductor/gd",
              "bitwise (aot, ind, gd, fused)", "kernels", "learned"]
    table_rows = [[r["model"], r["dtype"], *(fmt_us(r[f"{v}_us"]) for v in VARIANTS),
                   f"{r['fused_vs_graphdispatch']:.2f}", f"{r['fused_vs_eager']:.2f}",
                   f"{r['inductor_vs_graphdispatch']:.2f}",
                   " ".join("yes" if r[f"{v}_bitwise"] else "NO" for v in VARIANTS[1:]), r["kernels"],
                   ", ".join(r["learned"]) or "-"] for r in rows]
    first = [[r["model"], r["dtype"], *(f"{r[f'{v}_first_s']:.2f}" for v in VARIANTS[1:])] for r in rows]
    targets = [Target(f"{r['model']} {r['dtype']}: fused / graphdispatch per call", f"<= {TARGET}",
                      f"{r['fused_vs_graphdispatch']:.2f}", r["fused_vs_graphdispatch"] <= TARGET)
               for r in rows if r["model"] in DIT_LIKE]
    targets.append(Target("fused bitwise with eager on every call", "all", ", ".join(
        f"{r['model']} {r['dtype']}" for r in rows if not r["fused_bitwise"]) or "all",
        all(r["fused_bitwise"] for r in rows)))
    cache = "cold (an empty Inductor cache)" if args.cold else "as found (Inductor's on-disk caches)"
    emit("fusion", {"rows": rows, "repeats": repeats, "inner": inner, "caches": cache},
         [("Per call, CPU, one thread (us, median; ratios paired per repeat)", header, table_rows),
          (f"First call (compile + one run, seconds; caches {cache})",
           ["model", "dtype", *VARIANTS[1:]], first)], targets, args)


if __name__ == "__main__":
    main()
