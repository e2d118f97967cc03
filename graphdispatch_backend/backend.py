"""The `torch.compile` backend, and the one place that catches broad exceptions.

`graphdispatch_backend(gm, example_inputs, options=..., mode=...)` resolves the options,
finds the session, lowers the Dynamo graph with aot (inside the observed autocast state)
and builds each of aot's graphs in three steps: plan it (plan.py: engine, device, fusion,
then how its pieces are served), run the pass pipeline on it, and assemble its callables
from the plan (runners, fusion, the eager check around it); the record is written from
the plan (diagnostics/record_fields.py). If anything in that goes wrong, the graph runs
eagerly instead, counted and reported with its reason (`backend_error`); under `strict`
the error is raised as GraphDispatchError. Registered through the `torch_dynamo_backends`
entry point as "graphdispatch". aot compiles the backward lazily, inside the user's first
`backward()`: the builder's catch around that compile is a broad one, so it lives here.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from graphdispatch_backend.assemble import eager_checked, runner_for, watched_in_graph
from graphdispatch_backend.capture import lower as aot_inputs
from graphdispatch_backend.capture.autocast import AutocastState
from graphdispatch_backend.capture.lower import STATE_KINDS, InputOrigin, input_origins, lower, mutated_inputs
from graphdispatch_backend.capture.matmul_folds import unfolded_matmul
from graphdispatch_backend.codegen import deferred_forward, generated_forward
from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.diagnostics.fusion_report import FusionReport
from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.errors import (
    Contain,
    Decline,
    Engine,
    GraphDispatchError,
    KernelExited,
    OptionsError,
    StrictModeError,
)
from graphdispatch_backend.fusion.recipe import recipe_for, with_inductor_keys
from graphdispatch_backend.fusion.verdicts import device_identity
from graphdispatch_backend.graph_artifacts import GraphArtifacts, call_target
from graphdispatch_backend.options import Options
from graphdispatch_backend.passes import BACKWARD_PIPELINE, PassContext, run_pipeline
from graphdispatch_backend.passes.context import PieceInfo, PieceSpec
from graphdispatch_backend.passes.locate_writes import WritePlan
from graphdispatch_backend.passes.ops import collective_groups, unwritten_outputs
from graphdispatch_backend.plan import GraphPlan, Role, Serve, Serving, plan_graph
from graphdispatch_backend.runtime.call.contract import PlaceholderContract, WrittenApart
from graphdispatch_backend.runtime.checks.agree import Agreement, agreement_for
from graphdispatch_backend.runtime.checks.novelty import watched_on
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


def make_contain(strict: bool, kernels: bool = False) -> Contain:
    """Run a thunk of third-party code (artifact, capture, export) and hand back what it
    raised instead of raising. Only StrictModeError (graphdispatch's own, under `strict`)
    passes through; under `strict`, anything else raises StrictModeError too. `kernels`:
    the thunk runs an artifact's code only (its import, its calls), whose `sys.exit()` is
    a raise of the kernel's (KernelExited), not the end of the user's process (a trial's
    kernel exited on an input it did not support); the user's own code (a capture runs the
    model) exits as it would."""

    def contain(thunk: Callable[[], Any]) -> tuple[Any, Exception | None]:
        try:
            return thunk(), None
        except StrictModeError:
            raise
        except Exception as exc:
            if strict:
                raise StrictModeError(f"{type(exc).__name__}: {exc}") from exc
            return None, exc
        except SystemExit as exc:
            if not kernels:
                raise
            return None, KernelExited(f"the kernel called sys.exit({exc.code!r})")

    return contain


def graphdispatch_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    extra = sorted(set(kwargs) - {"options", "mode"})
    if extra:
        raise OptionsError(f"unexpected backend argument {extra[0]!r}; torch.compile passes 'options' and 'mode'")
    options = Options.resolve(kwargs.get("options"), kwargs.get("mode"))
    session = session_for(options, make_contain)
    record = session.report.new_graph(str(gm.meta.get("dynamo_compile_id", "")))
    try:
        compiled = _compile(session, record, gm, example_inputs)
        weakref.finalize(compiled, record.retire)  # the graph gone, its record keeps figures only
        return compiled
    except _DYNAMO_CONTROL:
        raise
    except Exception as exc:
        if options.strict:  # the report says it too: a graph whose compile raised does not read as clean
            record_fields.failed(record, exc, whole=True)
            raise exc if isinstance(exc, GraphDispatchError) else StrictModeError(
                f"compiling a graph failed: {type(exc).__name__}: {exc}") from exc
        return _fallback(session, record, gm, exc)
    finally:
        session.write()


def _fallback(session: Session, record: GraphRecord, gm: fx.GraphModule, exc: Exception) -> Callable[..., Any]:
    """The Dynamo graph, run as is: nothing half-built from this graph is used."""
    error = record_fields.failed(record, exc, whole=True)
    session.events.warn_once(f"backend_error:{type(exc).__name__}",
                             "graphdispatch: a graph runs eager because compiling it failed: %s", error)
    session.events.decision("fallback", {"graph": record.name, "error": error})
    return _as_traced(gm, record, Decline.BACKEND_ERROR)  # the module itself: no code of ours to fail again


def _as_traced(run_traced: Callable[..., Any], record: GraphRecord, reason: Decline) -> Callable[..., Any]:
    """The Dynamo graph (`run_traced`) as the call's answer, each call counted eager with `reason`."""

    def run(*args: Any) -> Any:
        try:
            out = run_traced(*args)
        except Exception:  # the caller's own error: counted as it is raised
            record.called(False, Decline.RAISED.value)
            raise
        record.called(False, reason.value)
        return out

    return run


