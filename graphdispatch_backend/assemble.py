"""The runtime objects of one graph, built from its plan (plan.py): a piece's runner and the
eager check around its lowered form. backend.py wires them together
for aot's compilers; nothing here decides what serves a graph (the plan did) or catches
an exception.

Before::   GraphPlan(engine=HOST, device="cpu", ...), a piece, the lowered graph
After::    GraphRunner(FusedUnit(piece), scope, warmup, ...); EagerCheck(dynamo_forward, lowered, ...)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.fx as fx

from graphdispatch_backend.capture.lower import InputOrigin
from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.diagnostics.report import CudaGraphStats, GraphRecord
from graphdispatch_backend.errors import Engine
from graphdispatch_backend.fusion.statistics import watchable
from graphdispatch_backend.passes.context import PieceInfo
from graphdispatch_backend.passes.locate_writes import WritePlan
from graphdispatch_backend.plan import GraphPlan, Role, fixed_shapes
from graphdispatch_backend.runtime.checks import novelty as novelty_checks
from graphdispatch_backend.runtime.checks.agree import Agreement
from graphdispatch_backend.runtime.checks.autograd_check import GradientCheck
from graphdispatch_backend.runtime.checks.eager_check import EagerCheck
from graphdispatch_backend.runtime.checks.novelty import Arrival, Novelty
from graphdispatch_backend.runtime.checks.schedule import graph_schedule
from graphdispatch_backend.runtime.checks.suspects import Suspects
from graphdispatch_backend.runtime.checks.world import Region, Writes
from graphdispatch_backend.runtime.program.fused import Fusion
from graphdispatch_backend.runtime.runner import GraphRunner
from graphdispatch_backend.session import Session


def runner_for(session: Session, scope: Any, piece: fx.GraphModule, fn: Callable[..., Any], info: PieceInfo,
               plan: GraphPlan, record: GraphRecord, agreement: Agreement | None, fusion: Fusion | None) -> GraphRunner:
    """The runner of one capturable piece (or of the whole graph; `fn` runs it), its counters in `record`."""
    opts = session.options
    stats = record_fields.piece_added(record, CudaGraphStats())
    gates = [n.target for n in piece.graph.nodes if "gd_substitution" in n.meta]
    state = {i: o.name for i, o in enumerate(info.input_origins) if o is not None and o.is_state}
    names = [o.name if o is not None else "" for o in info.input_origins]
    # A backward's inputs (saved tensors, gradients) pass no Dynamo guard: its runner
    # keys every call by layout and checks the layouts of what it reads in place.
    guarded = plan.role is not Role.BACKWARD
    if fusion is not None:
        fn = fusion.unit(piece, fn)
    runner = GraphRunner(fn, f"{record.name}.piece_{info.index}", scope, stats,
                         warmup=opts.warmup, max_captures=opts.max_captures,
                         verify_inputs=opts.verify_inputs, state_names=state, input_names=names, gates=gates,
                         # a piece holding collectives may not run again on this rank alone
                         suspects=Suspects(piece, rerun=not info.collectives), device=plan.device,
                         writes=Writes(info.mutated, info.write_plan, opts.max_snapshot_bytes, names),
                         wide=info.wide, guarded=guarded, static_shapes=guarded and fixed_shapes(piece),
                         agreement=agreement if info.collectives else None, unwritten=info.unwritten)
    if fusion is not None:
        fusion.on_change(runner.recompiled)
    return runner


def watched_in_graph(plan: GraphPlan, origins: Sequence[InputOrigin], devices: Sequence[str | None],
                     placeholders: Sequence[fx.Node], mutated: Sequence[int] | None, substituted: bool,
                     agreement: Agreement | None) -> list[int]:
    """The inputs (aot positions) whose novelty statistics a fused graph takes in its own
    kernels (fusion/statistics.py), for its eager check to judge the call after it ran
    (runtime/checks/posted.py): the inputs `eager_checked` watches (`devices`: per call
    input, where the checks would watch it, novelty.py `watched_on`). None ([]) where a
    call must be judged before it runs, or by a reduction of its own: the graph writes an
    input (a check puts the world back from before the call) or draws random numbers (it
    replays the draws from before), captures pieces, serves an artifact (a check runs its
    regions native, the served call did not), agrees its verdicts over ranks, runs off the
    CPU (a read would synchronize), or an input the check would watch has no static shape."""
    if (plan.role is not Role.INFERENCE or plan.engine is not Engine.OFF or mutated is None or mutated
            or plan.draws or substituted or agreement is not None or not novelty_checks.ENABLED
            or plan.inputs != len(origins) or torch.device(plan.device).type != "cpu"):
        return []
    n_lifted = len(origins) - len(devices)
    watched = []
    for p in range(n_lifted, len(origins)):
        device = devices[p - n_lifted]
        if origins[p].is_state or device is None:
            continue  # not watched at all (runtime/checks/novelty.py)
        if device != "cpu" or not watchable(placeholders[p].meta.get("val")):
            return []
        watched.append(p)
    return watched


class Lowering(Protocol):
    """What building the lowered graph left for its check (backend.py's builder)."""

    origins: tuple[InputOrigin, ...]
    mutated: list[int] | None  # inputs (aot positions) it writes into
    write_plan: WritePlan | None
    agreement: Agreement | None
    runners: list[GraphRunner]
    fusion: Fusion | None
    unfaithful: str | None  # what makes the lowering differ from eager on some inputs (capture/matmul_folds.py)


def eager_checked(session: Session, record: GraphRecord, gm: fx.GraphModule, eager: Callable[..., Any],
                  unwritten: Sequence[int], compiled: Callable[..., Any], plan: GraphPlan, lowering: Lowering,
                  lifted: list[torch.Tensor], n_inputs: int) -> EagerCheck:
    """The lowered graph (`compiled`, aot's; `plan`: its inference graph's or forward's)
    inside its eager check (runtime/checks/eager_check.py); `gm`: the Dynamo graph, `eager`
    its forward; `unwritten`: the outputs it makes and never writes (passes/ops.py)."""
    origins, mutated, agreement = lowering.origins, lowering.mutated or [], lowering.agreement
    n_lifted = len(lifted)
    # the lowered graph's inputs are aot's (parameters and buffers lifted first): its write
    # plan locates regions of those, when they are these one to one (no effect token, no
    # merged duplicate or synthetic base; else written inputs are snapshotted whole)
    one_to_one = plan.inputs == n_lifted + n_inputs
    writes = Writes(mutated, lowering.write_plan if one_to_one else None, session.options.max_snapshot_bytes,
                    [o.name for o in origins])

    def locate(args: Sequence[Any]) -> list[Region]:
        return writes.regions([*lifted, *args])

    # fingerprinted whole at a check where artifacts serve from replays (no gate runs there): the
    # inputs a kernel declares it writes (beyond its rows?), and those it reads and does not
    # declare (a write into a weight: the trial's kernel that added to a bias on one replay)
    reads = lowering.artifact_reads if one_to_one else ()

    def located(args: Sequence[Any]) -> list[torch.Tensor]:
        every = [*lifted, *args]
        found = writes.located(every)
        return found + [every[p] for p in reads if isinstance(every[p], torch.Tensor)
                        and all(every[p] is not t for t in found)]

    unwritten_reads = [p for p in reads if p not in mutated]  # those the graph writes are in its world already
    writing = any(s.mutates for s in record.substitutions)  # a kernel serving here writes its inputs

    def kept(args: Sequence[Any]) -> list[torch.Tensor]:
        """The `whole` inputs copied while the copies fit max_snapshot_bytes (together): the
        written ones where a kernel that writes its inputs serves (a write beyond its rows),
        then those artifacts read and nothing writes; such a write is put back
        (runtime/checks/side_by_side.py)."""
        every, out, total = [*lifted, *args], [], 0
        for t in [*(writes.located(every) if writing else ()), *(every[p] for p in unwritten_reads)]:
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
                if total > session.options.max_snapshot_bytes:
                    break
                out.append(t)
        return out

    keyed = [j for j, o in enumerate(origins[n_lifted:]) if not o.is_state]
    # the parameters among them (a block's weights; not its buffers: a cache made per request
    # is a new buffer, and would make every request a new state to check)
    state = [j for j, o in enumerate(origins[n_lifted:]) if o.kind == "parameter"]
    # ... and those of them artifacts read where they serve from replays (no gate sees such a
    # call): a write into them (a new checkpoint loaded in place) makes the next call checked
    replayed = bool(record.substitutions) and plan.engine is not Engine.OFF
    watched = [p - n_lifted for p in reads if p - n_lifted in state] if replayed else []
    dynamic = any(o.kind == "symbol" for o in origins)
    # calls whose inputs leave what the checked calls saw are checked too: the inputs it
    # only reads (not parameters, not written: aot's positions must map onto these one to
    # one, as for the write plan); not where ranks must check the same calls
    written = {p - n_lifted for p in mutated}
    names = [o.name for o in origins[n_lifted:]]
    novelty = None if agreement is not None or not one_to_one and mutated else Novelty(
        [j for j in keyed if j not in written], names, Arrival.NEXT_CALL if plan.engine is Engine.HOST else Arrival.NOW)
    # a fused graph that takes them itself: judged after its call (watched_in_graph)
    posted = lowering.fusion.posted if lowering.fusion is not None and novelty is not None else None
    if posted is not None:
        novelty = Novelty([p - n_lifted for p in posted.positions], names, Arrival.NOW)
    # an autograd graph's check also compares the gradients of one backward
    gradients = GradientCheck(lifted, [o.name for o in origins], session.contain, record) \
        if plan.role is Role.FORWARD else None
    options = session.options
    return EagerCheck(eager, compiled, record, session.events, session.contain,
                      options.strict, keyed, locate, dynamic, session.timing,
                      # eager's own nondeterminism is named by running the Dynamo graph op
                      # by op, where this rank may run it alone (runtime/checks/suspects.py)
                      Suspects(gm, rerun=agreement is None and gradients is None), agreement, gradients,
                      recheck="every" if options.timing == "shadow" else graph_schedule(
                          plan.recheck(options), options.artifact_recheck, replayed),
                      runners=lowering.runners, draws=plan.draws, fusion=lowering.fusion,
                      unwritten=unwritten, novelty=novelty, posted=posted, unfaithful=lowering.unfaithful, state=state,
                      watched=watched,
                      # a kernel that writes its inputs may write beyond the rows: where it replays (no
                      # gate runs), those inputs are read whole; an eager call's gate reads them itself
                      whole=located if plan.engine is not Engine.OFF and (reads or writing) else None,
                      kept=kept if plan.engine is not Engine.OFF and (unwritten_reads or writing) else None)
