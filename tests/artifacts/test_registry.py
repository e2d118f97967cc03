"""The artifact registry (docs/design.md sections 2 and 3): discovery one level deep, verification
of every bundle, duplicate ids, the `enable` allowlist and what the report says about it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed

import graphdispatch_backend
from graphdispatch_backend.artifacts.registry import ArtifactLoadError, Registry
from graphdispatch_backend.errors import RegistryError, StrictModeError
from graphdispatch_backend.testing import MLP_SOURCE, Block, mlp_inputs, write_bundle

OUT = [{"shape": [2, 8], "dtype": "float32"}]
SOURCE = "def forward(*args):\n    raise AssertionError('not called in these tests')\n"


def bundle(folder: Path, artifact_id: str, module: str = "m", source: str = SOURCE, **kwargs) -> Path:
    return write_bundle(folder, artifact_id, module, [], OUT, source, **kwargs)


def corrupt(folder: Path) -> Path:
    """Same size, other bytes: only the sha256 tells."""
    data = (folder / "kernel.py").read_bytes()
    (folder / "kernel.py").write_bytes(b"#" + data[1:] if data[:1] != b"#" else b" " + data[1:])
    return folder


def no_contain(thunk):
    try:
        return thunk(), None
    except Exception as exc:
        return None, exc


# -- discovery ------------------------------------------------------------------------------------


def test_root_that_is_itself_a_bundle(tmp_path):
    folder = bundle(tmp_path / "only", "only")
    reg = Registry.load([str(folder)])
    assert list(reg.artifacts) == ["only"] and reg.errors == []
    assert reg.artifacts["only"].bundle.folder == folder


def test_root_of_bundles_is_searched_one_level_deep(tmp_path):
    root = tmp_path / "root"
    bundle(root / "a", "a")
    bundle(root / "b", "b")
    bundle(root / "group" / "deeper", "deeper")  # two levels down: not a bundle of this root
    (root / "empty").mkdir()  # a folder without artifact.json is not a bundle
    (root / "README.txt").write_text("not a bundle")
    reg = Registry.load([str(root)])
    assert sorted(reg.artifacts) == ["a", "b"] and reg.verified_ids == ("a", "b")
    assert reg.errors == []


def test_a_root_that_is_a_bundle_hides_nothing_and_its_children_are_not_bundles(tmp_path):
    root = bundle(tmp_path / "root", "top")
    bundle(tmp_path / "elsewhere", "child")
    reg = Registry.load([str(root)])
    assert list(reg.artifacts) == ["top"]


def test_several_roots(tmp_path):
    bundle(tmp_path / "r1" / "a", "a")
    bundle(tmp_path / "r2", "b")
    reg = Registry.load([str(tmp_path / "r1"), str(tmp_path / "r2")])
    assert sorted(reg.artifacts) == ["a", "b"]
    assert reg.roots == (str(tmp_path / "r1"), str(tmp_path / "r2"))


def test_a_bad_bundle_is_reported_and_never_hides_the_good_ones(tmp_path):
    root = tmp_path / "root"
    bundle(root / "a", "a")
    bad = corrupt(bundle(root / "b", "b"))
    bundle(root / "c", "c")
    (root / "d").mkdir()
    (root / "d" / "artifact.json").write_text("[]")
    reg = Registry.load([str(root)])
    assert sorted(reg.artifacts) == ["a", "c"]
    assert [(e["bundle"], e["reason"]) for e in reg.errors] == [(str(bad), "hash_mismatch"),
                                                                 (str(root / "d"), "manifest")]
    assert all(e["message"] for e in reg.errors)


def test_missing_root_is_recorded_and_other_roots_still_load(tmp_path):
    bundle(tmp_path / "good" / "a", "a")
    (tmp_path / "file").write_text("a file, not a folder")
    missing, a_file = str(tmp_path / "nope"), str(tmp_path / "file")
    reg = Registry.load([missing, str(tmp_path / "good"), a_file])
    assert list(reg.artifacts) == ["a"]
    assert [(e["bundle"], e["reason"]) for e in reg.errors] == [(missing, "missing_root"), (a_file, "missing_root")]
    assert "nope" in reg.errors[0]["message"]


def test_a_missing_root_names_the_closest_existing_folders(tmp_path):
    bundle(tmp_path / "my_kernels" / "a", "a")
    (tmp_path / "other").mkdir()
    reg = Registry.load([str(tmp_path / "my_kernel"), str(tmp_path / "my_kernel" / "a"),
                         str(tmp_path / "nothing_like" / "x")])
    messages = [e["message"] for e in reg.errors]
    assert f"does not exist (did you mean '{tmp_path / 'my_kernels'}'?)" in messages[0], messages
    assert f"(did you mean '{tmp_path / 'my_kernels' / 'a'}'?)" in messages[1], messages  # the path's rest kept
    assert messages[2].endswith("does not exist"), messages


def test_a_root_one_level_too_high_names_the_folders_to_give(tmp_path):
    bundle(tmp_path / "kernels" / "team" / "a", "a")
    reg = Registry.load([str(tmp_path / "kernels")])
    (error,) = reg.errors
    assert error["reason"] == "no_bundles"
    assert f"bundles are two levels down: give {tmp_path / 'kernels' / 'team'}" in error["message"]


@pytest.mark.parametrize("spelling", ["{root}/", "{root}", "{root}/../root", "{link}"])
def test_a_root_given_twice_is_read_once(tmp_path, spelling):
    """A trial: `[root, root + "/"]` made every bundle a duplicate of itself ("provided by
    X and X; neither is used"). Roots are one folder by their real path."""
    root = tmp_path / "root"
    bundle(root / "a", "a")
    (tmp_path / "link").symlink_to(root, target_is_directory=True)
    reg = Registry.load([str(root), spelling.format(root=root, link=tmp_path / "link")])
    assert list(reg.artifacts) == ["a"] and reg.errors == []


def test_a_bundle_that_is_also_a_root_is_read_once(tmp_path):
    root = tmp_path / "root"
    folder = bundle(root / "a", "a")
    for roots in ([root, folder], [folder, root]):
        reg = Registry.load([str(r) for r in roots])
        assert list(reg.artifacts) == ["a"] and reg.errors == [], roots


def test_a_missing_root_given_twice_is_one_error(tmp_path):
    reg = Registry.load([str(tmp_path / "nope"), str(tmp_path / "nope") + "/"])
    assert [e["reason"] for e in reg.errors] == ["missing_root"]


# -- duplicate ids --------------------------------------------------------------------------------


def test_duplicate_ids_are_an_error_naming_both_folders_and_neither_is_used(tmp_path):
    root = tmp_path / "root"
    one, two = bundle(root / "one", "dup"), bundle(root / "two", "dup")
    bundle(root / "other", "other")
    reg = Registry.load([str(root)])
    assert list(reg.artifacts) == ["other"] and reg.verified_ids == ("other",)
    (error,) = reg.errors
    assert error["reason"] == "duplicate_id"
    assert str(one) in error["message"] and str(two) in error["message"] and "'dup'" in error["message"]
    assert str(one) in error["bundle"] and str(two) in error["bundle"]


def test_duplicate_ids_across_roots(tmp_path):
    bundle(tmp_path / "r1", "dup")
    bundle(tmp_path / "r2" / "x", "dup")
    reg = Registry.load([str(tmp_path / "r1"), str(tmp_path / "r2")])
    assert reg.artifacts == {} and [e["reason"] for e in reg.errors] == ["duplicate_id"]


def test_a_root_given_twice_keeps_two_folders_with_one_id_a_duplicate(tmp_path):
    root = tmp_path / "root"
    bundle(root / "one", "dup")
    bundle(root / "two", "dup")
    reg = Registry.load([str(root), str(root) + "/"])
    (error,) = reg.errors
    assert error["reason"] == "duplicate_id" and error["bundle"] == f"{root / 'one'} and {root / 'two'}"


# -- what this process runs: the torch range, the devices ------------------------------------------


def this_minor() -> str:
    return ".".join(str(torch.__version__).split(".")[:2])


def test_a_torch_range_that_excludes_the_running_torch_rejects_the_bundle_saying_both(tmp_path):
    """A trial: such a bundle was dropped region by region and said nowhere but the
    report's counts: no WARNING, nothing under strict, `artifacts verify` ok."""
    bundle(tmp_path / "root" / "old", "old", torch={"max_exclusive": this_minor()})
    bundle(tmp_path / "root" / "ok", "ok", torch={"min": this_minor()})
    reg = Registry.load([str(tmp_path / "root")])
    assert list(reg.artifacts) == ["ok"]
    (error,) = reg.errors
    assert (error["bundle"], error["reason"]) == (str(tmp_path / "root" / "old"), "torch_version")
    assert error["message"].startswith(f"the manifest's torch range (< {this_minor()}) excludes torch "
                                       f"{torch.__version__}, which runs here")


@pytest.mark.parametrize("version, miss", [("2.13.0+cpu", None), ("2.12.9", ">= 2.13, < 2.14"),
                                           ("2.14.0", ">= 2.13, < 2.14"), ("2.14.0a0+git1", ">= 2.13, < 2.14")])
def test_the_torch_range_is_judged_against_the_version_given(tmp_path, version, miss):
    folder = bundle(tmp_path / "a", "a", torch={"min": "2.13", "max_exclusive": "2.14"})
    reg = Registry.load([str(folder)], torch_version=version)
    if miss is None:
        assert list(reg.artifacts) == ["a"] and reg.errors == []
    else:
        assert reg.artifacts == {} and f"torch range ({miss}) excludes torch {version}" in reg.errors[0]["message"]


def test_one_folder_per_torch_version_for_one_id_serves_the_one_in_range(tmp_path):
    root = tmp_path / "root"
    bundle(root / "k-2.12", "k", torch={"min": "2.12", "max_exclusive": "2.13"})
    bundle(root / "k-2.13", "k", torch={"min": "2.13", "max_exclusive": "2.14"})
    reg = Registry.load([str(root)], torch_version="2.13.1")
    assert reg.artifacts["k"].bundle.folder == root / "k-2.13"
    assert [(e["bundle"], e["reason"]) for e in reg.errors] == [(str(root / "k-2.12"), "torch_version")]


def test_enable_naming_a_bundle_out_of_the_torch_range_is_its_rejection(tmp_path):
    bundle(tmp_path / "root" / "a", "a", torch={"min": "2.14"})
    reg = Registry.load([str(tmp_path / "root")], enable=["a"], torch_version="2.13.0")
    (error,) = reg.errors
    assert error["reason"] == "torch_version"
    assert error["message"].endswith("; enable names 'a': the run goes on without it")


def test_no_torch_installed_judges_no_torch_range(monkeypatch, tmp_path):
    """`artifacts verify` reads the installed torch's version without importing it; where
    there is none, no range is judged (the range only says which torch to run)."""
    import importlib.metadata

    from graphdispatch_backend.artifacts import registry

    def absent(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    with monkeypatch.context() as patch:  # torch put back before anything could import it again
        patch.delitem(registry.sys.modules, "torch")
        assert registry.running_torch_version() == importlib.metadata.version("torch")
        patch.setattr(importlib.metadata, "version", absent)
        assert registry.running_torch_version() is None
    monkeypatch.setattr(registry, "running_torch_version", lambda: None)
    folder = bundle(tmp_path / "a", "a", torch={"min": "99.0"})
    assert list(Registry.load([str(folder)]).artifacts) == ["a"]


def test_a_bundle_for_devices_this_machine_lacks_is_said_at_info_and_not_rejected(tmp_path, gd_log):
    cuda_only = bundle(tmp_path / "root" / "gpu", "gpu", devices=["cuda"])
    bundle(tmp_path / "root" / "any", "any")
    reg = Registry.load([str(tmp_path / "root")], devices=["cpu"])
    assert sorted(reg.artifacts) == ["any", "gpu"] and reg.errors == []
    said = [(r.levelname, r.getMessage()) for r in gd_log.records]
    assert said == [("INFO", f"graphdispatch: artifacts: gpu ({cuda_only}): devices ['cuda'], this machine has "
                              "cpu only: it serves no region here")], said
    gd_log.clear()
    Registry.load([str(tmp_path / "root")], devices=["cpu", "cuda"])
    assert gd_log.records == []


# -- enable -----------------------------------------------------------------------------------------


@pytest.fixture
def three(tmp_path) -> Path:
    root = tmp_path / "root"
    bundle(root / "a", "a")
    bundle(root / "b", "b")
    corrupt(bundle(root / "bad", "bad"))
    return root


def test_enable_narrows_the_selection_but_every_bundle_is_verified(three):
    reg = Registry.load([str(three)], enable=["a"])
    assert list(reg.artifacts) == ["a"] and list(reg.excluded) == ["b"]
    assert reg.verified_ids == ("a", "b")
    assert [e["reason"] for e in reg.errors] == ["hash_mismatch"]  # not enabled, still verified and reported
    summary = reg.summary()
    assert summary["enabled_filter"] == ["a"] and summary["excluded_ids"] == ["b"] and summary["loaded"] == ["a"]


def test_empty_enable_admits_nothing(three):
    reg = Registry.load([str(three)], enable=[])
    assert reg.artifacts == {} and sorted(reg.excluded) == ["a", "b"]
    assert reg.summary()["enabled_filter"] == []


def test_no_enable_admits_every_verified_bundle(three):
    summary = Registry.load([str(three)]).summary()
    assert summary["enabled_filter"] is None and summary["excluded_ids"] == [] and summary["loaded"] == ["a", "b"]


def test_enable_naming_an_unknown_id_is_an_error_naming_it_and_the_available_ones(three):
    with pytest.raises(RegistryError) as info:
        Registry.load([str(three)], enable=["a", "nope"])
    message = str(info.value)
    assert "'nope'" in message and "available: a, b" in message and "rejected: bad (hash_mismatch)" in message


def test_enable_naming_a_rejected_bundle_is_its_rejection_and_the_run_goes_on(three):
    """`bad` exists and fails its sha256 check: enable naming it used to raise "no verified
    bundle provides" (every call of the model, and the hash_mismatch said nowhere). It is the
    bundle's rejection, with its fix, and the run goes on without it (the session warns it,
    and raises it under strict, as every rejected bundle)."""
    reg = Registry.load([str(three)], enable=["a", "bad"])
    assert list(reg.artifacts) == ["a"] and list(reg.excluded) == ["b"]
    (error,) = reg.errors
    assert error["reason"] == "hash_mismatch" and "artifacts hash" in error["message"]
    assert error["message"].endswith("; enable names 'bad': the run goes on without it")


def test_enable_naming_a_rejected_bundle_s_id_mistyped_suggests_it(three):
    with pytest.raises(RegistryError) as info:
        Registry.load([str(three)], enable=["bda"])
    assert "(did you mean 'bad'?)" in str(info.value) and "rejected: bad (hash_mismatch)" in str(info.value)


def test_enable_naming_a_mistyped_id_gets_did_you_mean(three):
    with pytest.raises(RegistryError) as info:
        Registry.load([str(three)], enable=["aa"])
    assert "enable names 'aa' (did you mean 'a'?)" in str(info.value)


def test_enable_naming_a_duplicated_id_says_why(tmp_path):
    bundle(tmp_path / "root" / "one", "dup")
    bundle(tmp_path / "root" / "two", "dup")
    with pytest.raises(RegistryError, match=r"'dup'.*available: none.*more than one folder"):
        Registry.load([str(tmp_path / "root")], enable=["dup"])


def test_summary_keys(three):
    summary = Registry.load([str(three)], enable=["b"]).summary()
    assert set(summary) == {"roots", "loaded", "verified", "enabled_filter", "excluded_ids", "errors", "patterns"}
    assert summary["roots"] == [str(three)] and summary["verified"] == ["a", "b"]
    # what each verified artifact asks for, enabled or not, so a report can explain a miss
    assert set(summary["patterns"]) == {"a", "b"}
    assert summary["errors"][0]["reason"] == "hash_mismatch"


# -- lazy, once-only loading --------------------------------------------------------------------------


COUNTING = """
import pathlib
path = pathlib.Path({marker!r})
path.write_text(path.read_text() + "x" if path.exists() else "x")
def forward():
    return 1
"""


def test_entry_code_runs_lazily_and_once(tmp_path):
    marker = tmp_path / "marker"
    bundle(tmp_path / "c", "c", source=COUNTING.format(marker=str(marker)))
    reg = Registry.load([str(tmp_path / "c")])
    assert not marker.exists()  # verification executes nothing
    artifact = reg.artifacts["c"]
    fn = artifact.load(no_contain)
    assert artifact.load(no_contain) is fn and fn() == 1
    assert marker.read_text() == "x"


def test_a_load_failure_is_kept_and_the_code_not_run_again(tmp_path):
    marker = tmp_path / "marker"
    source = COUNTING.format(marker=str(marker)) + "raise ImportError('no triton here')\n"
    artifact = Registry.load([str(bundle(tmp_path / "c", "c", source=source))]).artifacts["c"]
    for _ in range(2):
        with pytest.raises(ArtifactLoadError, match="ImportError: no triton here"):
            artifact.load(no_contain)
    assert marker.read_text() == "x"


# -- through torch.compile -------------------------------------------------------------------------


MLP_INPUTS = mlp_inputs(batch=2)  # the batch pinned, as in OUT


@pytest.mark.parametrize("enable", [["fc1-only"], "fc1-only"])  # a list, or a comma-separated string
def test_not_enabled_rejection_is_reported_for_a_region_an_excluded_artifact_would_match(tmp_path, enable):
    root = tmp_path / "root"
    write_bundle(root / "mlp", "mlp", "mlp", MLP_INPUTS, OUT, MLP_SOURCE)
    write_bundle(root / "fc1", "fc1-only", "no.such.module", [], OUT, SOURCE)
    model, x = Block().eval(), torch.randn(2, 8)
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(root), "enable": enable})
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
    report = graphdispatch_backend.latest_report()
    assert report["registry"]["enabled_filter"] == ["fc1-only"]
    assert report["registry"]["excluded_ids"] == ["mlp"] and report["registry"]["loaded"] == ["fc1-only"]
    (graph,) = report["graphs"]
    assert graph["substitutions"] == []
    regions = {r["name"]: r for r in graph["regions"]}
    assert regions["mlp"]["rejections"] == [
        {"artifact": "mlp", "reason": "not_enabled", "detail": "not in the enable allowlist"}]
    assert regions["mlp.fc1"]["rejections"] == []  # the excluded pattern does not match it: no noise