def _compile(session: Session, record: GraphRecord, gm: fx.GraphModule,
             example_inputs: Sequence[Any]) -> Callable[..., Any]:
    autocast = AutocastState.observe()
    origins = input_origins(gm, example_inputs)
    lifted = [t for _, t in gm.named_parameters(remove_duplicate=False)] + [
        t for _, t in gm.named_buffers(remove_duplicate=False)]
    builder = _Builder(session, record, origins, gm.meta.get("gd_model_modules"),
                       [watched_on(x) for x in example_inputs],
                       [bool(getattr(x, "requires_grad", False)) for x in (*lifted, *example_inputs)])
    compiled = lower(gm, example_inputs, autocast, inference_compiler=builder.inference,
                     forward_compiler=builder.forward, backward_compiler=builder.backward)
    session.events.decision("compile", {"graph": record.name, "kind": record.kind.value, "nodes": record.nodes,
                                        "regions": len(record.regions), "substitutions": len(record.substitutions),
                                        "cuda_graph": record.cuda_graph_mode,
                                        "cuda_graph_reason": record.cuda_graph_reason,
                                        "autocast": autocast.to_dict()})
    plan, serving = builder.plan, builder.serving
    # the checks around the lowered graph index the call's inputs: aot's positions, where a tensor
    # subclass is flattened (a trial's DTensor Llama's static cache's fell on a weight), taken back
    written, whole = aot_inputs.outer_positions(builder.flat, builder.mutated or ())
    if not whole:
        record_fields.not_lowered(record, "the graph writes inside a tensor subclass (a DTensor's local tensor): "
                                          "no input of the call is what it writes, for its checks to copy and "
                                          "compare: the Dynamo graph runs, as eager")
        return _as_traced(generated_forward(gm), record, Decline.SUBCLASS_WRITES)
    if builder.mutated is not None:
        builder.mutated = written
    # a weight inside a subclass that a kernel reads is not fingerprinted at replayed checks
    builder.artifact_reads = tuple(aot_inputs.outer_positions(builder.flat, builder.artifact_reads)[0])
    if plan is not None and serving is not None and plan.serves_nothing(serving, bool(record.substitutions)):
        # no piece to capture, no artifact, nothing fused: the lowering would serve nothing
        # and cost its checks (a second prefill on the calls of its schedule): eager runs
        record_fields.not_lowered(record, "nothing to serve (no capturable piece, no artifact substituted, "
                                          "nothing fused): the Dynamo graph runs, as eager")
        compiled = _as_traced(generated_forward(gm), record, Decline.NO_CAPTURABLE_PIECE)
    elif plan is not None and builder.mutated is not None:
        compiled = eager_checked(session, record, gm, generated_forward(gm), unwritten_outputs(gm), compiled,
                                 plan, builder, lifted, len(example_inputs))
    if builder.mutated:
        compiled = _kept_apart(compiled, gm, builder, origins, len(lifted), example_inputs)
    if session.exporter is None:
        return compiled
    observe = session.exporter.register(record, gm, origins, autocast, len(lifted))
    checked = compiled

    def run(*args: Any) -> Any:
        observe(args)
        return checked(*args)

    return run


