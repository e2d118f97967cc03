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
from graphdispatch_backend.errors import Contain, Decline, SnapshotRefused, StrictModeError
from graphdispatch_backend.runtime.call.calls import mark_entry
from graphdispatch_backend.runtime.call.keys import layout_key
from graphdispatch_backend.runtime.checks.agree import Agreement, agreed_verdict
from graphdispatch_backend.runtime.checks.autograd_check import GradientCheck
from graphdispatch_backend.runtime.checks.draws import Start, privately
from graphdispatch_backend.runtime.checks.isolate import ARTIFACT, CAPTURE, FUSION, culprit
from graphdispatch_backend.runtime.checks.modes import native_regions
from graphdispatch_backend.runtime.checks.novelty import Novelty, Observation
from graphdispatch_backend.runtime.checks.reference import Reference, flat
from graphdispatch_backend.runtime.checks.schedule import MAX_KEYS as KEPT_KEYS
from graphdispatch_backend.runtime.checks.schedule import Due, KeyedDue
from graphdispatch_backend.runtime.checks.suspects import NONE_KNOWN, Suspects
from graphdispatch_backend.runtime.checks.world import Region, World
from graphdispatch_backend.runtime.cudagraph.engine import is_out_of_memory

MAX_KEYS = KEPT_KEYS  # shape keys whose schedules are kept (schedule.KeyedDue); 0 turns the check off

