"""Artifacts that write in place: a region that writes a cache's row (after passes/reinplace.py)
is served by a kernel declaring it in `signature.mutates`, which must write what the region
writes, where it writes it, and nothing else; a scaffolded transformers static-cache
attention does so as written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import graphdispatch_backend
from graphdispatch_backend.artifacts.scaffold import scaffold
from graphdispatch_backend.runtime.checks.world import World
from graphdispatch_backend.testing import accounted_graphs, manifest_from_region, region_entry, write_bundle

ROWS = 256


class Attn(nn.Module):
    """Writes its key row into a cache buffer, then reads the whole cache."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(ROWS, 8))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        k = self.proj(x)
        self.cache.index_copy_(0, pos, k)
        return self.cache.sum(0, keepdim=True) + k


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.attn(x, pos) * 2


KERNEL = """
import torch.nn.functional as F

NAMES = {names!r}


def forward(*inputs):
    a = dict(zip(NAMES, inputs))
    k = F.linear(a["input0"], a["proj.weight"], a["proj.bias"])
    {write}
    out = a["cache"].sum(0, keepdim=True) + k
    {after}
    return out
"""
RIGHT = 'a["cache"].index_copy_(0, a["input1"], k)'
WRITES = {  # (the write, what it does after computing its output)
    "right": (RIGHT, "pass"),
    "wrong_row": ('a["cache"].index_copy_(0, (a["input1"] + 1) % a["cache"].shape[0], k)', "pass"),
    "extra_row": (RIGHT, 'a["cache"][(a["input1"] + 3) % 256] = 1.0  # a row the region never writes'),
    # from position 25 (the 6th call) on, a past row as well: an off-by-one met only later
    "late_extra_row": (RIGHT, 'a["cache"][0] += (a["input1"] >= 25).float()'),
    "scribble": (RIGHT, 'a["proj.weight"].add_(1.0)'),
    # the same from position 25 on, but before it reads the cache: that call's output is off too
    "late_past_row_read": (RIGHT + '; a["cache"][0] += (a["input1"] >= 25).float()', "pass"),
}


def _make() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def _args(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 8, generator=torch.Generator().manual_seed(i)), torch.tensor([i * 5 % ROWS])


def _bundle(root: Path, write: str = "right", declare: bool = True) -> dict[str, Any]:
    region = region_entry(_make(), *_args(0), name="attn", cuda_graphs=False)
    sig = manifest_from_region(region)
    if not declare:
        sig.pop("mutates")
    names = [i["name"] for i in region["inputs"]]
    write_bundle(root / "attn", "attn-kernel", "attn", sig["inputs"], sig["outputs"],
                 KERNEL.format(names=names, write=WRITES[write][0], after=WRITES[write][1]),
                 **({} if declare else {}))
    if declare:  # write_bundle writes the signature's inputs and outputs: add the writes
        path = root / "attn" / "artifact.json"
        manifest = json.loads(path.read_text())
        manifest["signature"]["mutates"] = sig["mutates"]
        path.write_text(json.dumps(manifest))
    return region


def _serve(root: Path, options: dict[str, Any], calls: int = 10) -> dict[str, Any]:
    """`calls` calls of the compiled model next to eager: outputs, cache and weights bit for bit."""
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    model, ref = _make(), _make()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(root), "warmup": 1,
                                                                      **options})
    with torch.no_grad():
        for i in range(calls):
            x, pos = _args(i)
            assert torch.equal(compiled(x, pos), ref(x, pos)), i
            assert torch.equal(model.attn.cache, ref.attn.cache), i
            assert torch.equal(model.attn.proj.weight, ref.attn.proj.weight), i
    (graph,) = accounted_graphs()
    (sub,) = graph["substitutions"]
    return sub


def test_the_region_reports_what_it_writes(tmp_path):
    region = _bundle(tmp_path)
    assert region["mutates"] == ["cache"]
    assert manifest_from_region(region)["mutates"] == ["cache"]


@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
def test_a_kernel_writing_its_row_in_place_serves(tmp_path, cuda_graphs):
    _bundle(tmp_path)
    sub = _serve(tmp_path, {"cuda_graphs": cuda_graphs})
    assert (sub["parity"], sub["demoted"], sub["mutates"]) == ("passed", False, ["cache"]), sub
    assert sub["calls"] + sub["replays"] >= 8