def _kept_apart(compiled: Callable[..., Any], gm: fx.GraphModule, builder: _Builder,
                origins: tuple[InputOrigin, ...], lifted: int, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """`compiled`, for a graph that writes an input, behind the check that no call passes
    that input overlapping another (runtime/call/contract.py WrittenApart): aot traced them
    apart, and its graph and every replay compute as if so. A call that passes them
    overlapping runs the Dynamo graph, whose in-place ops eager's order keeps, counted
    `contract_mismatch` and said once. Positions are the Dynamo graph's (aot's less the
    module state it lifted first)."""
    written = [p - lifted for p in builder.mutated or () if p >= lifted]
    if not written:
        return compiled
    record = builder.record
    others = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)
              and not (i + lifted < len(origins) and origins[i + lifted].kind in STATE_KINDS)]
    names = [origins[i + lifted].name if i + lifted < len(origins) else "" for i in range(len(example_inputs))]
    apart, dynamo_graph = WrittenApart(written, others, names), generated_forward(gm)

    def run(*args: Any) -> Any:
        overlap = apart.overlap(args)
        if overlap is None:
            return compiled(*args)
        record_fields.contract_broken(record, overlap)
        builder.contract_mismatch(record, overlap)
        out = dynamo_graph(*args)
        record.called(False, Decline.CONTRACT_MISMATCH.value)
        return out

    return run


def _untraced(backward: Callable[..., Any]) -> Callable[..., Any]:
    """A backward Dynamo never traces. The autograd engine runs it from the user's
    `backward()`, and where that is called inside a function Dynamo compiles (a compiled
    train step) Dynamo would trace graphdispatch's own runtime as user code: its capture
    raised inside Dynamo, and each of its frames came back as one more graph. A forward
    needs none: Dynamo calls a backend's compiled function outside its tracing."""
    run = torch._dynamo.disable(backward, reason="graphdispatch's runtime, not user code")
    run._boxed_call = True  # type: ignore[attr-defined]  # aot hands over its argument list, as to `backward`
    return run


