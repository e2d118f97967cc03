"""Options.resolve: the options contract of DESIGN section 2 (keys, values, environment, mode, identity)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

import graphdispatch_backend
from graphdispatch_backend import Options, OptionsError

VALID_KEYS = (
    "artifacts", "enable", "cuda_graphs", "warmup", "max_captures", "verify_inputs",
    "speed_gate", "timing", "report_dir", "export_regions", "strict", "recheck", "artifact_recheck",
    "max_snapshot_bytes", "fuse", "cache_dir",
)


@pytest.fixture(autouse=True)
def _no_graphdispatch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # A GRAPHDISPATCH_* variable in the developer's shell would change every default below.
    for name in list(os.environ):
        if name.startswith("GRAPHDISPATCH_"):
            monkeypatch.delenv(name)


def _linear() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4).eval(), torch.randn(2, 4)


# -- keys ---------------------------------------------------------------------------

def test_the_valid_keys_are_the_documented_ones():
    assert set(Options.names()) == set(VALID_KEYS)


def test_defaults():
    o = Options.resolve(environ={})
    assert o.to_dict() == {
        "artifacts": [], "enable": None, "cuda_graphs": "auto", "warmup": 1, "max_captures": 8,
        "verify_inputs": 2, "speed_gate": False, "timing": "off", "report_dir": None,
        "export_regions": False, "strict": False, "recheck": "doubling", "artifact_recheck": "dense",
        "max_snapshot_bytes": 256 * 2**20,
        "fuse": False, "cache_dir": None, "inductor": {},
    }


def test_unknown_key_names_it_and_every_valid_key():
    with pytest.raises(ValueError) as info:
        Options.resolve({"warmup": 2, "no_such_key": 1}, environ={})
    assert isinstance(info.value, OptionsError)
    message = str(info.value)
    assert "no_such_key" in message
    assert all(key in message for key in VALID_KEYS), message


@pytest.mark.parametrize(("typed", "meant"), [("cuda_graph", "cuda_graphs"), ("Cuda_Graphs", "cuda_graphs"),
                                              ("recheks", "recheck"), ("artifact", "artifacts"),
                                              ("report-dir", "report_dir")])
def test_a_mistyped_key_gets_did_you_mean(typed, meant):
    with pytest.raises(OptionsError) as info:
        Options.resolve({typed: 1}, environ={})
    assert f"unknown option {typed!r} (did you mean {meant!r}?)" in str(info.value)


def test_a_key_like_none_gets_no_suggestion():
    with pytest.raises(OptionsError) as info:
        Options.resolve({"zzzz": 1}, environ={})
    assert "did you mean" not in str(info.value) and "valid keys" in str(info.value)


# -- values -------------------------------------------------------------------------

# (key, bad value, a fragment of the message that says what is allowed)
BAD_VALUES = [
    ("artifacts", 5, "a path or a list of paths"),
    ("artifacts", [""], "a path or a list of paths"),
    ("artifacts", ["ok", 3], "a path or a list of paths"),
    ("enable", 5, "list of artifact ids or a comma-separated string"),
    ("enable", ["a", 1], "list of artifact ids or a comma-separated string"),
    ("cuda_graphs", "sometimes", "'emulate'"),
    ("cuda_graphs", 1, "'auto'"),
    ("cuda_graphs", None, "'auto'"),
    ("warmup", 0, "integer >= 1"),
    ("warmup", -1, "integer >= 1"),
    ("warmup", 1.5, "integer >= 1"),
    ("warmup", True, "integer >= 1"),
    ("warmup", "3", "integer >= 1"),
    ("max_captures", 0, "integer >= 1"),
    ("max_captures", "8", "integer >= 1"),
    ("max_snapshot_bytes", -1, "integer >= 0"),
    ("max_snapshot_bytes", 1.5, "integer >= 0"),
    ("verify_inputs", 0, "integer >= 1"),
    ("verify_inputs", None, "integer >= 1"),
    ("speed_gate", 1, "True or False"),
    ("speed_gate", "yes", "True or False"),
    ("timing", "fast", "'shadow'"),
    ("timing", True, "'host'"),
    ("report_dir", 5, "a path"),
    ("report_dir", "", "a path"),
    ("export_regions", "true", "True or False"),
    ("strict", None, "True or False"),
    ("recheck", 0, "an integer N from 1 to 1024"),
    ("recheck", -1, "an integer N from 1 to 1024"),
    ("recheck", True, "an integer N from 1 to 1024"),
    ("recheck", 2.5, "an integer N from 1 to 1024"),
    ("recheck", 10**30, "an integer N from 1 to 1024"),
    ("recheck", "sometimes", "'doubling'"),
    ("artifact_recheck", 0, "an integer N from 1 to 1024"),
    ("artifact_recheck", False, "an integer N from 1 to 1024"),
    ("artifact_recheck", 1025, "an integer N from 1 to 1024"),
    ("artifact_recheck", "often", "'dense'"),
    ("artifact_recheck", "doubling|dense", "'every'"),  # a union is the graph's own, never an option
    ("fuse", "yes", "True, False or a tolerance"),
    ("fuse", 1, "True, False or a tolerance"),
    ("fuse", {"rtol": 1e-3}, "(both keys)"),
    ("fuse", {"rtol": 1e-3, "atol": -1}, "atol must be a finite number >= 0"),
    ("fuse", {"rtol": float("inf"), "atol": 0}, "rtol must be a finite number >= 0"),
    ("fuse", {"rtol": 1, "atol": 0, "mode": "allclose"}, "(both keys)"),
    ("fuse", {"rtol": 1e-3, "atol": 1e-5, "rtl": 1}, "unknown key 'rtl' (did you mean 'rtol'?)"),
    ("fuse", {"rtl": 1e-3, "atol": 1e-5}, "unknown key 'rtl' (did you mean 'rtol'?)"),
    ("fuse", {"rtol": 1e-3}, "'atol' missing"),
    ("cache_dir", "", "a path"),
    ("cache_dir", True, "False (nothing kept on disk)"),
    ("cache_dir", 3, "None (the user's cache directory)"),
]


@pytest.mark.parametrize(("key", "value", "allowed"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES])
def test_bad_value_names_the_key_and_what_is_allowed(key, value, allowed):
    with pytest.raises(OptionsError) as info:
        Options.resolve({key: value}, environ={})
    message = str(info.value)
    assert repr(key) in message, message
    assert allowed in message, message


@pytest.mark.parametrize("key", ["recheck", "artifact_recheck"])
@pytest.mark.parametrize("value", ["doubling", "dense", "every", 1, 64])
def test_recheck_accepts_its_values(key, value):
    assert getattr(Options.resolve({key: value}, environ={}), key) == value
    assert getattr(Options.resolve(environ={f"GRAPHDISPATCH_{key.upper()}": str(value)}), key) == value


def test_artifact_recheck_is_its_own_schedule_denser_than_the_lowerings():
    o = Options.resolve({"recheck": 1024}, environ={})
    assert (o.recheck, o.artifact_recheck) == (1024, "dense")  # one does not set the other
    with pytest.raises(OptionsError, match="GRAPHDISPATCH_ARTIFACT_RECHECK='sometimes'"):
        Options.resolve(environ={"GRAPHDISPATCH_ARTIFACT_RECHECK": "sometimes"})


@pytest.mark.parametrize("key", ["recheck", "artifact_recheck"])
@pytest.mark.parametrize("value", [1025, 10**9, 10**30, 0, -1, "never", "off", None])
def test_recheck_never_turns_the_checks_off(key, value):
    """docs/guarantees.md: the checks never stop. An integer N is the first call, then every
    Nth, up to the interval "doubling" settles at (1024); 10**30 was taken and meant no
    second check ever. A value asking for the checks off is told why not and the fewest."""
    with pytest.raises(OptionsError) as info:
        Options.resolve({key: value}, environ={})
    message = str(info.value)
    assert "an integer N from 1 to 1024" in message and "never stop" in message, message
    assert f"{key}=1024 for the fewest" in message and "did you mean" not in message, message  # not 'every'
    if isinstance(value, int):
        with pytest.raises(OptionsError, match=f"GRAPHDISPATCH_{key.upper()}='{value}'"):
            Options.resolve(environ={f"GRAPHDISPATCH_{key.upper()}": str(value)})
    assert getattr(Options.resolve({key: 1024}, environ={}), key) == 1024


def test_the_recheck_bound_is_the_interval_doubling_settles_at():
    """RECHECK_MAX is schedule.py's CAP (options.py imports no torch, so it is written twice):
    an integer schedule is never sparser than the default's steady state."""
    from graphdispatch_backend.options import RECHECK_MAX, is_recheck_mode
    from graphdispatch_backend.runtime.checks.schedule import CAP

    assert RECHECK_MAX == CAP
    assert is_recheck_mode(CAP) and not is_recheck_mode(CAP + 1) and not is_recheck_mode(True)


