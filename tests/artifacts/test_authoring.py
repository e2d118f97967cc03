"""Every authoring failure is loud: one WARNING line in a default run (once, not per region or
call), an exception under `strict`, and the rendered report says what went wrong.

The model is `Outer`: a two-block Stack held as `model`, so its MLP regions are
`model.blocks.<i>.mlp`, and a manifest written for the inner Stack (`blocks.*.mlp`)
names nothing, the way `layers.*.mlp` names nothing in a LlamaForCausalLM.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import graphdispatch_backend
from graphdispatch_backend.__main__ import main
from graphdispatch_backend.artifacts import registry
from graphdispatch_backend.diagnostics.render import render
from graphdispatch_backend.errors import StrictModeError
from graphdispatch_backend.runtime.gates.demote import ArtifactDemoted
from graphdispatch_backend.testing import MLP_OUTPUTS, MLP_SOURCE, Stack, mlp_inputs, region_entry, write_bundle


class Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Stack(depth=2, dim=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def exact(root: Path, pattern: str = "*.blocks.*.mlp", artifact_id: str = "mlp", batch: int | None = 2,
          **fields: Any) -> Path:
    """A bundle that serves the dim-8 MLP exactly (at `batch`; None: any)."""
    return write_bundle(root / artifact_id, artifact_id, pattern, mlp_inputs(batch), MLP_OUTPUTS, MLP_SOURCE,
                        **fields)


def run(artifacts: list[Path] | Path | None, strict: bool = False, calls: int = 2, report_dir: Path | None = None,
        batches: list[int] | None = None, model: torch.nn.Module | None = None, dynamic: bool | None = None) -> None:
    """`calls` calls at batch 2, or one call per batch of `batches` (a new batch makes Dynamo
    recompile with a symbolic one, unless `dynamic` is False), each output eager's."""
    torch.manual_seed(0)
    model = (model or Outer()).eval()
    options: dict[str, Any] = {"strict": strict}
    if artifacts is not None:
        options["artifacts"] = [str(p) for p in artifacts] if isinstance(artifacts, list) else str(artifacts)
    if report_dir is not None:
        options["report_dir"] = str(report_dir)
    compiled = torch.compile(model, backend="graphdispatch", options=options, dynamic=dynamic)
    with torch.no_grad():
        for batch in batches or [2] * calls:
            x = torch.randn(batch, 8)
            assert torch.equal(compiled(x), model(x))
    graphdispatch_backend.flush()


def warnings(log: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in log.records if r.levelno == logging.WARNING and r.name == "graphdispatch_backend"]


def _missing_root(tmp_path: Path) -> Path:
    return tmp_path / "nope"


