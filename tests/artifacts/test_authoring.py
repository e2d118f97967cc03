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
from graphdispatch_backend.errors import StrictModeError
from graphdispatch_backend.runtime.gates.demote import ArtifactDemoted
from graphdispatch_backend.testing import MLP_OUTPUTS, MLP_SOURCE, Stack, mlp_inputs, write_bundle


class Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Stack(depth=2, dim=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def exact(root: Path, pattern: str = "*.blocks.*.mlp", artifact_id: str = "mlp", **fields: Any) -> Path:
    """A bundle that serves the dim-8 MLP exactly (batch 2)."""
    return write_bundle(root / artifact_id, artifact_id, pattern, mlp_inputs(2), MLP_OUTPUTS, MLP_SOURCE, **fields)


def run(artifacts: list[Path] | Path, strict: bool = False, calls: int = 2, report_dir: Path | None = None) -> None:
    torch.manual_seed(0)
    model = Outer().eval()
    options: dict[str, Any] = {"artifacts": [str(p) for p in artifacts] if isinstance(artifacts, list)
                               else str(artifacts), "strict": strict}
    if report_dir is not None:
        options["report_dir"] = str(report_dir)
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(2, 8)
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


# (root maker, what the one WARNING line says)
FAILURES = [
    (_missing_root, "missing_root"),
    (_empty_root, "no_bundles"),
    (_tampered_bundle, "hash_mismatch"),
    (_unmatched, "did you mean `*.blocks.*.mlp`: 2 regions"),
    (_signature, "signature: input 2 'input0': dtype bfloat16, region has float32"),
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
