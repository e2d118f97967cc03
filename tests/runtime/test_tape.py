"""The host model of a capture predicts the GPU (runtime/cudagraph/tape.py, refusals.py):
what a CUDA capture refuses fails the emulated capture too, named with the code that ran
it, and a replay runs the ops recorded at capture, not the Python again, so a value
Python read at capture stays frozen as in a CUDA graph."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from graphdispatch_backend.errors import CaptureRefused
from graphdispatch_backend.runtime.cudagraph import tape as tape_mod
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine
from graphdispatch_backend.testing import Mlp, accounted_graphs, manifest_from_region, region_entry, write_bundle

# -- the recorder on its own ---------------------------------------------------------------------


def _capture(fn: Any, *args: Any) -> Any:
    return HostReplayEngine().capture(fn, args, warmup=False)


@pytest.mark.parametrize(("body", "op"), [
    (lambda x: (x * 2, x.sum().item()), "_local_scalar_dense"),
    (lambda x: (x[x > 0],), "index"),
    (lambda x: (torch.nonzero(x),), "nonzero"),
    (lambda x: (torch.masked_select(x, x > 0),), "masked_select"),
    (lambda x: (torch.tensor(x.tolist()),), "tolist"),
    (lambda x: (x * 2,) if bool(x.sum() > 0) else (x,), "_local_scalar_dense"),
    (lambda x: (torch.rand(3, generator=torch.Generator().manual_seed(0)) + x,), "rand"),
])
def test_what_cuda_refuses_while_capturing_the_host_capture_refuses(body, op):
    with pytest.raises(CaptureRefused, match=f"operation not permitted when stream is capturing: .*{op}"):
        _capture(body, torch.randn(3))


@pytest.mark.parametrize("body", [
    lambda x: (x[torch.tensor([0, 2])],),  # integer indices: the size is the index's
    lambda x: (torch.repeat_interleave(x, torch.tensor([1, 2, 1]), output_size=4),),
    lambda x: (x + torch.rand(3),),  # the default generator: registered with every capture
])
def test_what_cuda_permits_captures(body):
    assert _capture(body, torch.randn(3)).outputs


def test_a_refusal_the_code_catches_still_fails_the_capture():
    """CUDA invalidates the capture: catching the error does not make it capturable."""

    def tolerant(x: torch.Tensor) -> tuple[torch.Tensor]:
        with contextlib.suppress(RuntimeError):
            x.max().item()
        return (x * 2,)

    with pytest.raises(CaptureRefused, match="_local_scalar_dense"):
        _capture(tolerant, torch.randn(3))


def test_a_replay_runs_what_was_captured_with_python_values_frozen():
    x = torch.randn(4)
    scale = [2.0]  # a Python value the computation reads
    graph = _capture(lambda t: (t * scale[0] + 1, (t * 3).data * 1), x)
    x.copy_(torch.arange(4.0))
    scale[0] = 5.0
    graph.replay()
    # the new input values, the scale read at capture; `.data` (no op) of a tensor made in
    # the capture is rebuilt over the replay's own memory
    assert torch.equal(graph.outputs[0], torch.arange(4.0) * 2 + 1)
    assert torch.equal(graph.outputs[1], torch.arange(4.0) * 3)


def test_an_opaque_call_is_one_step_replayed_on_the_replays_tensors():
    """Compiled code no dispatch mode sees into (Inductor's kernels, runtime/program/fused.py): the
    call is one step of the tape, made again by each replay on the tensors it then holds;
    the ATen ops it runs inside are not recorded apart."""
    calls = []
    w = torch.full((4,), 2.0)  # made before the capture: held, as a graph holds a parameter

    def kernel(t: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        calls.append(1)
        return (t * w + 1,)

    def body(t: torch.Tensor) -> tuple[torch.Tensor]:
        three = t * 3
        out = tape_mod.opaque(kernel)(three, w)[0] - 1
        return (tape_mod.opaque(kernel)(three, w)[0] + out,)  # `three` read after an opaque step

    x = torch.randn(4)
    graph = _capture(body, x)
    steps = [step[0] for step in graph._tape.steps]
    # mul, opaque, sub, opaque, add: binding the held `w` (its detach()) records no step
    assert steps.count(kernel) == 2 and len(steps) == 5
    x.copy_(torch.arange(4.0))
    graph.replay()
    assert torch.equal(graph.outputs[0], torch.arange(4.0) * 12 + 1) and len(calls) == 4  # 2 recorded, 2 replayed


class _Ops(TorchDispatchMode):
    """The ATen ops a replay runs, and whether each ran in inference mode."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.inference: list[bool] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(func.__name__)
        self.inference.append(torch.is_inference_mode_enabled())
        return func(*args, **(kwargs or {}))


def test_a_view_of_held_tensors_runs_no_op_at_replay_and_reads_their_values_then():
    """A weight's `t()` is one view for every replay (runtime/cudagraph/tape_code.py), as a
    CUDA graph launches nothing for it; a view of a tensor the capture made is still made
    by each replay, over that replay's memory."""
    w = torch.randn(4, 3)  # made before the capture: held
    x = torch.randn(2, 3)
    graph = _capture(lambda t: ((t @ w.t()).t() + 1,), x)
    assert [str(step[0]) for step in graph._tape.steps] == ["aten.t.default", "aten.mm.default",
                                                            "aten.t.default", "aten.add.Tensor"]
    x.copy_(torch.arange(6.0).view(2, 3))
    w.copy_(torch.arange(12.0).view(4, 3))  # written in place: the view reads the values live now
    graph.replay()  # the first makes the view
    with _Ops() as ops:
        graph.replay()
    # then the copy of the output into its pool block
    assert ops.seen[:3] == ["mm.default", "t.default", "add.Tensor"] and "t.default" not in ops.seen[3:], ops.seen
    assert torch.equal(graph.outputs[0], (x @ w.t()).t() + 1)


def test_a_view_reshaped_in_place_is_made_at_every_replay():
    """A step that reshapes a view in place (`t_`) would carry the change into the next
    replay if the view were made once: two replays, the same answer as eager."""
    w = torch.randn(2, 3)

    def body(t: torch.Tensor) -> tuple[torch.Tensor]:
        v = w.t()
        v.t_()  # (3, 2) back to (2, 3)
        return (v.sum(0) + t,)

    x = torch.randn(3)
    graph = _capture(body, x)
    for _ in range(2):
        graph.replay()
        assert torch.equal(graph.outputs[0], w.sum(0) + x)


@torch.library.custom_op("gdtest::maybe_alias", mutates_args=())
def maybe_alias(x: torch.Tensor, w: torch.Tensor, how: str) -> torch.Tensor:
    """A custom op's Python runs below autograd, so the ops whose schema only allows
    aliasing (`Tensor(a)`) reach the recorder as themselves, and copy when they must (`w`
    is not contiguous)."""
    made = {"to": lambda: w.to(torch.float64),
            "reshape": lambda: w.reshape(-1),
            "contiguous": lambda: w.contiguous(),
            "flatten": lambda: w.flatten(),
            "_autocast_to_reduced_precision": lambda: torch.ops.aten._autocast_to_reduced_precision(
                w, False, True, torch.half, torch.bfloat16)}[how]()
    return x + made.sum().to(x.dtype)


@maybe_alias.register_fake
def _(x: torch.Tensor, w: torch.Tensor, how: str) -> torch.Tensor:
    return torch.empty_like(x)


@pytest.mark.parametrize("how", ["to", "reshape", "contiguous", "flatten", "_autocast_to_reduced_precision"])
def test_an_op_that_may_alias_but_copied_is_run_at_every_replay(how):
    """Issue 43: `linear_cross_entropy`'s chunked op casts its weight to float32 with `to`,
    whose schema says it may return a view of its input. Folded as a view of held tensors
    (runtime/cudagraph/tape_code.py), the cast was made once, at the first replay, and every
    later replay read the capture's weight: after the weight changed in place, a replay was
    0.25 off eager, where a CUDA graph launches the copy again. Folded only where the op
    made a view, a replay reads the live values."""
    w = torch.randn(4, 3).t()  # made before the capture (held), and not contiguous
    x = torch.randn(3, 4)
    graph = _capture(lambda t: (maybe_alias(t, w, how),), x)
    assert [str(step[0]) for step in graph._tape.steps][0].split(".")[1] == how, graph._tape.steps
    graph.replay()
    w.mul_(15 / 16)  # the held tensor written in place: a new value for the op to copy
    graph.replay()
    assert torch.equal(graph.outputs[0], maybe_alias(x, w, how))


def test_an_op_that_may_alias_and_made_a_view_is_still_folded():
    """The same ops on a tensor they can view (contiguous already): one view for every
    replay, no op run for it, the live values read."""
    w = torch.randn(3, 4)
    x = torch.randn(3, 4)
    graph = _capture(lambda t: (maybe_alias(t, w, "reshape"),), x)
    graph.replay()
    with _Ops() as ops:
        graph.replay()
    assert "reshape.default" not in ops.seen, ops.seen
    w.mul_(15 / 16)
    graph.replay()
    assert torch.equal(graph.outputs[0], maybe_alias(x, w, "reshape"))


def test_a_rebound_tape_runs_its_origins_code_on_the_moved_tensor_and_holds_no_old_one():
    """A relocation's tape (Tape.rebound) is the same generated code, its constants rebound
    (a folded view of the moved tensor too); it keeps nothing of the tensor that moved, so a
    dropped cache is freed while the relocated graph lives."""
    from torch.multiprocessing.reductions import StorageWeakRef

    w = torch.randn(3, 2)
    old, new = torch.randn(4, 3), torch.randn(4, 3)
    graph = _capture(lambda c: (c.t().t() @ w + 1,), old)
    graph.replay()
    moved = graph._tape.rebound({old.untyped_storage().data_ptr(): new})
    assert moved._replay.__code__ is graph._tape._replay.__code__ and moved.steps == []
    assert torch.equal(moved.replay()[0], new @ w + 1)
    gone = StorageWeakRef(old.untyped_storage())
    del graph, old
    assert gone.expired()
    assert torch.equal(moved.replay()[0], new @ w + 1)


def test_a_replay_hands_back_tensors_autograd_accepts_whatever_it_ran_in():
    """A host replay runs in inference mode (no autograd bookkeeping, as a graph replay
    does none): its outputs are the pool blocks made at capture, and the inputs it writes
    stay normal tensors that eager code outside inference mode can write again."""
    cache = torch.zeros(4, 3)
    graph = _capture(lambda t: (cache.index_copy_(0, torch.tensor([1]), t.view(1, 3)).sum(0) * 2,), torch.ones(3))
    with _Ops() as ops:
        graph.replay()
    assert "index_copy_.default" in ops.seen and all(ops.inference), ops.seen
    out = graph.outputs[0]
    assert not out.is_inference() and not cache.is_inference()
    assert torch.equal(out, torch.full((3,), 2.0))
    out.add_(1), cache.add_(1)  # in place outside inference mode: refused for an inference tensor
    assert torch.equal(cache.sum(0), torch.full((3,), 5.0))


def test_what_a_capture_refuses_is_refused_inside_an_opaque_call():
    with pytest.raises(CaptureRefused, match="_local_scalar_dense"):
        _capture(lambda t: tape_mod.opaque(lambda u: (u * float(u.sum()),))(t), torch.randn(3))


# -- through torch.compile: an artifact that syncs, one that reads a Python value --------------


class ShiftedMlp(Mlp):
    """The shared test Mlp (fc1, relu, fc2) plus a buffer `shift`, 0 until a test moves it."""

    def __init__(self) -> None:
        super().__init__(16)
        self.register_buffer("shift", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shift


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = ShiftedMlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x * 2)


def _make() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def _x(i: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(i))


EXACT = 'F.linear(torch.relu(F.linear(a["input0"], a["fc1.weight"], a["fc1.bias"])), a["fc2.weight"], a["fc2.bias"])'
KERNELS = {
    # exact, with a guard that reads a value on the host: fine eagerly, refused by a capture
    "sync": f"""
def forward(*inputs):
    a = dict(zip(NAMES, inputs))
    if a["input0"].abs().max().item() > 1e6:
        raise ValueError("input out of range")
    return {EXACT} + a["shift"]
""",
    # exact, but raising CUDA's own error while recorded: what a GPU capture of a kernel that
    # syncs raises (a RuntimeError with CUDA's text), to show both engines' errors take one path
    "cuda_error": f"""
from graphdispatch_backend.runtime.cudagraph.engine import in_recording


def forward(*inputs):
    a = dict(zip(NAMES, inputs))
    if in_recording():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    return {EXACT} + a["shift"]
""",
    # exact while the Python value it reads matches the `shift` buffer the model adds
    "python_value": f"""
def forward(*inputs):
    a = dict(zip(NAMES, inputs))
    return {EXACT} + float(os.environ.get("GD_TEST_SHIFT", "0"))
""",
}


def _compiled(root: Path, kind: str, **options: Any) -> tuple[Net, Net, Any]:
    region = region_entry(_make(), _x(0), name="mlp", cuda_graphs=False)
    sig = manifest_from_region(region)
    names = [i["name"] for i in region["inputs"]]
    source = f"import os\nimport torch\nimport torch.nn.functional as F\n\nNAMES = {names!r}\n" + KERNELS[kind]
    write_bundle(root / "mlp", f"mlp-{kind}", "mlp", sig["inputs"], sig["outputs"], source)
    model = _make()
    compiled = torch.compile(model, backend="graphdispatch",
                             options={"cuda_graphs": "emulate", "artifacts": str(root), **options})
    return model, _make(), compiled


@pytest.mark.parametrize(("kind", "error"), [
    ("sync", "operation not permitted when stream is capturing: aten._local_scalar_dense.default"),
    # the CUDA engine's capture raises CUDA's RuntimeError, not CaptureRefused: the same path
    ("cuda_error", "CUDA error: operation not permitted when stream is capturing"),
])
def test_an_artifact_a_capture_refuses_fails_the_capture_named_and_serves_eagerly(tmp_path, kind, error):
    _, ref, compiled = _compiled(tmp_path, kind)
    with torch.no_grad():
        for i in range(6):
            assert torch.equal(compiled(_x(i)), ref(_x(i))), i
    (graph,) = accounted_graphs()
    cg = graph["cuda_graph"]
    assert cg["replays"] == 0 and cg["declines"] == {"capture_failed": 1}
    detail = cg["decline_details"]["capture_failed"]
    assert detail.startswith(f"CaptureRefused: {error}")
    # the artifact, the manifest's fix (capturable: false, then the rest of the graph replays), its line
    assert f"in artifact mlp-{kind} (" in detail and '"capturable": false in its artifact.json' in detail
    assert f", at forward (<graphdispatch artifact mlp-{kind}:kernel.py>:" in detail
    (sub,) = graph["substitutions"]
    assert not sub["demoted"] and sub["calls"] == 6  # not the artifact's fault: it serves every (eager) call


def test_without_the_sync_check_emulate_replays_what_a_gpu_refuses(tmp_path, monkeypatch):
    """Mutation: the refusals removed, the syncing artifact captures and replays on CPU."""
    monkeypatch.setattr(tape_mod, "refusal", lambda *args: None)
    _, ref, compiled = _compiled(tmp_path, "sync")
    with torch.no_grad():
        for i in range(6):
            compiled(_x(i))
    (graph,) = accounted_graphs()
    assert graph["cuda_graph"]["replays"] > 0


def _python_value_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], dict[str, Any]]:
    """Calls 1-8 with shift 0, then the Python value and the buffer both move to 0.5:
    eager sees the move, a captured graph holds the value read at capture."""
    monkeypatch.setenv("GD_TEST_SHIFT", "0")
    model, ref, compiled = _compiled(tmp_path, "python_value", recheck="every")
    wrong = []
    with torch.no_grad():
        for i in range(1, 13):
            if i == 9:
                monkeypatch.setenv("GD_TEST_SHIFT", "0.5")
                model.mlp.shift.fill_(0.5)
                ref.mlp.shift.fill_(0.5)
            if not torch.equal(compiled(_x(i)), ref(_x(i))):
                wrong.append(i)
    (graph,) = accounted_graphs()
    return wrong, graph


