"""The parity gate (DESIGN.md section 5) through torch.compile, and `runtime.parity.compare`.

A one-block model has one region, `mlp`; each test writes a bundle for it whose kernel
misbehaves in one specific way, at its first or its k-th call. Whatever the artifact does,
the compiled output must stay bitwise equal to eager (allclose artifacts excepted, by
their manifest), and the report must say what happened. Every call gets fresh inputs, so
a stale or wrong result cannot hide behind a repeated one.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import graphdispatch_backend
from graphdispatch_backend.diagnostics.render import render
from graphdispatch_backend.errors import GraphDispatchError
from graphdispatch_backend.runtime.checks import novelty
from graphdispatch_backend.runtime.checks.parity import Mismatch, bitwise_equal, compare
from graphdispatch_backend.testing import MLP_INPUTS, MLP_OUTPUTS, MLP_SOURCE, Block, Mlp, Stack, write_bundle

# `{behaviour}` runs after the exact result is computed; CALLS[0] is this call's number (1-based).
KERNEL = """
import time
import torch

CALLS = [0]
K = {k}


def forward(w1, b1, x, w2, b2):
    CALLS[0] += 1
    out = torch.addmm(b2, torch.relu(torch.addmm(b1, x, w1.t())), w2.t())
    if CALLS[0] >= K:
{behaviour}
    return out
"""


def mlp_bundle(root: Path, behaviour: str = "pass", k: int = 1, **fields: Any) -> Path:
    body = "\n".join("        " + line for line in behaviour.strip().splitlines())
    source = KERNEL.format(k=k, behaviour=body)
    return write_bundle(root / "mlp", "mlp", "mlp", MLP_INPUTS, MLP_OUTPUTS, source, **fields)


def run(root: Path, calls: int = 4, model: nn.Module | None = None, bitwise: bool = True,
        **options: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """Compile `model` (default: a Block) with `root`, run it `calls` times on fresh inputs;
    return (compiled outputs, eager outputs, the substitution record)."""
    torch.manual_seed(0)
    model = (model or Block()).eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(root), **options})
    ours, eager = [], []
    with torch.no_grad():
        for i in range(calls):
            x = torch.randn(2, 8)  # one shape: a new one would be a new graph (Dynamo recompiles)
            expected = model(x.clone())
            ours.append(compiled(x))
            eager.append(expected)
            if bitwise:
                assert torch.equal(ours[-1], expected), f"call {i + 1} differs from eager"
    return ours, eager, substitution()


def substitution(index: int = 0) -> dict:
    return graphdispatch_backend.latest_report()["graphs"][-1]["substitutions"][index]


# -- bitwise ----------------------------------------------------------------------------------------------


def test_bitwise_pass_serves_every_later_call(tmp_path):
    mlp_bundle(tmp_path)
    torch.manual_seed(0)
    model = Block().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path)})
    with torch.no_grad():
        for i in range(1, 10):
            x = torch.rand(3, 8) * 2 - 1  # within (-1, 1), as the first call's: no call is checked for novel inputs
            assert torch.equal(compiled(x), model(x))
            sub = substitution()
            # gated on the first call, re-checked on the 2nd, 4th, 8th (a native run each time)
            gates = 1 + sum(1 for n in (2, 4, 8) if n <= i)
            assert (sub["parity"], sub["calls"], sub["native_calls"], sub["gates"]) == ("passed", i, 0, gates)
    assert sub["demoted"] is False and sub["reason"] is None and sub["parity_mode"] == "bitwise"


def test_bitwise_fail_is_demoted_with_diff_and_index(tmp_path):
    mlp_bundle(tmp_path, "out = out.clone()\nout[1, 3] += 0.5")
    _, _, sub = run(tmp_path)
    assert (sub["demoted"], sub["reason"], sub["parity"]) == (True, "parity", "failed")
    assert sub["max_abs_diff"] == pytest.approx(0.5, abs=1e-5)
    assert sub["first_mismatch_index"] == [1, 3]
    assert "bits differ" in sub["detail"] and "[1, 3]" in sub["detail"]
    assert (sub["calls"], sub["native_calls"], sub["gates"]) == (0, 4, 1)


def test_bitwise_comparator_rejects_negative_zero_that_torch_equal_accepts():
    expected, actual = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    assert torch.equal(expected, actual)
    mismatch = compare([expected], [actual])
    assert mismatch is not None and mismatch.first_index == (0,) and mismatch.max_abs_diff == 0.0


# -- allclose -------------------------------------------------------------------------------------------


ALLCLOSE = {"mode": "allclose", "rtol": 1e-4, "atol": 1e-6}


def test_allclose_pass_within_tolerance_serves(tmp_path):
    mlp_bundle(tmp_path, "out = out * (1 + 2e-6)", parity=ALLCLOSE)
    ours, eager, sub = run(tmp_path, bitwise=False)
    # the first call is gated, but answered natively: on it (and on the 2nd and 4th, its
    # re-checks) the whole graph is also checked against eager bit for bit
    # (runtime/checks/eager_check.py), which an allclose artifact is not; the 3rd call is the artifact's
    assert (sub["parity"], sub["parity_mode"], sub["demoted"]) == ("passed", "allclose", False)
    assert (sub["calls"], sub["native_calls"]) == (1, 3)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(ours, eager))
    assert not all(torch.equal(a, b) for a, b in zip(ours, eager))  # the artifact's own bits were served
    # what it served may be off by what its passing checks saw: the largest of them, reported
    served = max(float((a - b).abs().max()) for a, b in zip(ours, eager))
    assert 0 < sub["largest_diff_passed"] <= 2 * served, (sub["largest_diff_passed"], served)
    (entry,) = graphdispatch_backend.latest_report()["artifacts"].values()
    assert entry["status"] == "serving" and entry["largest_diff_passed"] == sub["largest_diff_passed"]
    assert f"passed=1 (allclose, passed up to {sub['largest_diff_passed']:.3g})" in render(
        graphdispatch_backend.latest_report())


def test_an_allclose_artifact_serves_replays_and_the_graphs_checks_run_it_eagerly(tmp_path):
    """Under CUDA graphs the capture was recorded inside the graph's check against eager,
    where an allclose artifact answers natively: its replays ran the native region, and a
    trial's int8 kernel served none of 80 calls. A piece holding one now runs the graph's
    checked calls eagerly (`checked_natively`), the kernel judged there beside its region;
    it is captured on a call it serves, and its replays are its own."""
    mlp_bundle(tmp_path, "out = out * (1 + 2e-6)", parity=ALLCLOSE)
    ours, eager, sub = run(tmp_path, calls=16, bitwise=False, cuda_graphs="emulate")
    (graph,) = [g for g in graphdispatch_backend.latest_report()["graphs"] if g["calls"]]
    cuda = graph["cuda_graph"]
    assert cuda["replays"] > 0 and cuda["eager_by_reason"]["checked_natively"] >= 4, cuda
    assert sub["replays"] == cuda["replays"] and sub["calls"] + sub["replays"] + sub["native_calls"] == 16, sub
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(ours, eager))
    assert sum(not torch.equal(a, b) for a, b in zip(ours, eager)) == sub["calls"] + sub["replays"]
    assert sub["parity"] == "passed" and not sub["demoted"] and sub["served_since_check"] < 8, sub
    (entry,) = graphdispatch_backend.latest_report()["artifacts"].values()
    assert entry["status"] == "serving"


def test_an_allclose_artifact_every_call_of_which_is_checked_answers_natively_said_so(tmp_path):
    """Reached on every call, passed, served none (`recheck="every"`: each call a check of
    its graph, where it answers natively): said so, not `pending` ("not called yet", as a
    trial's report read after 80 calls)."""
    mlp_bundle(tmp_path, "out = out * (1 + 2e-6)", parity=ALLCLOSE)
    ours, eager, sub = run(tmp_path, calls=4, bitwise=False, recheck="every")
    assert all(torch.equal(a, b) for a, b in zip(ours, eager)) and sub["native_calls"] == 4, sub
    (entry,) = graphdispatch_backend.latest_report()["artifacts"].values()
    assert (entry["status"], entry["calls"]) == ("native", 0), entry
    assert "answers natively inside a graph's check" in entry["why"]
    assert "mlp (native): every call of its regions was answered natively" in render(
        graphdispatch_backend.latest_report())


def test_an_allclose_artifact_beyond_its_tolerance_on_replays_is_caught_at_the_graphs_next_check(tmp_path):
    """Off by 1e-3 where its input sums above zero (a sign: no statistic sees it), from a
    replay on: the graph's next checked call runs it eagerly beside its region, demotes it,
    and the piece is captured again without it."""
    mlp_bundle(tmp_path, "out = torch.where(x.sum() > 0, out + 1e-3, out * (1 + 2e-6))", parity=ALLCLOSE)
    torch.manual_seed(0)
    model = Block().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path),
                                                                      "cuda_graphs": "emulate"})
    beyond = []
    with torch.no_grad():
        for i in range(1, 41):
            x = torch.randn(2, 8)
            x = x if (x.sum() > 0) == (i >= 21) else -x  # above zero from call 21 (20 and 24 are checked)
            out, expected = compiled(x), model(x)
            if not torch.allclose(out, expected, rtol=1e-4, atol=1e-6):
                beyond.append(i)
    sub = substitution()
    assert (sub["demoted"], sub["reason"]) == (True, "parity"), sub
    assert beyond == [21, 22, 23] and sub["caught_at_call"] == 24, (beyond, sub)
    assert sub["unchecked_calls"] >= len(beyond), (beyond, sub)  # the calls it served unchecked, said
    graph = graphdispatch_backend.latest_report()["graphs"][-1]
    assert graph["cuda_graph"]["state"] == "verified" and graph["cuda_graph"]["recaptures"] >= 1, graph["cuda_graph"]


