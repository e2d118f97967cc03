"""The CUDA engine's own code (runtime/cudagraph/cuda.py) run on the host, through a
stand-in for the torch.cuda calls it makes: streams, a MemPool, CUDAGraph. The stand-in's
graph records and replays with the host model's Tape (cudagraph/tape.py), keeps the memory
its outputs were captured in (as a pool does), and holds CUDA's capture rules that need
no device: no capture on the default stream, no synchronize on a capturing thread, a
capture that an operation invalidated ends with an error of its own (as
cudaStreamEndCapture does), no replay after a reset.

The same graphs through the CUDA engine and through HostReplayEngine come to the same
decisions (pieces, captures, verdicts, declines and their details, replays) and the same
bits: every decision lives in the runner, shared by both, and only the engine differs.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import graphdispatch_backend
from graphdispatch_backend import session as session_mod
from graphdispatch_backend.runtime.cudagraph.cuda import CudaGraphEngine
from graphdispatch_backend.runtime.cudagraph.tape import Recorder
from graphdispatch_backend.testing import Mlp, accounted_graphs

INVALIDATED = "CUDA error: operation failed due to a previous error during capture"


class _Stream:
    _ids = itertools.count(1)

    def __init__(self, device: Any = None, priority: int = 0, *, stream_id: int | None = None,
                 device_index: int | None = None, device_type: int | None = None) -> None:
        self.stream_id = next(_Stream._ids) if stream_id is None else stream_id

    def wait_stream(self, other: _Stream) -> None:
        pass  # the host runs every launch at once, in order

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return self.stream_id


class _MemPool:
    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.id = (next(_MemPool._ids), 0)

    def snapshot(self, include_traces: bool = True) -> list[dict[str, Any]]:
        return []


class _Graph:
    """A CUDAGraph on the host: capture_begin starts recording, capture_end keeps the
    memory of every tensor the capture made that is still alive (its outputs), replay runs
    the tape and writes those bytes again."""

    def __init__(self, cuda: CudaStandIn) -> None:
        self._cuda = cuda
        self._recorder: Recorder | None = None
        self._recording: contextlib.ExitStack | None = None
        self._blocks: list[tuple[int, torch.UntypedStorage]] | None = None
        self._tape: Any = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if self._cuda.current_stream() == self._cuda.default:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                               "(a capture on the legacy default stream)")
        if self._cuda.capturing() is not None:
            raise RuntimeError("CUDA error: a capture is already underway on this thread")
        self._recorder = Recorder(set())
        self._recording = contextlib.ExitStack()
        self._recording.enter_context(self._recorder.capturing())
        self._cuda.local.graph = self

    def capture_end(self) -> None:
        assert self._recorder is not None and self._recording is not None
        self._cuda.local.graph = None
        self._recording.close()
        if self._recorder.refused is not None:
            raise RuntimeError(INVALIDATED)
        made = self._recorder.alive()
        self._recorder.finish(made)
        self._tape = self._recorder.tape
        storages: dict[int, int] = {}
        for i, t in enumerate(made):
            storages.setdefault(t.untyped_storage().data_ptr(), i)
        self._blocks = [(i, made[i].untyped_storage()) for i in storages.values()]

    def replay(self) -> None:
        if self._tape is None or self._blocks is None:
            raise RuntimeError("CUDA error: replay of a graph that was reset or never captured")
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            fresh = self._tape.replay()
            for i, kept in self._blocks:
                storage = fresh[i].untyped_storage()
                torch.empty(0, dtype=torch.uint8).set_(kept).copy_(torch.empty(0, dtype=torch.uint8).set_(storage))

    def reset(self) -> None:
        self._tape = self._blocks = None


class CudaStandIn:
    """The torch.cuda surface cuda.py and CudaStreams use, on the host (module docstring)."""

    def __init__(self) -> None:
        self.default = _Stream(stream_id=0)
        self.local = threading.local()
        self.clears = 0

    def current_stream(self, device: Any = None) -> _Stream:
        return getattr(self.local, "stream", self.default)

    @contextlib.contextmanager
    def stream(self, s: _Stream) -> Iterator[None]:
        previous = self.current_stream()
        self.local.stream = s
        try:
            yield
        finally:
            self.local.stream = previous

    def capturing(self) -> _Graph | None:
        return getattr(self.local, "graph", None)

    def synchronize(self, device: Any = None) -> None:
        if self.capturing() is not None:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    def clear_cublas(self) -> None:
        self.clears += 1

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """torch.cuda's calls replaced; `cuda_graphs="emulate"` then captures with the CUDA engine."""
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "Stream", _Stream)
        monkeypatch.setattr(cuda, "stream", self.stream)
        monkeypatch.setattr(cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "device", lambda index=None: contextlib.nullcontext())
        monkeypatch.setattr(cuda, "MemPool", _MemPool)
        monkeypatch.setattr(cuda, "CUDAGraph", lambda: _Graph(self))
        monkeypatch.setattr(torch._C, "_cuda_getCurrentStream",
                            lambda index: (self.current_stream().stream_id, 0, 1), raising=False)
        monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", self.clear_cublas, raising=False)
        monkeypatch.setattr(session_mod, "HostReplayEngine", CudaGraphEngine)


