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
the worst one wins.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
