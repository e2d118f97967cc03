"""GraphRunner: warmup -> capture -> verify -> replay, and every decline, on CPU.

Through torch.compile with `cuda_graphs="emulate"` (the full state machine on HostReplayEngine)
where the path matters, and on a GraphRunner built directly where that is simpler. Every
test compares each output with eager, bit for bit, and checks the report's accounting:
`calls == replays + eager_calls` and `eager_by_reason` sums to `eager_calls`.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

import graphdispatch_backend
from graphdispatch_backend.backend import graphdispatch_backend as backend_fn
from graphdispatch_backend.backend import make_contain
from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import CudaGraphStats
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Decline
from graphdispatch_backend.examples.dit import DiTConfig, example_inputs, make_model
from graphdispatch_backend.runtime.checks import novelty
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine
from graphdispatch_backend.runtime.runner import GraphRunner, RuntimeScope, State
from graphdispatch_backend.runtime.runner import book as book_mod
from graphdispatch_backend.runtime.runner import transitions as transitions_mod
from graphdispatch_backend.runtime.runner.transitions import MAX_RECAPTURES
from graphdispatch_backend.testing import (
    LinearBlock,
    accounted_graphs,
    generates_like_eager,
    linear_stack,
    manifest_from_region,
    region_entry,
    write_bundle,
)

# -- helpers ---------------------------------------------------------------------------


def make_runner(fn: Callable[..., Sequence[Any]], *, warmup: int = 2, max_captures: int = 8, verify_inputs: int = 2,
                state: dict[int, str] | None = None, gates: Sequence[Any] = (), engine: Any = None,
                scope: RuntimeScope | None = None, mutated: Sequence[int] = ()) -> tuple[GraphRunner, CudaGraphStats]:
    """A runner on its own scope. Note warmup=1 sees one observation, so every tensor input
    counts as pinned until it moves; tests that feed new tensors use warmup >= 2."""
    scope = scope or RuntimeScope(engine or HostReplayEngine(), Timing(), Events(), make_contain(False))
    stats = CudaGraphStats()
    runner = GraphRunner(fn, "piece", scope, stats, warmup=warmup, max_captures=max_captures,
                         verify_inputs=verify_inputs, state_names=state or {}, gates=gates, mutated=mutated)
    return runner, stats


def assert_stats_accounted(stats: CudaGraphStats, calls: int) -> None:
    assert stats.replays + stats.eager_calls == calls
    assert sum(stats.eager_by_reason.values()) == stats.eager_calls


def assert_report_accounted(report: dict[str, Any]) -> None:
    for graph in report["graphs"]:
        cg = graph["cuda_graph"]
        assert graph["calls"] == cg["replays"] + cg["eager_calls"], graph["name"]
        assert sum(cg["eager_by_reason"].values()) == cg["eager_calls"], graph["name"]
        for piece in graph["pieces"]:
            if "cuda_graph" in piece:
                stats = piece["cuda_graph"]
                assert sum(stats["eager_by_reason"].values()) == stats["eager_calls"]


def only_graph() -> dict[str, Any]:
    report = graphdispatch_backend.latest_report()
    assert report is not None
    assert_report_accounted(report)
    (graph,) = report["graphs"]
    return graph


def emulate(model: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    return torch.compile(model, backend="graphdispatch", options={"cuda_graphs": "emulate", **options})


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of (tuples of) tensors and constants, same dtype and strides."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def affine(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    return (x @ w + 1.0,)


class PtrMemo:
    """A kernel with a host-side cache keyed by input address (as a descriptor cache might
    be): right for every fresh tensor, stale on a static buffer whose values changed. Right
    on the capture inputs, wrong on changed ones: what verification is for."""

    def __init__(self) -> None:
        self.memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        hit = self.memo.get(x.data_ptr())
        if hit is None:  # keeps x alive, so no fresh tensor can reuse its address
            hit = self.memo[x.data_ptr()] = (x, x * 2 + 1)
        return (hit[1] + 0,)  # a new tensor: the capture poisons its outputs, never the cache


def run_checked(compiled: Callable[..., Any], model: Callable[..., Any],
                inputs: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Call both on every input set; every output must be bitwise equal to eager."""
    outs = []
    with torch.no_grad():
        for i, args in enumerate(inputs):
            got, want = compiled(*args), model(*args)
            assert same(got, want), f"call {i}"
            outs.append(got)
    return outs


# -- the fast path ---------------------------------------------------------------------


def test_block_stack_replays_after_warmup_and_verification():
    cfg = DiTConfig(depth=2, image_size=8)
    model = make_model(cfg=cfg)
    inputs = [example_inputs(seed=i, cfg=cfg) for i in range(7)]
    run_checked(emulate(model), model, inputs)
    graph = only_graph()
    cg = graph["cuda_graph"]
    # 1 warmup (the default), the capture call verifies on its live inputs and on a set derived
    # from them (both in that call), then replays
    assert cg["state"] == "verified"
    assert (cg["captures"], cg["replays"], cg["eager_calls"]) == (1, 5, 2)
    assert cg["eager_by_reason"] == {"warmup": 1, "verifying": 1}
    assert graph["calls"] == 7 == cg["replays"] + cg["eager_calls"]
    assert cg["declines"] == {}
    assert cg["static_bytes"] > 0


def test_direct_runner_state_machine_counts():
    runner, stats = make_runner(affine, warmup=3, verify_inputs=2)
    w = torch.randn(4, 4)
    keep = [torch.randn(3, 4) for _ in range(8)]  # kept alive: each call a new address (moving)
    states = []
    for x in keep:
        assert same(runner(x, w), affine(x, w))
        states.append(stats.state)
    assert states[:3] == ["warming"] * 3
    # the capture call verifies live and derived inputs in the same call: verified at once
    assert states[3:] == ["verified"] * 5
    assert (stats.captures, stats.replays) == (1, 4)
    assert stats.eager_by_reason == {"warmup": 3, "verifying": 1}
    assert_stats_accounted(stats, 8)


def test_outputs_returned_never_change_when_later_calls_replay():
    model = linear_stack()
    compiled = emulate(model, warmup=2)
    inputs = [(torch.randn(2, 8),) for _ in range(8)]
    outs = run_checked(compiled, model, inputs)
    snapshots = [o.clone() for o in outs]
    run_checked(compiled, model, [(torch.randn(2, 8),) for _ in range(3)])  # more replays overwrite static outputs
    assert all(torch.equal(o, s) for o, s in zip(outs, snapshots))
    assert only_graph()["cuda_graph"]["replays"] == 5 + 3  # 2 warmups, the capture call verifies, 5 replays


# -- scalar inputs are constants in the key -----------------------------------------------


def scaled(x: torch.Tensor, flag: bool, n: int, s: float) -> tuple[torch.Tensor]:
    return ((x * n + s) if flag else (x - n * s),)


def test_changed_bool_int_float_is_captured_anew_never_stale():
    runner, stats = make_runner(scaled, warmup=2, verify_inputs=1, max_captures=16)
    scalars = [(True, 2, 0.5), (False, 2, 0.5), (True, 3, 0.5), (True, 2, 1.5), (True, 2, -0.0), (True, 2, 0.0),
               (True, 1, float("nan"))]
    keep = []
    for _ in range(4):  # rounds: warm, warm, capture, replay each scalar combination
        for flag, n, s in scalars:
            x = torch.randn(4)
            keep.append(x)
            got = runner(x, flag, n, s)[0]
            want = scaled(x, flag, n, s)[0]
            # bits, not ==: a stale 0.0 where -0.0 was passed flips the sign of zeros
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (flag, n, s)
    assert stats.shape_keys == len(scalars)  # NaN finds its own entry again
    assert stats.captures == len(scalars)
    assert stats.replays == len(scalars)  # fourth round
    assert_stats_accounted(stats, 4 * len(scalars))