def test_same_model_substitutes_when_enabled(tmp_path):
    """The control for the test above: enabled, the same bundle serves the region."""
    write_bundle(tmp_path / "mlp", "mlp", "mlp", MLP_INPUTS, OUT, MLP_SOURCE)
    model, x = Block().eval(), torch.randn(2, 8)
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path), "enable": "mlp"})
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    assert [(s["region"], s["artifact"], s["parity"]) for s in graph["substitutions"]] == [("mlp", "mlp", "passed")]


def test_enable_naming_an_unknown_id_fails_the_compile_with_a_registry_error(tmp_path):
    bundle(tmp_path / "a", "a")
    model = nn.Linear(4, 4)
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path), "enable": "a,zzz"})(
            torch.randn(2, 4))
    inner = info.value.inner_exception
    assert isinstance(inner, RegistryError) and "'zzz'" in str(inner) and "available: a" in str(inner)


def test_enable_naming_a_tampered_bundle_warns_its_fix_and_the_run_goes_on(tmp_path, gd_log):
    """The trial's `enable_tampered`: kernel.py edited after `artifacts hash`, the bundle named
    by `enable`. Every call used to raise RegistryError ("available: none"), no report was
    written and the hash_mismatch was said nowhere. Now the run serves eager's output, the
    WARNING names the mismatch and `artifacts hash`, and `strict` raises it."""
    folder = write_bundle(tmp_path / "root" / "mlp", "mlp", "mlp", MLP_INPUTS, OUT, MLP_SOURCE)
    (folder / "kernel.py").write_text(MLP_SOURCE + "# tuned\n")
    options = {"artifacts": str(tmp_path / "root"), "enable": "mlp", "report_dir": str(tmp_path / "out")}
    model, x = Block().eval(), torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(torch.compile(model, backend="graphdispatch", options=options)(x), model(x))
    graphdispatch_backend.flush()
    said = [r.getMessage() for r in gd_log.records if r.levelname == "WARNING"]
    assert [w for w in said if "(size_mismatch)" in w and "artifacts hash" in w and "enable names 'mlp'" in w], said
    report = graphdispatch_backend.load_report(tmp_path / "out")
    assert report["registry"]["loaded"] == [] and report["graphs"][0]["substitutions"] == []
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(model, backend="graphdispatch", options={**options, "strict": True})(x)
    assert "size_mismatch" in str(info.value.inner_exception)


