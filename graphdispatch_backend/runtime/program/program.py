"""CompiledGraph: the callable aot calls for one lowered graph; every call is counted.

Per call: check the placeholder contract (O(inputs); a mismatch runs the original, native
graph eagerly, counted), run the pipeline's graph (whose pieces may replay captured
graphs), and record whether the call replayed or ran eager, and why.

The hot path. A graph compiled through Dynamo (`guarded`) is called only once Dynamo's
guards passed, and they ensure what the contract checks (every tensor input's dtype,
device, sizes, strides and requires_grad, parameters included). When one runner serves
the whole graph, a call first asks it for a replay (`replay_hot`): the runner's one
address check decides, and a replay is counted by the runner, under the device lock the
replay holds (no lock, no thread-local here). Any other call (warmup, capture,
verification, a moved input, a new shape) takes the full path below, contract included:
a caller that kept the backend's callable and bypasses Dynamo is still checked wherever
the runner has a decision to make. A graph Dynamo compiled that has no captured piece
(cuda_graphs off, or "auto" on CPU) has no such decision ever: it runs its pipeline graph
with no contract check at all, as aot_eager would. A graph compiled by a direct call of
the backend checks its contract on every call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from graphdispatch_backend.diagnostics import record_fields
from graphdispatch_backend.diagnostics.record_fields import contract_broken
from graphdispatch_backend.diagnostics.report import GraphRecord
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Decline, StrictModeError
from graphdispatch_backend.runtime.call.calls import Answered, begin_call, end_call, take_entry
from graphdispatch_backend.runtime.call.contract import PlaceholderContract
from graphdispatch_backend.runtime.checks.isolate import Isolation, isolating_here
from graphdispatch_backend.runtime.program.compile_stacks import forget_compile_stacks


class CompiledGraph:
    _boxed_call = True  # aot hands us its argument list as is

    def __init__(
        self,
        run: Callable[..., Sequence[Any]],
        native: Callable[..., Sequence[Any]],
        contract: PlaceholderContract,
        record: GraphRecord,
        timing: Timing,
        eager_reason: Decline | None,
        on_contract_mismatch: Callable[[str], None],
        guarded: bool = False,
    ) -> None:
        self._run = run
        self._native = native
        self._contract = contract
        self._record = record
        self._timing = timing
        # A graph without captured pieces runs eager on every call, always for this reason.
        self._eager_reason = eager_reason.value if eager_reason is not None else None
        self._on_mismatch = on_contract_mismatch
        self._timed = timing.enabled
        # the whole graph's runner, asked first on every call (see module docstring)
        replay_hot = getattr(run, "replay_hot", None)
        self._hot: Callable[[list[Any]], Sequence[Any] | None] | None = (
            replay_hot if guarded and eager_reason is None and not self._timed else None)
        if self._hot is not None:
            # the counters the runner writes its hot replays into: plain data the record
            # owns, never the runner (a record outlives the graph: diagnostics/report.py)
            record_fields.hot_counters(record, run.stats)  # type: ignore[attr-defined]
        # no runner ever decides anything and Dynamo's guards stand in front: nothing to check
        self._trusted = guarded and eager_reason is not None and not self._timed
        self.__class__ = _FirstCall  # until the first call: no check on any later one

    def __call__(self, args: list[Any]) -> Sequence[Any]:
        hot = self._hot
        if hot is not None:
            try:
                out = hot(args)
            except Answered as answered:  # the replay failed; the runner answered eagerly
                self._record.called(False, answered.reason)
                return answered.outputs
            if out is not None:
                return out
        if Isolation.active and isolating_here():  # an isolation run (runtime/checks/isolate.py): not a call
            return self._run(*args)
        if self._timed:  # the one check the slow path pays when timing is off
            return self._timed_call(args)
        if not self._trusted and not self._contract.check(args):
            return self._contract_fallback(args)
        if self._eager_reason is not None:
            try:
                out = self._run(*args)
            except StrictModeError:
                self._raised()
                raise
            self._record.called(False, self._eager_reason)
            return out
        begin_call()
        try:
            out = self._run(*args)
        except StrictModeError:
            self._raised()
            raise
        reason = end_call()
        self._record.called(reason is None, reason)
        return out

    def _raised(self) -> None:
        """Under `strict`, a check failed inside the call, which raises StrictModeError: it
        is counted all the same (`strict_raised`), as its regions counted theirs, so that
        `calls == replays + eager_calls` holds for a strict run too. (A call that raises the
        caller's own error is counted where it leaves graphdispatch: runtime/checks/eager_check.py.)"""
        end_call()
        self._record.called(False, Decline.STRICT_RAISED.value)

    def _contract_fallback(self, args: Sequence[Any]) -> Sequence[Any]:
        detail = self._contract.explain(args) or "inputs differ from the traced placeholders"
        contract_broken(self._record, detail)
        self._on_mismatch(detail)
        out = self._native(*args)
        self._record.called(False, Decline.CONTRACT_MISMATCH.value)
        record_fields.answered_natively(self._record)
        return out

    def _timed_call(self, args: list[Any]) -> Sequence[Any]:
        timing = self._timing
        start = timing.now()
        entered = take_entry()
        if entered is not None:  # aot's runtime wrapper: flattening parameters and inputs
            timing.add("flatten", start - entered)
        ok = self._contract.check(args)
        timing.add("validate", timing.now() - start)
        if not ok:
            return self._contract_fallback(args)
        begin_call()
        start = timing.now()
        try:
            out = self._run(*args)
        except StrictModeError:
            self._raised()
            raise
        timing.add("execute", timing.now() - start)
        reason = end_call() if self._eager_reason is None else self._eager_reason
        self._record.called(reason is None, reason)
        if timing.shadow:
            start = timing.now()
            self._native(*args)
            timing.add("shadow.native_forward", timing.now() - start)
        return out


class _FirstCall(CompiledGraph):
    """A CompiledGraph before its first call, which comes after the compile that made it
    (and after any compile run meanwhile from a transformed frame, after a graph break):
    the call stacks those compiles recorded are dropped, so they cannot keep the graph
    alive (runtime/program/compile_stacks.py). Then it is a plain CompiledGraph."""

    def __call__(self, args: list[Any]) -> Sequence[Any]:
        self.__class__ = CompiledGraph
        forget_compile_stacks()
        return CompiledGraph.__call__(self, args)