@pytest.mark.parametrize("k", [5, 7], ids=["inside_the_capture", "at_its_verification"])
def test_an_allclose_kernel_drifting_from_a_run_of_a_capture_serves_no_call_beyond_it(tmp_path, k):
    """A trial's allclose kernel added 0.05 from its Nth run on. From the verification's
    eager run (its 7th here): that call was answered 0.05 off and the capture blamed
    (`verify_mismatch`, eager for good). From a run inside the capture (its 5th): replay
    and eager agreed and 3 replays were served beyond the tolerance. The call that
    verifies a capture of a piece holding an allclose artifact judges it beside its region."""
    mlp_bundle(tmp_path, "out = out + 0.05", k=k, parity=ALLCLOSE)
    ours, eager, sub = run(tmp_path, calls=16, bitwise=False, cuda_graphs="emulate")
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(ours, eager))
    assert (sub["demoted"], sub["reason"]) == (True, "parity"), sub
    assert "caught at the call that verified its capture" in sub["detail"], sub["detail"]
    cuda = graphdispatch_backend.latest_report()["graphs"][-1]["cuda_graph"]
    assert cuda["state"] == "verified" and cuda["replays"] >= 3 and not cuda["declines"], cuda  # captured again


def test_an_allclose_kernel_whose_bits_change_between_runs_is_named_by_the_capture_it_fails(tmp_path):
    """Within its tolerance, but its bits change from its 7th run on (an autotuner switching
    configuration): the replay differs from eager, and the decline names the artifact."""
    mlp_bundle(tmp_path, "out = out * (1 + 2e-6)", k=7, parity=ALLCLOSE)
    run(tmp_path, calls=8, bitwise=False, cuda_graphs="emulate")
    cuda = graphdispatch_backend.latest_report()["graphs"][-1]["cuda_graph"]
    detail = cuda["decline_details"]["verify_mismatch"]
    assert "the piece holds artifact(s) mlp, each judged beside its region on this call and within its parity" \
        in detail, detail


def test_an_allclose_artifact_demoted_at_its_first_check_leaves_the_graphs_checks_replaying(tmp_path):
    """Once its allclose artifact is demoted a piece holds none that serves: the graph's
    checks replay it again instead of running it eagerly (`checked_natively`: a trial's
    demoted kernel kept 9 of 20 calls off their replays)."""
    mlp_bundle(tmp_path, "out = out + 1.0", parity=ALLCLOSE)
    run(tmp_path, calls=20, cuda_graphs="emulate")
    sub = substitution()
    assert (sub["demoted"], sub["reason"]) == (True, "parity"), sub
    cuda = graphdispatch_backend.latest_report()["graphs"][-1]["cuda_graph"]
    assert cuda["eager_by_reason"].get("checked_natively", 0) <= 1 and cuda["replays"] >= 16, cuda


def test_allclose_fail_beyond_tolerance(tmp_path):
    mlp_bundle(tmp_path, "out = out.clone()\nout[0, 1] += 1e-2", parity=ALLCLOSE)
    _, _, sub = run(tmp_path)
    assert (sub["demoted"], sub["reason"]) == (True, "parity")
    assert "rtol=0.0001" in sub["detail"] and sub["first_mismatch_index"] == [0, 1]
    assert sub["max_abs_diff"] == pytest.approx(1e-2, rel=1e-3)


@pytest.mark.parametrize("value, name", [("float('nan')", "nan"), ("float('inf')", "+inf"), ("-float('inf')", "-inf")])
def test_allclose_fail_when_nan_or_inf_positions_differ_even_within_tolerance(tmp_path, value, name):
    # atol 1e30: every finite difference is "close"; only the NaN/inf placement rule can fail it
    huge = {"mode": "allclose", "rtol": 0, "atol": 1e30}
    mlp_bundle(tmp_path, f"out = out.clone()\nout[1, 2] = {value}", parity=huge)
    _, _, sub = run(tmp_path)
    assert (sub["demoted"], sub["reason"]) == (True, "parity")
    assert f"{name} positions differ" in sub["detail"] and sub["first_mismatch_index"] == [1, 2]
    assert sub["max_abs_diff"] is None


# -- raising ------------------------------------------------------------------------------------------------


def test_artifact_raising_on_its_first_call(tmp_path):
    folder = mlp_bundle(tmp_path, "raise RuntimeError('kernel launch failed')")
    _, _, sub = run(tmp_path)
    assert (sub["demoted"], sub["reason"], sub["parity"]) == (True, "raised", "failed")
    # the kernel's line, as a capture's refusal names it (the detail used to stop at the error)
    line = 1 + next(i for i, text in enumerate((folder / "kernel.py").read_text().splitlines()) if "raise" in text)
    at = f"forward (<graphdispatch artifact mlp:kernel.py>:{line})"
    assert sub["detail"] == f"RuntimeError: kernel launch failed, at {at}"
    assert (sub["calls"], sub["native_calls"]) == (0, 4)