def test_the_gate_snapshots_the_row_not_the_cache(tmp_path, monkeypatch):
    _bundle(tmp_path)
    sizes: list[int] = []
    take = World.take.__func__
    monkeypatch.setattr(World, "take", classmethod(lambda cls, regions: sizes.append(
        (world := take(cls, regions)).nbytes) or world))
    _serve(tmp_path, {"cuda_graphs": False})
    assert sizes and max(sizes) <= 8 * 4, sizes  # one row of 8 floats


def test_only_the_first_gate_copies_the_cache_its_rechecks_fingerprint_it(tmp_path, monkeypatch):
    """The first call judges the kernel's writes beyond its rows with the cache copied
    (undone if it wrote there) and fingerprinted whole; the re-checks (at the 2nd, 4th, 8th
    and 10th call, and at the calls whose position is new: 3, 5 and 9, a binade above the
    checked ones) copy only the row and fingerprint the cache after each run: two reads of
    it, no memory that grows with it."""
    from graphdispatch_backend.runtime.checks import side_by_side
    from graphdispatch_backend.runtime.gates import beside

    _bundle(tmp_path)
    cache = ROWS * 8 * 4
    runs: list[list[int]] = []  # per side-by-side run: bytes of each whole copy or fingerprint
    run, guards, digest = beside.Beside.run, beside.Beside._guards, beside.digest

    inside = [False]  # in a gate's side-by-side run (the graph's own check fingerprints the cache too)

    def counted_run(self, *args, **kwargs):
        runs.append([])
        inside[0] = True
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] = False

    def counted_guards(self, inputs, declared, whole):
        kept = guards(self, inputs, declared, whole)
        runs[-1].extend(g.copy.numel() * g.copy.element_size() for g in kept[0] + kept[1] if g.copy is not None)
        return kept

    def counted_digest(t):
        if inside[0]:
            runs[-1].append(t.numel() * t.element_size())
        return digest(t)

    monkeypatch.setattr(beside.Beside, "run", counted_run)
    monkeypatch.setattr(beside.Beside, "_guards", counted_guards)
    monkeypatch.setattr(beside, "digest", counted_digest)  # an undeclared input too large to copy
    digests = side_by_side.digests

    def counted_digests(tensors):
        if inside[0]:
            runs[-1].extend(t.numel() * t.element_size() for t in tensors)
        return digests(tensors)

    monkeypatch.setattr(side_by_side, "digests", counted_digests)  # the declared inputs, after each run
    sub = _serve(tmp_path, {"cuda_graphs": False})
    assert (sub["parity"], sub["demoted"], sub["gates"]) == ("passed", False, 1 + 4 + sub["novelty_checks"]), sub
    assert sub["novelty_checks"] >= 2, sub
    assert [run.count(cache) for run in runs] == [3] + [2] * (sub["gates"] - 1), runs  # a copy, native's print, ...


@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
def test_a_kernel_that_writes_a_past_row_only_later_is_caught_at_a_recheck(tmp_path, cuda_graphs):
    """A kernel right at its first calls that also writes a row the region never writes once
    the position passes 25 (call 6): every output is right, and the rows it should write
    are; a re-check that compared only those passed it on every call while the cache it left
    changed every later output. The re-check after it started catches it, says it is not
    undone, and native serves from then on: the gate's on an eager call; replaying, the
    graph's check against eager (the cache fingerprinted whole), whose isolation runs the
    gate beside native."""
    _bundle(tmp_path, "late_extra_row")
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    model = _make()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path),
                                                                      "cuda_graphs": cuda_graphs})
    with torch.no_grad():
        for i in range(24):
            compiled(*_args(i))
    (graph,) = accounted_graphs()
    (sub,) = graph["substitutions"]
    assert (sub["demoted"], sub["reason"]) == (True, "parity"), sub
    assert "beyond the rows the region writes" in sub["detail"], sub
    if cuda_graphs is False:
        assert "not undone: a re-check keeps no whole copy" in sub["detail"], sub
        assert sub["caught_at_call"] is not None and sub["caught_at_call"] >= 6, sub


@pytest.mark.parametrize(("cuda_graphs", "limit"), [(False, None), ("emulate", None), ("emulate", 64)],
                         ids=["eager", "emulate", "emulate-no-copy"])