def _empty_root(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def _tampered_bundle(tmp_path: Path) -> Path:
    folder = exact(tmp_path / "root")
    (folder / "kernel.py").write_text(MLP_SOURCE.replace("relu", "tanh"))  # edited after hashing, same size
    return tmp_path / "root"


def _unmatched(tmp_path: Path) -> Path:
    exact(tmp_path / "root", pattern="blocks.*.mlp")  # written for the inner Stack
    return tmp_path / "root"


def _signature(tmp_path: Path) -> Path:
    inputs = mlp_inputs(2)
    inputs[2]["dtype"] = "bfloat16"
    write_bundle(tmp_path / "root" / "mlp", "mlp", "*.blocks.*.mlp", inputs, MLP_OUTPUTS, MLP_SOURCE)
    return tmp_path / "root"


def _fingerprint(tmp_path: Path) -> Path:
    exact(tmp_path / "root", fingerprint="0" * 32)  # the trial's `badfp`: a pin no region has
    return tmp_path / "root"


# (root maker, what the one WARNING line says)
FAILURES = [
    (_missing_root, "missing_root"),
    (_empty_root, "no_bundles"),
    (_tampered_bundle, "hash_mismatch"),
    (_unmatched, "did you mean `*.blocks.*.mlp`: 2 regions"),
    (_signature, "signature: input 2 'input0': dtype bfloat16, region has float32"),
    (_fingerprint, f"fingerprint: manifest {'0' * 32}, region "),
]
IDS = [f.__name__.strip("_") for f, _ in FAILURES]


@pytest.mark.parametrize("make, said", FAILURES, ids=IDS)
def test_each_failure_is_one_warning_in_a_default_run(tmp_path, gd_log, make, said):
    run(make(tmp_path), calls=3)
    lines = [w for w in warnings(gd_log) if said in w]
    assert len(lines) == 1, warnings(gd_log)  # two MLP regions, three calls: said once


@pytest.mark.parametrize("make, said", FAILURES, ids=IDS)
def test_each_failure_fails_the_compile_under_strict(tmp_path, make, said):
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        run(make(tmp_path), strict=True)
    assert isinstance(info.value.inner_exception, StrictModeError)
    assert said.split(":")[0] in str(info.value.inner_exception)
    report = graphdispatch_backend.latest_report()
    if make in (_missing_root, _empty_root, _tampered_bundle):  # refused as the session starts: no graph, no report
        assert report is None
        return
    # a graph's compile that raised: its report says so too (a trial's read "no graph fell back
    # on a compile error", the graph clean)
    (graph,) = report["graphs"]
    assert graph["kind"] == "fallback" and said.split(":")[0] in graph["error"], graph
    assert "1 graph raised a compile error (strict)" in render(report)


def test_an_unreadable_root(tmp_path, gd_log, monkeypatch):
    root = exact(tmp_path / "root").parent

    def refuse(path: Path) -> list[Path]:
        raise PermissionError(13, "Permission denied", str(path))

    # the tests run as root, whom chmod does not stop: refuse the listing itself
    monkeypatch.setattr(registry, "discover", refuse)
    run(root)
    assert [w for w in warnings(gd_log) if "unreadable_root" in w and "Permission denied" in w]
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        run(root, strict=True)
    assert "unreadable_root" in str(info.value.inner_exception)


def test_every_demoted_region_is_named_and_strict_raises_naming_it(tmp_path, gd_log):
    """Two regions of one kind demoted for one reason: a WARNING names each (one line for
    the kind named only the first, and a user read it as the only one). Under strict the
    error names the artifact, the region and the call."""
    wrong = MLP_SOURCE.replace("return torch.addmm(b2,", "return 1 + torch.addmm(b2,")
    write_bundle(tmp_path / "root" / "mlp", "mlp", "*.blocks.*.mlp", mlp_inputs(2), MLP_OUTPUTS, wrong)
    run(tmp_path / "root")
    lines = [w for w in warnings(gd_log) if "demoted to native" in w]
    assert len(lines) == 2 and all("(parity)" in line for line in lines), lines
    assert {"blocks.0.mlp", "blocks.1.mlp"} == {n for n in ("blocks.0.mlp", "blocks.1.mlp") for w in lines if n in w}
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    with pytest.raises(ArtifactDemoted) as err:
        run(tmp_path / "root", strict=True)
    assert "artifact mlp" in str(err.value) and "region model.blocks.0.mlp" in str(err.value), err.value
    assert "the region's call 1" in str(err.value) and "bits differ" in str(err.value)


def test_a_serving_artifact_is_silent_and_passes_strict(tmp_path, gd_log):
    run(exact(tmp_path / "root").parent, strict=True)
    assert warnings(gd_log) == []
    report = graphdispatch_backend.latest_report()
    assert report["artifacts"]["mlp"]["status"] == "serving" and report["authoring"] == []


def test_a_pattern_naming_modules_of_a_later_graph_is_not_unmatched_yet(tmp_path, gd_log):
    """A graph break puts the MLPs in the second graph: the first graph's compile must not
    call the artifact unmatched (nor fail under strict), since the model has those modules."""

    class Broken(Outer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * 2
            torch._dynamo.graph_break()
            return self.model(x)

    exact(tmp_path / "root")
    torch.manual_seed(0)
    model = Broken().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path / "root"),
                                                                      "strict": True})
    with torch.no_grad():
        x = torch.randn(2, 8)
        assert torch.equal(compiled(x), model(x))
    report = graphdispatch_backend.latest_report()
    assert len([g for g in report["graphs"] if g["nodes"]]) == 2
    assert report["artifacts"]["mlp"]["status"] == "serving" and warnings(gd_log) == []