def test_artifact_raising_at_its_kth_call_is_demoted_then_and_the_run_goes_on(tmp_path, gd_log):
    mlp_bundle(tmp_path, "raise RuntimeError('out of registers')", k=3)
    _, _, sub = run(tmp_path, calls=5)
    assert (sub["demoted"], sub["reason"]) == (True, "raised")
    assert sub["parity"] == "passed"  # it did pass the gate; it failed later
    assert (sub["calls"], sub["native_calls"]) == (2, 3)  # served calls 1-2; native from call 3 on
    warnings = [r.getMessage() for r in gd_log.records if r.levelname == "WARNING" and "demoted" in r.getMessage()]
    assert len(warnings) == 1 and "out of registers" in warnings[0]


KEPT_BUFFER = """
import torch
BUFFERS = {}
def forward(w1, b1, x, w2, b2):
    out = torch.addmm(b2, torch.relu(torch.addmm(b1, x, w1.t())), w2.t())
    buf = BUFFERS.setdefault(tuple(out.shape), torch.empty_like(out))
    return buf.copy_(out)  # the same memory on every call
"""


def test_a_kernel_returning_a_buffer_it_keeps_is_a_bad_output_when_it_returns_it_again(tmp_path, gd_log):
    """Each call's values are right, but the output a caller kept from call 1 changes under
    it at call 2 (a trial: the report said passed). Met at call 2, after the kernel wrote:
    said, native from then on, every later kept output eager's."""
    write_bundle(tmp_path / "mlp", "mlp", "mlp", MLP_INPUTS, MLP_OUTPUTS, KEPT_BUFFER)
    torch.manual_seed(0)
    model = Block().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path)})
    with torch.no_grad():
        xs = [torch.randn(2, 8) for _ in range(5)]
        kept = [compiled(x) for x in xs]
        eager = [model(x) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(kept[1:], eager[1:]))
    sub = substitution()
    assert (sub["demoted"], sub["reason"], sub["calls"]) == (True, "bad_output", 1), sub
    assert "in the memory of an earlier output it returned" in sub["detail"], sub["detail"]
    assert "that holder now holds this call's values" in gd_log.text


def test_one_kernel_keeping_one_buffer_for_two_regions_serves_no_wrong_output(tmp_path):
    """Region blocks.1.mlp's run wrote into the memory region blocks.0.mlp's output is in
    (34 of 40 outputs wrong in a trial): met at the second region's first call, a checked
    call of the graph, whose eager values answer."""
    write_bundle(tmp_path / "mlp", "mlp", "blocks.*.mlp", MLP_INPUTS, MLP_OUTPUTS, KEPT_BUFFER)
    torch.manual_seed(0)
    model = Stack(depth=2).eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path),
                                                                      "cuda_graphs": False})
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(2, 8)
            assert torch.equal(compiled(x), model(x)), i
    subs = graphdispatch_backend.latest_report()["graphs"][-1]["substitutions"]
    # one caught, the other demoted with it (runtime/gates/kin.py)
    assert sorted((s["demoted"], s["reason"]) for s in subs) == [(True, "bad_output"),
                                                                 (True, "demoted_elsewhere")], subs


@pytest.mark.parametrize("change, setting", [
    ("torch.set_default_dtype(torch.float64)", "the default dtype from torch.float32 to torch.float64"),
    ("torch.set_flush_denormal(True)", "flush-denormal from False to True"),
])
def test_a_kernel_changing_a_process_wide_setting_is_demoted_and_it_is_put_back(tmp_path, change, setting):
    """The user's own code after the call computed otherwise (`torch.zeros(1)` float64, a
    subnormal flushed to 0), the artifact reported serving (a trial). Met at its judged first
    call: put back, demoted."""
    mlp_bundle(tmp_path, change)
    try:
        _, _, sub = run(tmp_path, calls=3)
        assert torch.zeros(1).dtype == torch.float32 and (torch.tensor([1e-39]) * 1.0).item() != 0.0
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_flush_denormal(False)
    assert (sub["demoted"], sub["reason"], sub["calls"]) == (True, "changed_settings", 0), sub["detail"]
    assert setting in sub["detail"], sub["detail"]


def test_a_kernel_calling_sys_exit_is_demoted_and_the_process_goes_on(tmp_path):
    """SystemExit is no Exception: a kernel's `sys.exit()` (a helper refusing an input it
    does not support) ended the user's process (a trial)."""
    mlp_bundle(tmp_path, "import sys\nsys.exit('kernel: unsupported case')", k=3)
    _, _, sub = run(tmp_path, calls=5)
    assert (sub["demoted"], sub["reason"], sub["calls"], sub["native_calls"]) == (True, "raised", 2, 3), sub
    assert sub["detail"].startswith("KernelExited: the kernel called sys.exit('kernel: unsupported case')"), sub


def test_a_kernel_file_calling_sys_exit_at_import_fails_to_load_and_the_process_goes_on(tmp_path):
    write_bundle(tmp_path / "mlp", "mlp", "mlp", MLP_INPUTS, MLP_OUTPUTS, "import sys\nsys.exit(3)\n" + MLP_SOURCE)
    torch.manual_seed(0)
    model = Block().eval()
    with torch.no_grad():
        x = torch.randn(2, 8)
        assert torch.equal(torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path)})(x),
                           model(x))
    graph = graphdispatch_backend.latest_report()["graphs"][-1]
    (rejection,) = next(r for r in graph["regions"] if r["name"] == "mlp")["rejections"]
    assert rejection["reason"] == "load_failed" and "sys.exit(3)" in rejection["detail"], rejection


@pytest.mark.parametrize("capturable", [True, False])
def test_a_kernel_that_syncs_names_the_manifest_fix_for_its_capture(tmp_path, capturable):
    """The trial's `case_hostsync`: a kernel that reads a value on the host (never true here)
    makes the capture fail, naming the artifact and its line, but never said that
    `"capturable": false` lets the rest of the graph replay. It says so; and with that
    written, the graph is captured around the call and replays, the kernel serving each call."""
    mlp_bundle(tmp_path, "if out.abs().max() > 1e30:\n    raise RuntimeError('overflow')", capturable=capturable)
    _, _, sub = run(tmp_path, calls=6, cuda_graphs="emulate")
    graph = graphdispatch_backend.latest_report()["graphs"][-1]
    assert not sub["demoted"] and sub["calls"] + sub["replays"] == 6  # not the kernel's fault: it serves
    if capturable:
        detail = graph["cuda_graph"]["decline_details"]["capture_failed"]
        assert "a host sync) in artifact mlp (" in detail and '"capturable": false in its artifact.json' in detail
        assert graph["cuda_graph"]["replays"] == 0
    else:
        assert "capture_failed" not in graph["cuda_graph"]["declines"] and graph["cuda_graph"]["replays"] > 0


# -- bad outputs at a later call ---------------------------------------------------------------------------


BAD_OUTPUTS = {
    "shape": ("out = out[:1]", "Tensor[1, 8]"),
    "dtype": ("out = out.double()", "torch.float64"),
    "stride": ("out = out.t().contiguous().t()", "stride (1,"),
    "non_tensor": ("out = 0.5", "float"),
    "none": ("out = None", "NoneType"),
    "count": ("out = (out, out)", "Tensor[2, 8] torch.float32 stride (8, 1), Tensor[2, 8]"),
}