# every string choice, with another case and with a near miss: (key, written, kept, meant)
CHOICES = [
    ("cuda_graphs", "EMULATE", "emulate", "emulate"),
    ("cuda_graphs", "Auto", "auto", "auto"),
    ("recheck", "EVERY", "every", "every"),
    ("recheck", "Doubling", "doubling", "doubling"),
    ("artifact_recheck", "DENSE", "dense", "dense"),
    ("timing", "Shadow", "shadow", "shadow"),
    ("timing", "HOST", "host", "host"),
]


@pytest.mark.parametrize(("key", "written", "kept", "meant"), CHOICES, ids=[f"{k}={w}" for k, w, _, _ in CHOICES])
def test_string_choices_are_matched_ignoring_case_everywhere(key, written, kept, meant):
    """One rule for every string choice (README "Options"): case ignored, kept lowercase, so
    a spelling is one compile identity; cuda_graphs took "EMULATE" while recheck refused
    "EVERY". A near miss names the choice meant, in any case."""
    resolved = Options.resolve({key: written}, environ={})
    assert getattr(resolved, key) == kept
    assert resolved == Options.resolve({key: kept}, environ={})
    assert getattr(Options.resolve(environ={f"GRAPHDISPATCH_{key.upper()}": written}), key) == kept
    typo = written[:-1] + written[-1] * 2 + "x"  # "EMULATEEx": near, not equal
    with pytest.raises(OptionsError) as info:
        Options.resolve({key: typo}, environ={})
    assert f"got {typo!r} (did you mean {meant!r}?)" in str(info.value), str(info.value)


