"""The `torch.compile` backend, and the one place that catches broad exceptions.

`graphdispatch_backend(gm, example_inputs, options=..., mode=...)` resolves the options,
finds the session, lowers the Dynamo graph with aot (inside the observed autocast state),
runs the pass pipeline on the ATen graph and wraps the result in a CompiledGraph. If
anything in that goes wrong, the graph runs eagerly instead, counted and reported with
its reason (`backend_error`); under `strict` the error is raised as GraphDispatchError.
Registered through the `torch_dynamo_backends` entry point as "graphdispatch".

The graph builder (`_Builder`: passes, gates and runners wired together for aot's
compilers) lives here too, though the module is then a little over 400 lines: aot compiles
the backward lazily, inside the user's first `backward()`, and the builder's catch around
that compile is a broad one, which only this module may hold.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.capture.autocast import AutocastState
from graphdispatch_backend.capture.lower import InputOrigin, input_origins, lower, mutated_inputs
from graphdispatch_backend.codegen import generated_forward
from graphdispatch_backend.diagnostics.report import CudaGraphStats, GraphRecord
from graphdispatch_backend.errors import (
    Contain,
    Decline,
    FusionStatus,
    GraphDispatchError,
    OptionsError,
    SplitReason,
    StrictModeError,
)
from graphdispatch_backend.fusion.recipe import recipe_for, with_inductor_keys
from graphdispatch_backend.fusion.verdicts import device_identity
from graphdispatch_backend.graph_artifacts import GraphArtifacts, call_target
from graphdispatch_backend.options import FuseTolerance, Options, reported
from graphdispatch_backend.passes import BACKWARD_PIPELINE, PassContext, run_pipeline
from graphdispatch_backend.passes.context import PieceInfo, PieceSpec
from graphdispatch_backend.passes.locate_writes import WritePlan
from graphdispatch_backend.passes.ops import (
    collective_groups,
    draws_random,
    effect_tokens,
    unwritten_outputs,
)
from graphdispatch_backend.runtime.call.contract import PlaceholderContract
from graphdispatch_backend.runtime.checks.agree import Agreement, agreement_for
from graphdispatch_backend.runtime.checks.autograd_check import GradientCheck
from graphdispatch_backend.runtime.checks.eager_check import EagerCheck
from graphdispatch_backend.runtime.checks.novelty import Arrival, Novelty
from graphdispatch_backend.runtime.checks.schedule import graph_schedule
from graphdispatch_backend.runtime.checks.suspects import Suspects
from graphdispatch_backend.runtime.checks.world import Region, Writes
from graphdispatch_backend.runtime.program.autograd import backward_fallback, without_history
from graphdispatch_backend.runtime.program.fused import Fusion
from graphdispatch_backend.runtime.program.program import CompiledGraph
from graphdispatch_backend.runtime.runner import GraphRunner
from graphdispatch_backend.session import Session, session_for

# Dynamo steers its own tracing with these; they must pass through any backend untouched.
_DYNAMO_CONTROL = tuple(
    getattr(torch._dynamo.exc, name)
    for name in ("RestartAnalysis", "SkipFrame", "TensorifyScalarRestartAnalysis", "ShortenTraceback")
    if hasattr(torch._dynamo.exc, name)
)


# `lowering_check.status` of a graph whose lowering never runs: with nothing to serve (no
# capturable piece, no artifact, no fusion) the Dynamo graph answers its calls
NOT_LOWERED = "not_lowered"

_DETAILS = {
    Decline.DISABLED: "cuda_graphs=False",
    Decline.NOT_CUDA: "the graph's inputs are not all on CUDA; cuda_graphs='emulate' shows what a GPU would do",
    Decline.NO_CUDA_DEVICE: "cuda_graphs=True but this machine has no CUDA device",
    Decline.NO_CAPTURABLE_PIECE: "every node of the graph must stay outside a CUDA graph",
    Decline.MULTI_DEVICE: "the graph's tensors are on several CUDA devices; a CUDA graph captures one device",
}


def _detail(reason: Decline, split_reasons: dict[str, int]) -> str | None:
    """What a graph-level decline says; no capturable piece names its nodes' split reasons."""
    detail = _DETAILS.get(reason)
    if reason is not Decline.NO_CAPTURABLE_PIECE or not split_reasons:
        return detail
    detail = f"{detail} ({', '.join(f'{k}: {v}' for k, v in split_reasons.items())})"
    if SplitReason.MADE_BUFFER.value in split_reasons:
        detail += ("; it makes and returns a buffer (a new cache): pass one in (a transformers StaticCache per "
                   "slot, reused) and the graph is captured, writing into it")
    if SplitReason.UNWRITTEN_BUFFER.value in split_reasons:
        detail += ("; it returns memory it made and never wrote, for its caller to fill (a collective after a "
                   "graph break): made at each call, as eager makes it")
    return detail