@pytest.mark.parametrize("kind", list(BAD_OUTPUTS))
def test_bad_output_at_a_later_call_is_demoted(tmp_path, kind):
    behaviour, named = BAD_OUTPUTS[kind]
    mlp_bundle(tmp_path, behaviour, k=3)
    _, _, sub = run(tmp_path, calls=4)
    assert (sub["demoted"], sub["reason"], sub["parity"]) == (True, "bad_output", "passed")
    assert named in sub["detail"], sub["detail"]
    assert (sub["calls"], sub["native_calls"]) == (2, 2)


@pytest.mark.parametrize("kind, what", [
    ("shape", "shape"), ("dtype", "dtype"), ("stride", "stride"), ("count", "count"),
    ("non_tensor", "tensors expected"), ("none", "tensors expected"),
])
def test_bad_output_at_the_first_call_fails_the_gate(tmp_path, kind, what):
    """A wrong count, type, shape, dtype or stride is `bad_output` (errors.py), at the gate
    as at a later call: `parity` is for values."""
    mlp_bundle(tmp_path, BAD_OUTPUTS[kind][0])
    _, _, sub = run(tmp_path, calls=2)
    assert (sub["demoted"], sub["reason"], sub["parity"]) == (True, "bad_output", "failed")
    assert what in sub["detail"]


def test_a_float64_output_for_a_float32_one_is_bad_output_not_parity(tmp_path):
    mlp_bundle(tmp_path, "out = out.double()")
    _, _, sub = run(tmp_path, calls=3)
    assert (sub["demoted"], sub["reason"]) == (True, "bad_output"), sub
    assert "dtype" in sub["detail"] and "torch.float64" in sub["detail"], sub["detail"]
    assert (sub["calls"], sub["native_calls"]) == (0, 3)


# -- mutation ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("behaviour", ["x.mul_(2)", "w1.zero_()", "b2.add_(1)"])
def test_artifact_that_mutates_its_input_is_demoted_and_the_input_restored(tmp_path, behaviour):
    mlp_bundle(tmp_path, behaviour)
    torch.manual_seed(0)
    model = Block().eval()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path)})
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 8)
            before, expected = x.clone(), model(x.clone())
            assert torch.equal(compiled(x), expected)
            assert torch.equal(x, before)  # the caller's tensor is as it was
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    sub = substitution()
    assert (sub["demoted"], sub["reason"], sub["parity"]) == (True, "mutated_input", "failed")
    assert "1 of its inputs" in sub["detail"]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])  # its activations count no writes there
def test_a_write_into_its_bias_on_a_call_served_unchecked_is_caught_on_that_call(tmp_path, mode):
    """A trial's kernel added 0.25 to its bias on one unchecked eager call: every check
    after it compared two runs that both read the written bias, and 8 of 16 calls came out
    0.33 off, the report `passed`. torch counts the write: the gate sees it on that call.
    (On a replay no gate runs: the graph's check finds such a write, tests/artifacts/test_in_place.py.)"""
    mlp_bundle(tmp_path, "if CALLS[0] == 3:\n    b2.add_(0.25)", k=3)  # once, on a call dense does not check
    torch.manual_seed(0)
    model = Block().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path)})
    with mode():
        for _ in range(5):
            compiled(torch.randn(2, 8))
    sub = substitution()
    assert (sub["demoted"], sub["reason"]) == (True, "mutated_input"), sub
    assert "wrote into input 4 (fc2.bias) on a call served unchecked" in sub["detail"], sub["detail"]
    assert "not undone" in sub["detail"]


@pytest.mark.parametrize("run", [2, 3, 4], ids=["warmup", "capture", "check"])
def test_a_write_into_its_bias_in_a_run_made_for_a_cuda_graph_is_caught_there(tmp_path, run):
    """A trial's kernel added 0.25 to its bias in the runs a CUDA graph's capture makes (its
    2nd, 3rd and 4th runs here: the warmup, the recorded run, the graph's check against
    eager), where no gate counted writes: the graph was then declined as eager's own
    nondeterminism, the artifact stayed `passed`, and a capture that recorded the write
    repeated it on each replay (the bias 0.75 off after one write). The gate counts the
    write there too; the capture is made again without the kernel before any replay. Each
    of those runs is made inside a check of the graph against eager here, which copied the
    bias before it ran (runtime/checks/side_by_side.py `kept`) and finds it written beyond
    what the graph writes, even where that run's outputs differ too: it puts the bias back
    (it stayed 0.25 off until the check's comparison looked past a differing output)."""
    mlp_bundle(tmp_path, f"if CALLS[0] == {run}:\n    b2.add_(0.25)", k=run)
    torch.manual_seed(0)
    model = Block().eval()
    before = model.mlp.fc2.bias.detach().clone()
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"artifacts": str(tmp_path), "cuda_graphs": "emulate"})
    with torch.no_grad():
        served = [(compiled(x), x) for x in torch.randn(8, 2, 8).unbind()]
        later = [torch.equal(out, model(x)) for out, x in served[2:]]
    sub = substitution()
    assert (sub["demoted"], sub["reason"]) == (True, "mutated_input"), sub
    assert "wrote into input 4 (fc2.bias) in a run made for a CUDA graph" in sub["detail"], sub["detail"]
    assert "where the graph's check against eager made the run and copied them: it puts them back" in sub["detail"]
    assert torch.equal(model.mlp.fc2.bias, before)  # put back by the check, never replayed
    assert all(later), later
    graph = graphdispatch_backend.latest_report()["graphs"][-1]
    assert graph["lowering_check"]["status"] == "bitwise", graph["lowering_check"]
    assert graph["cuda_graph"]["state"] == "verified" and graph["cuda_graph"]["replays"] >= 4, graph["cuda_graph"]


def test_a_kernel_that_draws_from_the_default_generator_is_demoted_and_the_callers_draws_stay_eagers(tmp_path):
    """A trial's kernel summed in `torch.randperm` order: demoted for parity at its gate, yet
    its one run there moved the default generator, and 11 of 12 later `torch.randn` inputs
    of the caller's were not eager's (outputs 16 to 39 off). A kernel that draws is
    demoted (`drew`) and the generator put back where native's run left it."""
    mlp_bundle(tmp_path, "torch.rand(3)", k=1)  # its values eager's: only the draw

    def serve(model: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        with torch.no_grad():
            return [model(torch.randn(2, 8)) for _ in range(4)]

    torch.manual_seed(0)
    model = Block().eval()
    eager = serve(model)
    ours = serve(torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path)}))
    assert all(torch.equal(a, b) for a, b in zip(ours, eager))
    sub = substitution()
    assert (sub["demoted"], sub["reason"]) == (True, "drew"), sub


# -- a region with several outputs -------------------------------------------------------------------------


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return torch.relu(h), torch.sigmoid(h)


class TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.two = Two()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.two(x)
        return a * b + x


TWO_SOURCE = """
import torch


def forward(w, b, x):
    h = torch.addmm(b, x, w.t())
    return {result}
"""
TWO_INPUTS = [{"name": "lin.weight", "shape": [8, 8], "dtype": "float32"},
              {"name": "lin.bias", "shape": [8], "dtype": "float32"},
              {"name": "input0", "shape": [None, 8], "dtype": "float32"}]
TWO_OUTPUTS = [{"shape": [None, 8], "dtype": "float32"}] * 2


