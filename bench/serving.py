"""The server case of bench/scale.py (`--only server`): requests as a transformers server
makes them, at a long static cache, on a dense model and on an MoE.

Two tiny random models (no download; float32, eager attention, CPU, one thread): a Llama
(2 layers, hidden 256, 4 heads of 64, wide KV) and a Qwen2-MoE (2 layers, hidden 128, 4
experts, 2 per token, a shared expert) whose experts run `experts_implementation=
"batched_mm"` (transformers' default grouped-mm fallback calls `tolist()`, which a capture
refuses). `max_cache_len` 4096 (a 16 MiB cache for the Llama), a fixed 8-token prompt,
greedy. graphdispatch compiles `model.forward` as transformers' docs compile a static-cache
decode (`cuda_graphs="emulate"`, `dynamic=False`). Four cases per model, each on a fresh
compile (`graphdispatch_backend.reset()`, `torch._dynamo.reset()`), its eager twin beside:

1. `new cache`: REQUESTS requests of TOKENS new tokens, each with a new `StaticCache`
   (`cache_implementation="static"`: transformers makes one per generate). Per request the
   eager and the compiled generate run back to back (order alternating, garbage collection
   off), so the ratio of their times is paired. Targets: every request from the 2nd <= 1.3x
   eager's time, the median <= 1.1x; the decode graph's bytes copied per replay <= 1% of the
   cache's (a moved cache is not copied in). The prefill graph makes the new cache, so it
   runs eagerly (split reason `made_buffer`, passes/split_pieces.py), as the Dynamo graph
   (nothing else to serve: no lowering to `recheck`); the 2nd request pays the decode
   graph's first relocation.
2. `one cache reused`: one `StaticCache` per side, `reset()` before each request (a server
   that keeps one cache per slot). Target: median ratio from the 3rd request <= 1.05x.
3. `short requests`: REQUESTS requests of SHORT new tokens, a new cache each. Target: no
   decode call after the first request answered eagerly, but for a call that captured
   (`verifying`; a call that relocates captures at the new cache and replays).
4. `rotation`: ROTATION caches used in turn (one per slot) for ROUNDS rounds of SHORT-token
   requests. Target: no capture and no eager decode call after the first round.

An encoder-decoder, a T5 (2 + 2 layers, d_model 256, 4 heads of 64) reading an encoder
input of ENC_LEN tokens per request, runs the first and third cases: each request brings a
new encoder output with its new cache, an input the decode step only reads moving with one
it writes (runner/relocate.py relocates both at once, the encoder output read in place
where the last one stayed put REPIN_AFTER replays, else copied in). Same targets, the bytes
copied per replay against the decoder's self-attention cache.

A fifth, `prefill`, times one prefill call with a new cache (what the first forward of
every request runs: transformers makes the cache's zeros there and writes the prompt's
rows) at PREFILL_LENGTHS, A/B interleaved (bench/common.py), against eager: aot_eager,
graphdispatch with `cuda_graphs=False` (the lowering alone) and with `emulate`. aot lowers
the row writes into a new buffer out of place (a copy of the whole cache per layer);
graphdispatch writes the rows into the zeros (passes/reinplace_buffers.py). Target: the
lowering alone <= PREFILL_MAX x eager at the largest length, logits and caches bitwise.
`emulate` is shown, not judged: the graph makes the cache, so it is not captured
(`made_buffer`) and runs the Dynamo graph (nothing to serve: not lowered).

Every generate's tokens and logits equal the eager twin's (`torch.equal`), else the
script exits 1. `--smoke`: a one-layer model of hidden 64 at `max_cache_len` 32, 3 requests,
rotation of 2 for 2 rounds, the prefill at 32, an encoder input of 16; the Llama runs every
case, the MoE and the T5 only the first (each case compiles afresh, 4 s here; the cases'
code is the same for every model): the plumbing, no figure.
"""

from __future__ import annotations

import copy
import functools
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from common import Target, interleaved, raise_dynamo_limits

import graphdispatch_backend

