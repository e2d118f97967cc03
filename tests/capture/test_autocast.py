"""AutocastState: what observe() records and that replay() re-enters it, on any thread, nested."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.fx as fx
from functorch.compile import make_boxed_func

from graphdispatch_backend.capture.autocast import AutocastState, DeviceAutocast
from graphdispatch_backend.capture.lower import lower

MATMULS = ("aten::addmm", "aten::mm")


def _entry(state: AutocastState, device_type: str) -> DeviceAutocast:
    (entry,) = [d for d in state.devices if d.device_type == device_type]
    return entry


def _live(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


# -- observe ---------------------------------------------------------------------------

def test_observe_outside_autocast_records_cpu_and_cuda_disabled():
    state = AutocastState.observe()
    assert {d.device_type for d in state.devices} >= {"cpu", "cuda"}
    assert not _entry(state, "cpu").enabled and not _entry(state, "cuda").enabled
    assert not state.any_enabled
    assert state.cache_enabled is True


def test_observe_cpu_autocast_records_enabled_dtype_and_cache_flag():
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        state = AutocastState.observe()
    assert _entry(state, "cpu") == DeviceAutocast("cpu", True, torch.float16)
    assert not _entry(state, "cuda").enabled
    assert state.any_enabled and state.cache_enabled is False
    assert state.to_dict()["devices"]["cpu"] == {"enabled": True, "dtype": "float16"}
    assert state.to_dict()["cache_enabled"] is False


def test_observe_cuda_entry_entered_disabled_keeps_its_dtype():
    # cuda autocast can always be entered disabled (even without a GPU); its dtype is set.
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False):
        state = AutocastState.observe()
    assert _entry(state, "cuda") == DeviceAutocast("cuda", False, torch.bfloat16)


# -- replay -----------------------------------------------------------------------------

def test_replay_enters_the_observed_cpu_state_and_restores_on_exit():
    with torch.autocast("cpu", dtype=torch.float16):
        state = AutocastState.observe()
    before = _live("cpu")
    assert before[0] is False
    with state.replay():
        assert _live("cpu") == (True, torch.float16)
        a, b = torch.randn(2, 3), torch.randn(3, 2)
        assert (a @ b).dtype == torch.float16  # the replayed state is the one ops see
    assert _live("cpu") == before


def test_replay_of_a_cuda_entry_entered_disabled():
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False):
        state = AutocastState.observe()
    before = _live("cuda")
    assert before[1] != torch.bfloat16  # the default cuda autocast dtype is float16
    with state.replay():
        assert _live("cuda") == (False, torch.bfloat16)
    assert _live("cuda") == before


@pytest.mark.cuda
def test_replay_of_an_enabled_cuda_entry():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        state = AutocastState.observe()
    assert _entry(state, "cuda") == DeviceAutocast("cuda", True, torch.bfloat16)
    with state.replay():
        assert _live("cuda") == (True, torch.bfloat16)
        a, b = torch.randn(4, 4, device="cuda"), torch.randn(4, 4, device="cuda")
        assert (a @ b).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cuda")


def test_replay_restores_the_cache_flag():
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        state = AutocastState.observe()
    assert torch.is_autocast_cache_enabled()
    with state.replay():
        assert not torch.is_autocast_cache_enabled()
    assert torch.is_autocast_cache_enabled()


def test_disabled_replay_inside_an_enabled_autocast_restores_the_outer_state():
    disabled = AutocastState.observe()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with disabled.replay():
            assert _live("cpu")[0] is False
            assert (torch.randn(2, 3) @ torch.randn(3, 2)).dtype == torch.float32
        assert _live("cpu") == (True, torch.bfloat16)
    assert _live("cpu")[0] is False


def test_nested_replays_unwind_in_order():
    with torch.autocast("cpu", dtype=torch.float16):
        fp16 = AutocastState.observe()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        bf16 = AutocastState.observe()
    with fp16.replay():
        with bf16.replay():
            assert _live("cpu") == (True, torch.bfloat16) and not torch.is_autocast_cache_enabled()
        assert _live("cpu") == (True, torch.float16) and torch.is_autocast_cache_enabled()
    assert _live("cpu")[0] is False


def test_replay_restores_the_state_when_the_body_raises():
    with torch.autocast("cpu", dtype=torch.float16):
        state = AutocastState.observe()
    with pytest.raises(KeyError), state.replay():
        raise KeyError("inside")
    assert _live("cpu")[0] is False


# -- lowering on another thread (THE test) ---------------------------------------------------

class _Matmuls(torch.nn.Module):
    """A bias linear (aten.addmm) and a plain matmul (aten.mm)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)
        self.w = torch.nn.Parameter(torch.randn(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) @ self.w


def _dynamo_graph_under_cpu_autocast() -> tuple[fx.GraphModule, list[Any], AutocastState]:
    """The Dynamo graph a backend receives for a call made under cpu bf16 autocast (entered
    outside the compiled function, so the graph itself holds no autocast node), and the
    state observed, as the backend does, when the graph arrives on the main thread."""
    seen: list[tuple[fx.GraphModule, list[Any], AutocastState]] = []

    def recording(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        seen.append((gm, list(example_inputs), AutocastState.observe()))
        return gm.forward

    torch.manual_seed(0)
    model = _Matmuls().requires_grad_(False)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(model, backend=recording)(torch.randn(3, 8))
    torch._dynamo.reset()
    (captured,) = seen
    return captured


def _lower_on_a_fresh_thread(gm: fx.GraphModule, inputs: list[Any], state: AutocastState) -> dict[str, Any]:
    result: dict[str, Any] = {}

    def keep(aten: fx.GraphModule, _inputs: Sequence[Any]) -> Callable[..., Any]:
        result["graph"] = aten
        return make_boxed_func(aten.forward)

    def work() -> None:
        try:
            result["autocast_on_thread"] = torch.is_autocast_enabled("cpu")
            lower(gm, inputs, state, inference_compiler=keep, forward_compiler=keep,
                  backward_compiler=make_boxed_func)
        except Exception as exc:  # surfaced in the main thread below
            result["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result


def _matmul_dtypes(gm: fx.GraphModule) -> list[torch.dtype]:
    return [
        n.meta["val"].dtype for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "_schema", None) and n.target._schema.name in MATMULS
    ]


def test_lowering_on_a_thread_without_autocast_replays_the_observed_state():
    gm, inputs, observed = _dynamo_graph_under_cpu_autocast()
    assert _entry(observed, "cpu") == DeviceAutocast("cpu", True, torch.bfloat16)
    assert not any(n.op == "call_function" and "autocast" in str(n.target) for n in gm.graph.nodes)

    result = _lower_on_a_fresh_thread(gm, inputs, observed)
    assert result["autocast_on_thread"] is False  # autocast is thread-local: nothing leaked
    dtypes = _matmul_dtypes(result["graph"])
    assert len(dtypes) == 2  # one addmm, one mm
    assert dtypes == [torch.bfloat16, torch.bfloat16]


def test_control_without_replay_the_same_lowering_traces_float32():
    gm, inputs, _ = _dynamo_graph_under_cpu_autocast()
    without = AutocastState.observe()  # on the main thread, outside autocast
    assert not without.any_enabled
    result = _lower_on_a_fresh_thread(gm, inputs, without)
    assert result["autocast_on_thread"] is False
    assert _matmul_dtypes(result["graph"]) == [torch.float32, torch.float32]