def _fixed_shapes(piece: fx.GraphModule) -> bool:
    """No tensor input of the piece has a symbolic size or stride, so Dynamo's guards fix
    its shapes: true of every piece of a static graph, and of a piece in a graph with
    symbols whose tensors do not depend on them (a Python int lifted out of the piece)."""
    for node in piece.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not all(type(d) is int for d in (*val.shape, *val.stride())):
            return False
    return True


def _recheck(options: Options, fusion: Fusion | None) -> str | int:
    """The graph's `recheck` schedule: a graph fused under a declared tolerance, whose kernels
    are not exact by construction (an intermittent fault served unchecked is its risk), is
    checked on the "dense" schedule where `recheck` is left "doubling"."""
    if fusion is not None and fusion.tolerance is not None and options.recheck == "doubling":
        return "dense"
    return options.recheck


def _static(gm: fx.GraphModule) -> bool:
    """Every input is a tensor of fixed shape and strides or a plain Python value."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return False
        if isinstance(val, torch.Tensor) and not all(type(d) is int for d in (*val.shape, *val.stride())):
            return False
    return True


def make_contain(strict: bool) -> Contain:
    """Run a thunk of third-party code (artifact, capture, export) and hand back what it
    raised instead of raising. Only StrictModeError (graphdispatch's own, under `strict`)
    passes through; under `strict`, anything else raises StrictModeError too."""

    def contain(thunk: Callable[[], Any]) -> tuple[Any, Exception | None]:
        try:
            return thunk(), None
        except StrictModeError:
            raise
        except Exception as exc:
            if strict:
                raise StrictModeError(f"{type(exc).__name__}: {exc}") from exc
            return None, exc

    return contain


def graphdispatch_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    extra = sorted(set(kwargs) - {"options", "mode"})
    if extra:
        raise OptionsError(f"unexpected backend argument {extra[0]!r}; torch.compile passes 'options' and 'mode'")
    options = Options.resolve(kwargs.get("options"), kwargs.get("mode"))
    session = session_for(options, make_contain)
    record = session.report.new_graph()
    try:
        compiled = _compile(session, record, gm, example_inputs)
        weakref.finalize(compiled, record.retire)  # the graph gone, its record keeps figures only
        return compiled
    except _DYNAMO_CONTROL:
        raise
    except Exception as exc:
        if options.strict:
            raise exc if isinstance(exc, GraphDispatchError) else StrictModeError(
                f"compiling a graph failed: {type(exc).__name__}: {exc}") from exc
        return _fallback(session, record, gm, exc)
    finally:
        session.write()


def _fallback(session: Session, record: GraphRecord, gm: fx.GraphModule, exc: Exception) -> Callable[..., Any]:
    """The Dynamo graph, run as is: nothing half-built from this graph is used."""
    record.kind, record.cuda_graph_mode = "fallback", "off"
    record.substitutions.clear()
    record.backward = None
    record.pieces.clear()
    record.piece_stats.clear()
    record.error = f"{type(exc).__name__}: {exc}"
    record.cuda_graph_reason, record.cuda_graph_detail = Decline.BACKEND_ERROR.value, record.error
    session.events.warn_once(f"backend_error:{type(exc).__name__}",
                             "graphdispatch: a graph runs eager because compiling it failed: %s", record.error)
    session.events.decision("fallback", {"graph": record.name, "error": record.error})

    return _as_traced(gm, record, Decline.BACKEND_ERROR)  # the module itself: no code of ours to fail again


def _as_traced(run_traced: Callable[..., Any], record: GraphRecord, reason: Decline) -> Callable[..., Any]:
    """The Dynamo graph (`run_traced`) as the call's answer, each call counted eager with `reason`."""

    def run(*args: Any) -> Any:
        out = run_traced(*args)
        record.called(False, reason.value)
        return out

    return run


def _compile(session: Session, record: GraphRecord, gm: fx.GraphModule,
             example_inputs: Sequence[Any]) -> Callable[..., Any]:
    record.compile_id = str(gm.meta.get("dynamo_compile_id", ""))
    autocast = AutocastState.observe()
    origins = input_origins(gm, example_inputs)
    builder = _Builder(session, record, origins, gm.meta.get("gd_model_modules"))
    compiled = lower(gm, example_inputs, autocast, inference_compiler=builder.inference,
                     forward_compiler=builder.forward, backward_compiler=builder.backward)
    session.events.decision("compile", {"graph": record.name, "kind": record.kind, "nodes": record.nodes,
                                        "regions": len(record.regions), "substitutions": len(record.substitutions),
                                        "cuda_graph": record.cuda_graph_mode,
                                        "cuda_graph_reason": record.cuda_graph_reason,
                                        "autocast": autocast.to_dict()})
    lifted = [t for _, t in gm.named_parameters(remove_duplicate=False)] + [
        t for _, t in gm.named_buffers(remove_duplicate=False)]
    n_lifted = len(lifted)
    if builder.serves_nothing():
        # no piece to capture, no artifact, nothing fused: the lowering would serve nothing
        # and cost its checks (a second prefill on the calls of its schedule): eager runs
        record.lowering = {"status": NOT_LOWERED, "detail": "nothing to serve (no capturable piece, no "
                           "artifact substituted, nothing fused): the Dynamo graph runs, as eager"}
        compiled = _as_traced(generated_forward(gm), record, Decline.NO_CAPTURABLE_PIECE)
    elif builder.mutated is not None:
        # the lowered graph's inputs are aot's (parameters and buffers lifted first): its write
        # plan locates regions of those, when they are these one to one (no effect token, no
        # merged duplicate or synthetic base; else written inputs are snapshotted whole)
        one_to_one = builder.placeholders == n_lifted + len(example_inputs)
        plan = builder.write_plan if one_to_one else None
        writes = Writes(builder.mutated, plan, session.options.max_snapshot_bytes, [o.name for o in origins])

        def locate(args: Sequence[Any]) -> list[Region]:
            return writes.regions([*lifted, *args])

        keyed = [j for j, o in enumerate(origins[n_lifted:]) if not o.is_state]
        dynamic = any(o.kind == "symbol" for o in origins)
        # calls whose inputs leave what the checked calls saw are checked too: the inputs it
        # only reads (not parameters, not written: aot's positions must map onto these one to
        # one, as for the write plan); not where ranks must check the same calls
        written = {p - n_lifted for p in builder.mutated}
        novelty = None if builder.agreement is not None or not one_to_one and builder.mutated else Novelty(
            [j for j in keyed if j not in written], [o.name for o in origins[n_lifted:]],
            Arrival.NEXT_CALL if record.cuda_graph_mode == "host" else Arrival.NOW)
        # an autograd graph's check also compares the gradients of one backward
        gradients = GradientCheck(lifted, [o.name for o in origins], session.contain, record) \
            if record.kind == "autograd" else None
        compiled = EagerCheck(generated_forward(gm), compiled, record, session.events, session.contain,
                              session.options.strict, keyed, locate, dynamic, session.timing,
                              # eager's own nondeterminism is named by running the Dynamo graph op
                              # by op, where this rank may run it alone (runtime/checks/suspects.py)
                              Suspects(gm, rerun=builder.agreement is None and gradients is None),
                              builder.agreement, gradients,
                              recheck="every" if session.options.timing == "shadow" else graph_schedule(
                                  _recheck(session.options, builder.fusion), session.options.artifact_recheck,
                                  bool(record.substitutions) and record.cuda_graph_mode != "off"),
                              runners=builder.runners, draws=builder.draws, fusion=builder.fusion,
                              unwritten=unwritten_outputs(gm), novelty=novelty)
    if session.exporter is None:
        return compiled
    observe = session.exporter.register(record, gm, origins, autocast, n_lifted)
    checked = compiled

    def run(*args: Any) -> Any:
        observe(args)
        return checked(*args)

    return run


class _Builder:
    """The aot compilers for one Dynamo graph: passes, gates and runners, wired together."""

    def __init__(self, session: Session, record: GraphRecord, origins: tuple[InputOrigin, ...],
                 model_modules: Sequence[str] | None = None) -> None:
        self.session = session
        self.record = record
        self.origins = origins
        self.artifacts = GraphArtifacts(session, record, model_modules)
        # inputs (aot positions) the inference graph writes into; None: it cannot be checked
        # against eager (an input's metadata is mutated, or aot did not say)
        self.mutated: list[int] | None = None
        self.write_plan: WritePlan | None = None  # where the forward writes them (passes/locate_writes.py)
        self.placeholders = 0  # the forward's placeholders
        self.runners: list[GraphRunner] = []  # the forward's, in the order of its record's piece_stats
        self.draws = False  # the lowered forward draws random numbers
        self.agreement: Agreement | None = None
        # Dynamo is compiling this graph: its guards stand in front of every call (program.py)
        self.guarded = torch._guards.CompileContext.try_get() is not None
        self.fusion: Fusion | None = None  # the inference graph's, with `fuse` (runtime/program/fused.py)

    def serves_nothing(self) -> bool:
        """The inference graph declined a CUDA graph for want of a capturable piece, and
        has no artifact substituted and no fusion: its lowered form adds nothing to eager."""
        record = self.record
        return (record.kind == "inference" and record.cuda_graph_reason == Decline.NO_CAPTURABLE_PIECE.value
                and not record.substitutions and self.fusion is None)

    def inference(self, gm: fx.GraphModule, inputs: Sequence[Any]) -> CompiledGraph:
        self.mutated = mutated_inputs()
        return self._build(gm, self.record, "inference")

    def forward(self, gm: fx.GraphModule, inputs: Sequence[Any]) -> CompiledGraph:
        """The forward of an autograd graph: checked, captured and replayed as an inference
        graph is (aot runs it under no_grad, inside its autograd.Function); every output is
        copied out of pool memory after a replay, the tensors saved for backward included
        (the generation rule: see docs/design.md, section 6)."""
        self.mutated = mutated_inputs()
        self.record.backward = GraphRecord(self.record.index, kind="backward", role="backward")
        return self._build(gm, self.record, "forward")

    def backward(self, gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        """The backward, captured like the forward. aot compiles it lazily, inside the
        user's first backward(): a failure here must not raise there, so the lowered
        backward then runs as aot made it, counted `backend_error`."""
        record = self.record.backward
        if record is None:  # aot compiled a backward without a forward: not expected
            record = self.record.backward = GraphRecord(self.record.index, kind="backward", role="backward")
        native = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        try:
            return self._build(gm, record, "backward")
        except Exception as exc:
            if self.session.options.strict:
                raise StrictModeError(f"compiling the backward of {self.record.name} failed: "
                                      f"{type(exc).__name__}: {exc}") from exc
            return backward_fallback(self.session.events, record, native, exc)

    def _build(self, gm: fx.GraphModule, record: GraphRecord, role: str) -> CompiledGraph:
        """role: inference, forward (of an autograd graph) or backward."""
        training = role != "inference"
        record.kind = {"inference": "inference", "forward": "autograd"}.get(role, "backward")
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        record.nodes, record.inputs = len(gm.graph.nodes), len(placeholders)
        native = generated_forward(gm)  # the original, before the passes: for contract fallbacks
        tokens = frozenset(effect_tokens(gm))
        contract = PlaceholderContract.of(gm, tokens)
        # a graph with collectives: verdicts are agreed over the ranks of its groups
        agreement = agreement_for(collective_groups(gm))
        if role != "backward":
            self.agreement = agreement
            self.draws = any(map(draws_random, gm.graph.nodes))  # the eager check's extra runs draw privately
            self.placeholders = len(placeholders)
        engine, reason, device = self._engine_for([p for i, p in enumerate(placeholders) if i not in tokens])
        record.cuda_graph_mode = engine or "off"
        fusion = self._fusion_for(gm, record, role, device, agreement) if self.session.options.fuse else None
        scope = self.session.scope(engine) if engine else None
        ctx = PassContext(
            # a backward's inputs are saved tensors and gradients: no parameter, no region
            input_origins=self.origins if role != "backward" else (),
            # an autograd graph substitutes nothing: every artifact its pattern names is refused
            matcher=self.artifacts.match if role == "inference" else self.artifacts.match_autograd,
            make_call=self.artifacts.make_call,
            pieces_spec=PieceSpec(torch.device(device).type, lambda piece, info: self._runner(
                scope, piece, info, device, record, agreement, fusion), role == "inference")
            if scope else None,
        )
        if role == "backward":
            run_pipeline(gm, ctx, BACKWARD_PIPELINE)
        else:
            run_pipeline(gm, ctx)
        record.stripped_assertions = ctx.stripped_assertions
        if role != "backward":
            self.write_plan = ctx.write_plan
        record.input_writes = [{"input": self._input_name(w.position, placeholders), "in_place": w.in_place,
                                "detail": w.detail} for w in ctx.writes]
        record.buffer_writes_in_place = ctx.buffer_writes
        if role != "backward":
            record.regions = [self.artifacts.region_entry(r, ctx.outcomes.get(r.name), role == "inference")
                              for r in ctx.regions]
            record.module_rejections = dict(self.artifacts.module_rejections)
            self.artifacts.check_authoring(training)
        record.pieces = [p.to_dict() for p in ctx.pieces]
        record.split_reasons = {k.value: v for k, v in ctx.split_reasons.items()}
        # forward, not __call__: nn.Module's call machinery costs microseconds per call
        run: Callable[..., Any] = generated_forward(gm)
        if fusion is not None and scope is None:
            run = fusion.unit(gm, run)
        if scope is not None:
            if not ctx.split_reasons and ctx.pieces:
                run = self._runner(scope, gm, ctx.pieces[0], device, record, agreement, fusion)
            elif not any(p.capturable for p in ctx.pieces):
                reason = Decline.NO_CAPTURABLE_PIECE
                if fusion is not None:  # not captured, still fused, as under cuda_graphs=False
                    run = fusion.unit(gm, run)
            elif fusion is not None:  # the ATen runs left between the captured pieces are fused too
                run = fusion.unit(gm, run)
            if training and reason is None:
                run = without_history(run, native, self.session.events, record)
        if fusion is not None:
            fusion.finish()  # compiled with what the graph learned before (the verdict cache)
        record.cuda_graph_reason = reason.value if reason else None
        record.cuda_graph_detail = _detail(reason, record.split_reasons) if reason else None
        # what runs instead: an autograd graph's lowered forward and backward, not the Dynamo graph
        runs = "the lowered forward and backward run, not captured" if training else "it runs eager"
        if reason is not None and training:
            record.cuda_graph_detail = f"{record.cuda_graph_detail}; {runs}"
        asked = self.session.options.cuda_graphs in (True, "emulate")
        if reason is not None and (asked or reason is Decline.NO_CAPTURABLE_PIECE):
            # the user asked for graphs (or a piece could have had one): say why there is none
            self.session.events.warn_once(
                f"decline:{reason.value}", "graphdispatch: CUDA graph declined for %s (%s): %s; %s",
                record.name, reason.value, _detail(reason, record.split_reasons), runs)
        return CompiledGraph(run, native, contract, record, self.session.timing, reason,
                             lambda detail: self._contract_mismatch(record, detail),
                             guarded=self.guarded and role != "backward")

    def _input_name(self, position: int, placeholders: list[fx.Node]) -> str:
        if position < len(self.origins) and self.origins[position] is not None:
            return self.origins[position].name
        return placeholders[position].name

    def _engine_for(self, placeholders: list[fx.Node]) -> tuple[str | None, Decline | None, str]:
        """(engine, why there is none, the device the pieces run on: `cuda:N` or a type)."""
        mode = self.session.options.cuda_graphs
        devices = {n.meta["val"].device for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)}
        types = {d.type for d in devices}
        cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        device = f"cuda:{cuda[0]}" if cuda else (sorted(types)[0] if types else "cpu")
        if mode is False:
            return None, Decline.DISABLED, device
        if len(cuda) > 1:  # one graph, one device: a capture cannot span devices
            return None, Decline.MULTI_DEVICE, device
        if mode == "emulate":
            return "host", None, device
        if mode == "auto":
            return ("cuda", None, device) if types == {"cuda"} else (None, Decline.NOT_CUDA, device)
        if not torch.cuda.is_available():
            return None, Decline.NO_CUDA_DEVICE, device
        return ("cuda", None, device) if "cuda" in types else (None, Decline.NOT_CUDA, device)

    def _fusion_for(self, gm: fx.GraphModule, record: GraphRecord, role: str, device: str,
                    agreement: Agreement | None) -> Fusion | None:
        """The graph's Fusion (fuse=True), or None with the reason it is not fused in its record."""
        kind = torch.device(device).type
        why = None
        if role != "inference":
            why = "autograd graphs are not fused: their checks compare gradients and blame the lowering as a whole"
        elif self.mutated is None:
            why = "the graph cannot be checked against eager (aot did not say which inputs it writes)"
        elif agreement is not None:
            why = "the graph holds collectives: every rank would have to agree on each recompile"
        elif not _static(gm):
            why = "dynamic shapes: only graphs whose input shapes Dynamo fixed are fused"
        elif kind not in ("cpu", "cuda"):
            why = f"no eager-numerics recipe for {kind}"
        if why is not None:
            record.fusion = {"status": FusionStatus.OFF.value, "detail": why}
            return None
        record.fusion = {"status": FusionStatus.PENDING.value}
        session = self.session
        tolerance = session.options.fuse if isinstance(session.options.fuse, FuseTolerance) else None
        # Inductor settings given in `options` (a framework's): applied unless the recipe sets them
        recipe, keys = with_inductor_keys(recipe_for(kind, tolerance), session.options.inductor.items)
        if session.options.inductor:
            record.fusion["inductor_keys"] = {
                "applied": {k: reported(v) for k, v in keys["applied"].items()},
                "overridden": {k: {w: reported(v) for w, v in both.items()} for k, both in keys["overridden"].items()}}
        self.fusion = Fusion(recipe, device_identity(kind), session.verdicts, record.fusion,
                             session.contain, lambda key, message: session.events.warn_once(key, "%s", message),
                             session.options.strict, record.name)
        return self.fusion

    def _runner(self, scope: Any, piece: fx.GraphModule, info: PieceInfo, device: str, record: GraphRecord,
                agreement: Agreement | None, fusion: Fusion | None = None) -> GraphRunner:
        opts = self.session.options
        stats = CudaGraphStats()
        record.piece_stats.append(stats)
        gates = [n.target for n in piece.graph.nodes if "gd_substitution" in n.meta]
        state = {i: o.name for i, o in enumerate(info.input_origins) if o is not None and o.is_state}
        # A backward's inputs (saved tensors, gradients) pass no Dynamo guard: its runner
        # keys every call by layout and checks the layouts of what it reads in place.
        guarded = record.kind != "backward"
        fn: Callable[..., Any] = generated_forward(piece)
        if fusion is not None:
            fn = fusion.unit(piece, fn)
        runner = GraphRunner(fn, f"{record.name}.piece_{info.index}", scope, stats,
                             warmup=opts.warmup, max_captures=opts.max_captures,
                             verify_inputs=opts.verify_inputs, state_names=state,
                             input_names=[o.name if o is not None else "" for o in info.input_origins], gates=gates,
                             # a piece holding collectives may not run again on this rank alone
                             suspects=Suspects(piece, rerun=not info.collectives), device=device,
                             writes=Writes(info.mutated, info.write_plan, opts.max_snapshot_bytes,
                                           [o.name if o is not None else "" for o in info.input_origins]),
                             wide=info.wide,
                             guarded=guarded, static_shapes=guarded and _fixed_shapes(piece),
                             agreement=agreement if info.collectives else None, unwritten=info.unwritten)
        if record is self.record:
            self.runners.append(runner)
        if fusion is not None:
            fusion.on_change(runner.recompiled)
        return call_target(runner, f"gd_piece_{info.index}")

    def _contract_mismatch(self, record: GraphRecord, detail: str) -> None:
        self.session.events.warn_once(f"contract:{record.name}",
                                      "graphdispatch: %s ran eager: inputs break its contract: %s",
                                      record.name, detail)