Verdict = tuple[Decline, str] | None
# agreement codes, the worst last: the largest code over the ranks is the agreed verdict
class EagerCheck:
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
    ) -> None:
        self._eager = eager  # the Dynamo graph: the user's code, as Dynamo traced it
        self._compiled = compiled
        self._record = record
        self._events = events
        self._contain = contain
        self._strict = strict
        self._keyed = tuple(keyed)  # positions of call inputs (parameters are not keyed)
        self._locate = locate  # where in its inputs this call will write (runtime/checks/world.py)
        self._suspects = suspects if suspects is not None else Suspects()  # who to name when eager disagrees
        self._agreement = agreement  # the graph holds collectives: verdicts are agreed over its ranks
        self._dynamic = dynamic
        # which calls are checked (runtime/checks/schedule.py); dynamic graphs: per shape key
        self._schedules = KeyedDue(recheck, record.name)
        self._schedule = Due(recheck, record.name)  # static graphs: one shape key (Dynamo guards it)
        self._on = MAX_KEYS > 0
        self._declined: Decline | None = None
        self._timing = timing if timing.enabled else None
        self._gradients = gradients  # an autograd graph's: its backward is checked too
        # an inference graph's pieces' runners (by the record's piece_stats): a mismatch is
        # isolated (runtime/checks/isolate.py) where ranks need not agree on every eager run
        self._runners = tuple(runners)
        self._isolates = gradients is None and agreement is None
        self._draws = draws  # the graph draws random numbers: the extra runs draw privately
        self._fusion = fusion  # the graph's runtime/program/fused.py Fusion: a party isolation may blame
        self._n = self._previous = 0  # the checked call's number in its shape key, and the last check's
        # outputs the Dynamo graph makes uninitialized and returns unwritten (its caller fills
        # them: a collective after a graph break): compared but for their values
        self._unwritten = frozenset(unwritten)
        # calls whose inputs leave what the checked calls saw are checked too (runtime/checks/novelty.py)
        self._novelty = novelty if novelty is not None and novelty.on else None

    def __call__(self, *args: Any) -> Any:
        if self._timing is not None:
            mark_entry(self._timing.now())
        if self._declined is not None:
            out = self._eager(*args)
            self._record.called(False, self._declined.value)
            return out
        if self._on:
            due = self._due(args)
            if due is not None and (self._gradients is not None or not self._needs_grad(args)):
                return self._check(args, *due)
        try:
            return self._compiled(*args)
        except RuntimeError as exc:  # free unless raised; torch's errors (CUDA's too) are RuntimeErrors
            return self._failed_later(args, exc)

    def _due(self, args: Sequence[Any]) -> tuple[Observation | None, str | None] | None:
        """None, or why this call is checked: (what it saw, to widen what the checked calls
        saw; a description of its new inputs when they, not the `recheck` schedule of its
        shape key, made it due)."""
        due = self._schedule
        if self._dynamic:
            due = self._schedules(layout_key(map(args.__getitem__, self._keyed)))
        scheduled = due()
        seen = self._novelty.observe(args) if self._novelty is not None else None
        novel = None if scheduled or seen is None else seen.why
        if novel is not None:
            due.checked_now()
        elif not scheduled:
            return None
        self._n, self._previous = due.n, due.previous
        return seen, novel

    def _needs_grad(self, args: Sequence[Any]) -> bool:
        return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)

    # -- the check ----------------------------------------------------------------------
    def _check(self, args: Sequence[Any], seen: Observation | None = None, novel: str | None = None) -> Any:
        before, exc = self._contain(lambda: World.take(self._locate(args)))
        if exc is not None:  # nothing ran yet
            return self._unsnapshotted(args, exc)
        start = Start() if self._draws else None  # before anything draws
        raw, exc = self._contain(lambda: privately(start, self._eager)(*args))
        if exc is not None:  # eager itself raises: the compiled run answers, as it would have
            self._own(before.restore)
            return self._compiled(*args)
        tolerance = self._tolerance()
        # Eager's outputs are printed and freed before the compiled run: the check holds one
        # call's outputs at a time (runtime/checks/prints.py). Not where the gradient check needs
        # their history, nor where ranks must run every eager run in step (collectives), nor
        # where values are judged within a tolerance (a print says equal or not).
        # Printed now, before the world goes back: an output may be a view of a written input.
        lean = self._gradients is None and self._agreement is None and tolerance is None
        ref = Reference(raw, args, lean, self._contain, start, self._unwritten)
        replays = [s.replays for s in self._record.piece_stats] if self._isolates else []
        after, exc = self._contain(before.swap)  # eager's world kept aside, the world before back
        if exc is not None:
            self._record.called(False, Decline.CHECK_FAILED.value)  # the compiled graph never ran
            return self._verdict(Decline.CHECK_FAILED, f"snapshot raised {type(exc).__name__}: {exc}", raw, None)
        ref.drop()
        del raw
        with native_regions():  # judge the lowering; each artifact's gate judges the artifact
            out, exc = self._contain(lambda: self._compiled(*args))
        raised = exc is not None  # then the call was not counted (CompiledGraph counts as it returns)
        gradients: Sequence[str] = ()  # the inputs whose gradients differ from eager's
        forward = False  # the verdict comes from comparing the forward's results and world
        if raised:
            reason = Decline.OUT_OF_MEMORY if is_out_of_memory(exc) else Decline.LOWERING_FAILED
            local: Verdict = (reason, f"raised {type(exc).__name__}: {exc}")
        else:
            got = flat(out)
            mismatch, exc = self._contain(lambda: ref.compare(got, tolerance) or after.compare(tolerance))
            if tolerance is not None and exc is None:
                self._judged(tolerance, mismatch is None, ref, got, after)
            if exc is not None:
                local = (Decline.CHECK_FAILED, f"comparing raised {type(exc).__name__}: {exc}")
            elif mismatch is not None:
                local, forward = (Decline.LOWERING_MISMATCH, f"differs from eager: {mismatch}"), True
            elif self._gradients is not None and self._gradients.needed(args):
                judged = self._gradients.judge(args, ref.outputs, got)  # blames eager's nondeterminism itself
                local = None if judged is None else (judged.reason, judged.detail)
                gradients = () if judged is None else judged.gradients
            else:
                local = None
        verdict = self._settle(local, args, before, after, ref, forward)
        if seen is not None:  # judged: what this call's inputs hold counts as seen
            seen.checked()
        if novel is not None:
            with self._record.lock:
                self._record.novelty_checks += 1
        isolated = False  # an artifact or a capture took the blame: eager's values answer, nothing else changes
        if verdict is not None and verdict[0] is Decline.LOWERING_MISMATCH and forward and self._isolates:
            verdict = self._isolate(args, before, after, ref, verdict, replays, novel)
            isolated = verdict is None
        if raised:
            self._record.called(False, verdict[0].value if verdict else Decline.LOWERING_FAILED.value)
        if verdict is None:
            with self._record.lock:
                self._record.eager_checks += 1
            if not isolated:
                return out
        del out
        answer = ref.answer(ref.extra(self._eager), before, after, self._own)  # eager's outputs and world
        if isolated:
            return answer
        if verdict[0] is Decline.OUT_OF_MEMORY:  # memory was short this once: no verdict on the lowering
            return answer
        return self._verdict(*verdict, answer, None, gradients)

    def _tolerance(self) -> Any:
        """A graph fused under a declared tolerance is judged within it while it serves fused
        code (runtime/checks/tolerance.py); None: bit for bit."""
        return self._fusion.tolerance if self._fusion is not None and self._fusion.active else None

    def _judged(self, tolerance: Any, within: bool, ref: Reference, got: list[Any], after: World) -> None:
        """A check of a graph fused under a tolerance: counted, and (served) its errors kept."""
        tolerance.judged(within)
        if not within:
            return
        _, exc = self._contain(lambda: (tolerance.observe(self._n, ref.outputs, got),
                                        tolerance.observe(self._n, *after.pairs(), what="written input")))
        if exc is not None:  # the served values passed; only the error figures are missing
            self._events.warn_once(f"tolerance:{self._record.name}", "graphdispatch: %s: measuring the errors of a "
                                   "checked call raised %s: %s", self._record.name, type(exc).__name__, exc)

    def _isolate(self, args: Sequence[Any], before: World, after: World, ref: Reference,
                 verdict: tuple[Decline, str], replays: list[int], novel: str | None = None) -> Verdict:
        """The served call differed from eager, which agrees with itself: find the party at
        fault (runtime/checks/isolate.py). An artifact is demoted there, a capture declined here;
        either way the graph keeps its lowering (None). The lowering's fault stays the
        verdict. The world is left as eager left it. `novel`: the call was checked for its
        new inputs (runtime/checks/novelty.py), which the verdict names."""
        why = f"checked for novel inputs: {novel}" if novel is not None else "checked by the recheck schedule"
        call = f"call {self._n} of {self._record.name} ({why})"
        tolerance = self._tolerance()
        found = culprit(ref.extra(self._compiled), args, before, after, lambda got: ref.compare(got, tolerance),
                        self._record.substitutions, call, self._contain, self._fusion, tolerance)
        party, detail, demoted = found.party, found.detail, found.demoted
        unchecked = self._n - self._previous - 1  # served since the last check, which passed
        message = f"{self._record.name}: a served call differed from eager at {call}: the {party} was at fault"
        if self._previous:
            message += f"; the {unchecked} call(s) since the last check (call {self._previous}) were served unchecked"
        for sub in demoted:
            with sub.lock:
                sub.caught_at_call, sub.unchecked_calls = self._n, unchecked
                sub.caught_by = "novelty" if novel is not None else "recheck"
        if party == ARTIFACT:
            self._events.warn_once(f"culprit:{self._record.name}:{detail}", "graphdispatch: %s (%s); eager's values "
                                   "answered it", message, detail)
            return None
        if party == FUSION:  # learned (kept as ATen calls, recompiled) or given up: runtime/program/fused.py
            self._fusion.learn(found.ops, self._n, f"{verdict[1]}; {detail}")
            return None
        if party == CAPTURE:
            now = [s.replays for s in self._record.piece_stats]
            for runner, was, is_ in zip(self._runners, replays, now):
                if is_ > was:  # it replayed in the checked call
                    runner.distrust(Decline.VERIFY_MISMATCH, f"a replay differed from eager at {call}: "
                                                             f"{verdict[1]}; {detail}")
            self._events.warn_once(f"culprit:{self._record.name}:capture", "graphdispatch: %s; eager's values "
                                   "answered it, and the pieces that replayed run eager", message)
            return None
        return verdict[0], f"{verdict[1]} (at {call}; {detail})" if detail else verdict[1]

    def _settle(self, local: Verdict, args: Sequence[Any], before: World, after: World,
                ref: Reference, forward: bool) -> Verdict:
        """This rank's verdict, blamed on eager's nondeterminism where eager disagrees with
        itself (`forward`: it compared the forward's results; a gradient verdict is blamed by
        the gradient check), and agreed with every other rank of the graph's groups: the
        eager runs a verdict adds happen on every rank, and a rank that found nothing itself
        takes the reason another found (checks/agree.py's `agreed_verdict`)."""
        agreement = self._agreement
        if agreement is None:
            if local is not None and forward:
                return self._blame(args, before, after, ref, local[1])
            return local
        worst = agreed_verdict(agreement, local)
        if worst is None or worst[0] is not Decline.LOWERING_MISMATCH:
            return worst
        blamed = self._blame(args, before, after, ref, local[1] if local else "")  # every rank runs eager again
        if local is not None and forward:
            local = blamed
        return agreed_verdict(agreement, local)  # the blame agreed: one reason on every rank

    def _blame(self, args: Sequence[Any], before: World, after: World, ref: Reference,
               detail: str) -> tuple[Decline, str]:
        """Run eager once more from the world before: if eager disagrees with itself, the
        mismatch is eager's nondeterminism, not the lowering's fault."""
        output = [-1]  # the output that differed (-1: none, the written inputs did)

        def again() -> Any:
            before.restore()
            found = ref.again(flat(ref.extra(self._eager)(*args)))
            if found is not None:
                output[0] = found.output
            return found or after.compare()

        def run(fn: Callable[..., Any]) -> Any:  # the suspects' runs, op by op (runtime/checks/suspects.py)
            before.restore()
            return ref.extra(fn)(*args)

        differs, exc = self._contain(again)
        if exc is None and differs is not None:
            named, _ = self._contain(lambda: self._suspects.name(output[0], run))
            if self._suspects.reruns:
                ref.forget_second()
            return (Decline.EAGER_NONDETERMINISTIC,
                    f"eager disagrees with itself ({differs}); suspects: {named or NONE_KNOWN}")
        return Decline.LOWERING_MISMATCH, ref.detail(detail)

    # -- verdicts -----------------------------------------------------------------------
    def _verdict(self, reason: Decline, detail: str, raw: Any, after: World | None,
                 gradients: Sequence[str] = ()) -> Any:
        """Answer with eager's result and world, and run the Dynamo graph from now on."""
        if after is not None:
            _, exc = self._contain(after.restore)
            if exc is not None:
                detail += f"; restoring eager's world raised {type(exc).__name__}: {exc}"
        with self._record.lock:
            self._record.eager_checks += 1
        self._give_up(reason, detail, gradients)
        return raw

    def _unsnapshotted(self, args: Sequence[Any], exc: Exception) -> Any:
        """What this call writes could not be snapshotted, so it is not checked. Too large
        for max_snapshot_bytes (it always will be): the compiled graph answers, unchecked,
        and the report says why. Memory short this once: the Dynamo graph answers (eager's
        values), and the next due call tries again. Anything else: check_failed."""
        if isinstance(exc, SnapshotRefused):
            with self._record.lock:
                self._record.unchecked += 1
                self._record.unchecked_detail = exc.detail
            self._events.warn_once(f"unchecked:{self._record.name}", "graphdispatch: %s is not checked against "
                                   "eager: %s", self._record.name, exc.detail)
            return self._compiled(*args)
        reason = Decline.OUT_OF_MEMORY if is_out_of_memory(exc) else Decline.CHECK_FAILED
        if reason is Decline.CHECK_FAILED:
            self._give_up(reason, f"snapshot of the written inputs raised {type(exc).__name__}: {exc}")
        else:
            with self._record.lock:
                self._record.unchecked += 1
                self._record.unchecked_detail = f"snapshotting what the call writes ran out of memory: {exc}"
        out = self._eager(*args)
        self._record.called(False, reason.value)
        return out

    def _own(self, step: Callable[[], Any]) -> None:
        _, exc = self._contain(step)
        if exc is not None:
            self._give_up(Decline.CHECK_FAILED, f"restoring the mutated inputs raised {type(exc).__name__}: {exc}")

    def _give_up(self, reason: Decline, detail: str, gradients: Sequence[str] = ()) -> None:
        """From now on the Dynamo graph runs: record why, mark the artifacts unused, say it
        once (or raise, under strict)."""
        self._declined = reason
        with self._record.lock:
            self._record.lowering = {"status": reason.value, "detail": detail}
            if gradients:  # the inputs whose gradients differ from eager's
                self._record.lowering["gradients"] = list(gradients)
        self._unused(reason)
        message = f"{self._record.name} runs as the Dynamo graph, eagerly: the compiled graph {detail}"
        self._events.decision("decline", {"graph": self._record.name, "reason": reason.value, "detail": detail})
        if self._strict:
            raise StrictModeError(message)
        self._events.warn_once(f"lowering:{reason.value}", "graphdispatch: %s (%s)", message, reason.value)

    def _unused(self, reason: Decline) -> None:
        """The graph's artifacts serve no call from now on (the Dynamo graph runs): say so
        where their verdicts are read, instead of leaving them `pending`."""
        for sub in self._record.substitutions:
            with sub.lock:
                if sub.parity == "pending":
                    sub.parity = "unused"
                    sub.detail = f"the graph runs as the Dynamo graph ({reason.value})"

    def _failed_later(self, args: Sequence[Any], exc: RuntimeError) -> Any:
        """The compiled graph raised on a call that was not checked: if eager answers the
        same inputs, the lowering is at fault; else the error is the user's own."""
        out = self._eager(*args)  # raises the user's own error if there is one
        if is_out_of_memory(exc):  # memory was short this once: no verdict on the lowering
            self._record.called(False, Decline.OUT_OF_MEMORY.value)
            return out
        self._record.called(False, Decline.LOWERING_FAILED.value)
        self._give_up(Decline.LOWERING_FAILED, f"raised {type(exc).__name__}: {exc}")
        return out
