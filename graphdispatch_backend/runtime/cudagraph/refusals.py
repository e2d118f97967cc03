"""What a CUDA capture refuses, and where it came from: the host model's capture raises on
the same operations (cudagraph/tape.py), so emulation declines what a GPU would.

A CUDA stream that is capturing permits no operation that needs the host to wait for the
device (CUDA raises `operation not permitted when stream is capturing` and invalidates the
capture), and so none whose output size is known only after it ran:

- host syncs: `.item()`, `bool()`/`int()`/`float()` of a tensor (all reach the dispatcher as
  `_local_scalar_dense`), `.tolist()` and `.numpy()` (a device-to-host copy), `equal`;
- data-dependent output shapes: ops tagged `dynamic_output_shape` (`nonzero`,
  `masked_select`, `unique`, `bincount`, ...), except `index` and `repeat_interleave` where
  their arguments fix the size (integer indices, an `output_size`);
- a random draw from a generator the graph does not own (CUDA's default generator is
  registered with every capture; another must be, by `register_generator_state`).

The split pass (passes/split_pieces.py) keeps such ops out of captured pieces where it
sees them; these checks find them where it cannot: inside an artifact or a custom op.
`where` names the origin from the exception's traceback, for either engine.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import torch
from torch._ops import HigherOrderOperator

from graphdispatch_backend.errors import CaptureRefused
from graphdispatch_backend.passes.ops import indexes_by_mask, sized_by_arguments

_HOST_SYNCS = {
    "aten::_local_scalar_dense": ".item(), or bool(), int() or float() of a tensor: a host sync",
    "aten::equal": "torch.equal: a host sync",
}
# Tensor methods that read a tensor's values on the host without dispatching an op on CPU
HOST_READS = {
    torch.Tensor.tolist: ".tolist(): a device-to-host copy",
    torch.Tensor.numpy: ".numpy(): a device-to-host copy",
    torch.Tensor.__array__: "a tensor read as an array: a device-to-host copy",
}


def refused_by_capture(exc: BaseException) -> bool:
    """The error a capture raises for an operation it does not permit: the host model's
    CaptureRefused, or CUDA's own (a RuntimeError torch gives no type of its own; its
    text is CUDA's, `cudaErrorStreamCapture*`)."""
    if isinstance(exc, CaptureRefused):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("stream is capturing" in text or "cudaErrorStreamCapture" in text)


def refusal(func: Any, args: Any, kwargs: dict[str, Any]) -> str | None:
    """Why a CUDA capture would refuse this op, or None."""
    kind = _KINDS.get(func)
    if kind is None:
        kind = _KINDS[func] = _kind(func)
    if kind is _NEVER:
        return None
    if isinstance(kind, str):
        return kind
    name = func._schema.name
    if kind is _SIZED:
        sized = sized_by_arguments(name, args, kwargs)
        return None if sized else "an output whose size depends on the values: a host sync"
    if kind is _SEEDED:
        if kwargs.get("generator") is not None:
            return "a random draw from a generator the graph does not own (register_generator_state)"
        return None
    return "indexing by a boolean mask: a host sync" if indexes_by_mask(
        args[1] if len(args) > 1 else kwargs.get("indices")) else None


# what an op's refusal depends on, worked out once per op (a capture asks for every op it records)
_NEVER, _SIZED, _SEEDED, _MASK = object(), object(), object(), object()
_KINDS: dict[Any, Any] = {}


def _kind(func: Any) -> Any:
    if isinstance(func, HigherOrderOperator):
        return _HIGHER_ORDER.get(func.name(), _HIGHER_ORDER_WHY)
    schema = getattr(func, "_schema", None)
    if schema is None:
        return _NEVER
    why = _HOST_SYNCS.get(schema.name)
    if why is not None:
        return why
    tags = getattr(func, "tags", ())
    if torch.Tag.dynamic_output_shape in tags:
        return _SIZED
    if torch.Tag.nondeterministic_seeded in tags:
        return _SEEDED
    if schema.name in ("aten::index_put", "aten::index_put_"):
        return _MASK
    return _NEVER


# a higher-order operator in a piece (aot leaves a few in its graphs): the CPU model records
# ATen operations, not these. The two met so far could not be replayed on CUDA either:
# their CUDA kernels read or set the generator's state on the host (torch/_prims/rng_prims.py,
# `torch.cuda.get_rng_state`, `set_rng_state`), which a graph does not record, so a replay
# would save or draw from wherever the generator stood; Inductor swaps them for
# `graphsafe_run_with_rng_state` under its own CUDA graphs. Named here, where torch's
# refusal of a dispatch mode is a hint to the mode's author (a trial, 2026-12-07).
_HIGHER_ORDER = {
    "run_and_save_rng_state": "torch.utils.checkpoint's random op whose RNG state is saved for its recomputation "
                              "in backward, read on the host, which a CUDA graph does not record",
    "run_with_rng_state": "torch.utils.checkpoint's recomputation of a random op from a saved RNG state, set on "
                          "the host, which a CUDA graph does not record",
}
_HIGHER_ORDER_WHY = "a higher-order operator, not recorded by the CPU model of a CUDA graph"

_TORCH = os.path.dirname(torch.__file__) + os.sep
_OWN = str(Path(__file__).resolve().parents[2]) + os.sep  # the package (not imported: it imports the runtime)
_EXAMPLES = os.path.join(_OWN, "examples") + os.sep


def _foreign(filename: str) -> bool:
    """A frame of the user's code, an artifact's or a library's: not torch's, not ours
    (the built-in examples count as a user's)."""
    if filename.startswith(_TORCH):
        return False
    return not filename.startswith(_OWN) or filename.startswith(_EXAMPLES)


def where(exc: BaseException) -> str:
    """The innermost frame of user, artifact or library code where `exc` (or the error it
    was raised from) came from, as `function (file:line)`; "" when every frame is
    torch's or graphdispatch's."""
    while exc.__cause__ is not None:  # re-raised with context (the gate names its artifact)
        exc = exc.__cause__
    found = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if _foreign(frame.filename):
            name = "the graph's code" if frame.filename.startswith("<eval_with_key>") else os.path.basename(
                frame.filename)
            found = f"{frame.name} ({name}:{frame.lineno})"
    return found