def test_mode_follows_the_same_rule():
    assert Options.resolve(mode="Max-Autotune", environ={}) == Options.resolve(mode="max-autotune", environ={})
    with pytest.raises(OptionsError, match=re.escape("mode 'max_autotune' (did you mean 'max-autotune'?)")):
        Options.resolve(mode="max_autotune", environ={})


@pytest.mark.parametrize("key", ["warmup", "max_captures", "verify_inputs", "max_snapshot_bytes"])
def test_integer_options_take_integers_only(key):
    """Zero or negative where a count must be positive, a bool, a float or a string are
    refused; any Integral (numpy's int64) is taken and kept as an int (one identity)."""
    import numpy

    low = 0 if key == "max_snapshot_bytes" else 1
    for bad in (low - 1, True, float(low + 1), str(low + 1), None):
        with pytest.raises(OptionsError, match=re.escape(f"option {key!r} must be an integer >= {low}")):
            Options.resolve({key: bad}, environ={})
    taken = getattr(Options.resolve({key: numpy.int64(3)}, environ={}), key)
    assert taken == 3 and type(taken) is int
    assert Options.resolve({"recheck": numpy.int64(3)}, environ={}).recheck == 3


# options that are no dict of names: (options, what the message names)
NOT_NAMES = [
    ("abc", "options must be a dict of option names (strings) to values"),
    ([("warmup", 2)], "options must be a dict of option names (strings) to values"),
    ({1: 2}, "option names are strings, got the key 1 (int)"),
    ({None: True}, "option names are strings, got the key None (NoneType)"),
    ({("cuda_graphs",): True}, "got the key ('cuda_graphs',) (tuple) (did you mean 'cuda_graphs'?)"),
    ({b"warmup": 2, "strict": True}, "got the key b'warmup' (bytes) (did you mean 'warmup'?)"),
]


@pytest.mark.parametrize(("options", "said"), NOT_NAMES, ids=[repr(o) for o, _ in NOT_NAMES])
def test_options_that_are_not_a_dict_of_names_are_an_options_error(options, said):
    """`{1: 2}` raised TypeError (len of an int), a tuple key AttributeError (.lower), "abc"
    dict()'s own ValueError: each an OptionsError saying what options are."""
    with pytest.raises(OptionsError) as info:
        Options.resolve(options, environ={})
    assert said in str(info.value), str(info.value)


def test_a_key_that_is_no_string_through_torch_compile_is_an_options_error():
    model, x = _linear()
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(model, backend="graphdispatch", options={1: 2})(x)
    assert isinstance(info.value.inner_exception, OptionsError), info.value.inner_exception
    assert "option names are strings" in str(info.value.inner_exception)


def test_cache_dir_is_a_path_none_or_false(tmp_path):
    assert Options.resolve({"cache_dir": tmp_path / "c"}, environ={}).cache_dir == str(tmp_path / "c")
    assert Options.resolve({"cache_dir": False}, environ={}).cache_dir is False
    assert Options.resolve({"cache_dir": None}, environ={}).cache_dir is None
    env = Options.resolve(environ={"GRAPHDISPATCH_CACHE_DIR": str(tmp_path), "GRAPHDISPATCH_FUSE": "1"})
    assert (env.cache_dir, env.fuse) == (str(tmp_path), True)
    assert Options.resolve(environ={"GRAPHDISPATCH_CACHE_DIR": "off"}).cache_dir is False