class _Builder:
    """The aot compilers for one Dynamo graph: each graph planned, its passes run, its
    callables assembled from the plan."""

    def __init__(self, session: Session, record: GraphRecord, origins: tuple[InputOrigin, ...],
                 model_modules: Sequence[str] | None = None, watched: Sequence[str | None] = (),
                 requires_grad: Sequence[bool] = ()) -> None:
        self.session = session
        self.record = record
        self.origins = origins
        # aot's inputs where a tensor subclass (a DTensor) is flattened; None: the user's one to one
        self.flat: aot_inputs.FlatInputs | None = None
        # per Dynamo input, where the novelty checks would watch it (not the inputs: the
        # builder lives as long as the graph, and would keep the first call's inputs alive)
        self.watched = watched
        self.requires_grad = tuple(requires_grad)  # per aot input (lifted first): what eager's matmuls fold by
        self.unfaithful: str | None = None  # the inference graph's lowering differs from eager on some inputs
        self.artifacts = GraphArtifacts(session, record, model_modules)
        # inputs (aot positions) the inference graph writes into; None: it cannot be checked
        # against eager (an input's metadata is mutated, or aot did not say)
        self.mutated: list[int] | None = None
        self.plan: GraphPlan | None = None  # the inference graph's or forward's, and how it is served
        self.serving: Serving | None = None
        self.write_plan: WritePlan | None = None  # where the forward writes them (passes/locate_writes.py)
        self.artifact_reads: tuple[int, ...] = ()  # inputs (aot positions) artifacts read and do not declare writing
        self.runners: list[GraphRunner] = []  # the forward's, in the order of its record's piece_stats
        self.agreement: Agreement | None = None
        # Dynamo is compiling this graph: its guards stand in front of every call (program.py)
        self.guarded = torch._guards.CompileContext.try_get() is not None
        self.fusion: Fusion | None = None  # the inference graph's, with `fuse` (runtime/program/fused.py)

    def inference(self, gm: fx.GraphModule, inputs: Sequence[Any]) -> CompiledGraph:
        self.mutated = mutated_inputs()
        self.flat = aot_inputs.flat_inputs(gm)
        self.unfaithful = unfolded_matmul(gm, self.requires_grad, [o.name for o in self.origins])
        return self._build(gm, self.record, Role.INFERENCE)

    def forward(self, gm: fx.GraphModule, inputs: Sequence[Any]) -> CompiledGraph:
        """The forward of an autograd graph: checked, captured and replayed as an inference
        graph is (aot runs it under no_grad, inside its autograd.Function); every output is
        copied out of pool memory after a replay, the tensors saved for backward included
        (the generation rule: see docs/design.md, section 6)."""
        self.mutated = mutated_inputs()
        self.flat = aot_inputs.flat_inputs(gm)
        record_fields.backward_of(self.record, fresh=True)
        return self._build(gm, self.record, Role.FORWARD)

    def backward(self, gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        """The backward, captured like the forward. aot compiles it lazily, inside the
        user's first backward(): a failure here must not raise there, so the lowered
        backward then runs as aot made it, counted `backend_error`."""
        record = record_fields.backward_of(self.record)  # made with the forward; here if aot made none
        native = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        try:
            return _untraced(self._build(gm, record, Role.BACKWARD))
        except Exception as exc:
            if self.session.options.strict:
                raise StrictModeError(f"compiling the backward of {self.record.name} failed: "
                                      f"{type(exc).__name__}: {exc}") from exc
            return _untraced(backward_fallback(self.session.events, record, native, exc))

    def _build(self, gm: fx.GraphModule, record: GraphRecord, role: Role) -> CompiledGraph:
        # the original, before the passes: for contract fallbacks (generated if one comes)
        native = deferred_forward(gm)
        # a graph with collectives: verdicts are agreed over the ranks of its groups
        agreement = agreement_for(collective_groups(gm))
        plan = plan_graph(gm, role, self.session.options, self.mutated is not None, agreement is not None)
        contract = PlaceholderContract.of(gm, plan.tokens)
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        record_fields.planned(record, role.kind, plan.nodes, plan.inputs, plan.engine)
        if role is not Role.BACKWARD:
            self.plan, self.agreement = plan, agreement
        fusion = self._fusion(plan, record)
        if role is not Role.BACKWARD:
            self.fusion = fusion
        scope = self.session.scope(plan.engine.value) if plan.engine is not Engine.OFF else None
        ctx = PassContext(
            # a backward's inputs are saved tensors and gradients: no parameter, no region
            input_origins=self._inner_origins() if role is not Role.BACKWARD else (),
            # an autograd graph substitutes nothing: every artifact its pattern names is refused
            matcher=self.artifacts.match if role is Role.INFERENCE else self.artifacts.match_autograd,
            make_call=self.artifacts.make_call,
            pieces_spec=PieceSpec(torch.device(plan.device).type, lambda piece, info: self._runner(
                scope, piece, info, plan, record, agreement, fusion), role is Role.INFERENCE) if scope else None,
            fused=fusion is not None,
        )
        if role is Role.BACKWARD:
            run_pipeline(gm, ctx, BACKWARD_PIPELINE)
        else:
            run_pipeline(gm, ctx)
        record_fields.passes_found(record, ctx.stripped_assertions, [
            {"input": self._input_name(w.position, placeholders), "in_place": w.in_place, "detail": w.detail}
            for w in ctx.writes], ctx.buffer_writes, [p.to_dict() for p in ctx.pieces], ctx.split_reasons)
        if role is not Role.BACKWARD:
            self.write_plan = ctx.write_plan
            self.artifact_reads = tuple(sorted({p for s in ctx.substitutions for p in s.reads}))
            record_fields.regions_found(record, [self.artifacts.region_entry(
                r, ctx.outcomes.get(r.name), role is Role.INFERENCE) for r in ctx.regions],
                self.artifacts.module_rejections)
            self.artifacts.check_authoring(role.training)
        serving = plan.serving(ctx.pieces, ctx.split_reasons)
        run: Callable[..., Any]
        if serving.how is Serve.WHOLE:  # the runner generates its piece's own forward
            run = self._runner(scope, gm, ctx.pieces[0], plan, record, agreement, fusion)
        else:  # forward, not __call__: nn.Module's call machinery costs microseconds per call
            run = generated_forward(gm)
            if serving.fused and fusion is not None:  # fused around its captured pieces, or uncaptured
                # the inputs whose novelty statistics its kernels take (fusion/statistics.py)
                watched = watched_in_graph(plan, self.origins, self.watched, placeholders, self.mutated,
                                           bool(record.substitutions), agreement)
                run = fusion.unit(gm, run, watched)
        if serving.without_history:
            run = without_history(run, native, self.session.events, record)
        if fusion is not None:
            fusion.finish()  # compiled with what the graph learned before (the verdict cache)
        record_fields.served(record, serving.decline, serving.detail)
        if serving.decline is not None and serving.warning is not None:
            self.session.events.warn_once(f"decline:{serving.decline.value}",
                                          "graphdispatch: CUDA graph declined for %s (%s): %s",
                                          record.name, serving.decline.value, serving.warning)
        if role is not Role.BACKWARD:
            self.serving = serving
        return CompiledGraph(run, native, contract, record, self.session.timing, serving.decline,
                             lambda detail: self.contract_mismatch(record, detail),
                             guarded=self.guarded and role is not Role.BACKWARD)

    def _inner_origins(self) -> tuple[InputOrigin, ...]:
        """The origins of the lowered graph's own inputs (aot's, subclasses flattened): what
        its passes, runners and gates name and key by position."""
        return self.origins if self.flat is None else self.flat.origins(self.origins)

    def _input_name(self, position: int, placeholders: list[fx.Node]) -> str:
        origins = self._inner_origins()
        if position < len(origins) and origins[position] is not None:
            return origins[position].name
        return placeholders[position].name

    def _fusion(self, plan: GraphPlan, record: GraphRecord) -> Fusion | None:
        """The graph's Fusion where its plan fuses it (`fuse`); else its record says why not."""
        if plan.fusion is None or plan.fusion.off is not None:
            if plan.fusion is not None:
                FusionReport.off(record, plan.fusion.detail or "")
            return None
        session, kind = self.session, plan.fusion.device_type
        # Inductor settings given in `options` (a framework's): applied unless the recipe sets them
        recipe, keys = with_inductor_keys(recipe_for(kind, plan.fusion.tolerance), session.options.inductor.items)
        return Fusion(recipe, device_identity(kind), session.verdicts,
                      FusionReport.planned(record, keys if session.options.inductor else None), session.contain,
                      lambda key, message: session.events.warn_once(key, "%s", message), session.options.strict,
                      record.name)

    def _runner(self, scope: Any, piece: fx.GraphModule, info: PieceInfo, plan: GraphPlan, record: GraphRecord,
                agreement: Agreement | None, fusion: Fusion | None = None) -> Callable[..., Any]:
        # forward, not __call__: nn.Module's call machinery costs microseconds per call
        runner = runner_for(self.session, scope, piece, generated_forward(piece), info, plan, record, agreement,
                            fusion)
        if record is self.record:
            self.runners.append(runner)
        return call_target(runner, f"gd_piece_{info.index}")

    def contract_mismatch(self, record: GraphRecord, detail: str) -> None:
        self.session.events.warn_once(f"contract:{record.name}",
                                      "graphdispatch: %s ran eager: inputs break its contract: %s",
                                      record.name, detail)