def test_the_rendered_report_shows_rejections_by_reason_and_what_was_meant(tmp_path, capsys):
    exact(tmp_path / "root", pattern="blocks.*.mlp", artifact_id="inner")
    sig = exact(tmp_path / "root", artifact_id="wide")
    doc = json.loads((sig / "artifact.json").read_text())
    doc["signature"]["inputs"][2]["shape"] = [4, 8]
    (sig / "artifact.json").write_text(json.dumps(doc))  # the manifest is not among the hashed files
    run(tmp_path / "root", report_dir=tmp_path / "out")
    assert main(["report", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("inner ", "wide "))}
    assert "unmatched" in rows["inner"] and "module=" in rows["inner"]
    assert "rejected" in rows["wide"] and "signature=2" in rows["wide"]
    assert "inner: pattern `blocks.*.mlp` matched no region; did you mean `*.blocks.*.mlp`: 2 regions" in out
    authoring = out.split("Authoring failures", 1)[1].split("\n\n", 1)[0]
    assert "unmatched: artifact inner matched no region" in authoring
    assert "signature: artifact wide does not fit region model.blocks.0.mlp" in authoring


# -- a pinned region.fingerprint ------------------------------------------------------------------


def pin(batch: int = 2) -> str:
    """The fingerprint of Outer's MLP regions compiled at `batch` (a static graph)."""
    torch.manual_seed(0)
    return region_entry(Outer().eval(), torch.randn(batch, 8), name="model.blocks.0.mlp")["fingerprint"]


def fingerprint_warnings(log: pytest.LogCaptureFixture) -> list[str]:
    return [w for w in warnings(log) if "does not fit" in w and ": fingerprint: " in w]


def test_a_pin_that_stops_fitting_after_a_recompile_warns_with_the_fix(tmp_path, gd_log):
    """The trial's `case_null keepfp`: null written in the batch dims as the docs say, the
    scaffold's pin kept. Batch 5 makes Dynamo recompile with a symbolic batch, whose graph
    has another fingerprint (it covers shapes): the artifact served nothing there, without a
    word and under strict too. It is a WARNING naming the pin and the fix, once for the kind,
    counted in `authoring`, and strict fails that compile."""
    fp = pin()
    exact(tmp_path / "root", batch=None, fingerprint=fp)
    run(tmp_path / "root", batches=[2, 5, 3])
    (line,) = fingerprint_warnings(gd_log)
    assert f"fingerprint: manifest {fp}, region " in line and "the signature fits (its null dims included)" in line
    assert "delete region.fingerprint" in line and "once per kind `model.blocks.*.mlp`" in line
    report = graphdispatch_backend.latest_report()
    assert [(a["failure"], a["artifact"]) for a in report["authoring"]] == [("fingerprint", "mlp")]
    assert report["artifacts"]["mlp"]["status"] == "partly_rejected"
    assert [len(g["substitutions"]) for g in report["graphs"] if g["nodes"]] == [2, 0]  # served where it fits
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        run(tmp_path / "root", strict=True, batches=[2, 5])
    assert isinstance(info.value.inner_exception, StrictModeError)
    assert "fingerprint: manifest" in str(info.value.inner_exception)


def test_a_pinned_concrete_batch_on_the_recompile_says_both_fixes(tmp_path, gd_log):
    """The trial's `case_batch2 1122` on a scaffold that pinned the fingerprint: batch 2 pinned
    and written, the recompile with a symbolic batch refused on the pin (checked first) with
    no WARNING, where docs/artifacts.md promises one that says to write null. It says that,
    and that the pin must go too."""
    exact(tmp_path / "root", fingerprint=pin())
    run(tmp_path / "root", batches=[2, 5])
    (line,) = fingerprint_warnings(gd_log)
    assert "the region's sizes are not the ones the manifest was written for (input 2 'input0': shape [2, 8], " \
           "region has [null, 8] (null: a dim Dynamo made dynamic" in line
    assert "write null there to match it" in line and "delete region.fingerprint" in line
    assert graphdispatch_backend.latest_report()["artifacts"]["mlp"]["status"] == "partly_rejected"


