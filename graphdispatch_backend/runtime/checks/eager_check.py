"""EagerCheck: prove the lowering against real eager, bit for bit, again and again.

Everything downstream (artifact gates, CUDA-graph verification) compares against the
*lowered* ATen graph. The lowering itself (aot) is not always bitwise equal to eager on
torch 2.13: a Linear after a permuted conv under CPU bf16 autocast is lowered to another
matmul path, eval BatchNorm on a transposed input gets fake strides that make a later view
invalid at run time, and some lowerings (nuclear `norm`, bf16 bilinear upsampling) differ
only for some values. So on the calls the `recheck` schedule picks per shape key (by
default the 1st, 2nd, 4th, 8th, ...; runtime/checks/schedule.py; the first MAX_KEYS shape
keys of a dynamic graph), and where artifacts are served from replays (no gate sees a
replay) on the calls their `artifact_recheck` schedule picks too (`graph_schedule`), the
Dynamo graph itself also runs, eagerly, on the same inputs: the inputs the
graph mutates are snapshotted and restored and the RNG state is replayed, so both runs see
the same world. The compiled call on such a call is the one the user gets (a replay, once
the graph replays), so the check covers the served path end to end.

An autograd graph's check also compares the gradients of one backward when the call
records autograd history (runtime/checks/autograd_check.py); its verdicts are the same.

Verdicts, each for the rest of the session (the graph then runs as the Dynamo graph,
eagerly, counted and said):
- `lowering_mismatch`: outputs (values, strides, views) or mutated inputs differ, and a
  second eager run agrees with the first;
- `eager_nondeterministic`: eager disagrees with itself (atomics, `index_add_`), so no
  bitwise promise can be checked; the suspected ops are reported;
- `lowering_failed`: the compiled graph raises where eager does not (an out-of-memory
  is no verdict: eager answers that call, `out_of_memory`);
- `check_failed`: one of graphdispatch's own steps (a snapshot, a comparison) raised.
Nothing this check adds raises into the user's call: every step runs inside `contain`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Contain, Decline, Demotion, StrictModeError
from graphdispatch_backend.runtime.call.calls import mark_entry
from graphdispatch_backend.runtime.checks.agree import Agreement, agreed_verdict
from graphdispatch_backend.runtime.checks.autograd_check import GradientCheck
from graphdispatch_backend.runtime.checks.draws import Start, privately
from graphdispatch_backend.runtime.checks.isolate import Checked, across_ranks, beside, blame, caught_elsewhere, culprit
from graphdispatch_backend.runtime.checks.lowering import Lowering
from graphdispatch_backend.runtime.checks.modes import native_regions
from graphdispatch_backend.runtime.checks.novelty import Novelty, Observation
from graphdispatch_backend.runtime.checks.parity import BEYOND
from graphdispatch_backend.runtime.checks.posted import Posted
from graphdispatch_backend.runtime.checks.reference import Reference, flat
from graphdispatch_backend.runtime.checks.schedule import MAX_KEYS as KEPT_KEYS
from graphdispatch_backend.runtime.checks.schedule import GraphDue
from graphdispatch_backend.runtime.checks.side_by_side import REFERENCE, Compared, Kind, SideBySide, within
from graphdispatch_backend.runtime.checks.suspects import Suspects
from graphdispatch_backend.runtime.checks.world import Region
from graphdispatch_backend.runtime.cudagraph.engine import is_out_of_memory

MAX_KEYS = KEPT_KEYS  # shape keys whose schedules are kept (schedule.KeyedDue); 0 turns the check off

Verdict = tuple[Decline, str] | None
_UNSERVED = object()  # EagerCheck._check: the compiled graph has not run for this call yet


class EagerCheck:
    """The schedule (which calls are checked) and the order of one check; the comparison is
    runtime/checks/side_by_side.py's, the verdict's consequences runtime/checks/lowering.py's
    and isolate.py's (`blame`)."""

    def __init__(
        self,
        eager: Callable[..., Any],
        compiled: Callable[..., Any],
        record: GraphRecord,
        events: Events,
        contain: Contain,
        strict: bool,
        keyed: Sequence[int],
        locate: Callable[[Sequence[Any]], list[Region]],
        dynamic: bool,
        timing: Timing,
        suspects: Suspects | None = None,
        agreement: Agreement | None = None,
        gradients: GradientCheck | None = None,
        recheck: str | int = "doubling",
        runners: Sequence[Any] = (),
        draws: bool = False,
        fusion: Any = None,
        unwritten: Sequence[int] = (),
        novelty: Novelty | None = None,
        posted: Posted | None = None,
        unfaithful: str | None = None,
        whole: Callable[[Sequence[Any]], Sequence[Any]] | None = None,
        state: Sequence[int] = (),
        watched: Sequence[int] = (),
        kept: Callable[[Sequence[Any]], Sequence[Any]] | None = None,
    ) -> None:
        self._eager = eager  # the Dynamo graph: the user's code, as Dynamo traced it
        self._compiled = compiled
        self._record = record
        self._events = events
        self._contain = contain
        self._locate = locate  # where in its inputs this call will write (runtime/checks/world.py)
        # the written inputs fingerprinted whole, where an artifact that writes inputs serves
        # inside the graph: a write beyond the rows (runtime/checks/side_by_side.py)
        self._whole = whole
        self._kept = kept  # ... and those of them that no party may write, copied to undo such a write
        self._suspects = suspects if suspects is not None else Suspects()  # who to name when eager disagrees
        self._agreement = agreement  # the graph holds collectives: verdicts are agreed over its ranks
        # which calls are checked (runtime/checks/schedule.py): by position per shape key, and
        # those whose inputs leave what the checked calls saw (runtime/checks/novelty.py)
        # a fused graph may take them itself (runtime/checks/posted.py): then a call is judged
        # by them after it ran, and checked then (its inputs unwritten, no draws) when new
        self._posted = posted if novelty is not None and novelty.on else None
        self._watch = novelty if self._posted is not None else None
        # `state`: the parameters among the call inputs (blocks compiled one by one share this
        # graph, each with its own: a schedule per block, runtime/checks/schedule.py); `watched`:
        # the weights artifacts read from replays, a call after a write into them checked
        self._due = GraphDue(recheck, record.name, dynamic, keyed, None if self._posted is not None else novelty,
                             state, watched)
        self._on = MAX_KEYS > 0
        self._lowering = Lowering(eager, compiled, record, events, contain, strict)  # who answers, who is declined
        if unfaithful is not None:  # known to differ from eager on some inputs: never served (capture/matmul_folds.py)
            self._lowering.give_up(Decline.LOWERING_UNFAITHFUL, unfaithful)
        self._timing = timing if timing.enabled else None
        self._gradients = gradients  # an autograd graph's: its backward is checked too
        # an inference graph's pieces' runners (by the record's piece_stats): a mismatch is
        # isolated (runtime/checks/isolate.py) where ranks need not agree on every eager run
        self._runners = tuple(runners)
        self._isolates = gradients is None and agreement is None
        # ... and where they must (the graph holds collectives), by every rank at once (isolate.py `across_ranks`)
        self._across = gradients is None and agreement is not None
        self._draws = draws  # the graph draws random numbers: the extra runs draw privately
        self._fusion = fusion  # the graph's runtime/program/fused.py Fusion: a party isolation may blame
        # outputs the Dynamo graph makes uninitialized and returns unwritten (its caller fills
        # them: a collective after a graph break): compared but for their values
        self._unwritten = frozenset(unwritten)

    def __call__(self, *args: Any) -> Any:
        try:  # free unless raised (Python 3.11's exceptions cost nothing on the way through)
            if self._timing is not None:
                mark_entry(self._timing.now())
            if self._lowering.declined is not None:
                return self._lowering.declined_call(args)
            if self._on:
                due = self._due(args)
                if due is not None and (self._gradients is not None or not self._needs_grad(args)):
                    return self._check(args, *due)
            posted = self._posted
            if posted is not None:
                posted.stats = None
            start = Start() if self._draws else None  # where the generators stood, for the run that answers instead
            try:
                out = self._compiled(*args)
            except RuntimeError as exc:  # torch's errors (CUDA's too) are RuntimeErrors
                if start is not None:
                    start.restore()
                return self._lowering.failed_later(args, exc)
            if posted is None or not self._on:
                return out
            values = posted.take()
            if values is not None and self._watch.within(values):  # type: ignore[union-attr]
                return out  # the usual call: nothing new, nothing made (inline: it runs on every call)
            return self._after(args, out, values)
        except StrictModeError:  # counted where it was raised (runtime/program/program.py, lowering.py)
            raise
        except Exception:
            # what leaves the check is the caller's own error, raised as eager raises it (an
            # index past a static cache's end; a compiled run's error eager shares): counted,
            # so that calls == replays + eager_calls holds for it too; nothing was counted yet
            self._record.called(False, Decline.RAISED.value)
            raise

    def _after(self, args: Sequence[Any], out: Any, values: list[float] | None) -> Any:
        """A call its schedule did not pick, judged by the statistics its graph took, `values`
        (or, where its unit did not run, a reduction of its own): checked now when they are
        new, with the outputs it made as the served ones (nothing ran since: no input written,
        no draw)."""
        watch = self._watch
        seen = watch.observe(args) if values is None else watch.judge(values)  # type: ignore[union-attr]
        if seen.why is None or self._needs_grad(args):
            return out
        self._due.novel(args)
        return self._check(args, seen, seen.why, served=out)

    def _taken(self) -> Observation | None:
        """This call's statistics as its graph took them (runtime/checks/posted.py), judged;
        None where its unit posted none (it did not run)."""
        values = self._posted.take()  # type: ignore[union-attr]
        return None if values is None else self._watch.judge(values)  # type: ignore[union-attr]

    def _needs_grad(self, args: Sequence[Any]) -> bool:
        return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)

    # -- the check: eager the reference, the served call the candidate (side_by_side.py) --
    def _check(self, args: Sequence[Any], seen: Observation | None = None, novel: str | None = None,
               served: Any = _UNSERVED) -> Any:
        """`served`: the outputs the compiled graph made for this call already (`_after`)."""
        lowering = self._lowering
        whole, kept = self._whole, self._kept
        side = SideBySide.open(lambda: self._locate(args), self._contain,
                               None if whole is None else lambda: whole(args),
                               None if kept is None else lambda: kept(args))
        if isinstance(side, Compared):  # refused: nothing ran yet
            return lowering.unsnapshotted(args, side.raised)
        start = Start() if self._draws else None  # before anything draws
        raw, exc = self._contain(lambda: privately(start, self._eager)(*args))
        if exc is not None:  # eager itself raises: the compiled run answers, as it would have
            # the world back, where it takes it: an input eager could not write (an inference
            # tensor outside inference mode) refuses the restore too, the caller's error, no verdict
            self._contain(side.back)
            return self._compiled(*args)
        tolerance = self._tolerance()
        # Eager's outputs are printed and freed before the compiled run: the check holds one
        # call's outputs at a time (runtime/checks/prints.py). Not where the gradient check needs
        # their history, nor where ranks must run every eager run in step (collectives), nor
        # where values are judged within a tolerance (a print says equal or not), nor where an
        # artifact writing its inputs serves inside (`whole`) and they are too large to copy:
        # one that wrote beyond its rows moved a world no snapshot puts back, and only eager's
        # first run, kept, answers right (with the copies, eager run again from them does).
        # Printed now, before the world goes back: an output may be a view of a written input.
        lean = (self._gradients is None and self._agreement is None and tolerance is None
                and (whole is None or side.restorable))
        ref = Reference(raw, args, lean, self._contain, start, self._unwritten)
        # eager's gradients now, before its world is put back and the compiled forward writes it again
        grads = self._gradients.reference(args, ref.outputs, start) \
            if self._gradients is not None and self._gradients.needed(args) else None
        replays = [s.replays for s in self._record.piece_stats] if self._gradients is None else []
        demoted = [s.demoted for s in self._record.substitutions]
        _, exc = self._contain(lambda: side.set_aside(REFERENCE))  # eager's world kept aside, the world before back
        if exc is not None:
            self._record.called(False, Decline.CHECK_FAILED.value)  # the compiled graph never ran
            return lowering.verdict(Decline.CHECK_FAILED, f"snapshot raised {type(exc).__name__}: {exc}", raw)
        ref.drop()
        del raw
        if served is not _UNSERVED:
            out, failed = served, None
        else:
            if self._posted is not None:
                self._posted.stats = None
            with native_regions():  # judge the lowering; each artifact's gate judges the artifact
                out, failed = side.run(lambda: self._compiled(*args))
            if self._posted is not None and failed is None:  # what the checked call saw, as its graph took it
                seen = self._taken() or seen
        raised = failed is not None  # then the call was not counted (CompiledGraph counts as it returns)
        gradients: Sequence[str] = ()  # the inputs whose gradients differ from eager's
        forward = False  # the verdict comes from comparing the forward's results and world
        beyond = False  # ... and a written input differs beyond the rows (runtime/checks/side_by_side.py)
        if failed is not None:
            reason = Decline.OUT_OF_MEMORY if is_out_of_memory(failed.raised) else Decline.LOWERING_FAILED
            local: Verdict = (reason, f"raised {failed.detail}")
        else:
            got = flat(out)
            compared = side.compare(lambda: ref.compare(got, tolerance), within(tolerance))
            if tolerance is not None and compared.kind is not Kind.RAISED:
                self._judged(tolerance, compared.equal, ref, got, side)
            if compared.kind is Kind.RAISED:
                local = (Decline.CHECK_FAILED, f"comparing raised {compared.detail}")
            elif compared.kind is Kind.MISMATCH:
                local, forward = (Decline.LOWERING_MISMATCH, f"differs from eager: {compared.mismatch}"), True
                # beyond the rows: the world before is no longer what eager ran on, and eager
                # run again there would disagree with itself; the isolation finds the party
                beyond = compared.mismatch is not None and compared.mismatch.what == BEYOND
            elif grads is not None:
                judged = self._gradients.judge(grads, ref.outputs, got)  # blames eager's nondeterminism itself
                local = None if judged is None else (judged.reason, judged.detail)
                gradients = () if judged is None else judged.gradients
            else:
                local = None
        # an artifact demoted for a write during the compiled run (a CUDA graph's warmup, its
        # capture): the world moved under the check, and eager run again would disagree with
        # itself; no verdict on the lowering, eager's values answer (the next check judges it)
        moved = local is not None and forward and _wrote_during(self._record.substitutions, demoted)
        verdict, settled = self._settle(None if moved else local, args, side, ref, forward and not beyond)
        if seen is not None:  # judged: what this call's inputs hold counts as seen
            seen.checked()
        if novel is not None:
            with self._record.lock:
                self._record.novelty_checks += 1
        isolated = moved and verdict is None  # an artifact or a capture took the blame: eager's values answer
        if verdict is not None and verdict[0] is Decline.LOWERING_MISMATCH and forward and self._isolates:
            verdict = self._isolate(args, side, ref, replays, demoted, verdict, novel)
            isolated = verdict is None
        elif verdict is not None and verdict[0] is Decline.LOWERING_MISMATCH and self._across:
            # this rank's own finding: a forward mismatch it can isolate, nothing, or one it cannot
            mine = (None if moved or beyond else False if settled is None
                    else True if forward and settled[0] is Decline.LOWERING_MISMATCH else None)
            verdict = self._isolate_across(args, side, ref, demoted, verdict, novel, mine)
            isolated = verdict is None
        elif verdict is None and failed is None and self._judges_kernels(tolerance, replays, novel):
            checked = Checked(self._record, self._due.n, self._due.previous, novel)
            isolated = beside(ref.extra(self._compiled), args, side, self._record.substitutions, checked,
                              self._contain, self._events, self._agreement is not None)
            if self._agreement is not None and self._agreement.agree(int(isolated)) and not isolated:
                caught_elsewhere(checked, self._events)
        if raised:
            self._record.called(False, verdict[0].value if verdict else Decline.LOWERING_FAILED.value)
        if verdict is None:
            with self._record.lock:
                self._record.eager_checks += 1
            if not isolated:
                return out
        del out
        answer = ref.answer(ref.extra(self._eager), side, lowering.own)  # eager's outputs and world
        if isolated or verdict[0] is Decline.OUT_OF_MEMORY:  # memory short this once: no verdict on the lowering
            return answer
        return lowering.verdict(*verdict, answer, gradients)

    def _tolerance(self) -> Any:
        """A graph fused under a declared tolerance is judged within it while it serves fused
        code (runtime/checks/tolerance.py); None: bit for bit."""
        return self._fusion.tolerance if self._fusion is not None and self._fusion.active else None

    def _isolate(self, args: Sequence[Any], side: SideBySide, ref: Reference, replays: list[int],
                 demoted: list[bool], verdict: tuple[Decline, str], novel: str | None) -> Verdict:
        """The served call differed from eager, which agrees with itself: the party at fault,
        found by running (runtime/checks/isolate.py `culprit`) and its consequence (`blame`);
        None: the graph keeps its lowering. The world is left as eager left it."""
        checked = Checked(self._record, self._due.n, self._due.previous, novel)
        tolerance = self._tolerance()
        found = culprit(ref.extra(self._compiled), args, side, lambda got: ref.compare(got, tolerance),
                        self._record.substitutions, checked.call, self._contain, self._fusion, tolerance, demoted)
        return blame(found, checked, verdict, self._events, self._fusion, self._runners, replays)

    def _isolate_across(self, args: Sequence[Any], side: SideBySide, ref: Reference, demoted: list[bool],
                        verdict: tuple[Decline, str], novel: str | None, mine: bool | None) -> Verdict:
        """`_isolate` where the graph holds collectives: run by every rank in step, what it
        found agreed (runtime/checks/isolate.py `across_ranks`); None: the graph keeps its lowering."""
        checked = Checked(self._record, self._due.n, self._due.previous, novel)
        return across_ranks(self._agreement, mine, lambda: culprit(  # type: ignore[arg-type]
            ref.extra(self._compiled), args, side, lambda got: ref.compare(got, None), self._record.substitutions,
            checked.call, self._contain, None, None, demoted), checked, verdict, self._events)

    def _judges_kernels(self, tolerance: Any, replays: list[int], novel: str | None) -> bool:
        """Whether a passing check must judge the kernels inside beside their regions too
        (isolate.py `beside`): within a tolerance; where a piece replayed them (no gate saw
        the call) on inputs new to the checks (a scheduled check's were judged so when new:
        on every check it would cost a replaying stack of artifacts 7-9% a call, bench/recheck.py
        part 3), or on any check where ranks agree (no check follows the inputs there)."""
        record, here = self._record, False
        if tolerance is not None:
            here = any(not s.demoted and s.parity_mode == "bitwise" for s in record.substitutions)
        elif any(not s.demoted for s in record.substitutions):
            here = (novel is not None or self._agreement is not None) and any(
                s.replays > was for s, was in zip(record.piece_stats, replays))
        if self._agreement is not None and record.substitutions:
            return bool(self._agreement.agree(int(here)))
        return here

    def _judged(self, tolerance: Any, within: bool, ref: Reference, got: list[Any], side: SideBySide) -> None:
        """A check of a graph fused under a tolerance: counted, and (served) its errors kept."""
        tolerance.judged(within)
        if not within:
            return
        _, exc = self._contain(lambda: (tolerance.observe(self._due.n, ref.outputs, got),
                                        tolerance.observe(self._due.n, *side.pairs(), what="written input")))
        if exc is not None:  # the served values passed; only the error figures are missing
            self._events.warn_once(f"tolerance:{self._record.name}", "graphdispatch: %s: measuring the errors of a "
                                   "checked call raised %s: %s", self._record.name, type(exc).__name__, exc)

    def _settle(self, local: Verdict, args: Sequence[Any], side: SideBySide, ref: Reference,
                forward: bool) -> tuple[Verdict, Verdict]:
        """This rank's verdict, blamed on eager's nondeterminism where eager disagrees with
        itself (`forward`: it compared the forward's results; a gradient verdict is blamed by
        the gradient check), and agreed with every other rank of the graph's groups: the
        eager runs a verdict adds happen on every rank, and a rank that found nothing itself
        takes the reason another found (checks/agree.py's `agreed_verdict`). Returns the
        verdict every rank takes, and this rank's own once blamed."""
        agreement = self._agreement
        if agreement is None:
            if local is not None and forward:
                local = self._blame(args, side, ref, local[1])
            return local, local
        worst = agreed_verdict(agreement, local)
        if worst is None or worst[0] is not Decline.LOWERING_MISMATCH:
            return worst, local
        blamed = self._blame(args, side, ref, local[1] if local else "")  # every rank runs eager again
        if local is not None and forward:
            local = blamed
        return agreed_verdict(agreement, local), local  # the blame agreed: one reason on every rank

    def _blame(self, args: Sequence[Any], side: SideBySide, ref: Reference, detail: str) -> tuple[Decline, str]:
        """Run eager once more from the world before: if eager disagrees with itself, the
        mismatch is eager's nondeterminism, not the lowering's fault."""
        again = side.again(lambda fn: ref.extra(fn)(*args), self._eager, lambda second: ref.again(flat(second)),
                           self._suspects)
        if again is not None:
            ref.forget_second()  # the world is eager's first run's again: the answer runs eager once more
            return Decline.EAGER_NONDETERMINISTIC, again.detail
        return Decline.LOWERING_MISMATCH, ref.detail(detail)


def _wrote_during(substitutions: Sequence[Any], demoted: Sequence[bool]) -> bool:
    """An artifact was demoted since `demoted` was taken for writing an input it does not
    declare: in a run no check snapshots (runtime/gates/gate.py), so its write stays."""
    return any(s.demoted and not was and s.reason == Demotion.MUTATED_INPUT.value
               for s, was in zip(substitutions, demoted))