LLAMA = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64}
MOE = {"vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
       "shared_expert_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}
LENGTH, PROMPT_LEN, TOKENS, SHORT, REQUESTS, ROTATION, ROUNDS = 4096, 8, 24, 4, 12, 4, 3
EVERY_MAX, MEDIAN_MAX, REUSED_MAX, COPY_MAX = 1.3, 1.1, 1.05, 0.01
PREFILL_LENGTHS, PREFILL_MAX, PREFILL_REPEATS = (1024, 4096), 1.1, 15
T5 = {"vocab_size": 1024, "d_model": 256, "d_kv": 64, "d_ff": 512, "num_layers": 2, "num_decoder_layers": 2,
      "num_heads": 4}
ENC_LEN = 512  # the encoder input per request: its output, [1, 512, 256] float32, is what moves with the cache
MOE_CASES = ("new cache", "one cache reused", "short requests", "rotation")  # the MoE's (all: CASES)
T5_CASES = ("new cache", "short requests")
SMOKE: dict[str, Any] = {
    "LLAMA": {**LLAMA, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32},
    "MOE": {**MOE, "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2},
    "LENGTH": 32, "PROMPT_LEN": 4, "TOKENS": 6, "SHORT": 2, "REQUESTS": 3, "ROTATION": 2, "ROUNDS": 2,
    "T5": {**T5, "vocab_size": 128, "d_model": 64, "d_kv": 32, "d_ff": 128, "num_layers": 1, "num_decoder_layers": 1,
           "num_heads": 2},
    "PREFILL_LENGTHS": (32,), "PREFILL_REPEATS": 2, "MOE_CASES": ("new cache",), "T5_CASES": ("new cache",),
    "ENC_LEN": 16,
}
KINDS = ("llama", "moe", "t5")


def _model(kind: str) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    common = {"max_position_embeddings": 2 * LENGTH, "attn_implementation": "eager", "bos_token_id": None,
              "eos_token_id": None, "pad_token_id": 0}
    torch.manual_seed(0)
    if kind == "moe":
        config = transformers.Qwen2MoeConfig(**MOE, **common, experts_implementation="batched_mm")
        return transformers.Qwen2MoeForCausalLM(config).eval()
    if kind == "t5":
        config = transformers.T5Config(**T5, decoder_start_token_id=0, pad_token_id=0, eos_token_id=None)
        return transformers.T5ForConditionalGeneration(config).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, **common)).eval()


class _Pair:
    """A model's eager twin and its compiled copy, fresh: their generates, timed and compared."""

    def __init__(self, base: Any, prompt: torch.Tensor) -> None:
        graphdispatch_backend.reset()
        torch._dynamo.reset()
        self.eager, self.compiled, self.prompt = copy.deepcopy(base), copy.deepcopy(base), prompt
        self.compiled.forward = torch.compile(self.compiled.forward, backend="graphdispatch",
                                              options={"cuda_graphs": "emulate"}, dynamic=False)
        self.bitwise = True
        self.generates = 0

    def request(self, tokens: int, index: int, caches: tuple[Any, Any] | None = None) -> float:
        """One request on both sides (the order alternating with `index`); compiled / eager time."""
        took: dict[str, float] = {}
        outs: dict[str, Any] = {}
        for side in (("eager", "compiled") if index % 2 else ("compiled", "eager")):
            kw: dict[str, Any] = {"cache_implementation": "static", "max_cache_len": LENGTH}
            if caches is not None:
                cache = caches[0 if side == "eager" else 1]
                cache.reset()
                kw = {"cache": cache}
            gc.collect()
            gc.disable()  # as timeit does: a collection inside one generate is another's noise
            try:
                start = time.perf_counter()
                outs[side] = getattr(self, side).generate(
                    self.prompt, max_new_tokens=tokens, do_sample=False, pad_token_id=0, disable_compile=True,
                    return_dict_in_generate=True, output_logits=True, **kw)
                took[side] = time.perf_counter() - start
            finally:
                gc.enable()
        a, b = outs["eager"], outs["compiled"]
        self.bitwise &= bool(torch.equal(a.sequences, b.sequences) and len(a.logits) == len(b.logits)
                             and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)))
        self.generates += 1
        return took["compiled"] / took["eager"]

    def cache(self) -> tuple[Any, Any]:
        import transformers

        return tuple(transformers.StaticCache(config=m.config, max_cache_len=LENGTH)
                     for m in (self.eager, self.compiled))  # type: ignore[return-value]