def test_a_pin_that_picks_one_static_graph_of_the_same_modules_is_silent(tmp_path, gd_log):
    """What transformers' static-cache decode bundles pin for: the prefill's and the decode
    step's graphs name the same modules at other sizes, and the bundle is the decode's
    (tests/artifacts/test_in_place.py). Here: static graphs at batch 3, then 2; the bundle,
    pinned and written at 2, refuses the first on both pin and signature (another graph,
    not a recompile it claims), serves the second, and strict passes."""
    exact(tmp_path / "root", fingerprint=pin())
    run(tmp_path / "root", strict=True, batches=[3, 2, 2], dynamic=False)
    report = graphdispatch_backend.latest_report()
    assert [len(g["substitutions"]) for g in report["graphs"] if g["nodes"]] == [0, 2]
    assert warnings(gd_log) == [] and report["authoring"] == []


def test_the_documented_null_workflow_serves_a_scaffold_across_the_recompile(tmp_path, gd_log):
    """docs/artifacts.md as written: scaffold, write null in the dims that vary, and "the
    artifact keeps serving across the recompile". The scaffold pinned the fingerprint, which
    no recompile with a symbolic batch has: it pins one now only to pick a kind (--fingerprint)."""
    run(None, report_dir=tmp_path / "report")
    assert main(["artifacts", "scaffold", str(tmp_path / "report"), "--region", "*.blocks.*.mlp",
                 str(tmp_path / "kernels" / "mlp")]) == 0
    path = tmp_path / "kernels" / "mlp" / "artifact.json"
    doc = json.loads(path.read_text())
    assert "fingerprint" not in doc["region"]
    for entry in [doc["signature"]["inputs"][2], *doc["signature"]["outputs"]]:
        entry["shape"][0] = None  # the batch; the manifest is not among the hashed files
    path.write_text(json.dumps(doc))
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    run(tmp_path / "kernels", strict=True, batches=[2, 5, 3])
    report = graphdispatch_backend.latest_report()
    assert [len(g["substitutions"]) for g in report["graphs"] if g["nodes"]] == [2, 2]
    assert report["artifacts"]["mlp"]["status"] == "serving" and warnings(gd_log) == []


class TwoWidths(torch.nn.Module):
    """`*.blocks.*.mlp` names two kinds: the dim-8 MLPs of `model` and the dim-4 one of
    `head` (behind a graph break, in a graph of its own, with `split`)."""

    def __init__(self, split: bool) -> None:
        super().__init__()
        self.model, self.head, self.proj, self.split = Stack(depth=2, dim=8), Stack(depth=1, dim=4), \
            torch.nn.Linear(8, 4), split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.model(x))
        if self.split:
            torch._dynamo.graph_break()
        return self.head(x)


@pytest.mark.parametrize("split", [False, True], ids=["one_graph", "graph_break"])
def test_a_pin_that_picks_one_kind_of_a_wide_pattern_is_silent(tmp_path, gd_log, split):
    """What the docs say a pin is for: a wide pattern over two kinds, the pin keeping one.
    The other kind's fingerprint rejections are the pin doing its job: no WARNING, and
    strict passes, in the same graph or a later one."""
    exact(tmp_path / "root", fingerprint=pin())
    run(tmp_path / "root", strict=True, model=TwoWidths(split))
    report = graphdispatch_backend.latest_report()
    served = {s["region"] for g in report["graphs"] for s in g["substitutions"]}
    assert served == {"model.blocks.0.mlp", "model.blocks.1.mlp"}
    refused = {r["name"]: r["rejections"] for g in report["graphs"] for r in g["regions"]
               if r["name"] == "head.blocks.0.mlp"}
    assert [j["reason"] for j in refused["head.blocks.0.mlp"]] == ["fingerprint"]
    assert warnings(gd_log) == [] and report["authoring"] == []
    assert report["artifacts"]["mlp"]["status"] == "serving"
