"""Agreement: a verdict one rank reaches is taken by every rank of the graph's groups.

Every rank must run the same collectives, in the same order, the same number of times. The
runs graphdispatch adds (eager checks and re-checks, the second eager run that tests
nondeterminism, captures and verifications of pieces that hold collectives) keep that
schedule only while every rank decides alike; a verdict reached on one rank alone (a
lowering mismatch, a nondeterministic kernel, a failed or out-of-memory capture) would
put the collectives out of step: wrong values, then a hang or a crash. So each such
decision is a small integer, all-reduced (MAX) over the graph's process groups at a
point every rank reaches on the same call, and acted on as agreed.

A graph without collectives has no Agreement and pays nothing. Verdict codes are ordered:
the worst one wins. A verdict is agreed with its reason (`agreed_verdict`): every rank
declines with the same reason, the one the rank at fault found, so two ranks never report
one piece differently (one `verify_mismatch`, the other `eager_nondeterministic`); a rank
with no fault of its own says so in the detail.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphdispatch_backend.errors import Decline

# Verdict codes for agreement: 0 is no verdict; an out-of-memory (a retry, not a judgement)
# ranks below every other reason, the rest in Decline's order.
_ORDER: tuple[Decline, ...] = (Decline.OUT_OF_MEMORY, *(d for d in Decline if d is not Decline.OUT_OF_MEMORY))
Verdict = tuple[Decline, str] | None


class Agreement:
    def __init__(self, groups: Sequence[object]) -> None:
        self._groups = tuple(groups)
        self.rounds = 0  # all-reduces made, for the report and tests

    def agree(self, code: int) -> int:
        """The largest `code` over every rank of every group (in one fixed group order)."""
        import torch.distributed as dist

        for group in self._groups:
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
            value = torch.tensor([code], dtype=torch.int64, device=device)
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
            code = int(value.item())
        self.rounds += 1
        return code


def agreed(agreement: Agreement | None, code: int) -> int:
    """The worst of this rank's `code` and every other rank's; the code itself without an
    agreement (no collectives: no other rank's schedule depends on this one's)."""
    return code if agreement is None else agreement.agree(code)


def agreement_for(group_names: Sequence[str]) -> Agreement | None:
    """The Agreement over the named process groups, or None when there are none (or
    torch.distributed is not initialized: no other rank to agree with)."""
    if not group_names:
        return None
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_available() or not dist.is_initialized():
        return None
    return Agreement([_resolve_process_group(name) for name in group_names])


def agreed_verdict(agreement: Agreement | None, verdict: Verdict) -> Verdict:
    """The verdict every rank takes: the worst reason any rank reached (one all-reduce), with
    this rank's detail where it reached that reason itself, else a detail naming it as
    another rank's; `verdict` itself without an agreement."""
    if agreement is None:
        return verdict
    code = agreement.agree(0 if verdict is None else _ORDER.index(verdict[0]) + 1)
    if code == 0:
        return None
    reason = _ORDER[code - 1]
    if verdict is not None and verdict[0] is reason:
        return verdict
    mine = f" (this rank found {verdict[0].value}: {verdict[1]})" if verdict is not None else ""
    return reason, f"{reason.value} on another rank of the graph's process groups{mine}"