def _decode() -> dict[str, Any]:
    """The decode graph's figures (the graph called most), summed over its pieces."""
    graphs = (graphdispatch_backend.latest_report() or {}).get("graphs", [])
    graph = max(graphs, key=lambda g: g["calls"])
    cg = graph["cuda_graph"]
    pieces = [p["cuda_graph"] for p in graph["pieces"] if "cuda_graph" in p]
    return {"calls": graph["calls"], "replays": cg["replays"], "eager": cg["eager_calls"],
            "eager_by_reason": dict(cg["eager_by_reason"]), "captures": cg["captures"],
            "relocations": cg.get("relocations", 0), "copy_bytes": sum(p["copy_bytes"] for p in pieces),
            "piece_replays": sum(p["replays"] for p in pieces)}


def _since(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {k: after[k] - before[k] for k in ("calls", "replays", "eager", "captures", "relocations")}
    out["eager_by_reason"] = {r: n - before["eager_by_reason"].get(r, 0) for r, n in after["eager_by_reason"].items()
                              if n - before["eager_by_reason"].get(r, 0)}
    return out


def _case(kind: str, name: str, base: Any, prompt: torch.Tensor,
          run: Callable[[_Pair], dict[str, Any]]) -> dict[str, Any]:
    pair = _Pair(base, prompt)
    with torch.no_grad():
        got = run(pair)
    return {"model": kind, "case": name, **got, "bitwise": pair.bitwise, "generates": pair.generates}


def _new_cache(pair: _Pair) -> dict[str, Any]:
    ratios = [pair.request(TOKENS, i) for i in range(REQUESTS)]
    decode = _decode()
    return {"ratios": ratios, "decode": decode,
            "copied_per_replay": decode["copy_bytes"] / max(decode["piece_replays"], 1)}


def _reused(pair: _Pair) -> dict[str, Any]:
    caches = pair.cache()
    return {"ratios": [pair.request(TOKENS, i, caches) for i in range(REQUESTS)], "decode": _decode()}


def _short(pair: _Pair) -> dict[str, Any]:
    ratios = [pair.request(SHORT, 0)]
    first = _decode()
    ratios += [pair.request(SHORT, i) for i in range(1, REQUESTS)]
    return {"ratios": ratios, "decode": _decode(), "after_first": _since(_decode(), first)}


def _rotation(pair: _Pair) -> dict[str, Any]:
    slots = [pair.cache() for _ in range(ROTATION)]
    ratios = [pair.request(SHORT, i, slots[i]) for i in range(ROTATION)]
    first = _decode()
    ratios += [pair.request(SHORT, i, slots[i % ROTATION]) for i in range(ROTATION, ROTATION * ROUNDS)]
    return {"ratios": ratios, "decode": _decode(), "after_first": _since(_decode(), first)}


CASES = {"new cache": _new_cache, "one cache reused": _reused, "short requests": _short, "rotation": _rotation}


PREFILL_SIDES = {"aot_eager": ("aot_eager", None), "graphdispatch, cuda_graphs=False": ("graphdispatch",
                 {"cuda_graphs": False}), "graphdispatch, emulate": ("graphdispatch", {"cuda_graphs": "emulate"})}


def _prefill(base: Any, prompt: torch.Tensor, length: int) -> dict[str, Any]:
    """One prefill with a new cache per call, on each side (module docstring)."""
    import transformers

    graphdispatch_backend.reset()
    torch._dynamo.reset()
    models = {"eager": copy.deepcopy(base)}
    for name, (backend, options) in PREFILL_SIDES.items():
        models[name] = copy.deepcopy(base)
        models[name].forward = torch.compile(models[name].forward, backend=backend, options=options, dynamic=False)
    outs: dict[str, Any] = {}

    def call(name: str) -> Any:
        cache = transformers.StaticCache(config=base.config, max_cache_len=length)
        logits = models[name](input_ids=prompt, past_key_values=cache, cache_position=torch.arange(prompt.shape[1]),
                              use_cache=True).logits
        outs[name] = (logits, [t for layer in cache.layers for t in (layer.keys, layer.values)])

    with torch.no_grad():
        for _ in range(4):  # compile, warm up, capture, verify
            for name in models:
                call(name)
        bitwise = all(torch.equal(outs[n][0], outs["eager"][0]) and all(
            torch.equal(a, b) for a, b in zip(outs[n][1], outs["eager"][1])) for n in models)
        timed = interleaved({n: functools.partial(call, n) for n in models}, repeats=PREFILL_REPEATS, inner=1,
                            baseline="eager")
    report = graphdispatch_backend.latest_report() or {}  # emulate's: the last side compiled
    written = max((g.get("buffer_writes_in_place", 0) for g in report.get("graphs", [])), default=0)
    pools = report.get("totals", {}).get("pools", {})
    return {"length": length, "eager_us": timed["eager"]["median_us"], "bitwise": bitwise,
            "buffer_writes_in_place": written, "ratios": {n: timed[n]["ratio"] for n in PREFILL_SIDES},
            "emulate_pool_bytes": sum(p["pool_bytes"] for p in pools.values()),
            "cache_bytes": sum(t.untyped_storage().nbytes() for t in outs["eager"][1]),
            "split_reasons": {k: v for g in report.get("graphs", []) for k, v in g.get("split_reasons", {}).items()}}


def section_server(smoke: bool) -> tuple[dict[str, Any], list[Any], list[Target], bool]:
    if smoke:
        globals().update(SMOKE)
    prompts = {kind: torch.randint(0, 100, (1, ENC_LEN if kind == "t5" else PROMPT_LEN),
                                   generator=torch.Generator().manual_seed(1)) for kind in KINDS}
    cases = {"llama": tuple(CASES), "moe": MOE_CASES, "t5": T5_CASES}
    runs = []
    for kind in KINDS:
        base = _model(kind)
        for name, run in CASES.items():
            if name in cases[kind]:
                runs.append(_case(kind, name, base, prompts[kind], run))
        if kind == "llama":
            raise_dynamo_limits()  # every side compiles transformers' one forward wrapper
            prefills = [_prefill(base, prompts[kind], length) for length in PREFILL_LENGTHS]
    graphdispatch_backend.reset()
    rows, targets = [], []
    for r in runs:
        later = r["ratios"][1:] if r["case"] != "one cache reused" else r["ratios"][2:]
        rows.append([r["model"], r["case"], len(r["ratios"]), f"{max(later):.2f}", f"{statistics.median(later):.2f}",
                     f"{r['decode']['replays']}/{r['decode']['calls']}", r["decode"]["captures"],
                     r["decode"]["relocations"], f"{r['generates']} {'yes' if r['bitwise'] else 'NO'}"])
    for kind in KINDS:
        case = {r["case"]: r for r in runs if r["model"] == kind}
        new = case["new cache"]
        later = new["ratios"][1:]
        targets += [
            Target(f"scale server {kind}: a new cache per request, {TOKENS} tokens: every request from the 2nd",
                   f"<= {EVERY_MAX}x eager", f"max {max(later):.2f}x (2nd {later[0]:.2f}x)", max(later) <= EVERY_MAX),
            Target(f"scale server {kind}: a new cache per request, {TOKENS} tokens: median from the 2nd",
                   f"<= {MEDIAN_MAX}x eager", f"{statistics.median(later):.2f}x",
                   statistics.median(later) <= MEDIAN_MAX),
            Target(f"scale server {kind}: a new cache per request: decode bytes copied per replay / cache bytes",
                   f"<= {COPY_MAX}", f"{new['copied_per_replay']:.0f} B per replay",
                   new["copied_per_replay"] <= COPY_MAX * _cache_bytes(kind)),
        ]
        if "one cache reused" in case:
            reused = case["one cache reused"]["ratios"][2:]
            targets.append(Target(f"scale server {kind}: one cache reused, median from the 3rd request",
                                  f"<= {REUSED_MAX}x eager", f"{statistics.median(reused):.2f}x",
                                  statistics.median(reused) <= REUSED_MAX))
        if "short requests" in case:
            short = case["short requests"]
            targets.append(Target(
                f"scale server {kind}: {SHORT}-token requests, a new cache each: decode calls after the first "
                "request answered eagerly, but for a call that captured", "0",
                f"{_uncaptured(short)} of {short['after_first']['calls']} "
                f"({short['after_first']['relocations']} relocations)", _uncaptured(short) == 0))
        if "rotation" in case:
            rot = case["rotation"]["after_first"]
            targets.append(Target(
                f"scale server {kind}: a rotation of {ROTATION} caches, after the first round: captures, "
                "eager decode calls", "0, 0", f"{rot['captures']}, {rot['eager']} of {rot['calls']} calls",
                rot["captures"] == 0 and rot["eager"] == 0))
    lowering = [p["ratios"]["graphdispatch, cuda_graphs=False"] for p in prefills]
    targets.append(Target(f"scale server llama: a prefill with a new cache at {PREFILL_LENGTHS[-1]}, graphdispatch "
                          "cuda_graphs=False / eager", f"<= {PREFILL_MAX}x",
                          f"{lowering[-1]:.2f}x (aot_eager {prefills[-1]['ratios']['aot_eager']:.2f}x)",
                          lowering[-1] <= PREFILL_MAX))
    held = prefills[-1]["emulate_pool_bytes"] / prefills[-1]["cache_bytes"]
    targets.append(Target(f"scale server llama: a prefill with a new cache at {PREFILL_LENGTHS[-1]}, emulate: "
                          "pool bytes held / cache bytes (the graph makes the cache: eager, made_buffer)", "0",
                          f"{held:.2f} ({prefills[-1]['split_reasons']})", held == 0))
    bitwise = all(r["bitwise"] for r in runs) and all(p["bitwise"] for p in prefills)
    targets.append(Target("scale server: tokens and logits bitwise equal to eager", "every generate",
                          "yes" if bitwise else "NO", bitwise))
    table = (f"a server's requests at max_cache_len {LENGTH} (ratio: compiled / eager time of the same request, "
             "paired; from the 2nd request, from the 3rd with one cache reused)",
             ["model", "case", "requests", "max ratio", "median", "decode replays", "captures", "relocations",
              "generates bitwise"], rows)
    prefill_table = (f"a prefill with a new cache per call (ratio to eager, A/B interleaved, {PREFILL_REPEATS} "
                     "repeats)", ["max_cache_len", "eager", *PREFILL_SIDES, "writes in place", "emulate pool / cache",
                                  "bitwise"],
                     [[p["length"], f"{p['eager_us'] / 1e3:.2f} ms", *(f"{p['ratios'][n]:.2f}x" for n in PREFILL_SIDES),
                       p["buffer_writes_in_place"], f"{p['emulate_pool_bytes'] / p['cache_bytes']:.2f}",
                       "yes" if p["bitwise"] else "NO"] for p in prefills])
    payload = {"prefill": prefills, "length": LENGTH, "tokens": TOKENS, "short": SHORT, "requests": REQUESTS,
               "rotation": ROTATION, "rounds": ROUNDS, "runs": runs}
    return payload, [table, prefill_table], targets, bitwise


def _uncaptured(case: dict[str, Any]) -> int:
    """Eager decode calls after the first request other than a capture's own (`verifying`)."""
    after = case["after_first"]
    return after["eager"] - after["eager_by_reason"].get("verifying", 0)


def _cache_bytes(kind: str) -> int:
    """The decoder's self-attention cache (keys and values, float32)."""
    if kind == "t5":
        return 2 * T5["num_decoder_layers"] * T5["num_heads"] * LENGTH * T5["d_kv"] * 4
    cfg = MOE if kind == "moe" else LLAMA
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * LENGTH * head_dim * 4
