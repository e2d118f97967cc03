"""HostReplayEngine: the CPU model of a CUDA graph, and the semantics the runner relies on.

Capture computes nothing the caller may read (outputs are poisoned); replay re-runs the
computation against the storages live at capture (a new tensor, or `param.data = new`,
is not seen; an in-place write to a captured storage is) and writes into the same static
output tensors; reset frees it all.
"""

from __future__ import annotations

import math

import pytest
import torch

from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine


def affine(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    return (x @ w + 1.0,)


def test_capture_poisons_outputs_until_replay():
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    graph = HostReplayEngine().capture(affine, (x, w))
    (out,) = graph.outputs
    assert torch.isnan(out).all()  # a capture computes nothing: reading before replay is a bug
    graph.replay()
    assert torch.equal(out, affine(x, w)[0])


@pytest.mark.parametrize(("dtype", "poison"), [
    (torch.float32, math.nan), (torch.bfloat16, math.nan), (torch.int32, torch.iinfo(torch.int32).max),
    (torch.int64, torch.iinfo(torch.int64).max), (torch.bool, True),
])
def test_poison_of_each_dtype(dtype, poison):
    x = torch.zeros(4, dtype=dtype)
    graph = HostReplayEngine().capture(lambda t: (t.clone(),), (x,))
    (out,) = graph.outputs
    if isinstance(poison, float):
        assert torch.isnan(out.float()).all()
    else:
        assert (out == poison).all()


def test_replay_reads_the_capture_storages_in_place():
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    graph = HostReplayEngine().capture(affine, (x, w))
    x.copy_(torch.randn(3, 4))  # what copy-in does to a static buffer
    graph.replay()
    assert torch.equal(graph.outputs[0], affine(x, w)[0])


def test_replay_does_not_see_a_new_storage():
    w = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    x = torch.randn(3, 4)
    graph = HostReplayEngine().capture(affine, (x, w))
    old = affine(x, w)[0]
    w.data = torch.randn(4, 4)  # FSDP2 reshard: the parameter now lives elsewhere
    graph.replay()
    assert torch.equal(graph.outputs[0], old)  # stale, as a CUDA graph's baked address would be
    assert not torch.equal(graph.outputs[0], affine(x, w)[0])


def test_replay_writes_into_the_same_static_outputs():
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    graph = HostReplayEngine().capture(affine, (x, w))
    (out,) = graph.outputs
    ptr = out.data_ptr()
    graph.replay()
    first = out.clone()
    x.add_(1.0)
    graph.replay()
    assert graph.outputs[0] is out and out.data_ptr() == ptr
    assert not torch.equal(out, first)  # a caller holding `out` would see it change: the runner clones


def test_an_output_aliasing_an_input_is_not_poisoned():
    x = torch.randn(4)
    graph = HostReplayEngine().capture(lambda t: (t[1:], t * 2), (x,))
    view, fresh = graph.outputs
    assert torch.equal(view, x[1:]) and not torch.isnan(x).any()
    assert torch.isnan(fresh).all()


def test_constant_outputs_pass_through():
    graph = HostReplayEngine().capture(lambda t: (t + 1, None, 3), (torch.randn(2),))
    assert graph.outputs[1:] == (None, 3)
    graph.replay()
    assert graph.outputs[1:] == (None, 3)


def test_capture_and_replay_run_without_autograd():
    w = torch.randn(4, 4, requires_grad=True)
    graph = HostReplayEngine().capture(affine, (torch.randn(3, 4), w))
    graph.replay()
    assert not graph.outputs[0].requires_grad


def test_reset_frees_and_forbids_replay():
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    graph = HostReplayEngine().capture(affine, (x, w))
    graph.reset()
    assert graph.outputs == ()
    with pytest.raises(RuntimeError, match="reset"):
        graph.replay()
    graph.reset()  # idempotent


def test_capture_that_raises_propagates():
    def boom(x: torch.Tensor) -> tuple[torch.Tensor]:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        HostReplayEngine().capture(boom, (torch.randn(2),))