def test_a_torch_range_that_excludes_the_running_torch_warns_and_strict_raises(tmp_path, gd_log):
    """The trial's `torch_range_excludes_this_torch`: a WARNING with the range and the
    version, the report's registry errors (its authoring failures), StrictModeError under strict."""
    write_bundle(tmp_path / "root" / "mlp", "mlp", "mlp", MLP_INPUTS, OUT, MLP_SOURCE,
                 torch={"max_exclusive": this_minor()})
    options = {"artifacts": str(tmp_path / "root"), "cuda_graphs": False}
    model, x = Block().eval(), torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(torch.compile(model, backend="graphdispatch", options=options)(x), model(x))
    said = [r.getMessage() for r in gd_log.records if r.levelname == "WARNING"]
    assert [w for w in said if "rejected (torch_version)" in w and f"excludes torch {torch.__version__}" in w], said
    report = graphdispatch_backend.latest_report()
    assert [e["reason"] for e in report["registry"]["errors"]] == ["torch_version"]
    assert report["graphs"][0]["substitutions"] == []
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(model, backend="graphdispatch", options={**options, "strict": True})(x)
    assert isinstance(info.value.inner_exception, StrictModeError)
    assert "(torch_version)" in str(info.value.inner_exception)


def test_a_cuda_only_bundle_on_a_cpu_machine_is_no_authoring_failure(tmp_path, gd_log, monkeypatch):
    """The trial's `devices_cuda_only_on_cpu`: one bundle set shipped to CPU and GPU hosts is
    no author's mistake (registry.Registry._note_idle): an INFO line at load, the region's
    `device` rejection in the report, no WARNING, nothing raised under strict."""
    from graphdispatch_backend.artifacts import registry

    monkeypatch.setattr(registry, "machine_devices", lambda: ("cpu",))
    write_bundle(tmp_path / "root" / "mlp", "mlp", "mlp", MLP_INPUTS, OUT, MLP_SOURCE, devices=["cuda"])
    options = {"artifacts": str(tmp_path / "root"), "cuda_graphs": False, "strict": True}
    model, x = Block().eval(), torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(torch.compile(model, backend="graphdispatch", options=options)(x), model(x))
    assert [r.getMessage() for r in gd_log.records if r.levelname == "WARNING"] == []
    assert [r.getMessage() for r in gd_log.records if "it serves no region here" in r.getMessage()] == [
        f"graphdispatch: artifacts: mlp ({tmp_path / 'root' / 'mlp'}): devices ['cuda'], this machine has cpu only: "
        "it serves no region here"]
    report = graphdispatch_backend.latest_report()
    assert report["registry"]["errors"] == [] and report["authoring"] == []
    (region,) = [r for r in report["graphs"][0]["regions"] if r["name"] == "mlp"]
    assert region["rejections"] == [{"artifact": "mlp", "reason": "device",
                                     "detail": "region on cpu, artifact supports ['cuda']"}]