def test_fuse_is_a_bool_or_a_tolerance():
    from graphdispatch_backend.options import FuseTolerance

    o = Options.resolve({"fuse": {"rtol": 1e-3, "atol": 0}}, environ={})
    assert o.fuse == FuseTolerance(1e-3, 0.0) and o.to_dict()["fuse"] == {"rtol": 1e-3, "atol": 0.0}
    assert hash(o) == hash(Options.resolve({"fuse": {"atol": 0.0, "rtol": 0.001}}, environ={}))  # one identity
    for text in ('{"rtol": 1e-3, "atol": 0}', "rtol=1e-3, atol=0"):
        assert Options.resolve(environ={"GRAPHDISPATCH_FUSE": text}).fuse == FuseTolerance(1e-3, 0.0)
    with pytest.raises(OptionsError, match="GRAPHDISPATCH_FUSE='maybe'"):
        Options.resolve(environ={"GRAPHDISPATCH_FUSE": "maybe"})
    with pytest.raises(OptionsError, match="both keys"):
        Options.resolve(environ={"GRAPHDISPATCH_FUSE": "rtol=1e-3"})


def test_every_key_has_a_bad_value_case():
    assert {k for k, _, _ in BAD_VALUES} == set(VALID_KEYS)


def test_values_are_normalized(tmp_path):
    o = Options.resolve(
        {"artifacts": str(tmp_path), "enable": " b, a ,,a", "cuda_graphs": "EMULATE", "report_dir": tmp_path / "r"},
        environ={},
    )
    assert o.artifacts == (str(tmp_path),)
    assert o.enable == ("a", "b")
    assert o.cuda_graphs == "emulate"
    assert o.report_dir == str(tmp_path / "r")
    rel = Options.resolve({"report_dir": "relative/out", "artifacts": ["k1", "k2"]}, environ={})
    assert rel.report_dir == os.path.abspath("relative/out")
    assert rel.artifacts == (os.path.abspath("k1"), os.path.abspath("k2"))


# -- copied and frozen ------------------------------------------------------------------

def test_resolve_neither_mutates_nor_keeps_the_callers_dict(tmp_path):
    given = {"artifacts": [str(tmp_path)], "enable": ["x"], "warmup": 2}
    before = copy.deepcopy(given)
    o = Options.resolve(given, environ={})
    assert given == before
    given["artifacts"].append(str(tmp_path / "other"))
    given["enable"].append("y")
    given["warmup"] = 9
    assert (o.artifacts, o.enable, o.warmup) == ((str(tmp_path),), ("x",), 2)
    exported = o.to_dict()
    exported["artifacts"].append("z")  # to_dict hands out copies too
    assert o.artifacts == (str(tmp_path),)