@pytest.mark.parametrize("result, demoted, detail", [
    ("torch.relu(h), torch.sigmoid(h)", False, None),
    ("[torch.relu(h), torch.sigmoid(h)]", False, None),  # a list is as good as a tuple
    ("torch.sigmoid(h), torch.relu(h)", True, "output 0: values"),
    ("torch.relu(h), torch.sigmoid(h) * 1.0001", True, "output 1: values"),
    ("torch.relu(h)", True, "outputs: count: 1 outputs, expected 2"),  # bad_output
    # -0.0 where relu gives +0.0: equal values (torch.equal agrees), different bits
    ("torch.where(h <= 0, -0.0, torch.relu(h)), torch.sigmoid(h)", True,
     "output 0: values: bits differ (max abs diff 0,"),
])
def test_multi_output_region(tmp_path, result, demoted, detail):
    write_bundle(tmp_path / "two", "two", "two", TWO_INPUTS, TWO_OUTPUTS,
                 TWO_SOURCE.format(result=result))
    _, _, sub = run(tmp_path, calls=3, model=TwoOut())
    assert sub["region"] == "two" and sub["demoted"] is demoted
    if demoted:
        reason = "bad_output" if ": count: " in detail else "parity"
        assert sub["reason"] == reason and sub["detail"].startswith(detail), sub["detail"]
    else:
        assert (sub["parity"], sub["calls"]) == ("passed", 3)


# -- speed_gate ---------------------------------------------------------------------------------------------


def test_speed_gate_keeps_native_when_the_artifact_is_slower(tmp_path):
    # 50 ms a call: far above the native region's median even on a loaded machine
    mlp_bundle(tmp_path, "time.sleep(0.05)")
    _, _, sub = run(tmp_path, calls=3, speed_gate=True)
    assert (sub["demoted"], sub["reason"]) == (True, "slower")
    assert sub["parity"] == "passed"  # the bits were right: speed alone decided
    speed = sub["speed"]
    assert speed["artifact_ms"] >= 50 > speed["native_ms"] and speed["speedup"] < 1
    assert "median of" in sub["detail"] and (sub["calls"], sub["native_calls"]) == (0, 3)


class Slow(nn.Module):
    """200 exact no-ops (x * 1.0): slow through the native region, one clone for the artifact."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(200):
            x = x * 1.0
        return x


class SlowModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.slow = Slow()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.slow(x) + 1


def test_speed_gate_serves_a_faster_artifact(tmp_path):
    spec = [{"name": "input0", "shape": [None, 8], "dtype": "float32"}]
    write_bundle(tmp_path / "fast", "fast", "slow", spec, [{"shape": [None, 8], "dtype": "float32"}],
                 "def forward(x):\n    return x.clone()\n")
    _, _, sub = run(tmp_path, calls=3, model=SlowModel(), speed_gate=True)
    assert (sub["demoted"], sub["parity"], sub["calls"]) == (False, "passed", 3)
    assert sub["speed"]["speedup"] > 1 and sub["speed"]["artifact_ms"] < sub["speed"]["native_ms"]


def test_speed_gate_off_records_no_timing(tmp_path):
    mlp_bundle(tmp_path, "time.sleep(0.003)")
    _, _, sub = run(tmp_path, calls=2)
    assert (sub["demoted"], sub["speed"], sub["calls"]) == (False, None, 2)


def test_artifact_raising_while_timed_for_speed_gate_is_demoted(tmp_path):
    """The speed gate runs the artifact again; raising there demotes like any other call."""
    mlp_bundle(tmp_path, "raise RuntimeError('flaky')", k=2)
    _, _, sub = run(tmp_path, calls=3, speed_gate=True)
    assert (sub["demoted"], sub["reason"]) == (True, "raised")
    assert "flaky" in sub["detail"] and "speed_gate" in sub["detail"]


# -- strict ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("behaviour, named", [
    ("out = out.clone()\nout[0, 0] += 1", "parity"),
    ("raise RuntimeError('boom')", "boom"),
])
def test_strict_raises_instead_of_demoting(tmp_path, behaviour, named):
    mlp_bundle(tmp_path, behaviour)
    model = Block().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path), "strict": True})
    with torch.no_grad(), pytest.raises(GraphDispatchError) as info:
        compiled(torch.randn(2, 8))
    assert named in str(info.value)


def test_strict_does_not_raise_for_a_passing_artifact(tmp_path):
    mlp_bundle(tmp_path)
    _, _, sub = run(tmp_path, calls=2, strict=True)
    assert sub["parity"] == "passed"


# -- one gate per shape key -----------------------------------------------------------------------------------


def test_each_shape_key_is_gated_then_rechecked_at_powers_of_two(tmp_path):
    mlp_bundle(tmp_path)
    torch.manual_seed(0)
    model = Block().eval()
    compiled = torch.compile(model, backend="graphdispatch", dynamic=True, options={"artifacts": str(tmp_path)})
    with torch.no_grad():
        for batch in (2, 3, 2, 3, 5, 2, 2, 2):
            x = torch.randn(batch, 8)
            assert torch.equal(compiled(x), model(x))
    report = graphdispatch_backend.latest_report()
    (graph,) = report["graphs"]
    (sub,) = graph["substitutions"]
    # batch 2 is seen 5 times (gate + re-checks at its 2nd and 4th call), 3 twice (gate +
    # re-check at its 2nd), 5 once (gate)
    assert (sub["gates"], sub["calls"], sub["parity"]) == (3 + 1 + 2, 8, "passed")


# == runtime.parity.compare ======================================================================================


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def test_identical_outputs_compare_equal():
    a = torch.randn(3, 4)
    assert compare([a, 2, None], [a.clone(), 2, None]) is None
    assert bitwise_equal(a, a.clone())


def test_nan_payloads_must_agree_bitwise_but_not_in_allclose():
    quiet, other = torch.tensor([f32(0x7FC00000)]), torch.tensor([f32(0x7FC00001)])
    assert torch.isnan(quiet).all() and torch.isnan(other).all()
    assert compare([quiet], [quiet.clone()]) is None
    mismatch = compare([quiet], [other])
    assert mismatch.what == "values" and mismatch.first_index == (0,) and mismatch.max_abs_diff is None
    assert compare([quiet], [other], "allclose", 0.0, 0.0) is None
    assert not bitwise_equal(quiet, other)


def test_negative_zero_in_allclose_is_equal():
    assert compare([torch.tensor([0.0])], [torch.tensor([-0.0])], "allclose", 0.0, 0.0) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_bitwise_in_narrow_and_wide_floats(dtype):
    e = torch.tensor([1.0, 2.0, 3.0], dtype=dtype)
    a = e.clone()
    bits = a.view(torch.int64 if dtype == torch.float64 else torch.int16)
    bits[2] += 1  # the next representable value after 3.0: one ulp
    mismatch = compare([e], [a])
    assert mismatch is not None and mismatch.first_index == (2,) and mismatch.max_abs_diff > 0


def test_first_mismatch_index_is_row_major_and_max_diff_is_over_all():
    e = torch.zeros(2, 3, 4)
    a = e.clone()
    a[1, 2, 0] = 5.0
    a[1, 0, 3] = 0.25
    a[0, 2, 1] = float("nan")
    mismatch = compare([e], [a])
    assert mismatch.first_index == (0, 2, 1) and mismatch.max_abs_diff == 5.0  # NaN has no distance
    assert str(mismatch) == "output 0: values: bits differ (max abs diff 5, first at [0, 2, 1])"
    assert mismatch.to_dict() == {"output": 0, "what": "values", "detail": "bits differ", "max_abs_diff": 5.0,
                                  "first_mismatch_index": [0, 2, 1]}


def test_zero_dim_tensor_mismatch_index_is_empty():
    mismatch = compare([torch.tensor(1.0)], [torch.tensor(2.0)])
    assert mismatch.first_index == () and mismatch.to_dict()["first_mismatch_index"] == []


def test_complex_bitwise_and_allclose():
    e = torch.tensor([1 + 1j, 2 + 2j, 3 + 3j], dtype=torch.complex64)
    a = e.clone()
    a[1] = 2 + 2.001j  # only the imaginary part differs
    mismatch = compare([e], [a])
    assert mismatch.first_index == (1,)
    assert mismatch.max_abs_diff == pytest.approx(1e-3, rel=1e-3)  # |a - e|, not ||a| - |e||
    assert compare([e], [a], "allclose", 1e-3, 0.0) is None
    assert compare([e], [a], "allclose", 1e-5, 0.0).what == "values"


def test_complex_allclose_pins_nan_and_inf_per_component():
    nan, inf = float("nan"), float("inf")
    e = torch.tensor([complex(nan, 1.0), complex(1.0, inf), 1 + 1j], dtype=torch.complex128)
    assert compare([e], [e.clone()], "allclose", 0.0, 0.0) is None  # same places: equal
    moved = torch.tensor([complex(1.0, nan), complex(1.0, inf), 1 + 1j], dtype=torch.complex128)
    mismatch = compare([e], [moved], "allclose", 1.0, 1.0)
    assert mismatch.what == "nan_inf" and mismatch.first_index == (0,)


def test_bool_and_int_are_always_compared_exactly():
    e, a = torch.tensor([True, False, True]), torch.tensor([True, True, True])
    mismatch = compare([e], [a], "allclose", 1.0, 1.0)
    assert mismatch.first_index == (1,) and mismatch.max_abs_diff is None
    ei, ai = torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 2], [3, 5]])
    mismatch = compare([ei], [ai], "allclose", 1.0, 10.0)  # no tolerance for integers
    assert mismatch.first_index == (1, 1) and mismatch.max_abs_diff == 1.0


def test_allclose_nan_and_inf_placement():
    nan, inf = float("nan"), float("inf")
    e = torch.tensor([1.0, nan, inf, -inf])
    assert compare([e], [e.clone()], "allclose", 0.0, 0.0) is None
    assert compare([e], [torch.tensor([1.0, 0.0, inf, -inf])], "allclose", 0.0, 1e30).detail == "nan positions differ"
    assert compare([e], [torch.tensor([1.0, nan, -inf, -inf])], "allclose", 0.0, 1e30).detail == "+inf positions differ"
    mismatch = compare([e], [torch.tensor([1.0, nan, inf, 5.0])], "allclose", 0.0, 1e30)
    assert (mismatch.what, mismatch.first_index) == ("nan_inf", (3,))
    assert compare([torch.tensor([1.0, 2.0])], [torch.tensor([1.0, nan])], "allclose", 0.0, 1e30).what == "nan_inf"


def test_allclose_tolerance():
    e = torch.tensor([1.0, 100.0])
    assert compare([e], [torch.tensor([1.0, 100.05])], "allclose", 1e-3, 0.0) is None
    mismatch = compare([e], [torch.tensor([1.01, 100.05])], "allclose", 1e-3, 0.0)
    assert mismatch.first_index == (0,) and mismatch.max_abs_diff == pytest.approx(0.05, rel=1e-3)


def test_strides_are_part_of_parity():
    e = torch.arange(6.0).reshape(2, 3)
    a = e.t().contiguous().t()
    assert torch.equal(e, a) and e.stride() != a.stride()
    mismatch = compare([e], [a])
    assert mismatch.what == "stride" and "(1, 2)" in mismatch.detail
    assert compare([e], [a], check_strides=False) is None
    assert compare([torch.ones(1, 1)], [torch.ones(1, 1).t()]) is None  # one element: no layout to differ


@pytest.mark.parametrize("expected, actual, what", [
    ([torch.zeros(2)], [torch.zeros(3)], "shape"),
    ([torch.zeros(2)], [torch.zeros(2, dtype=torch.float64)], "dtype"),
    ([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)], "count"),
    ([torch.zeros(2)], [0.0], "type"),
    ([3], [4], "type"),
    ([None], [torch.zeros(2)], "type"),
])
def test_structure_mismatches(expected, actual, what):
    mismatch = compare(expected, actual)
    assert isinstance(mismatch, Mismatch) and mismatch.what == what


def test_empty_tensors_compare_equal():
    assert compare([torch.empty(0, 3)], [torch.empty(0, 3)]) is None


# == artifact_recheck: the artifact's own schedule =============================================================

# a kernel 1 ulp off on every element when the input's max exceeds 1.0 (tensor ops only, no host
# read: a capture records it and a replay computes it for each call's values)
ULP_KERNEL = """
import torch