def test_a_python_value_read_at_capture_is_frozen_and_the_check_blames_the_capture(tmp_path, monkeypatch):
    wrong, graph = _python_value_run(tmp_path, monkeypatch)
    assert wrong == []  # the checked call answers with eager's values
    cg = graph["cuda_graph"]
    assert cg["declines"] == {"verify_mismatch": 1}  # the capture, not the artifact, nor the lowering
    assert "call 9" in cg["decline_details"]["verify_mismatch"]
    (sub,) = graph["substitutions"]
    assert not sub["demoted"]  # run eagerly, the artifact reads the new value: right


def test_without_the_frozen_replay_emulate_misses_the_stale_value(tmp_path, monkeypatch):
    """Mutation: a replay that runs the graph's Python again reads the new value, so
    emulation sees nothing wrong where a GPU's replay serves the value read at capture."""
    record = tape_mod.Recorder.record

    def keeping(self: Any, fn: Any, args: Any) -> Any:
        self.tape.rerun = (fn, args)
        return record(self, fn, args)

    monkeypatch.setattr(tape_mod.Recorder, "record", keeping)
    monkeypatch.setattr(tape_mod.Tape, "replay", lambda self: list(self.rerun[0](*self.rerun[1])))
    wrong, graph = _python_value_run(tmp_path, monkeypatch)
    assert wrong == [] and graph["cuda_graph"]["declines"] == {}


