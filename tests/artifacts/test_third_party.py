"""A manifest written from the report alone, as a new user would (region name, input order and
names, shapes), matches the intended region of a real third-party model (transformers' GPT-2),
and substitutes in every repeated block it names."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphdispatch_backend
from graphdispatch_backend import testing
from graphdispatch_backend.diagnostics.report_file import expand

transformers = pytest.importorskip("transformers")

LAYERS = 3

# Written by reading `h.0.mlp` in dispatch.json: its inputs (input0, c_fc.bias, c_fc.weight,
# c_proj.bias, c_proj.weight, in that order) and its ops (two addmm on 2-d views, and the
# tanh GELU as mul/add/pow/tanh); the report's one `clone` is eval-mode dropout, a no-op
# for the bits. Doing the same ops in the same order makes it bitwise equal.
KERNEL = '''\
import math

import torch


def forward(x, c_fc_bias, c_fc_weight, c_proj_bias, c_proj_weight):
    lead = x.shape[:-1]
    h = torch.addmm(c_fc_bias, x.view(-1, x.shape[-1]), c_fc_weight).view(*lead, c_fc_weight.shape[1])
    h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
    out = torch.addmm(c_proj_bias, h.view(-1, h.shape[-1]), c_proj_weight)
    return out.view(*lead, c_proj_weight.shape[1])
'''


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=LAYERS, n_embd=32, n_head=4, n_positions=16, vocab_size=64,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2Model(config).eval()  # random weights: nothing is downloaded


def _run(model: torch.nn.Module, options: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
    torch._dynamo.reset()
    graphdispatch_backend.reset()
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    with torch.no_grad():
        out = compiled(input_ids=ids).last_hidden_state
        again = compiled(input_ids=ids).last_hidden_state  # past the gate: the artifact serves
    assert torch.equal(out, again)
    graphdispatch_backend.flush()
    return out


def _report(report_dir: Path) -> dict[str, Any]:
    return expand(json.loads((report_dir / "dispatch.json").read_text()))  # every region whole


def test_manifest_from_the_report_substitutes_every_gpt2_mlp(tmp_path):
    model = _gpt2()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(input_ids=ids).last_hidden_state

    # 1. compile once without artifacts and read the report, as a new user would
    first = tmp_path / "first"
    _run(model, {"report_dir": str(first)}, ids)
    (graph,) = _report(first)["graphs"]
    regions = {r["name"]: r for r in graph["regions"]}
    mlp = regions["h.0.mlp"]
    assert mlp["class"] == "GPT2MLP"
    assert [i["name"] for i in mlp["inputs"]] == ["input0", "c_fc.bias", "c_fc.weight", "c_proj.bias",
                                                  "c_proj.weight"]
    assert mlp["ops"] == {"aten::add.Tensor": 2, "aten::addmm.default": 2, "aten::clone.default": 1,
                          "aten::mul.Tensor": 4, "aten::pow.Tensor_Scalar": 1, "aten::tanh.default": 1,
                          "aten::view.default": 4}
    assert {regions[f"h.{i}.mlp"]["fingerprint"] for i in range(LAYERS)} == {mlp["fingerprint"]}

    # the kernel does exactly the report's ops, bar the no-op clone (checked, not assumed)
    namespace: dict[str, Any] = {}
    exec(compile(KERNEL, "kernel.py", "exec"), namespace)
    examples = [torch.randn(s["shape"]) for s in mlp["inputs"]]
    traced = make_fx(namespace["forward"])(*examples)
    assert {**testing.op_counts(traced), "aten::clone.default": 1} == mlp["ops"]
    assert math.isfinite(float(namespace["forward"](*examples).sum()))

    # 2. the manifest: region pattern over clean names, signature copied from the report
    bundle = testing.write_bundle(tmp_path / "kernels" / "gpt2-mlp", "gpt2-mlp", "h.*.mlp",
                                  source=KERNEL, fingerprint=mlp["fingerprint"], **testing.manifest_from_region(mlp))
    assert json.loads((bundle / "artifact.json").read_text())["signature"]["inputs"][1] == {
        "name": "c_fc.bias", "shape": [128], "dtype": "float32"}

    # 3. recompile with the bundle: every h.<i>.mlp is served by it, bitwise equal to eager
    second = tmp_path / "second"
    out = _run(model, {"artifacts": str(tmp_path / "kernels"), "report_dir": str(second)}, ids)
    assert torch.equal(out, eager)
    report = _report(second)
    assert report["registry"]["errors"] == []
    (graph,) = report["graphs"]
    subs = {s["region"]: s for s in graph["substitutions"]}
    assert set(subs) == {f"h.{i}.mlp" for i in range(LAYERS)}
    for sub in subs.values():
        assert sub["artifact"] == "gpt2-mlp" and sub["parity"] == "passed" and not sub["demoted"]
        assert sub["calls"] >= 1 and sub["native_calls"] == 0
    by_name = {r["name"]: r for r in graph["regions"]}
    assert all(by_name[f"h.{i}.mlp"]["artifact"] == "gpt2-mlp" for i in range(LAYERS))
    # only the named regions: the attention and the blocks around them stay native
    assert not [r["name"] for r in graph["regions"] if r.get("artifact") and not r["name"].endswith(".mlp")]