@pytest.fixture
def on_cuda_engine(monkeypatch: pytest.MonkeyPatch) -> CudaStandIn:
    cuda = CudaStandIn()
    cuda.install(monkeypatch)
    return cuda


# -- the stand-in holds CUDA's rules ---------------------------------------------------------


def test_the_engine_captures_on_its_own_stream_and_replays_on_the_callers(on_cuda_engine):
    engine = CudaGraphEngine()
    x = torch.randn(4)
    graph = engine.capture(lambda t: (t * 2 + 1,), [x], "cpu")
    assert on_cuda_engine.clears == 3  # cuBLAS workspaces: before and after warmup, after capture
    x.copy_(torch.arange(4.0))
    graph.replay()
    assert torch.equal(graph.outputs[0], torch.arange(4.0) * 2 + 1)
    inner = graph._graph
    graph.reset()
    with pytest.raises(RuntimeError, match="reset"):
        inner.replay()


def test_a_capture_on_the_default_stream_or_a_synchronize_inside_fails(on_cuda_engine):
    graph = _Graph(on_cuda_engine)
    with pytest.raises(RuntimeError, match="legacy default stream"):
        graph.capture_begin()
    with on_cuda_engine.stream(_Stream()):
        graph.capture_begin()
        with pytest.raises(RuntimeError, match="stream is capturing"):
            torch.cuda.synchronize()
        graph.capture_end()


def test_an_operation_that_invalidates_the_capture_is_what_the_engine_reports(on_cuda_engine):
    """CUDA ends an invalidated capture with an error of its own; the engine raises the
    operation's (what it was, where it ran), not the end's, as the host engine does."""
    engine = CudaGraphEngine()

    def synced(t: torch.Tensor) -> tuple[torch.Tensor]:
        return (t * t.sum().item(),)

    with pytest.raises(RuntimeError, match="_local_scalar_dense") as caught:
        engine.capture(synced, [torch.randn(3)], "cpu")
    assert INVALIDATED in "".join(getattr(caught.value, "__notes__", []))


# -- the same decisions from both engines ------------------------------------------------------


@torch.library.custom_op("gd_test_engines::offsets", mutates_args=())
def offsets(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """A host read inside a custom op (transformers' grouped_mm fallback calls tolist())."""
    out = x.clone()
    start = 0
    for n in counts.tolist():
        out[start:start + n] *= 2
        start += n
    return out


@offsets.register_fake
def _(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class HostRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return offsets(self.lin(x), torch.tensor([2, 4])).relu()


class CacheStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, cache: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        k = self.proj(x)
        cache.index_copy_(0, pos, k)
        return cache.sum(0, keepdim=True) + k


class ConvBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _mlp() -> Callable[[Any], list[torch.Tensor]]:
    def run(compile_: Any) -> list[torch.Tensor]:
        model = compile_(Mlp().eval())
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]
        with torch.no_grad():
            return [model(x) for x in xs] + [model(xs[0])]
    return run


def _host_read(compile_: Any) -> list[torch.Tensor]:
    model = compile_(HostRead().eval())
    with torch.no_grad():
        return [model(torch.randn(3, 6, generator=torch.Generator().manual_seed(i))) for i in range(5)]


def _cache(compile_: Any) -> list[torch.Tensor]:
    """Requests, each with a new cache: re-captured in place, or backing off when short."""
    model = compile_(CacheStep().eval())
    outs = []
    with torch.no_grad():
        for request, tokens in enumerate((20, 20, 3, 3, 3, 20)):
            cache = torch.zeros(32, 8)
            for i in range(tokens):
                x = torch.randn(1, 8, generator=torch.Generator().manual_seed(100 * request + i))
                outs += [model(cache, torch.tensor([i]), x), cache.clone()]
    return outs


def _conv_bn(compile_: Any) -> list[torch.Tensor]:
    model = compile_(ConvBn().eval())  # grad on: an autograd graph
    return [model(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(i))).detach() for i in range(5)]