def forward(w1, b1, x, w2, b2):
    out = torch.addmm(b2, torch.relu(torch.addmm(b1, x, w1.t())), w2.t())
    return torch.where(x.amax() > 1.0, torch.nextafter(out, torch.full_like(out, float("inf"))), out)
"""
WRONG_ON = (9, 10, 11, 12, 20)  # the calls of a 20-call run whose input's max exceeds 1.0


class OnlyMlp(nn.Module):
    """The region is the whole model: its output is the kernel's, every ulp of it."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def _scenario_inputs(calls: int = 20) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(2, 8, generator=g) * 0.5 for _ in range(calls)]  # max < 0.5: the kernel is exact
    for n in WRONG_ON:
        xs[n - 1][0, 0] = 2.0
    return xs


def _served_wrong(tmp_path: Path, **options: Any) -> tuple[list[int], dict, dict]:
    """The 20-call run: the calls whose output differed from eager, the substitution record
    and the report."""
    write_bundle(tmp_path / "mlp", "mlp-ulp", "mlp", MLP_INPUTS, MLP_OUTPUTS, ULP_KERNEL)
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = OnlyMlp().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path), **options})
    wrong = []
    with torch.no_grad():
        for n, x in enumerate(_scenario_inputs(), start=1):
            if not bitwise_equal(compiled(x), model(x)):
                wrong.append(n)
    report = graphdispatch_backend.latest_report()
    return wrong, report["graphs"][-1]["substitutions"][0], report