def test_a_past_row_written_before_the_read_is_blamed_on_the_kernel_not_on_eager(tmp_path, cuda_graphs, limit):
    """The kernel above, writing the past row before it reads the cache: from call 6 on, the
    served output differs too. A check that compared the outputs first, and ran eager again
    from the rows it put back, met a cache the kernel had changed beyond them: eager
    disagreed with itself, the graph was declined as `eager_nondeterministic` (no replay for
    the rest of the process), the artifact stayed `passed` and the check answered with
    eager's second, wrong run (a trial's static-cache Llama, 2026-12-07). Now the cache is
    fingerprinted with eager's rows in place when the rows differ too: the write beyond them
    is found, the kernel demoted, and the checked call answers eager's first run, its values
    bit for bit with eager's: from the cache put back where its copy fits (`limit`: none
    does), else from eager's first run kept whole."""
    _bundle(tmp_path, "late_past_row_read")
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    model, ref = _make(), _make()
    compiled = torch.compile(model, backend="graphdispatch", options={
        "artifacts": str(tmp_path), "cuda_graphs": cuda_graphs,
        **({"max_snapshot_bytes": limit} if limit is not None else {})})
    wrong = []
    with torch.no_grad():
        for i in range(24):
            # eager from the cache as it stands (not undone: what the kernel wrote stays)
            ref.attn.cache.copy_(model.attn.cache)
            want = ref(*_args(i))
            if not torch.equal(compiled(*_args(i)), want):
                wrong.append(i)
    (graph,) = accounted_graphs()
    (sub,) = graph["substitutions"]
    assert (sub["demoted"], sub["reason"]) == (True, "parity"), sub
    assert graph["lowering_check"]["status"] != "eager_nondeterministic", graph["lowering_check"]
    assert sub["calls"] + sub["replays"] + sub["native_calls"] == 24, sub  # every call of the region, once
    caught = sub["caught_at_call"]
    assert caught is not None and caught >= 6, sub
    # every call from the catch on answers eager's values (the calls served unchecked before it may not)
    assert all(i < caught - 1 for i in wrong), (wrong, caught)


def test_an_undeclared_write_is_a_signature_rejection_that_says_what_to_declare(tmp_path):
    _bundle(tmp_path, declare=False)
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(_make(), backend="graphdispatch", options={"artifacts": str(tmp_path)})(*_args(0))
    (graph,) = accounted_graphs()
    (region,) = [r for r in graph["regions"] if r["name"] == "attn"]
    (rejection,) = region["rejections"]
    assert rejection["reason"] == "signature"
    assert "the region writes 'cache' in place (a cache update): declare it in signature.mutates" in rejection["detail"]


@pytest.mark.parametrize(("write", "detail"), [
    ("wrong_row", "the rows it writes in place (cache): values: bits differ"),
    ("extra_row", "it wrote cache beyond the rows the region writes (undone)"),
])
def test_a_kernel_writing_other_rows_is_demoted_and_the_cache_is_native(tmp_path, write, detail):
    _bundle(tmp_path, write)
    sub = _serve(tmp_path, {"cuda_graphs": False})  # every value, the cache's included, as eager's
    assert (sub["demoted"], sub["reason"]) == (True, "parity"), sub
    assert detail in sub["detail"], sub["detail"]


def test_a_cache_too_large_to_copy_is_caught_but_said_not_undone(tmp_path):
    _bundle(tmp_path, "extra_row")
    with pytest.raises(AssertionError):  # the row it wrote beyond its own stays written
        _serve(tmp_path, {"cuda_graphs": False, "max_snapshot_bytes": 64})
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    (sub,) = graph["substitutions"]
    assert (sub["demoted"], sub["reason"]) == (True, "parity") and "not undone" in sub["detail"], sub


@pytest.mark.parametrize(("limit", "undone"), [(None, True), (16, False)])
def test_a_write_into_an_undeclared_input_is_caught(tmp_path, limit, undone):
    _bundle(tmp_path, "scribble")
    options: dict[str, Any] = {"cuda_graphs": False}
    if limit is not None:
        options["max_snapshot_bytes"] = limit  # no copy fits: the write is caught by fingerprint only
    if undone:
        sub = _serve(tmp_path, options)
    else:
        with pytest.raises(AssertionError):  # the weights were not restored: not bitwise any more
            _serve(tmp_path, options)
        (graph,) = graphdispatch_backend.latest_report()["graphs"]
        (sub,) = graph["substitutions"]
    assert (sub["demoted"], sub["reason"]) == (True, "mutated_input"), sub
    assert ("could not be undone" in sub["detail"]) is not undone, sub["detail"]


# -- a transformers static-cache attention, scaffolded as an author would ---------------------

transformers = pytest.importorskip("transformers")


def _llama() -> Any:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                      max_position_embeddings=512, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()  # random weights: nothing downloaded