# -- a custom op that syncs: transformers' grouped GEMM fallback ---------------------------------


@torch.library.custom_op("gdtest::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype)
    start = 0
    for i, end in enumerate(offs.tolist()):  # one host sync for all groups
        torch.mm(x[start:end], w[i], out=out[start:end])
        start = end
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([3, 6])  # where each expert's rows end
        return torch.relu(grouped_mm(x * 2, self.w, offs)) + 1


def test_a_custom_op_that_syncs_fails_its_piece_named_and_the_run_stays_bitwise():
    torch.manual_seed(0)
    model = Experts().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(6, 8)
            assert torch.equal(compiled(x), model(x))
    (graph,) = accounted_graphs()
    detail = graph["cuda_graph"]["decline_details"]["capture_failed"]
    assert "tolist" in detail and "in custom op gdtest::grouped_mm" in detail
    assert "at grouped_mm (test_tape.py:" in detail


def _tiny_mixtral(**config: Any) -> dict[str, Any]:
    """5 calls of a tiny transformers Mixtral compiled with emulate, each bitwise with eager:
    its one graph's report."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32, **config)
    model = transformers.MixtralModel(cfg).eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    with torch.no_grad():
        for i in range(5):
            ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i))
            assert torch.equal(compiled(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)
    (graph,) = accounted_graphs()
    return graph


def test_tiny_mixtral_with_its_default_experts_declines_what_a_gpu_would():
    """transformers' grouped GEMM fallback (used where torch's grouped GEMM is not: this
    CPU, GPUs before Hopper) reads its offsets on the host: the capture fails, naming it,
    and the graph answers eagerly, every output eager's. Its integer indexing of expert
    weights (`weights[expert_ids]`, sized by its arguments) splits nothing: a GPU captures it."""
    graph = _tiny_mixtral()
    assert graph["split_reasons"] == {}
    assert graph["cuda_graph"]["declines"] == {"capture_failed": 1}
    assert "transformers::grouped_mm_fallback" in graph["cuda_graph"]["decline_details"]["capture_failed"]


def test_tiny_mixtral_with_batched_mm_experts_replays_whole():
    """`experts_implementation="batched_mm"` (no host read): one graph, captured whole, replays."""
    graph = _tiny_mixtral(experts_implementation="batched_mm")
    assert graph["split_reasons"] == {} and not graph["cuda_graph"]["declines"]
    assert graph["cuda_graph"]["replays"] == 3, graph["cuda_graph"]


def test_rebind_reads_the_same_view_of_the_moved_tensor():
    """A relocation rebinds what the tape held (runtime/cudagraph/tape.py `rebind`): the same
    offset, sizes, strides and lazy negative bit, over the new storage; other values unchanged."""
    from graphdispatch_backend.runtime.cudagraph.tape import rebind

    old, new = torch.arange(12.0), torch.arange(12.0) + 100
    held = old[2:10].view(2, 4).t()._neg_view()
    moves = {old.untyped_storage().data_ptr(): new}
    got = rebind([held, 3, None], moves)
    assert got[1:] == [3, None] and got[0].is_neg() and got[0].stride() == held.stride()
    assert torch.equal(got[0].resolve_neg(), -new[2:10].view(2, 4).t())
    other = torch.ones(3)
    assert rebind(other, moves) is other