@pytest.mark.parametrize("cuda_graphs", [None, "emulate"])
def test_a_kernel_wrong_on_calls_9_to_12_and_20_is_caught_at_its_first_large_input(tmp_path, cuda_graphs):
    """The issue's kernel: 1 ulp off on every element when the input's max exceeds 1.0,
    which holds on calls 9-12 and 20 of 20 (every other call's max is below 0.5). The
    lowering's schedule (1, 2, 4, 8, 16) meets none of them: 5 of 20 outputs were wrong, and
    nothing said so; the dense schedule met call 12, after 3 wrong outputs. Call 9's input
    leaves what the checked calls saw (max 2.0, two binades above): it is checked for that
    (runtime/checks/novelty.py). On CPU, where the statistics are read in the call, call 9
    is answered natively and the artifact demoted: no wrong output. With CUDA graphs
    (emulated as a GPU runs them: the statistics reach the host without a sync, a call
    late) call 9 is replayed as computed and call 10, checked for call 9's new inputs,
    catches it: one wrong output."""
    options = {} if cuda_graphs is None else {"cuda_graphs": cuda_graphs}
    wrong, sub, report = _served_wrong(tmp_path, **options)
    first = 9 if cuda_graphs is None else 10
    assert wrong == list(range(9, first)), wrong
    assert (sub["demoted"], sub["reason"], sub["parity"]) == (True, "parity", "failed"), sub
    text = render(report)
    checks = text.split("Artifact checks (artifact_recheck='dense'", 1)[1]
    if cuda_graphs is None:  # the gate's check for call 9's new inputs (inside the graph's, made for them too)
        assert (sub["caught_at_call"], sub["caught_by"]) == (9, "novelty"), sub
        assert "by a check for novel inputs (input0 max|x| 2, at or above 0.5" in sub["detail"], sub["detail"]
        assert "mlp-ulp on graph_0 mlp: caught at call 9 of its shape key by a check for novel inputs" in checks
        row = next(line for line in text.split("Graphs (", 1)[1].splitlines() if line.startswith("graph_0"))
        assert "(1 novel)" in row, row
    else:  # call 10 is also on the graph's schedule (dense, for its replayed artifact): the schedule is named
        assert sub["caught_at_call"] == 10 and sub["caught_by"] in ("recheck", "novelty"), sub


@pytest.mark.parametrize("cuda_graphs", [None, "emulate"])
def test_without_novelty_checks_the_dense_schedule_serves_one_wrong_output(tmp_path, cuda_graphs, monkeypatch):
    """The schedule alone (novelty checks off): "dense" checks 8, 10, 12, ... from call 8 on
    (four times per doubling up to 64): call 9 is served as computed, call 10 catches it
    (it served 3 before the start was made denser: 9-11, caught at 12)."""
    monkeypatch.setattr(novelty, "ENABLED", False)
    options = {} if cuda_graphs is None else {"cuda_graphs": cuda_graphs}
    wrong, sub, report = _served_wrong(tmp_path, **options)
    assert wrong == [9], wrong
    assert (sub["caught_at_call"], sub["unchecked_calls"]) == (10, 1), sub
    assert sub["caught_by"] == ("artifact_recheck" if cuda_graphs is None else "recheck"), sub
    # the catch was a check: none served since (call 9, before it, is unchecked_calls); 5-7 the widest
    assert (sub["served_since_check"], sub["largest_gap"]) == (0, 3), sub
    # served: 1-9; with CUDA graphs also call 10, replayed inside the check that caught it (eager's values answered)
    served = 9 if cuda_graphs is None else 10
    assert sub["calls"] + sub["replays"] == served, sub
    assert report["totals"]["artifact_unchecked_calls"] == 0 and report["totals"]["artifact_largest_gap"] == 3
    text = render(report)
    checks = text.split("Artifact checks (artifact_recheck='dense'", 1)[1]
    row = next(line.split() for line in checks.splitlines() if line.startswith("graph_0"))
    assert row == ["graph_0", "mlp-ulp", "1", str(served), "0", "3", "0"], row
    assert "mlp-ulp on graph_0 mlp: caught at call 10 of its shape key by " in checks


@pytest.mark.parametrize("cuda_graphs", [None, "emulate"])
def test_on_the_lowerings_schedule_without_novelty_the_same_kernel_serves_five_wrong_outputs(tmp_path, cuda_graphs,
                                                                                              monkeypatch):
    """The old behaviour, asked for by name: the artifact re-checked on the lowering's
    schedule (1, 2, 4, 8, 16), no novelty check, meets none of calls 9-12 and 20."""
    monkeypatch.setattr(novelty, "ENABLED", False)
    options = {"artifact_recheck": "doubling", **({} if cuda_graphs is None else {"cuda_graphs": cuda_graphs})}
    wrong, sub, report = _served_wrong(tmp_path, **options)
    assert wrong == list(WRONG_ON) and not sub["demoted"], (wrong, sub)
    assert (sub["served_since_check"], sub["largest_gap"]) == (4, 7), sub  # 17-20 now; 9-15 the widest
    assert "at most 7 calls served unchecked in a row" in render(report)


@pytest.mark.parametrize("artifact_recheck, checked", [
    ("dense", [1, 2, 4, 8, 10, 12, 14, 16, 20, 24]),
    ("every", list(range(1, 25))),
    (5, [1, 6, 11, 16, 21]),
    ("doubling", [1, 2, 4, 8, 16]),
])
def test_the_gate_checks_on_artifact_recheck_not_on_the_lowerings_schedule(tmp_path, artifact_recheck, checked):
    """Which eager calls the gate judges beside native: the `artifact_recheck` schedule,
    whatever `recheck` says (the lowering is never re-checked here)."""
    mlp_bundle(tmp_path)
    torch.manual_seed(0)
    model = Block().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={
        "artifacts": str(tmp_path), "recheck": 1024, "artifact_recheck": artifact_recheck, "cuda_graphs": False})
    judged = []
    with torch.no_grad():
        for n in range(1, 25):
            before = substitution()["gates"] if n > 1 else 0
            x = torch.rand(2, 8) * 2 - 1  # within (-1, 1), as the first call's: no call is checked for novelty
            assert torch.equal(compiled(x), model(x))
            if substitution()["gates"] > before:
                judged.append(n)
    assert judged == checked
    sub = substitution()
    assert sub["served_since_check"] == 24 - checked[-1]
    assert sub["largest_gap"] == max(b - a - 1 for a, b in zip(checked, [*checked[1:], 25]))



# -- outputs that share memory native's do not ---------------------------------------------------------------


class _Copies(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 1.0, x + 0.0


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.copies = _Copies()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.lin(x), *self.copies(x))


ALIASING = {  # values eager's, memory not: what a later write into one shows
    "its_input": ("return input0, input0.clone()", "output 0: aliasing: a view of input 0"),
    "one_tensor_twice": ("y = input0 * 1.0\n    return y, y", "output 1: aliasing: a view of output 0"),
}


@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
@pytest.mark.parametrize("kind", list(ALIASING))
def test_outputs_sharing_memory_natives_do_not_are_bad_output(tmp_path, kind, cuda_graphs):
    """A trial's kernels returned their input itself, or one tensor for two outputs, with
    eager's values: the gate compared values only, and the caller's in-place update of its
    latent changed an output it held (10 of 12 calls, 0.416 off), the report `passed`."""
    body, detail = ALIASING[kind]
    spec = {"shape": [4, 8], "dtype": "float32"}
    write_bundle(tmp_path / "copies", "copies", "copies", [{**spec, "name": "input0"}], [spec, spec],
                 f"def forward(input0):\n    {body}\n")
    torch.manual_seed(0)
    model = _Twice().eval()
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"artifacts": str(tmp_path), "cuda_graphs": cuda_graphs})
    wrong = 0
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            ours, eager = compiled(x), model(x.clone())
            x.mul_(0.5)  # the caller's loop updates its latent in place, then reads what it got
            ours[1].add_(1.0)
            eager[1].add_(1.0)
            wrong += not all(torch.equal(a, b) for a, b in zip(ours, eager))
    (sub,) = [s for g in graphdispatch_backend.latest_report()["graphs"] for s in g.get("substitutions", [])]
    assert wrong == 0
    assert (sub["demoted"], sub["reason"], sub["parity"]) == (True, "bad_output", "failed"), sub
    assert detail in sub["detail"], sub["detail"]