def test_options_are_frozen_and_hashable():
    o = Options.resolve({"warmup": 2}, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.warmup = 5
    assert hash(o) == hash(Options.resolve({"warmup": 2}, environ={}))


def test_mutating_the_dict_after_torch_compile_changes_nothing(tmp_path):
    # torch.compile keeps a reference to the caller's dict (and pops its own keys from
    # it); the backend must have copied what it validated.
    model, x = _linear()
    given = {"warmup": 2, "artifacts": [str(tmp_path)]}
    compiled = torch.compile(model, backend="graphdispatch", options=given)
    with torch.no_grad():
        compiled(x)
        given["warmup"] = 7
        given["artifacts"].append(str(tmp_path / "elsewhere"))
        compiled(x)  # same guards: no recompile, the graph compiled with the original options serves
    report = graphdispatch_backend.latest_report()
    assert report["options"]["warmup"] == 2
    assert report["options"]["artifacts"] == [str(tmp_path)]
    (graph,) = report["graphs"]
    assert graph["calls"] == 2


# -- environment ------------------------------------------------------------------------

def test_environment_overrides_defaults(tmp_path):
    env = {
        "GRAPHDISPATCH_WARMUP": "5", "GRAPHDISPATCH_CUDA_GRAPHS": "emulate", "GRAPHDISPATCH_SPEED_GATE": "yes",
        "GRAPHDISPATCH_STRICT": "1", "GRAPHDISPATCH_ENABLE": "b,a", "GRAPHDISPATCH_TIMING": "host",
        "GRAPHDISPATCH_ARTIFACTS": os.pathsep.join([str(tmp_path / "k1"), str(tmp_path / "k2")]),
        "GRAPHDISPATCH_REPORT_DIR": str(tmp_path / "out"), "GRAPHDISPATCH_EXPORT_REGIONS": "off",
        "GRAPHDISPATCH_MAX_CAPTURES": "2", "GRAPHDISPATCH_VERIFY_INPUTS": "3",
        "OTHER_VARIABLE": "ignored",
    }
    o = Options.resolve(environ=env)
    assert o == Options(
        artifacts=(str(tmp_path / "k1"), str(tmp_path / "k2")), enable=("a", "b"), cuda_graphs="emulate",
        warmup=5, max_captures=2, verify_inputs=3, speed_gate=True, timing="host",
        report_dir=str(tmp_path / "out"), export_regions=False, strict=True,
    )


@pytest.mark.parametrize(("text", "value"), [("0", False), ("false", False), ("1", True), ("True", True)])
def test_cuda_graphs_from_environment_accepts_booleans(text, value):
    assert Options.resolve(environ={"GRAPHDISPATCH_CUDA_GRAPHS": text}).cuda_graphs is value


def test_explicit_option_wins_over_environment():
    env = {"GRAPHDISPATCH_WARMUP": "5", "GRAPHDISPATCH_TIMING": "sync"}
    o = Options.resolve({"warmup": 1}, environ=env)
    assert (o.warmup, o.timing) == (1, "sync")


def test_environment_is_read_from_os_environ(monkeypatch):
    monkeypatch.setenv("GRAPHDISPATCH_WARMUP", "4")
    assert Options.resolve().warmup == 4
    assert Options.resolve({"warmup": 2}).warmup == 2


BAD_ENV = [
    ("GRAPHDISPATCH_WARMUP", "x"),
    ("GRAPHDISPATCH_WARMUP", "0"),
    ("GRAPHDISPATCH_STRICT", "perhaps"),
    ("GRAPHDISPATCH_SPEED_GATE", "2"),
    ("GRAPHDISPATCH_TIMING", "fast"),
    ("GRAPHDISPATCH_CUDA_GRAPHS", "maybe"),
    ("GRAPHDISPATCH_MAX_CAPTURES", "-1"),
    ("GRAPHDISPATCH_FUSE", "perhaps"),
]


@pytest.mark.parametrize(("name", "text"), BAD_ENV, ids=[f"{n}={t!r}" for n, t in BAD_ENV])
def test_bad_environment_value_names_the_variable(name, text):
    with pytest.raises(OptionsError) as info:
        Options.resolve(environ={name: text})
    assert name in str(info.value), str(info.value)


def test_empty_environment_variable_means_unset():
    # `export GRAPHDISPATCH_ENABLE=` must not silently mean "enable no artifact at all"
    resolved = Options.resolve(environ={"GRAPHDISPATCH_ENABLE": "", "GRAPHDISPATCH_REPORT_DIR": " "})
    assert resolved.enable is None and resolved.report_dir is None


def test_unknown_graphdispatch_variable_is_an_error_naming_it():
    with pytest.raises(OptionsError) as info:
        Options.resolve(environ={"GRAPHDISPATCH_WARMUPS": "3"})
    message = str(info.value)
    assert "GRAPHDISPATCH_WARMUPS" in message
    assert "(did you mean 'GRAPHDISPATCH_WARMUP'?)" in message  # compared without the shared prefix
    assert "GRAPHDISPATCH_WARMUP," in message  # and it lists the valid ones


def test_bad_environment_fails_torch_compile(monkeypatch):
    monkeypatch.setenv("GRAPHDISPATCH_VERIFY_INPUTS", "many")
    model, x = _linear()
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(model, backend="graphdispatch")(x)
    assert isinstance(info.value.inner_exception, OptionsError)
    assert "GRAPHDISPATCH_VERIFY_INPUTS" in str(info.value.inner_exception)


def test_environment_reaches_the_report_through_torch_compile(monkeypatch):
    monkeypatch.setenv("GRAPHDISPATCH_WARMUP", "6")
    model, x = _linear()
    with torch.no_grad():
        torch.compile(model, backend="graphdispatch")(x)
    assert graphdispatch_backend.latest_report()["options"]["warmup"] == 6


# -- mode ---------------------------------------------------------------------------------

def test_reduce_overhead_means_cuda_graphs_true():
    assert Options.resolve(mode="reduce-overhead", environ={}).cuda_graphs is True
    assert Options.resolve(mode="default", environ={}).cuda_graphs == "auto"
    assert Options.resolve(mode=None, environ={}).cuda_graphs == "auto"


# what each of torch.compile's modes means here: (fuse, cuda_graphs, Inductor settings for the fusion compile)
MEANINGS = {
    "default": (False, "auto", {}),
    "lite": (False, "auto", {}),
    "reduce-overhead": (False, True, {}),
    "max-autotune-no-cudagraphs": (True, "auto", {"max_autotune": True, "coordinate_descent_tuning": True}),
    "max-autotune": (True, True, {"max_autotune": True, "coordinate_descent_tuning": True}),
}


def test_every_mode_torch_compile_takes_has_a_meaning():
    from torch._inductor import list_mode_options

    assert set(MEANINGS) == set(list_mode_options())  # a mode torch adds fails here until it means something
    for mode, (fuse, cuda_graphs, inductor) in MEANINGS.items():
        o = Options.resolve(mode=mode, environ={})
        assert (o.fuse, o.cuda_graphs, o.to_dict()["inductor"]) == (fuse, cuda_graphs, inductor), mode


def test_an_unknown_mode_is_refused_naming_the_modes():
    with pytest.raises(OptionsError) as info:
        Options.resolve(mode="reduce_overhead", environ={})
    assert "'reduce_overhead'" in str(info.value) and "'max-autotune-no-cudagraphs'" in str(info.value)


def test_options_win_over_what_a_mode_sets():
    """torch.compile itself refuses a mode with options (below); a framework that calls the
    backend with both gets the mode's meaning with the explicit options over it."""
    o = Options.resolve({"cuda_graphs": False, "max_autotune": False}, mode="max-autotune", environ={})
    assert (o.fuse, o.cuda_graphs) == (True, False)
    assert o.to_dict()["inductor"] == {"max_autotune": False, "coordinate_descent_tuning": True}
    assert Options.resolve(mode="max-autotune", environ={"GRAPHDISPATCH_FUSE": "0"}).fuse is True  # env < mode


def test_torch_compile_refuses_a_mode_with_options():
    model, _ = _linear()
    with pytest.raises(RuntimeError, match="Either mode or options"):
        torch.compile(model, backend="graphdispatch", mode="max-autotune", options={"warmup": 2})


def test_reduce_overhead_through_torch_compile():
    model, x = _linear()
    with torch.no_grad():
        out = torch.compile(model, backend="graphdispatch", mode="reduce-overhead")(x)
        assert torch.equal(out, model(x))
    report = graphdispatch_backend.latest_report()
    assert report["options"]["cuda_graphs"] is True
    if not torch.cuda.is_available():  # the graph's tensors are on the CPU either way
        assert report["graphs"][0]["cuda_graph"]["eager_by_reason"] == {"no_cuda_device": 1}


def test_max_autotune_no_cudagraphs_fuses_bitwise(caplog):
    """The mode a user switches to from Inductor: the graphs are fused (Inductor under the
    eager-numerics recipe, checked bit for bit), no CUDA graphs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).eval()
    compiled = torch.compile(model, backend="graphdispatch", mode="max-autotune-no-cudagraphs")
    with caplog.at_level(logging.WARNING, logger="graphdispatch_backend"), torch.no_grad():
        for i in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            assert torch.equal(compiled(x), model(x))
    report = graphdispatch_backend.latest_report()
    assert report["options"]["fuse"] is True and report["options"]["cuda_graphs"] == "auto"
    (graph,) = report["graphs"]
    assert graph["fusion"]["status"] == "fused" and graph["fusion"]["fused_ops"], graph["fusion"]
    assert graph["fusion"]["inductor_keys"]["applied"] == {"max_autotune": True, "coordinate_descent_tuning": True}
    assert graph["lowering_check"]["status"] == "bitwise"
    assert graph["cuda_graph"]["eager_by_reason"] == {"not_cuda": 4}  # "auto": no CUDA graph for CPU tensors
    assert not [r for r in caplog.records if "Inductor settings" in r.getMessage()]  # the mode's own: not warned


# -- Inductor's keys, as frameworks pass them --------------------------------------------

def test_inductor_keys_are_accepted_and_kept_apart():
    o = Options.resolve({"emulate_precision_casts": True, "triton.cudagraphs": False, "fx-graph-cache": False,
                         "warmup": 2}, environ={})
    assert o.warmup == 2
    assert o.to_dict()["inductor"] == {"emulate_precision_casts": True, "triton.cudagraphs": False,
                                       "fx_graph_cache": False}  # `-` read as `_`, as torch.compile reads it
    assert "inductor" not in Options.names()  # not a key of its own
    with pytest.raises(OptionsError, match="unknown option 'inductor'"):
        Options.resolve({"inductor": {}}, environ={})


def test_a_key_neither_ours_nor_inductors_still_raises_naming_the_valid_keys():
    with pytest.raises(OptionsError) as info:
        Options.resolve({"emulate_precision_casts": True, "emulate_precision_cast": True}, environ={})
    assert "'emulate_precision_cast'" in str(info.value)
    assert all(key in str(info.value) for key in VALID_KEYS)


def test_an_inductor_key_of_the_wrong_type_says_what_inductor_takes():
    with pytest.raises(OptionsError, match="Inductor option 'emulate_precision_casts' must be of type bool"):
        Options.resolve({"emulate_precision_casts": "yes"}, environ={})


# Inductor settings whose declared type is generic (torch.compile checks plain types only):
# (key, a value of the wrong type, what the message says it must be)
INDUCTOR_WRONG = [
    ("cpp.simdlen", "x", "of type int | None"),
    ("cpp.simdlen", True, "of type int | None"),  # a bool is no int
    ("compile_threads", 2.0, "of type int | None"),
    ("triton.multi_kernel", "1", "one of 0, 1, 2, 3"),
    ("cpu_backend", "tritn", "one of 'cpp', 'triton'"),
    ("rocm.arch", ["gfx90a", 1], "of type list[str]"),
    ("aot_inductor.metadata", {"a": 1}, "of type dict[str, str]"),
    ("cpp.cxx", ("g++",), "of type tuple[None, str]"),
    ("trace.upload_tar", "upload", "of type Callable[[str], None] | None"),
]


@pytest.mark.parametrize(("key", "value", "kind"), INDUCTOR_WRONG, ids=[f"{k}={v!r}" for k, v, _ in INDUCTOR_WRONG])
def test_an_inductor_key_of_a_generic_type_is_checked_too(key, value, kind):
    """`"cpp.simdlen": "x"` was taken and reported `applied` while `max_autotune: "yes"` was
    refused: every Inductor setting's value is held to the type its config declares."""
    from torch._inductor import config

    before = config.get_config_copy()[key]
    with pytest.raises(OptionsError) as info:
        Options.resolve({key: value}, environ={})
    message = str(info.value)
    assert f"Inductor option {key!r} must be {kind}" in message and f"got {value!r}" in message, message
    assert config.get_config_copy()[key] == before  # checked, never set
    if key == "cpu_backend":
        assert "(did you mean 'triton'?)" in message


@pytest.mark.parametrize(("key", "value"), [("cpp.simdlen", 8), ("cpp.simdlen", None), ("compile_threads", 4),
                                            ("triton.multi_kernel", 2), ("cpu_backend", "triton"),
                                            ("triton.cudagraph_capture_sizes", (1, 2, 4)),
                                            ("aot_inductor.metadata", {"a": "b"}), ("trace.upload_tar", print)])
def test_an_inductor_key_of_its_declared_type_is_taken(key, value):
    assert dict(Options.resolve({key: value}, environ={}).inductor.items) == {key: value}


def test_every_inductor_default_is_of_its_declared_type():
    """The check refuses no value Inductor itself holds: each key's default fits its declared
    type (or the type cannot be told: one written as text)."""
    from torch._inductor import config

    from graphdispatch_backend.inductor_options import inductor_type_fits

    known = config.get_config_copy()
    assert not [k for k in known if inductor_type_fits(known[k], config.get_type(k)) is False]


def test_inductor_keys_are_part_of_the_compile_identity():
    a = Options.resolve({"emulate_precision_casts": True}, environ={})
    assert a == Options.resolve({"emulate_precision_casts": True}, environ={})
    assert hash(a) == hash(Options.resolve({"emulate_precision_casts": True}, environ={}))
    assert a != Options.resolve({"emulate_precision_casts": False}, environ={})
    assert a != Options.resolve(environ={})
    unhashable = {"pre_grad_fusion_options": {"batch_linear": {}}}  # a dict: Options still hash, by its text
    assert hash(Options.resolve(unhashable, environ={})) == hash(Options.resolve(unhashable, environ={}))


def test_inductor_keys_through_torch_compile_warn_once_and_are_reported(caplog):
    model, x = _linear()
    options = {"emulate_precision_casts": True, "triton.cudagraphs": False, "cuda_graphs": "emulate"}
    with caplog.at_level(logging.WARNING, logger="graphdispatch_backend"), torch.no_grad():
        compiled = torch.compile(model, backend="graphdispatch", options=options)
        for i in range(4):
            y = x + i
            assert torch.equal(compiled(y), model(y))
        torch.compile(lambda t: t * 2, backend="graphdispatch", options=options)(x)  # a second graph, one session
    said = [r.getMessage() for r in caplog.records if "Inductor settings" in r.getMessage()]
    assert len(said) == 1, said
    assert "emulate_precision_casts" in said[0] and "triton.cudagraphs" in said[0] and "fuse=True" in said[0]
    report = graphdispatch_backend.latest_report()
    assert report["options"]["inductor"] == {"emulate_precision_casts": True, "triton.cudagraphs": False}
    assert report["graphs"][0]["cuda_graph"]["replays"] == 2  # the rest of the options took effect


# -- identity ----------------------------------------------------------------------------

def test_equal_options_are_equal_whatever_their_spelling(tmp_path):
    a = Options.resolve({"enable": "b,a", "artifacts": str(tmp_path), "warmup": 2}, environ={})
    b = Options.resolve({"enable": ["a", "b"], "artifacts": [str(tmp_path)]}, environ={"GRAPHDISPATCH_WARMUP": "2"})
    assert a == b and hash(a) == hash(b)
    assert a != Options.resolve({"enable": "b,a", "artifacts": str(tmp_path), "warmup": 3}, environ={})


def test_equal_options_share_one_session_and_report():
    # Three different functions, so Dynamo compiles each (one Linear class would reuse its code).
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.compile(lambda t: t + 1, backend="graphdispatch", options={"warmup": 2})(x)
        torch.compile(lambda t: t * 2, backend="graphdispatch", options={"warmup": 2})(x)
        shared = graphdispatch_backend.latest_report()
        torch.compile(lambda t: t - 3, backend="graphdispatch", options={"warmup": 3})(x)
        separate = graphdispatch_backend.latest_report()
        torch.compile(lambda t: t / 4, backend="graphdispatch", options={"warmup": 2})(x)
        back = graphdispatch_backend.latest_report()
    assert [g["calls"] for g in shared["graphs"]] == [1, 1]  # both graphs in one report
    assert separate["options"]["warmup"] == 3
    assert [g["calls"] for g in separate["graphs"]] == [1]
    assert [g["calls"] for g in back["graphs"]] == [1, 1, 1]  # the warmup=2 session again


def test_unknown_key_through_torch_compile_is_an_options_error():
    model, x = _linear()
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(model, backend="graphdispatch", options={"warmups": 3})(x)
    inner = info.value.inner_exception
    assert isinstance(inner, OptionsError) and isinstance(inner, ValueError)
    assert "warmups" in str(inner) and "verify_inputs" in str(inner)
    assert "did you mean 'warmup'?" in str(inner)


def test_bad_value_through_torch_compile_is_an_options_error():
    model, x = _linear()
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(model, backend="graphdispatch", options={"timing": "always"})(x)
    inner = info.value.inner_exception
    assert isinstance(inner, OptionsError)
    assert "'timing'" in str(inner) and "always" in str(inner)


def test_what_the_readme_says_an_option_error_is():
    """README "Options": torch.compile checks nothing; the error comes at the first call as
    Dynamo's BackendCompilerFailed, a RuntimeError (not a ValueError), its message starting
    with the OptionsError's, which names the fix, and `inner_exception` the OptionsError;
    Options.resolve raises that ValueError itself, before any compile."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text("utf-8")
    said = " ".join(readme.split("## Options", 1)[1].split("\n## ", 1)[0].split("|", 1)[0].split())
    for claim in ("`OptionsError`, a `ValueError` naming the fix", "`torch.compile` checks nothing",
                  "first call", "`torch._dynamo.exc.BackendCompilerFailed` (a `RuntimeError`: `except ValueError` "
                  "misses it), whose message starts with it and whose `inner_exception` is it",
                  "`graphdispatch_backend.Options.resolve(options)`"):
        assert claim in said, claim
    model, x = _linear()
    for options, fix in (({"cuda_graph": True}, "unknown option 'cuda_graph' (did you mean 'cuda_graphs'?)"),
                         ({"fuse": {"rtol": 1e-3, "atol": 1e-5, "rtl": 1}},
                          "option 'fuse': unknown key 'rtl' (did you mean 'rtol'?)")):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="graphdispatch", options=options)  # nothing checked yet
        with pytest.raises(RuntimeError) as info:
            compiled(x)
        error = info.value
        assert isinstance(error, BackendCompilerFailed) and not isinstance(error, ValueError)
        assert str(error).startswith(f"backend='graphdispatch' raised:\nOptionsError: {fix}"), str(error)
        assert isinstance(error.inner_exception, OptionsError) and isinstance(error.inner_exception, ValueError)
        with pytest.raises(ValueError, match=re.escape(fix)):
            graphdispatch_backend.Options.resolve(options)