def test_negative_zero_does_not_replay_a_positive_zero_capture():
    runner, stats = make_runner(lambda x, s: (x * s,), warmup=1, verify_inputs=1)
    x = torch.tensor([1.0, -2.0, 3.0])
    for _ in range(3):
        runner(x, 0.0)
    assert stats.state == "verified"
    out = runner(x, -0.0)[0]
    assert torch.equal(out.view(torch.int32), (x * -0.0).view(torch.int32))


def test_dynamic_int_through_compile_is_keyed_not_baked():
    def f(x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n + n

    compiled = torch.compile(f, backend="graphdispatch", options={"cuda_graphs": "emulate", "warmup": 2},
                             dynamic=True)
    ns = [2] * 5 + [3] * 5 + [2, 3]
    run_checked(compiled, f, [(torch.randn(4), n) for n in ns])
    graph = only_graph()
    (piece,) = graph["pieces"]
    assert piece["cuda_graph"]["shape_keys"] == 2
    assert graph["cuda_graph"]["captures"] == 2
    assert graph["cuda_graph"]["replays"] == 6  # the 4th and 5th call of each n, and the last two


# -- tensors that move, restride or get reallocated -----------------------------------------


def test_restrided_view_of_the_same_storage_is_correct():
    base = torch.randn(4, 4)
    runner, stats = make_runner(affine, warmup=2, verify_inputs=1)
    w = torch.randn(4, 4)
    for _ in range(4):
        assert same(runner(base, w), affine(base, w))
    assert stats.replays == 1
    views = [base.t(), base[:, :2].t(), base.view(2, 8)[:, :4]]  # the same block, other shapes and strides
    for view in views:
        assert view.data_ptr() == base.data_ptr()
        for _ in range(4):
            assert same(runner(view, w), affine(view, w))
    base.add_(1.0)  # pinned inputs are read in place
    assert same(runner(base, w), affine(base, w))
    assert stats.replays == 1 + len(views) + 1
    assert stats.declines == {}
    assert_stats_accounted(stats, 4 + 4 * len(views) + 1)


def test_restrided_parameter_with_same_address_declines_parameter_moved():
    w = torch.randn(4, 4)
    runner, stats = make_runner(affine, warmup=2, verify_inputs=1, state={1: "lin.weight"})
    keep = [torch.randn(3, 4) for _ in range(6)]
    for x in keep[:4]:
        assert same(runner(x, w), affine(x, w))
    assert stats.replays == 1
    wt = w.t()  # same data_ptr, same key (parameters are keyed by address), other layout
    for x in keep[4:]:
        assert same(runner(x, wt), affine(x, wt))
    assert stats.declines == {"parameter_moved": 1}
    assert stats.eager_by_reason["parameter_moved"] == 2
    assert_stats_accounted(stats, 6)


def test_parameter_restrided_during_warmup_declines_parameter_moved():
    w = torch.randn(4, 4)
    runner, stats = make_runner(affine, warmup=2, state={1: "lin.weight"})
    for i in range(4):
        x = torch.randn(3, 4)
        wi = w if i % 2 == 0 else w.t()
        assert same(runner(x, wi), affine(x, wi))
    assert stats.declines == {"parameter_moved": 1}
    assert "during warmup" in stats.decline_details["parameter_moved"]
    assert_stats_accounted(stats, 4)


def test_moved_parameter_through_compile_is_correct_and_captured_anew():
    model = linear_stack(depth=1)
    compiled = emulate(model, warmup=2)
    run_checked(compiled, model, [(torch.randn(2, 8),) for _ in range(6)])
    assert only_graph()["cuda_graph"]["replays"] == 3  # 2 warmups, the capture call verifies, 3 replays
    model[0].lin.weight.data = torch.randn(8, 8)  # FSDP2 reshard / offload: a new storage under the graph
    run_checked(compiled, model, [(torch.randn(2, 8),) for _ in range(6)])
    cg = only_graph()["cuda_graph"]
    # the new parameter set is its own entry: warmed, captured and verified again, never replayed stale
    assert cg["captures"] == 2
    assert cg["replays"] == 6


def test_blocks_sharing_one_graph_each_capture():
    """With Dynamo's default inline_inbuilt_nn_modules, `block.compile()` on every block gives
    ONE compiled graph called with each block's parameters in turn. Before parameters were
    part of the entry key, that graph declined parameter_moved and never replayed."""
    blocks = [LinearBlock() for _ in range(3)]
    for b in blocks:
        b.eval().compile(backend="graphdispatch", options={"cuda_graphs": "emulate", "warmup": 2})
    keep = []  # intermediates kept alive: every block input is at a new address (moving), deterministically

    def run(x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            x = b(x)
            keep.append(x)
        return x

    def ref(x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            x = b.forward(x)  # Module.compile() leaves forward itself uncompiled
        return x

    run_checked(run, ref, [(torch.randn(2, 8),) for _ in range(6)])
    graph = only_graph()
    cg = graph["cuda_graph"]
    assert cg["captures"] == 3 and cg["declines"] == {}
    assert cg["replays"] == 3 * 3  # per block: 2 warmups, the capture call verifies, 3 replays
    (piece,) = graph["pieces"]
    assert piece["cuda_graph"]["shape_keys"] == 1


def test_too_many_parameter_sets_run_eager_as_parameter_moved(monkeypatch):
    monkeypatch.setattr(book_mod, "MAX_PARAMETER_SETS", 2)
    runner, stats = make_runner(affine, warmup=2, verify_inputs=1, state={1: "w"})
    ws = [torch.randn(4, 4) for _ in range(3)]
    keep = []
    for _ in range(4):  # rounds: warm, warm, capture, replay
        for w in ws:
            x = torch.randn(2, 4)
            keep.append(x)
            assert same(runner(x, w), affine(x, w))
    assert (stats.captures, stats.replays) == (2, 2)
    assert stats.declines == {"parameter_moved": 1}
    assert "more than 2 addresses" in stats.decline_details["parameter_moved"]
    assert stats.eager_by_reason["parameter_moved"] == 4
    assert_stats_accounted(stats, 12)


def test_input_reallocated_at_the_same_address_with_new_values_is_read_in_place():
    pool = torch.empty(64)
    runner, stats = make_runner(affine, warmup=2, verify_inputs=1)
    w = torch.randn(4, 4)
    for _ in range(6):
        x = pool[:12].view(3, 4)  # a new tensor object at the old address (the allocator reused the block)
        x.copy_(torch.randn(3, 4))
        assert same(runner(x, w), affine(x, w))
    assert stats.replays == 3 and stats.recaptures == 0  # pinned: read in place, never stale


def test_input_freed_and_reallocated_through_compile_is_correct():
    model = linear_stack()
    compiled = emulate(model)
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(2, 8)  # the previous x is freed: the allocator may hand back its address
            assert same(compiled(x), model(x))
            del x
    cg = only_graph()["cuda_graph"]
    assert cg["replays"] >= 1


def test_pinned_input_moved_relocates_it_as_moving():
    """An input the graph only reads, pinned through warmup, then a new tensor of the same
    layout on every call (a pipeline's embeddings per request): the graph only moved. It is
    captured again at once, the input moving from then on (no warmup, no verification: the
    same kernels, reading a copy laid out as the input was), and every call replays."""
    runner, stats = make_runner(affine, warmup=2, verify_inputs=1)
    x0, w = torch.randn(3, 4), torch.randn(4, 4)
    for _ in range(4):  # x0 never moves during warmup: pinned
        assert same(runner(x0, w), affine(x0, w))
    assert stats.replays == 1
    keep = [torch.randn(3, 4) for _ in range(6)]
    for x in keep:
        assert same(runner(x, w), affine(x, w))
    assert stats.relocations == 1 and stats.captures == 2 and stats.recaptures == 0
    assert stats.eager_by_reason.get("pinned_input_moved", 0) == 0 and stats.declines == {}
    assert stats.replays == 1 + 6  # relocated at the first move, then replays as moving
    assert_stats_accounted(stats, 10)


def test_pinned_input_moved_to_another_layout_recaptures_it_as_moving():
    """Moved with another layout (a view at another offset): no relocation; captured again as
    moving after warming up, and verified."""
    runner, stats = make_runner(affine, warmup=2, verify_inputs=1)
    x0, w = torch.randn(3, 4), torch.randn(4, 4)
    for _ in range(4):
        assert same(runner(x0, w), affine(x0, w))
    keep = [torch.randn(13)[1:].view(3, 4) for _ in range(6)]  # storage offset 1
    for x in keep:
        assert same(runner(x, w), affine(x, w))
    assert stats.eager_by_reason["pinned_input_moved"] == 1 and stats.relocations == 0
    assert stats.recaptures == 1 and stats.captures == 2
    assert stats.declines == {}
    assert stats.replays == 1 + 2  # re-warmed (2), captured and verified (1), then replays as moving
    assert_stats_accounted(stats, 10)


class _Conditioned(nn.Module):
    """A denoiser step that adds a conditioning tensor the pipeline keeps between steps (read
    in place while it stays), reached through the pipeline's nested state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, denoising_loop_state: dict[str, Any]) -> torch.Tensor:
        text = denoising_loop_state["text_encoder_2_outputs"]
        return self.lin(x) + text["negative_pooled_prompt_embeds_for_classifier_free_guidance"]


def test_a_pinned_input_that_moves_is_named_and_its_note_is_whole_in_timing_json(tmp_path):
    """The note says which input moved by the name the model gives it (not `input 3`), and
    timing.json keeps the note whole, the name and all."""
    name = "denoising_loop_state.text_encoder_2_outputs.negative_pooled_prompt_embeds_for_classifier_free_guidance"
    model = _Conditioned().eval()
    compiled = emulate(model, warmup=2, timing="host", report_dir=str(tmp_path))

    def state(t: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        return x, {"text_encoder_2_outputs": {"negative_pooled_prompt_embeds_for_classifier_free_guidance": t}}

    x, cond = torch.randn(2, 8), torch.randn(2, 8)
    moved = torch.randn(17)[1:].view(2, 8)  # at another offset: captured again as moving, after warming up
    run_checked(compiled, model, [state(cond)] * 5 + [state(moved)] * 3)  # it moves after a replay
    graphdispatch_backend.flush()
    cg = only_graph()["cuda_graph"]
    assert cg["eager_by_reason"]["pinned_input_moved"] == 1 and cg["recaptures"] == 1
    notes = json.loads((tmp_path / "timing.json").read_text())["notes"]
    (note,) = [n for n in notes if "pinned_input_moved" in n]
    assert re.fullmatch(rf"recapture graph_0\.piece_0: pinned_input_moved: `{name}` \(input \d+\) is not the tensor "
                        "the graph was captured with", note), note
    assert len(note) > 200  # longer than timing.json used to keep


def test_a_relocated_input_is_named_in_timing_json(tmp_path):
    """Moved with its layout, nothing else: relocated, and the note names it."""
    name = "denoising_loop_state.text_encoder_2_outputs.negative_pooled_prompt_embeds_for_classifier_free_guidance"
    model = _Conditioned().eval()
    compiled = emulate(model, warmup=2, timing="host", report_dir=str(tmp_path))
    x, cond = torch.randn(2, 8), torch.randn(2, 8)
    state = {"text_encoder_2_outputs": {"negative_pooled_prompt_embeds_for_classifier_free_guidance": cond}}
    later = {"text_encoder_2_outputs": {"negative_pooled_prompt_embeds_for_classifier_free_guidance":
                                        torch.randn(2, 8)}}
    run_checked(compiled, model, [(x, state)] * 5 + [(x, later)] * 3)
    graphdispatch_backend.flush()
    cg = only_graph()["cuda_graph"]
    assert cg["relocations"] == 1 and cg["recaptures"] == 0 and "pinned_input_moved" not in cg["eager_by_reason"]
    notes = json.loads((tmp_path / "timing.json").read_text())["notes"]
    (note,) = [n for n in notes if n.startswith("relocate")]
    assert re.fullmatch(rf"relocate graph_0\.piece_0: `{name}` \(input \d+\) moved, nothing else \(same layout and "
                        r"alignment class\): captured again at once, copied in from now on", note), note


def test_an_input_without_a_name_is_named_by_its_position():
    """A piece's input that is an intermediate value has no name: its position says which."""
    runner, stats = make_runner(affine, warmup=2, verify_inputs=1)
    runner._names = ("", "w")
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    for _ in range(4):
        runner(x, w)
    entry = next(iter(runner._book.entries.values()))
    said = "is not the tensor the graph was captured with"
    assert runner._check(entry, (torch.randn(3, 4), w))[1] == f"input 0 {said}"
    assert runner._check(entry, (x, torch.randn(4, 4)))[1] == f"`w` (input 1) {said}"


def test_pinned_inputs_that_keep_moving_end_up_moving_and_replay():
    """Each pinned input that moves becomes moving for good (with any other pinned input
    that moved at the same time): relocated at once where only its address changed, else
    re-captured; every re-capture makes progress, so there are at most as many as inputs,
    and the entry ends up replaying instead of declining."""
    def four(a, b, c, d):
        return (a + b * c - d,)

    for layout in ("same", "other"):  # relocated; re-captured (a view at another offset)
        runner, stats = make_runner(four, warmup=1, verify_inputs=1)
        args = [torch.randn(4) for _ in range(4)]
        calls = 0
        for moved in range(4):
            for _ in range(3):  # warm, capture, replay (replays once relocated)
                assert same(runner(*args), four(*args))
                calls += 1
            args[moved] = torch.randn(4) if layout == "same" else torch.randn(5)[1:]  # moves after verification
            assert same(runner(*args), four(*args))
            calls += 1
        moves = (stats.relocations, stats.recaptures)
        assert moves == ((4, 0) if layout == "same" else (0, 4)) and stats.declines == {}, moves
        replays = stats.replays
        for _ in range(5):  # every input is moving: fresh tensors replay (after a re-warm, re-captured)
            args = [torch.randn(4) if layout == "same" else torch.randn(5)[1:] for _ in range(4)]
            assert same(runner(*args), four(*args))
        assert stats.replays == replays + (5 if layout == "same" else 3), layout
        assert (stats.relocations, stats.recaptures) == moves
        assert_stats_accounted(stats, calls + 5)


def _cache_step(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor]:
    cache.index_copy_(0, pos, k)
    return (cache.sum(0) + k[0],)


def _requests(runner: GraphRunner, requests: int, tokens: int) -> list[int]:
    """`requests` requests of `tokens` calls, each on a new cache (as transformers'
    `generate` makes one per request), bitwise with eager, cache included; the bytes one
    replay of the entry copies, after each request."""
    copies = []
    for _ in range(requests):
        cache, ref = torch.zeros(64, 4), torch.zeros(64, 4)
        for i in range(tokens):
            pos, k = torch.tensor([i]), torch.randn(1, 4)
            assert same(runner(cache, pos, k), _cache_step(ref, pos, k)) and torch.equal(cache, ref)
        (entry,) = runner._book.entries.values()
        copies.append(entry.copy_bytes)
    return copies


def test_a_cache_replaced_for_every_request_is_relocated_at_its_new_address():
    """A static KV cache that `generate` allocates anew for each request: as a moving input
    every replay would copy it whole, in and back. The verified graph only moved: it is
    captured at once at the new address (runner/relocate.py) and the call replays, for as
    many requests as come; no call of a later request runs eager."""
    runner, stats = make_runner(_cache_step, warmup=2, verify_inputs=1, mutated=(0,))
    requests = transitions_mod.MAX_REPINS + 3
    copies = _requests(runner, requests, 24)
    assert max(copies) < 64 * 4 * 4, copies  # never the cache (1 KiB): its row, the output
    assert stats.relocations == requests - 1 and "pinned_input_moved" not in stats.eager_by_reason
    assert stats.replays == requests * 24 - 3  # the first request's 2 warmup calls and its capture call
    assert_stats_accounted(stats, requests * 24)


def test_a_relocation_keeps_the_static_buffers_its_verified_capture_read():
    """A moving input arrives at another alignment than at the capture (a row of a bigger
    tensor: a timestep taken from the schedule's tensor, a token from the prompt's): its
    static buffer for this call's alignment is another one. The relocated graph reads the
    buffer the verified capture read (the graph's own memory); re-derived from the call's
    inputs, the rebound capture read the old buffer's view over the new one: wrong values."""
    runner, stats = make_runner(_cache_step, warmup=2, verify_inputs=1, mutated=(0,))
    flat = torch.randn(256)  # k is 4 floats from element i on: its alignment mod 16 bytes turns with i
    for request in range(3):
        cache, ref = torch.zeros(64, 4), torch.zeros(64, 4)
        for i in range(request, request + 6):  # each request starts at another row
            pos, k = torch.tensor([i]), flat[i:i + 4].view(1, 4)
            assert same(runner(cache, pos, k), _cache_step(ref, pos, k)) and torch.equal(cache, ref), (request, i)
    assert stats.relocations == 2 and stats.declines == {}
    assert_stats_accounted(stats, 18)


def test_short_requests_replay_every_call_after_the_first_request():
    """Requests of 3 calls, a new cache each: every call of a later request replays, the
    first of them in the call that captures; the caches the caller dropped are released."""
    runner, stats = make_runner(_cache_step, warmup=2, verify_inputs=1, mutated=(0,))
    copies = _requests(runner, 40, 3)
    assert max(copies) < 64 * 4 * 4, copies
    assert stats.replays == 39 * 3 and stats.relocations == 39 and stats.eager_calls == 3
    (entry,) = runner._book.entries.values()
    assert entry.held == {0} and all(p.alive for p in entry.parked.values()) and len(entry.parked) <= 1
    assert_stats_accounted(stats, 40 * 3)


def test_a_relocation_runs_the_graph_as_often_as_its_capture_plus_the_replay():
    runs = [0]

    def step(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor]:
        runs[0] += 1
        return _cache_step(cache, pos, k)

    runner, stats = make_runner(step, warmup=2, verify_inputs=1, mutated=(0,))
    _requests(runner, 1, 6)
    cache, before = torch.zeros(64, 4), stats.replays
    runs[0] = 0
    runner(cache, torch.tensor([0]), torch.randn(1, 4))  # the new cache's first call
    assert stats.relocations == 1 and stats.replays == before + 1
    # the host model rebinds the verified tape to the new cache (cudagraph/host.py): no run
    # of the graph's Python; a CUDA capture runs it twice (its warmup and its recording),
    # and the replay runs none
    assert runs[0] == 0


def test_a_rotation_of_caches_replays_without_capturing_after_the_first_round():
    """A server with one cache per slot, reused: a capture per cache address, parked beside
    the entry, found again by address."""
    runner, stats = make_runner(_cache_step, warmup=2, verify_inputs=1, mutated=(0,), max_captures=8)
    caches = [torch.zeros(64, 4) for _ in range(4)]
    refs = [torch.zeros(64, 4) for _ in range(4)]
    for rnd in range(4):
        for cache, ref in zip(caches, refs):
            for i in range(3):
                pos, k = torch.tensor([3 * rnd + i]), torch.randn(1, 4)
                assert same(runner(cache, pos, k), _cache_step(ref, pos, k)) and torch.equal(cache, ref)
        if rnd == 0:
            captures = stats.captures
    assert stats.captures == captures == 4  # one per cache, in the first round only
    assert stats.replays == 4 * 4 * 3 - 3 and stats.parked == 3


def test_a_cache_of_another_alignment_class_is_captured_and_verified_anew():
    """Kernels pick paths by address alignment (runner/relocate.py ALIGNMENT): a cache at
    an address of another class is no relocation; it takes the verified path again."""
    runner, stats = make_runner(_cache_step, warmup=2, verify_inputs=1, mutated=(0,))
    _requests(runner, 1, 6)
    # a cache whose storage starts 4 bytes past a 64-byte boundary: the same layout
    cache = torch.frombuffer(bytearray(64 * 4 * 4 + 4), dtype=torch.float32, offset=4, count=64 * 4).view(64, 4)
    cache.zero_()
    assert cache.data_ptr() % 64 != runner._book.entries[next(iter(runner._book.entries))].ptrs[0] % 64
    ref = torch.zeros(64, 4)
    for i in range(4):
        pos, k = torch.tensor([i]), torch.randn(1, 4)
        assert same(runner(cache, pos, k), _cache_step(ref, pos, k)) and torch.equal(cache, ref)
    assert stats.relocations == 0 and stats.eager_by_reason["pinned_input_moved"] >= 1


def test_without_relocation_short_requests_run_eager():
    """Mutation: the old path, a re-capture with warmup and verification per new cache,
    backing off: most calls of short requests run eager."""
    runner, stats = make_runner(_cache_step, warmup=2, verify_inputs=1, mutated=(0,))
    runner._relocator.relocate = lambda entry, args: False  # type: ignore[method-assign]
    _requests(runner, 40, 3)
    assert stats.replays < 40 * 3 // 2 and stats.relocations == 0


@pytest.mark.parametrize("tokens", [24, 3])
def test_without_the_rule_the_replaced_cache_is_copied_whole(monkeypatch, tokens):
    monkeypatch.setattr(transitions_mod, "never_moving", lambda positions, args, written: set())
    runner, _ = make_runner(_cache_step, warmup=2, verify_inputs=1, mutated=(0,))
    copies = _requests(runner, transitions_mod.MAX_REPINS + 3 if tokens > 3 else 40, tokens)
    assert max(copies) >= 2 * 64 * 4 * 4  # in and back, every replay


def test_an_input_marked_static_is_read_in_place_even_if_it_moved_during_warmup():
    """`torch._dynamo.mark_static_address` (transformers marks its caches): the owner says
    the address is the graph's; copying it in would cost its size on every replay."""
    def read(table: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (table.sum(0) * x,)

    runner, stats = make_runner(read, warmup=2, verify_inputs=1)
    tables = [torch.randn(256, 4) for _ in range(2)]
    for t in tables:
        torch._dynamo.mark_static_address(t)
    x = torch.randn(4)
    for table in (tables[0], tables[1], tables[1], tables[1], tables[1]):  # moved between the warmup calls
        assert same(runner(table, x), read(table, x))
    (entry,) = runner._book.entries.values()
    assert 0 in entry.pinned, entry.pinned
    assert entry.copy_bytes < tables[0].numel() * 4 and stats.replays >= 2


def test_the_capture_records_from_the_callers_state_not_the_warmups():
    """The engine's warmup run writes what the graph writes (a cache row, the position
    after it); the recording must start from the caller's state, as a CUDA capture, which
    runs nothing, does: recorded from the advanced position, the host model would index
    past the cache (transformers' sliding-window caches declined `capture_failed` so)."""
    def step(cache: torch.Tensor, n: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor]:
        cache.index_copy_(0, n, k)
        n.add_(1)
        return (cache.sum(0),)

    runner, stats = make_runner(step, warmup=1, verify_inputs=1, mutated=(0, 1))
    cache, n, ref_cache, ref_n = torch.zeros(2, 4), torch.tensor([0]), torch.zeros(2, 4), torch.tensor([0])
    for _ in range(2):  # the second call captures at the last row
        k = torch.randn(1, 4)
        assert same(runner(cache, n, k), step(ref_cache, ref_n, k))
        assert torch.equal(cache, ref_cache) and torch.equal(n, ref_n)
    assert stats.declines == {} and stats.captures == 1, stats.decline_details


def test_a_transformers_sliding_window_cache_generate_captures_and_replays():
    """Gemma 2's static cache has sliding-window layers: the capture call's position is the
    window's last row, which a recording from after the warmup would index past. (Dynamo
    specializes each step on the cache's length: a graph per step, called once per
    generate; the third generate replays.)"""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                       query_pre_attn_scalar=16, max_position_embeddings=256, pad_token_id=0,
                                       bos_token_id=1, eos_token_id=None)
    model = transformers.Gemma2ForCausalLM(config).eval()
    model.config._attn_implementation = "eager"
    prompt = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", max_cache_len=32,
              return_dict_in_generate=True, output_logits=True, disable_compile=True)
    generates_like_eager(model, prompt, kw, 3)
    report = graphdispatch_backend.latest_report()
    assert_report_accounted(report)
    assert all(not g["cuda_graph"]["declines"] for g in report["graphs"]), report["graphs"]
    assert report["totals"]["replays"] > 0


def _llama(cache_len: int = 64) -> tuple[Any, Any, torch.Tensor, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=cache_len,
                                      attn_implementation="eager", bos_token_id=None, eos_token_id=None,
                                      pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", max_cache_len=cache_len,
              pad_token_id=0, disable_compile=True)
    return transformers, model, prompt, kw


def _decode(report: dict[str, Any]) -> dict[str, Any]:
    return max(report["graphs"], key=lambda g: g["calls"])


def test_short_transformers_requests_with_a_new_cache_each_replay_after_the_first():
    """`generate` with 4 new tokens, a new StaticCache per request (transformers' default):
    every decode call after the first request replays or is the call that captures."""
    _, model, prompt, kw = _llama()
    with torch.no_grad():
        ref = model.generate(prompt, **kw)
        model.forward = torch.compile(model.forward, backend="graphdispatch", options={"cuda_graphs": "emulate"},
                                      dynamic=False)
        for _ in range(6):
            assert torch.equal(model.generate(prompt, **kw), ref)
    report = graphdispatch_backend.latest_report()
    assert_report_accounted(report)
    decode = _decode(report)["cuda_graph"]
    assert decode["eager_calls"] == 2 and decode["replays"] == 6 * 3 - 2  # the first request: warmup, capture
    assert decode["relocations"] == 5 and not decode["declines"]


def test_a_rotation_of_transformers_caches_replays_without_capturing_after_the_first_round():
    transformers, model, prompt, kw = _llama()
    kw.pop("cache_implementation")
    caches = [transformers.StaticCache(config=model.config, max_cache_len=64) for _ in range(4)]
    with torch.no_grad():
        ref = model.generate(prompt, cache=transformers.StaticCache(config=model.config, max_cache_len=64),
                             **kw)
        model.forward = torch.compile(model.forward, backend="graphdispatch", options={"cuda_graphs": "emulate"},
                                      dynamic=False)
        for rnd in range(3):
            for cache in caches:
                cache.reset()
                assert torch.equal(model.generate(prompt, cache=cache, **kw), ref)
            if rnd == 0:
                captures = _decode(graphdispatch_backend.latest_report())["cuda_graph"]["captures"]
    decode = _decode(graphdispatch_backend.latest_report())["cuda_graph"]
    assert decode["captures"] == captures and decode["replays"] == 12 * 3 - 2 and not decode["declines"]


@pytest.mark.parametrize("fuse", [False, True])
def test_transformers_own_compile_path_generates_eagers_tokens_and_replays(fuse):
    """`generate(..., compile_config=CompileConfig(backend="graphdispatch", ...))`:
    transformers compiles the model's call itself and uses it for the decode steps (docs/
    serving.md). Its CompileConfig's default `mode` is "reduce-overhead", which torch.compile
    refuses beside `options`: `mode=None` says so. On a CPU transformers compiles only when
    told to (`_compile_all_devices`)."""
    transformers, model, prompt, kw = _llama()
    kw.pop("disable_compile")
    config = transformers.CompileConfig(backend="graphdispatch", mode=None,
                                        options={"cuda_graphs": "emulate", "fuse": fuse})
    config._compile_all_devices = True
    with torch.no_grad():
        for request in range(3):
            ids = prompt if request == 0 else torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(
                request))
            ref = model.generate(ids, **kw)
            assert torch.equal(model.generate(ids, compile_config=config, **kw), ref)
    report = graphdispatch_backend.latest_report()
    assert_report_accounted(report)
    (decode,) = report["graphs"]  # the prefill runs uncompiled: transformers compiles the decode steps
    assert decode["calls"] == 3 * (kw["max_new_tokens"] - 1)
    assert decode["cuda_graph"]["replays"] == decode["calls"] - 2 and not decode["cuda_graph"]["declines"]
    assert (decode["fusion"] or {}).get("status") == ("fused" if fuse else None)


def test_several_pinned_inputs_moving_at_once_are_demoted_together():
    def four(a, b, c, d):
        return (a + b * c - d,)

    runner, stats = make_runner(four, warmup=1, verify_inputs=1)
    args = [torch.randn(4) for _ in range(4)]
    for _ in range(3):
        assert same(runner(*args), four(*args))
    args = [torch.randn(4) for _ in range(4)]  # all four move in one call: relocated, all moving
    for _ in range(5):
        assert same(runner(*args), four(*args))
        args = [torch.randn(4) for _ in range(4)]
    assert stats.relocations == 1 and stats.recaptures == 0 and stats.declines == {}
    runner, stats = make_runner(four, warmup=1, verify_inputs=1)
    args = [torch.randn(4) for _ in range(4)]
    for _ in range(3):
        assert same(runner(*args), four(*args))
    args = [torch.randn(5)[1:] for _ in range(4)]  # all four move, at another offset: captured again, as moving
    for _ in range(5):
        assert same(runner(*args), four(*args))
        args = [torch.randn(5)[1:] for _ in range(4)]
    assert stats.recaptures == 1 and stats.relocations == 0 and stats.declines == {}


# -- shape keys and max_captures ---------------------------------------------------------


def test_keys_that_only_warm_do_not_evict_the_captured_ones():
    """max_captures bounds the keys holding a capture; keys still warming hold no memory."""
    model = linear_stack(depth=1)
    compiled = torch.compile(model, backend="graphdispatch", dynamic=True,
                             options={"cuda_graphs": "emulate", "warmup": 2, "max_captures": 2})
    inputs = [(torch.randn(b, 8),) for b in [2] * 5 + [3] * 5 + [4, 4, 5, 2, 3]]
    run_checked(compiled, model, inputs)
    graph = only_graph()
    cg = graph["cuda_graph"]
    assert cg["captures"] == 2 and cg["declines"] == {}
    assert cg["eager_by_reason"]["warmup"] == 2 + 2 + 3  # batch 2, 3, then 4 twice and 5: warming
    assert cg["replays"] == 6  # batch 2 and 3 replay twice each (their 4th, 5th call), and go on replaying
    assert graph["pieces"][0]["cuda_graph"]["shape_keys"] == 4
    assert graph["pieces"][0]["cuda_graph"]["evictions"] == 0


def _cycle_int_scale(rounds: int, values: int = 13) -> tuple[dict[str, Any], list[int]]:
    """`linear(x) * t` with t a Python int cycling through `values` values, one call each per
    round, max_captures=4: every key is evicted before it verified. Replays per round."""
    lin = nn.Linear(8, 8).eval()

    def f(x: torch.Tensor, t: int) -> torch.Tensor:
        return lin(x) * t

    compiled = torch.compile(f, backend="graphdispatch", options={"cuda_graphs": "emulate", "max_captures": 4})
    x = torch.randn(2, 8)
    per_round = []
    with torch.no_grad():
        for _ in range(rounds):
            before = _replays()
            for t in range(1, values + 1):
                assert torch.equal(compiled(x, t), f(x, t)), t
            per_round.append(_replays() - before)
    graphs = accounted_graphs()
    return graphs[-1], per_round


def _replays() -> int:
    report = graphdispatch_backend.latest_report()
    return sum(g["cuda_graph"]["replays"] for g in report["graphs"]) if report else 0


def test_keys_cycling_past_max_captures_stop_evicting_and_name_the_scalar():
    """Thirteen int values, one call each: evicting would capture on every call and replay on
    none. After THRASH_LIMIT wasted evictions the keys past the captured ones run eager."""
    graph, per_round = _cycle_int_scale(rounds=10)
    cg = graph["cuda_graph"]
    assert cg["declines"] == {"max_captures": 1}
    detail = cg["decline_details"]["max_captures"]
    assert "evicted before they verified" in detail and "`t`" in detail and "as a tensor" in detail
    assert cg["captures"] <= book_mod.THRASH_LIMIT + 4
    assert per_round[-1] == 4  # the four captured values replay every round; the others run eager
    assert cg["eager_by_reason"]["max_captures"] > 0


def test_without_the_thrash_guard_captures_never_stop(monkeypatch):
    monkeypatch.setattr(book_mod.EntryBook, "thrashing", lambda self, key: False)
    graph, per_round = _cycle_int_scale(rounds=20)
    # keys re-warm after their eviction and capture again: about 2.5 captures a round, for good
    assert graph["cuda_graph"]["captures"] > 3 * (book_mod.THRASH_LIMIT + 4) and per_round[-1] < 4


def test_a_shape_key_new_on_every_call_is_shape_churn_not_warmup():
    """A decode loop's growing cache in small: x grows by one row per call. Past 16 new keys
    in a row the calls say the fast path is not coming, and name the input; a length that
    then comes back warms, captures and replays as usual."""
    lin = nn.Linear(8, 8).eval()

    def f(x: torch.Tensor) -> torch.Tensor:
        return lin(x)

    compiled = torch.compile(f, backend="graphdispatch", dynamic=True,
                             options={"cuda_graphs": "emulate", "warmup": 2, "verify_inputs": 2})
    lengths = list(range(2, 26)) + [5] * 8
    with torch.no_grad():
        for n in lengths:
            x = torch.randn(n, 8)
            assert torch.equal(compiled(x), f(x)), n
    graph = accounted_graphs()[-1]
    cg = graph["cuda_graph"]
    assert cg["eager_by_reason"]["shape_churn"] == 24 - 15  # the 16th new key in a row onwards
    assert cg["declines"] == {"shape_churn": 1}
    assert cg["decline_details"]["shape_churn"].endswith("the keys differ in `x`")  # not its size symbol too
    # length 5 again (its first call was during the churn): one more warmup call, the capture's
    # call (verified against eager on its live inputs and a set derived from them), then replays
    assert cg["replays"] == 8 - 2 and cg["captures"] == 1


def test_a_python_number_new_on_every_call_is_churn_that_says_so():
    """A step counter `t` that never repeats, used in math (not liftable): shape_churn, and the
    detail says a tensor would serve every value."""
    lin = nn.Linear(8, 8).eval()

    def f(x: torch.Tensor, t: int) -> torch.Tensor:
        return lin(x) * t

    compiled = torch.compile(f, backend="graphdispatch", options={"cuda_graphs": "emulate"})
    x = torch.randn(2, 8)
    with torch.no_grad():
        for t in range(1, 21):
            assert torch.equal(compiled(x, t), f(x, t)), t
    cg = accounted_graphs()[-1]["cuda_graph"]
    detail = cg["decline_details"]["shape_churn"]
    assert "the keys differ in `t`" in detail and "`t` is a Python number" in detail and "as a tensor" in detail


# -- every decline reason, forced ----------------------------------------------------------


@pytest.mark.parametrize(("cuda_graphs", "reason"), [(False, "disabled"), ("auto", "not_cuda")])
def test_graph_level_declines(cuda_graphs, reason):
    model = linear_stack(depth=1)
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": cuda_graphs})
    run_checked(compiled, model, [(torch.randn(2, 8),) for _ in range(5)])
    cg = only_graph()["cuda_graph"]
    assert cg["mode"] == "off" and cg["reason"] == reason
    assert cg["eager_by_reason"] == {reason: 5}
    assert cg["declines"] == {reason: 1}


def test_no_cuda_device_declines(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # deterministic on a GPU machine too
    model = linear_stack(depth=1)
    compiled = torch.compile(model, backend="graphdispatch", mode="reduce-overhead")
    run_checked(compiled, model, [(torch.randn(2, 8),) for _ in range(3)])
    cg = only_graph()["cuda_graph"]
    assert cg["reason"] == "no_cuda_device"
    assert cg["eager_by_reason"] == {"no_cuda_device": 3}


def test_training_graph_captures_its_forward_and_backward():
    model = linear_stack(depth=1).train()
    ref = linear_stack(depth=1).train()
    compiled = emulate(model)
    for _ in range(8):
        x = torch.randn(2, 8)
        out, want = compiled(x), ref(x)
        assert torch.equal(out, want)
        out.sum().backward()
        want.sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    graph = only_graph()
    assert graph["kind"] == "autograd"
    assert graph["cuda_graph"]["eager_by_reason"] == {"warmup": 1, "verifying": 1}
    assert graph["cuda_graph"]["replays"] == 6 and graph["backward"]["cuda_graph"]["replays"] > 0


def test_non_tensor_output_declines():
    runner, stats = make_runner(lambda x: (x + 1, [x]), warmup=1)
    for _ in range(3):
        x = torch.randn(4)
        out = runner(x)
        assert torch.equal(out[0], x + 1) and out[1][0] is x
    assert stats.declines == {"non_tensor_output": 1}
    assert "list" in stats.decline_details["non_tensor_output"]
    assert stats.eager_by_reason == {"warmup": 1, "non_tensor_output": 2}


def test_none_and_scalar_outputs_replay_as_constants():
    runner, stats = make_runner(lambda x: (x + 1, None, 3, 0.5, True), warmup=2, verify_inputs=1)
    keep = [torch.randn(4) for _ in range(5)]
    for x in keep:
        assert same(runner(x), (x + 1, None, 3, 0.5, True))
    assert stats.replays == 2 and stats.declines == {}


class _FailingCapture(HostReplayEngine):
    def capture(self, fn, args, device="cpu", **engine_kwargs):
        raise RuntimeError("capture exploded")


class _FailingReplay(HostReplayEngine):
    def capture(self, fn, args, device="cpu", **engine_kwargs):
        graph = super().capture(fn, args, device, **engine_kwargs)

        def boom() -> None:
            raise RuntimeError("replay exploded")

        graph.replay = boom
        return graph


@pytest.mark.parametrize(("engine", "reason", "detail"), [
    (_FailingCapture(), "capture_failed", "capture exploded"),
    (_FailingReplay(), "replay_failed", "replay exploded"),
])
def test_engine_failures_decline(engine, reason, detail):
    runner, stats = make_runner(affine, warmup=1, engine=engine)
    w = torch.randn(4, 4)
    for _ in range(4):
        x = torch.randn(3, 4)
        assert same(runner(x, w), affine(x, w))
    assert stats.declines == {reason: 1}
    assert detail in stats.decline_details[reason]
    assert stats.state == "eager"
    assert_stats_accounted(stats, 4)


class _FailsWhenServing(HostReplayEngine):
    """Replays right while verifying, then raises (a device fault after publish)."""

    def __init__(self, good_replays: int) -> None:
        super().__init__()
        self.good = good_replays

    def capture(self, fn, args, device="cpu", **engine_kwargs):
        graph = super().capture(fn, args, device, **engine_kwargs)
        inner = graph.replay

        def replay() -> None:
            if self.good <= 0:
                raise RuntimeError("device fault on replay")
            self.good -= 1
            inner()

        graph.replay = replay
        return graph


def test_replay_failing_after_verification_declines_and_answers_eagerly():
    runner, stats = make_runner(affine, warmup=2, verify_inputs=2, engine=_FailsWhenServing(good_replays=3))
    w = torch.randn(4, 4)
    keep = [torch.randn(3, 4) for _ in range(9)]
    # 2 warmups, the capture call verifying (2 good replays: the derived set's and the live
    # one), 1 served replay, then the fault
    for x in keep:
        assert same(runner(x, w), affine(x, w))
    assert stats.replays == 1
    assert stats.declines == {"replay_failed": 1}
    assert "device fault on replay" in stats.decline_details["replay_failed"]
    assert stats.eager_by_reason["replay_failed"] == 5  # the failing call and every later one
    assert stats.state == "eager"
    assert_stats_accounted(stats, len(keep))


def test_replay_failing_after_verification_raises_under_strict():
    from graphdispatch_backend.errors import GraphDispatchError

    scope = RuntimeScope(_FailsWhenServing(good_replays=2), Timing(), Events(), make_contain(True))
    runner, _ = make_runner(affine, warmup=2, verify_inputs=2, scope=scope)
    w = torch.randn(4, 4)
    keep = [torch.randn(3, 4) for _ in range(4)]
    for x in keep[:3]:  # 2 warmups, the capture call verifying (its 2 good replays)
        runner(x, w)
    with pytest.raises(GraphDispatchError, match="device fault on replay"):
        runner(keep[3], w)  # the first served replay


def test_capture_failed_through_compile_keeps_outputs_right(monkeypatch):
    monkeypatch.setattr(HostReplayEngine, "capture", _FailingCapture.capture)
    model = linear_stack()
    run_checked(emulate(model, warmup=1), model, [(torch.randn(2, 8),) for _ in range(4)])
    cg = only_graph()["cuda_graph"]
    assert cg["declines"] == {"capture_failed": 1}
    assert cg["eager_by_reason"] == {"warmup": 1, "capture_failed": 3}


def test_verify_mismatch_declines():
    runner, stats = make_runner(PtrMemo(), warmup=2, verify_inputs=2)
    keep = [torch.randn(4) for _ in range(6)]
    for x in keep:
        assert same(runner(x), (x * 2 + 1,))  # a verifying call answers with eager's output
    assert stats.declines == {"verify_mismatch": 1}
    assert "bits differ" in stats.decline_details["verify_mismatch"]
    # caught at the capture call, by the set derived from its inputs: the 3 later calls run eager
    assert stats.eager_by_reason == {"warmup": 2, "verifying": 1, "verify_mismatch": 3}
    assert stats.replays == 0


class _Gate:
    """A stand-in for an ArtifactGate: what the runner reads (demoted, a bitwise parity, its
    id) and tells (replayed)."""

    tolerant = False
    artifact = "stand-in"

    def __init__(self) -> None:
        self.demoted = False
        self.replays = 0
        self.native_calls = 0

    def replayed(self, native: bool = False) -> None:
        if native:
            self.native_calls += 1
        else:
            self.replays += 1


def test_artifact_demoted_after_capture_recaptures_then_declines():
    gate = _Gate()
    runner, stats = make_runner(affine, warmup=1, verify_inputs=1, gates=[gate])
    w, x = torch.randn(4, 4), torch.randn(3, 4)
    keep = []

    def call() -> None:
        keep.append(x)
        assert same(runner(x, w), affine(x, w))

    for flip in range(MAX_RECAPTURES + 1):
        for _ in range(3):
            call()
        gate.demoted = not gate.demoted  # a stand-in gate may flip back; a real demotion is permanent
        call()
        assert stats.eager_by_reason["artifact_demoted"] == flip + 1
    assert stats.recaptures == MAX_RECAPTURES
    assert stats.declines == {"artifact_demoted": 1}
    assert_stats_accounted(stats, len(keep))


def test_a_replay_runs_none_of_the_artifacts_python(tmp_path, monkeypatch):
    """A CUDA graph replays kernels, not the Python that launched them (the host model
    replays its recorded ops, cudagraph/tape.py): once the graph replays, the artifact's
    own call counter stands still while the report counts replays, and a failure its
    Python would raise now is never reached. Mutation: a replay that re-runs the graph's
    Python counts every call and demotes the artifact."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ff = LinearBlock(residual=False)  # region `ff`: relu(lin(x))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ff(x) * 2

    torch.manual_seed(0)
    model = Model().eval()
    region = region_entry(model, torch.randn(2, 8), name="ff", cuda_graphs="emulate")
    names = [i["name"] for i in region["inputs"]]
    source = (
        "import os\nimport torch\n\n\n"
        "def forward(*args):\n"
        "    os.environ['GD_TEST_KERNEL_CALLS'] = str(int(os.environ.get('GD_TEST_KERNEL_CALLS', '0')) + 1)\n"
        "    if os.environ.get('GD_TEST_KERNEL_FAIL'):\n"
        "        raise RuntimeError('kernel gave up')\n"
        f"    b, w, x = args[{names.index('lin.bias')}], args[{names.index('lin.weight')}], "
        f"args[{names.index('input0')}]\n"
        "    return torch.relu(torch.addmm(b, x, w.t()))\n"
    )
    write_bundle(tmp_path / "ff", "ff-relu", "ff", **manifest_from_region(region), source=source)
    monkeypatch.delenv("GD_TEST_KERNEL_FAIL", raising=False)
    monkeypatch.setenv("GD_TEST_KERNEL_CALLS", "0")
    # no check in these calls: a check (by schedule or for new inputs) judges the kernel beside its
    # region, running its Python (runtime/checks/isolate.py `beside`)
    monkeypatch.setattr(novelty, "ENABLED", False)
    compiled = emulate(model, artifacts=str(tmp_path), warmup=2, recheck=1024, artifact_recheck=1024)
    run_checked(compiled, model, [(torch.randn(2, 8),) for _ in range(6)])
    assert only_graph()["cuda_graph"]["replays"] == 3
    ran = int(os.environ["GD_TEST_KERNEL_CALLS"])
    monkeypatch.setenv("GD_TEST_KERNEL_FAIL", "1")
    run_checked(compiled, model, [(torch.randn(2, 8),) for _ in range(7)])
    graph = only_graph()
    assert int(os.environ["GD_TEST_KERNEL_CALLS"]) == ran  # 7 more replays, no Python
    assert graph["cuda_graph"]["replays"] == 10 and graph["cuda_graph"]["captures"] == 1
    (sub,) = graph["substitutions"]
    assert not sub["demoted"]


class _Tupled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.relu(self.lin(x)),)


def test_contract_mismatch_runs_the_native_graph():
    # Without Dynamo's guards in front (the backend called directly), nothing but the
    # contract stops a batch of 3 from reaching a graph traced for 2.
    model = _Tupled().eval()
    with torch.no_grad():
        fn = backend_fn(fx.symbolic_trace(model), [torch.randn(2, 8)], options={"cuda_graphs": "emulate"})
        for batch in (2, 3, 2):
            x = torch.randn(batch, 8)
            assert torch.equal(fn(x)[0], model(x)[0])
        # only the compiled guards see this one; explaining it used to crash the process
        x = torch.randn(2, 8, requires_grad=True)
        assert torch.equal(fn(x)[0], model(x)[0])
    graph = only_graph()
    assert graph["contract_mismatches"] == 2
    assert "size (3, 8)" in graph["contract_detail"]
    assert graph["cuda_graph"]["eager_by_reason"]["contract_mismatch"] == 2


def test_backend_error_runs_the_dynamo_graph(monkeypatch):
    import graphdispatch_backend.backend as backend_module

    def broken(gm, ctx):
        raise RuntimeError("a pass exploded")

    monkeypatch.setattr(backend_module, "run_pipeline", broken)
    model = linear_stack(depth=1)
    run_checked(emulate(model), model, [(torch.randn(2, 8),) for _ in range(3)])
    graph = only_graph()
    assert graph["kind"] == "fallback" and "a pass exploded" in graph["error"]
    assert graph["cuda_graph"]["eager_by_reason"] == {"backend_error": 3}


def test_decline_is_logged_at_warning_once_per_reason(gd_log):
    runner, _ = make_runner(lambda x: (x, "s"), warmup=1)
    other, _ = make_runner(lambda x: (x, "s"), warmup=1, scope=runner._scope)  # one session, one Events
    for r in (runner, other):
        for _ in range(3):
            r(torch.randn(2))
    warnings = [rec for rec in gd_log.records if rec.levelname == "WARNING" and "non_tensor_output" in rec.getMessage()]
    assert len(warnings) == 1


def test_entry_declined_in_one_thread_is_not_released_under_a_replay():
    """Thread D finds a mismatch and is about to decline the entry; thread R has passed its
    checks and is mid-replay. The decline must wait for the replay (it releases the graph
    under the replay lock), or R replays a graph that was reset."""
    w = torch.randn(4, 4)
    runner, stats = make_runner(affine, warmup=1, verify_inputs=1, state={1: "w"})
    x = torch.randn(3, 4)
    for _ in range(3):
        runner(x, w)
    assert stats.state == "verified"
    (entry,) = runner._book.entries.values()
    at_mismatch, go_mismatch = threading.Event(), threading.Event()
    in_replay, go_replay = threading.Event(), threading.Event()

    real_transition = runner._transitions.transition

    def paused_mismatch(*args: Any) -> Any:
        at_mismatch.set()
        go_mismatch.wait(5)
        return real_transition(*args)

    plan = entry.inputs
    real_copy_in = plan.copy_in

    def paused_copy_in(args: Any) -> None:
        in_replay.set()
        go_replay.wait(5)
        real_copy_in(args)

    runner._transitions.transition = paused_mismatch  # type: ignore[method-assign]
    plan.copy_in = paused_copy_in
    results: dict[str, Any] = {}

    def call(name: str, *args: Any) -> None:
        try:
            results[name] = runner(*args)
        except BaseException as exc:  # the point is that nothing escapes
            results[name] = exc

    decliner = threading.Thread(target=call, args=("D", x, w.t()))  # restrided: parameter_moved
    decliner.start()
    assert at_mismatch.wait(5)
    replayer = threading.Thread(target=call, args=("R", x, w))
    replayer.start()
    assert in_replay.wait(5)
    go_mismatch.set()
    decliner.join(0.3)  # time enough for a decline that does not wait to release the graph
    go_replay.set()
    decliner.join(5)
    replayer.join(5)
    assert same(results["R"], affine(x, w)), results["R"]
    assert same(results["D"], affine(x, w.t())), results["D"]
    assert entry.state is State.EAGER and entry.reason is Decline.PARAMETER_MOVED
    assert stats.replays == 2


def test_state_names_of_non_tensors_are_ignored():
    runner, stats = make_runner(lambda x, n: (x * n,), warmup=2, verify_inputs=1, state={1: "odd"})
    keep = [torch.randn(3) for _ in range(5)]
    for x in keep:
        assert same(runner(x, 2), (x * 2,))
    assert stats.declines == {} and stats.replays == 2


def test_parameters_moving_on_every_call_decline_fast_and_say_why():
    """FSDP2 reshard, offload or `weight.data = ...` every step: each call brings a new
    parameter set whose old storage is gone before it comes back. The shape key must
    decline parameter_moved within a few calls, not warm a new capture forever."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    c = torch.compile(m, backend="graphdispatch", options={"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1})
    with torch.no_grad():
        for _ in range(12):
            x = torch.randn(4, 8)
            assert torch.equal(c(x), m(x))
            m[0].weight.data = m[0].weight.data.clone()
    cg = graphdispatch_backend.latest_report()["graphs"][0]["cuda_graph"]
    assert cg["declines"].get("parameter_moved") == 1
    assert "new address on each call" in cg["decline_details"]["parameter_moved"]
    assert cg["eager_by_reason"].get("parameter_moved", 0) >= 12 - 5
    assert cg["replays"] == 0 and cg["captures"] == 0


def test_weights_reloaded_once_are_captured_again():
    """One reload (new LoRA weights, say) is not churn: the new parameter set is captured
    and replays; the old entry is dropped."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    c = torch.compile(m, backend="graphdispatch", options={"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1})
    with torch.no_grad():
        for i in range(10):
            if i == 4:
                m[0].weight.data = torch.randn(8, 8)
            x = torch.randn(4, 8)
            assert torch.equal(c(x), m(x))
    cg = graphdispatch_backend.latest_report()["graphs"][0]["cuda_graph"]
    assert "parameter_moved" not in cg["declines"]
    assert cg["captures"] == 2 and cg["replays"] >= 4