def _dropout(compile_: Any) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = compile_(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)).train())
    with torch.no_grad():
        return [model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))) for i in range(5)]


def _mixtral(compile_: Any) -> list[torch.Tensor]:
    """transformers' grouped GEMM fallback reads its offsets on the host: the capture fails
    (its integer indexing of expert weights splits nothing)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32)
    model = compile_(transformers.MixtralModel(cfg).eval())
    with torch.no_grad():
        return [model(input_ids=torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i)))
                .last_hidden_state for i in range(4)]


def _llama_generate(compile_: Any) -> list[torch.Tensor]:
    """Static-cache generate, twice: the decode graph re-captured at the second cache."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                   max_position_embeddings=256, attn_implementation="eager", pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.forward = compile_(model.forward)
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    outs = []
    with torch.no_grad():
        for _ in range(2):
            got = model.generate(prompt, max_new_tokens=20, do_sample=False, cache_implementation="static",
                                 max_cache_len=64, return_dict_in_generate=True, output_logits=True,
                                 disable_compile=True)
            outs += [got.sequences, *got.logits]
    return outs


GRAPHS = {"mlp": _mlp(), "host_read_in_custom_op": _host_read, "cache_per_request": _cache, "conv_bn_grad": _conv_bn,
          "dropout": _dropout, "mixtral_grouped_mm_fallback": _mixtral, "llama_static_cache_generate": _llama_generate}


def _decisions(graphs: list[dict[str, Any]]) -> list[Any]:
    """What the runtime decided for each graph, piece by piece (no figure that measures
    memory or time: a pool's size is the engine's own)."""
    keys = ("state", "captures", "recaptures", "replays", "eager_calls", "eager_by_reason", "declines",
            "decline_details", "shape_keys", "evictions", "live_captures", "copy_bytes")
    return [(g["name"], g["kind"], g["calls"], g.get("lowering_check"),
             [(p["capturable"], p["split_reasons"], {k: p["cuda_graph"].get(k) for k in keys} if "cuda_graph" in p
               else None) for p in g["pieces"]],
             [(s["artifact"], s["parity"], s["demoted"], s.get("reason")) for s in g.get("substitutions", [])])
            for g in graphs]


def _run(name: str) -> tuple[list[torch.Tensor], list[Any]]:
    graphdispatch_backend.reset()
    torch._dynamo.reset()
    torch.manual_seed(0)
    outs = GRAPHS[name](lambda m: torch.compile(m, backend="graphdispatch", dynamic=False,
                                                options={"cuda_graphs": "emulate", "warmup": 1}))
    return outs, _decisions(accounted_graphs())


@pytest.mark.parametrize("name", list(GRAPHS))
def test_both_engines_decide_alike_and_give_the_same_bits(name, monkeypatch):
    host_outs, host = _run(name)
    torch.manual_seed(0)
    eager = GRAPHS[name](lambda m: m)
    cuda = CudaStandIn()
    with monkeypatch.context() as patch:
        cuda.install(patch)
        cuda_outs, decided = _run(name)
        engines = {type(s.engine).__name__ for s in session_mod._LATEST[0]._scopes.values()}
    assert engines == {"CudaGraphEngine"}
    assert decided == host
    declines_all = ("host_read_in_custom_op", "mixtral_grouped_mm_fallback")
    assert sum(p[2]["replays"] for g in host for p in g[4] if p[2]) > 0 or name in declines_all, host
    if name == "mixtral_grouped_mm_fallback":  # what a GPU running the fallback reports, from its engine
        failed = [p for g in decided for p in g[4] if p[2] and p[2]["declines"]]
        assert len(failed) == 1 and all("transformers::grouped_mm_fallback" in str(p[2]["decline_details"])
                                        for p in failed), decided
    for a, b, e in zip(host_outs, cuda_outs, eager, strict=True):
        assert torch.equal(a, e) and torch.equal(b, e)


def test_the_cuda_engine_names_the_host_read_and_where_it_ran(on_cuda_engine):
    """What the report says is the operation (a `tolist()` inside a custom op, its line),
    not CUDA's error for ending an invalidated capture."""
    _, decided = _run("host_read_in_custom_op")
    details = str([p[2]["decline_details"] for g in decided for p in g[4] if p[2] and p[2]["declines"]])
    assert "capture_failed" in details and "tolist" in details and "gd_test_engines::offsets" in details, details
    assert "test_cuda_engine_on_host.py" in details and "previous error during capture" not in details, details