def _generate(options: dict[str, Any]) -> tuple[Any, Any]:
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    model = _llama()
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=10, do_sample=False, cache_implementation="static", max_cache_len=128,
              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ref = model.generate(prompt, **kw)
        model.forward = torch.compile(model.forward, backend="graphdispatch", options=options, dynamic=False)
        out = model.generate(prompt, **kw)
    graphdispatch_backend.flush()
    assert torch.equal(ref.sequences, out.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.logits, out.logits))
    return out, accounted_graphs()


def test_a_scaffolded_static_cache_attention_writes_the_cache_rows_in_place(tmp_path):
    _, graphs = _generate({"cuda_graphs": "emulate", "report_dir": str(tmp_path / "report")})
    report = json.loads((tmp_path / "report" / "dispatch.json").read_text())
    decode = [r for r in graphs[-1]["regions"] if r["module"] == "model.layers.0.self_attn"][0]
    assert decode["mutates"] == ["input3", "input4", "input5"]  # the counter and both caches
    manifest = scaffold(report, "model.layers.*.self_attn", tmp_path / "kernels" / "attn",
                        fingerprint=decode["fingerprint"])
    assert manifest["signature"]["mutates"] == ["input3", "input4", "input5"]
    kernel = (tmp_path / "kernels" / "attn" / "kernel.py").read_text()
    assert kernel.count("torch.ops.aten.index_copy_.default(") == 2  # the rows, in place
    assert "index_copy.default(" not in kernel  # never the cache copied whole
    _, graphs = _generate({"cuda_graphs": "emulate", "artifacts": str(tmp_path / "kernels")})
    subs = graphs[-1]["substitutions"]
    assert len(subs) == 2 and all(s["parity"] == "passed" and not s["demoted"] for s in subs), subs
    assert all(s["replays"] > 0 and s["mutates"] == ["input3", "input4", "input5"] for s in subs), subs


# -- an undeclared write on a replayed call ---------------------------------------------------

WRITES_ITS_BIAS_WHEN_LARGE = """
import torch
def forward(w1, b1, x, w2, b2):
    y = torch.addmm(b2, torch.relu(torch.addmm(b1, x, w1.t())), w2.t())
    # undeclared, and only for large inputs; through `.data`, as a kernel writing raw memory
    # does, torch counts no write (a counted one is caught at its gate's runs: tests/runtime/test_gate.py)
    b2.data.add_(torch.where(x.abs().amax() > 6.0, 1e-3, 0.0))
    return y
"""


def _replayed_bias_writer(tmp_path: Path, limit: int | None) -> tuple[int, dict[str, Any]]:
    """A Stack whose blocks' MLP kernel adds to its fc2 bias when an input is large, served
    from replays (emulate) and checked on every call; the large input comes at call 9, a
    replay. The outputs that differ from the uncompiled copy's, and the artifact's entry."""
    import copy

    from graphdispatch_backend import testing

    torch.manual_seed(0)
    model = testing.Stack(2).eval()
    reference = copy.deepcopy(model)
    write_bundle(tmp_path / "bias-writer", "bias-writer", "blocks.*.mlp", testing.mlp_inputs(), testing.MLP_OUTPUTS,
                 WRITES_ITS_BIAS_WHEN_LARGE)
    options: dict[str, Any] = {"cuda_graphs": "emulate", "artifacts": str(tmp_path), "artifact_recheck": "every"}
    if limit is not None:
        options["max_snapshot_bytes"] = limit
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    wrong = 0
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).clamp(-3, 3) * (4 if i == 8 else 1)
            wrong += not torch.equal(compiled(x), reference(x))
    (graph,) = accounted_graphs()
    assert graph["cuda_graph"]["replays"] > 0
    return wrong, next(s for s in graph["substitutions"] if s["demoted"])


def test_an_undeclared_write_into_a_weight_on_a_replay_is_caught_and_undone(tmp_path):
    """A replay runs no gate; its check against eager fingerprints the inputs artifacts read
    and do not declare writing, and keeps copies of them (they fit max_snapshot_bytes): the
    bias written on call 9 is put back, eager's values answer that call, and every later
    output is the uncompiled model's (a trial's Wan served 8 wrong calls after it, the
    report bitwise, even with artifact_recheck="every")."""
    wrong, sub = _replayed_bias_writer(tmp_path, None)
    assert wrong == 0
    assert sub["reason"] == "mutated_input" and "caught at call 9" in sub["detail"], sub


def test_an_undeclared_write_too_large_to_copy_is_caught_and_said_not_undone(tmp_path):
    wrong, sub = _replayed_bias_writer(tmp_path, 16)
    assert wrong > 0  # the bias stays written: said, not hidden
    assert sub["reason"] == "mutated_input" and "could not be undone" in sub["detail"], sub