def test_a_kernel_caught_at_one_block_is_demoted_at_every_block_of_its_kind(tmp_path):
    """A trial's kernel, one ulp high above a magnitude, was caught at one block of a model
    compiled whole and kept serving the other block, which it served a wrong value at an
    unchecked call; compiled block by block (one gate) the same catch demoted it everywhere.
    The gates of one kernel over one kind of region are kin: a fault met at one demotes the
    rest (`demoted_elsewhere`, naming the region and what was found there), and from the
    catch on every call is eager's."""
    body = "        return torch.nextafter(out, torch.full_like(out, float('inf')))"
    write_bundle(tmp_path / "mlp", "mlp", "blocks.*.mlp", MLP_INPUTS, MLP_OUTPUTS, KERNEL.format(k=3, behaviour=body))
    torch.manual_seed(0)
    model = Stack(depth=2).eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"artifacts": str(tmp_path),
                                                                      "cuda_graphs": False})
    wrong = []
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(2, 8)
            if not torch.equal(compiled(x), model(x)):
                wrong.append(i)
    subs = {s["region"]: s for s in graphdispatch_backend.latest_report()["graphs"][-1]["substitutions"]}
    assert set(subs) == {"blocks.0.mlp", "blocks.1.mlp"}, subs
    assert all(s["demoted"] for s in subs.values()), subs
    reasons = sorted(s["reason"] for s in subs.values())
    assert reasons == ["demoted_elsewhere", "parity"], reasons
    (caught,) = [r for r, s in subs.items() if s["reason"] == "parity"]
    (other,) = [s for s in subs.values() if s["reason"] == "demoted_elsewhere"]
    assert other["detail"].startswith(f"its kernel was demoted at region {caught} (parity): "), other["detail"]
    assert all(s["calls"] + s["replays"] + s["native_calls"] == 12 for s in subs.values()), subs
    assert wrong == [], wrong  # the kernel's 3rd run is the 2nd call's first region's: a checked call


def _ulp_high_above_50_in_two_graphs(tmp_path: Path, calls: list[tuple[int, int]]) -> tuple[list[int], list[Any]]:
    """A Block whose MLP kernel is one ulp high where its input's magnitude passes 50, compiled
    with `dynamic=False` under emulate, called with `(batch, scale)` per step (a batch of 2 and
    one of 3: two graphs, two kinds of region): the steps whose output differed from eager's,
    and the report's graphs."""
    body = ("        out = torch.where(x.abs().amax() > 50, torch.nextafter(out, torch.full_like(out, float('inf'))),"
            " out)")
    write_bundle(tmp_path / "mlp", "mlp", "mlp", MLP_INPUTS, MLP_OUTPUTS, KERNEL.format(k=1, behaviour=body))
    torch.manual_seed(0)
    model = Block().eval()
    compiled = torch.compile(model, backend="graphdispatch", dynamic=False,
                             options={"artifacts": str(tmp_path), "cuda_graphs": "emulate"})
    wrong = []
    with torch.no_grad():
        for step, (batch, scale) in enumerate(calls):
            x = torch.randn(batch, 8) * scale
            if not torch.equal(compiled(x), model(x)):
                wrong.append(step)
    return wrong, graphdispatch_backend.latest_report()["graphs"]


def test_a_kernel_caught_at_one_kind_of_region_serves_no_other_kind(tmp_path):
    """A trial's RMSNorm kernel, one ulp high above a magnitude, with a dynamic sequence
    dimension: demoted at an LLM's decode graph, it kept serving the prefill graph's replays
    (the same module over other shapes: another kind) and gave a request wrong logits at a
    call no schedule checked. A fault in the kernel's values follows no shape: met at one
    kind of region, it demotes the kernel at every region it serves. Here two graphs of one
    Block (batches 2 and 3, `dynamic=False`), replaying under emulate, where a call's
    statistics decide the next call: graph A's first large call is served as computed and
    its next one catches the kernel; graph B's first large call, after that, is native."""
    wrong, graphs = _ulp_high_above_50_in_two_graphs(
        tmp_path, [(2, 1)] * 5 + [(3, 1)] * 6 + [(2, 100)] * 3 + [(3, 100)] * 3)
    (a,), (b,) = ([s for s in g["substitutions"]] for g in graphs)
    assert (a["demoted"], a["reason"], a["caught_by"], a["caught_at_call"]) == (True, "parity", "novelty", 7), a
    assert (b["demoted"], b["reason"]) == (True, "demoted_elsewhere"), b
    assert b["detail"].startswith("its kernel was demoted at region mlp (parity): "), b["detail"]
    assert all(g["cuda_graph"]["replays"] > 0 for g in graphs)
    assert wrong == [11], wrong  # graph A's first large call, its 6th (module docstring of runtime/checks/novelty.py)


def test_a_kernel_that_raises_at_one_kind_of_region_keeps_serving_the_others(tmp_path):
    """A raise (or an output of the wrong shape or strides) follows the shapes the kernel is
    given and never serves a wrong value (every shape key's first call is checked): the kernel
    is demoted at the regions of that kind only (runtime/gates/kin.py)."""
    body = "        assert x.shape[0] != 3, 'this kernel takes no batch of 3'"
    write_bundle(tmp_path / "mlp", "mlp", "mlp", MLP_INPUTS, MLP_OUTPUTS, KERNEL.format(k=1, behaviour=body))
    torch.manual_seed(0)
    model = Block().eval()
    compiled = torch.compile(model, backend="graphdispatch", dynamic=False,
                             options={"artifacts": str(tmp_path), "cuda_graphs": False})
    with torch.no_grad():
        for batch in (2, 3, 2, 3, 2):
            x = torch.randn(batch, 8)
            assert torch.equal(compiled(x), model(x))
    (a,), (b,) = (g["substitutions"] for g in graphdispatch_backend.latest_report()["graphs"])
    assert (a["demoted"], a["calls"]) == (False, 3), a
    assert (b["demoted"], b["reason"]) == (True, "raised"), b


def test_a_graph_compiled_after_a_kernel_was_caught_does_not_serve_it(tmp_path):
    """A demotion stands for the session: a trial's kernel, caught in one prefill graph, came
    back in the next prompt length's graph (compiled after the catch), passed that gate's
    first call and served 3 wrong decode steps at unchecked calls before it was caught again.
    Here graph B (batch 3) is compiled after graph A (batch 2) caught the kernel; its first
    large call is replayed, unchecked, and is eager's: the gate joined demoted."""
    wrong, graphs = _ulp_high_above_50_in_two_graphs(
        tmp_path, [(2, 1)] * 5 + [(2, 100)] * 2 + [(3, 1)] * 2 + [(3, 100)] * 3)
    (a,), (b,) = (g["substitutions"] for g in graphs)
    assert (a["demoted"], a["reason"], a["caught_at_call"]) == (True, "parity", 7), a
    assert (b["demoted"], b["reason"], b["calls"], b["replays"]) == (True, "demoted_elsewhere", 0, 0), b
    assert wrong == [5], wrong  # graph A's first large call, served before its statistics arrived
