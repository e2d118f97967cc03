"""What the report says when a runner's shape keys do not come back, or an input it reads
in place moved, naming the inputs.

Two patterns keep a piece from replaying without anything being wrong with it:

- churn: every call brings a shape key not seen before (a growing KV cache, a sequence
  length that changes every call). A capture serves one shape, so the calls only warm keys
  that never return: they are counted `shape_churn`, not `warmup` (the fast path is not on
  its way), and the detail names the inputs whose shapes change.
- thrashing: keys cycle through more values than max_captures holds, one call each, so
  each capture is evicted before it verified (runner/book.py): the keys past the captured
  ones decline `max_captures`, and the detail names the Python-number inputs the keys
  differ in (a CUDA graph bakes a number in; a tensor would serve every value).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graphdispatch_backend.runtime.call.keys import is_scalar_item, varying

# Calls in a row, each with a new shape key, before the keys count as churning: a decode
# loop brings one per token; a first pass over a server's size buckets, a dozen in a row.
CHURN_CALLS = 16
NAMED = 4  # inputs named in a detail, at most


def input_label(position: int, names: Sequence[str]) -> str:
    """One input as a note names it: the graph input name the runner was given (its access
    path, `past_key_values.layers.0.keys`, what the model calls it) in backticks, then its
    position, as "`x` (input 3)"; "input 3" alone where no name is known (a piece's input
    that is an intermediate value of the graph)."""
    name = names[position] if 0 <= position < len(names) else ""
    return f"`{name}` (input {position})" if name else f"input {position}"


def _names(positions: Sequence[int], names: Sequence[str]) -> str:
    """The inputs by name; a size symbol goes unsaid next to the tensor it sizes (`x.size().0`)."""
    named = [names[p] if p < len(names) and names[p] else f"input {p}" for p in positions]
    named = [n for n in named if not any(n.startswith(f"{other}.") for other in named if other != n)]
    shown = ", ".join(f"`{n}`" for n in named[:NAMED])
    return shown + (f" and {len(named) - NAMED} more" if len(named) > NAMED else "")


def _varying(keys: Sequence[tuple[Any, ...]], key_positions: Sequence[int], scalars: bool | None) -> list[int]:
    """Input positions whose key items differ (scalars only, tensors only, or both)."""
    out = []
    for i in varying(keys):
        if i >= len(key_positions):
            continue
        if scalars is None or scalars == any(is_scalar_item(k[i]) for k in keys if i < len(k)):
            out.append(key_positions[i])
    return out


def _numbers(keys: Sequence[tuple[Any, ...]], key_positions: Sequence[int], names: Sequence[str]) -> list[int]:
    """Scalar inputs whose value differs, bar the sizes Dynamo passes for dynamic shapes
    (`x.size().0`): a Python number the caller passes."""
    sized = (".size()", ".stride()", ".storage_offset()")
    return [p for p in _varying(keys, key_positions, True)
            if not (p < len(names) and any(mark in names[p] for mark in sized))]


def churn_detail(keys: Sequence[tuple[Any, ...]], key_positions: Sequence[int], names: Sequence[str]) -> str:
    detail = (f"each of the last {CHURN_CALLS} calls had a shape key not seen before: a captured graph serves "
              "one shape, so these calls only warm keys that do not come back (pad inputs to a few fixed "
              "sizes, or use a static KV cache)")
    changing = _varying(keys, key_positions, None)
    if changing:
        detail += f"; the keys differ in {_names(changing, names)}"
    numbers = _numbers(keys, key_positions, names)
    if numbers:
        detail += (f"; {_names(numbers, names)} {'is a Python number' if len(numbers) == 1 else 'are Python numbers'}"
                   " whose value a CUDA graph bakes in: passed as a tensor, one capture serves every value")
    return detail


def thrash_detail(limit: int, max_captures: int, keys: Sequence[tuple[Any, ...]], key_positions: Sequence[int],
                  names: Sequence[str]) -> str:
    detail = (f"{limit} captures in a row were evicted before they verified: the calls cycle through more shape "
              f"keys than max_captures={max_captures} holds, so keys past the captured ones run eager (raise "
              "max_captures to hold them all)")
    numbers = _numbers(keys, key_positions, names)
    if numbers:
        detail += (f"; the keys differ in the value of {_names(numbers, names)}: a CUDA graph bakes a Python "
                   "number in, so each value needs a capture of its own; passed as a tensor, one capture "
                   "serves every value")
    return detail
