"""Graph passes, pure (they never import the runtime), in one ordered list.

Each pass is `pass(gm, ctx) -> None`: it rewrites `gm` in place and records what it did in
the PassContext. `run_pipeline` runs them in PIPELINE order and names the failing pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.fx as fx

from graphdispatch_backend.errors import GraphDispatchError
from graphdispatch_backend.passes.context import PassContext
from graphdispatch_backend.passes.lift_scalars import lift_scalars
from graphdispatch_backend.passes.locate_writes import locate_writes
from graphdispatch_backend.passes.reinplace import reinplace
from graphdispatch_backend.passes.reinplace_buffers import reinplace_buffers
from graphdispatch_backend.passes.split_pieces import split_pieces
from graphdispatch_backend.passes.strip_assertions import strip_assertions
from graphdispatch_backend.passes.substitute import substitute
from graphdispatch_backend.passes.tag_regions import tag_regions

Pass = Callable[[fx.GraphModule, PassContext], None]

PIPELINE: tuple[Pass, ...] = (strip_assertions, reinplace, locate_writes, tag_regions, substitute, lift_scalars,
                              reinplace_buffers, split_pieces)
# a backward's inputs are saved tensors and gradients: no region to tag or substitute
BACKWARD_PIPELINE: tuple[Pass, ...] = (strip_assertions, lift_scalars, split_pieces)


class PassFailed(GraphDispatchError):
    def __init__(self, name: str, ran: Sequence[str], cause: Exception) -> None:
        super().__init__(f"pass {name} failed after {list(ran)}: {type(cause).__name__}: {cause}")
        self.pass_name = name


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, pipeline: Sequence[Pass] = PIPELINE) -> PassContext:
    ran: list[str] = []
    for p in pipeline:
        try:
            p(gm, ctx)
        except GraphDispatchError:
            raise
        except (RuntimeError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise PassFailed(p.__name__, ran, exc) from exc
        ran.append(p.__name__)
    return ctx


__all__ = ["BACKWARD_PIPELINE", "PIPELINE", "PassContext", "PassFailed", "run_pipeline"]
