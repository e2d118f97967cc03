"""Compare two output tuples: bit for bit, or allclose with NaN/inf pinned in place.

Bitwise means the same bits: -0.0 differs from 0.0, and NaN payloads must agree, which
`torch.equal` cannot tell. Shapes, dtypes, devices and strides are compared first. A
mismatch carries the max abs diff and the first mismatching index for the report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import torch

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


BEYOND = "beyond_rows"  # Mismatch.what: a written input differs beyond the rows the graph writes


@dataclasses.dataclass(frozen=True)
class Mismatch:
    output: int
    what: str  # count | type | shape | dtype | device | stride | view | values | nan_inf | BEYOND
    detail: str
    max_abs_diff: float | None = None
    first_index: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "what": self.what,
            "detail": self.detail,
            "max_abs_diff": self.max_abs_diff,
            "first_mismatch_index": list(self.first_index) if self.first_index is not None else None,
        }

    def __str__(self) -> str:
        if self.output >= 0:
            return self.describe(f"output {self.output}")
        return self.describe("written inputs" if self.what == BEYOND else "outputs")

    def describe(self, name: str) -> str:
        """The mismatch said of `name` (an output, an input's gradient)."""
        extra = []
        if self.max_abs_diff is not None:
            extra.append(f"max abs diff {self.max_abs_diff:.3g}")
        if self.first_index is not None:
            extra.append(f"first at {list(self.first_index)}")
        return f"{name}: {self.what}: {self.detail}" + (f" ({', '.join(extra)})" if extra else "")


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """The values a tensor reads as: a lazily conjugated or negated view (`a.conj()`,
    `fft.ifft` on real input) materialized, so its bits can be read and compared."""
    return t.detach().resolve_conj().resolve_neg()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (floats), so == compares bits."""
    flat = _resolved(t).contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():
        return flat.view(_SAME_SIZE_INT[flat.element_size()])
    return flat


def _where(mask: torch.Tensor, shape: torch.Size, offset: int = 0) -> tuple[int, ...]:
    """The index in `shape` of `mask`'s first true element, `mask` being the flat elements
    from `offset` on."""
    return unravel(offset + int(torch.nonzero(mask.reshape(-1))[0].item()), shape)


def unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The index in `shape` of the `flat`-th element in row-major order."""
    index = []
    for size in reversed(shape):
        index.append(flat % size if size else 0)
        flat = flat // size if size else 0
    return tuple(reversed(index))


_CHUNK = 1 << 20  # elements: a comparison takes float64 copies (and masks) of this much at a time


def _diff(a: torch.Tensor, b: torch.Tensor, differ: torch.Tensor) -> tuple[float | None, tuple[int, ...]]:
    return _gap(a, b), _where(differ, a.shape)


def _gap(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """The largest |a - b| over the elements finite in both (None: booleans, or none finite)."""
    if a.dtype == torch.bool:
        return None
    wide = torch.complex128 if a.is_complex() else torch.float64
    flat_a, flat_b = _resolved(a).reshape(-1), _resolved(b).reshape(-1)
    peak: float | None = None
    for i in range(0, flat_a.numel(), _CHUNK):  # bounded memory, whatever the output's size
        da, db = flat_a[i : i + _CHUNK].to(wide), flat_b[i : i + _CHUNK].to(wide)
        gap = (da - db).abs()[torch.isfinite(da) & torch.isfinite(db)]  # complex: |a - b|, not |a| - |b|
        if gap.numel():
            peak = max(peak or 0.0, float(gap.max()))
    return peak


def largest_gap(expected: Sequence[Any], actual: Sequence[Any]) -> float | None:
    """The largest |expected - actual| over the floating (and complex) tensor outputs'
    elements finite in both: what a passing allclose check served (None: no such output)."""
    gaps = [_gap(e, a) for e, a in zip(expected, actual) if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor)
            and (e.is_floating_point() or e.is_complex()) and e.shape == a.shape]
    return max((g for g in gaps if g is not None), default=None)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(_bits(a), _bits(b))


def differ(a: Sequence[Any], b: Sequence[Any], skip: Collection[int] = ()) -> bool:
    """Whether two output sets differ at all: bits only, never the float64 copies a
    mismatch's detail takes (several times an output's size). `skip`: outputs whose values
    are nobody's (memory made uninitialized and never written): their bits are not read."""
    if len(a) != len(b):
        return True
    return not all(i in skip or (bitwise_equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                                 else type(x) is type(y) and x == y) for i, (x, y) in enumerate(zip(a, b)))


def compare(
    expected: Sequence[Any],
    actual: Sequence[Any],
    mode: str = "bitwise",
    rtol: float = 0.0,
    atol: float = 0.0,
    check_strides: bool = True,
    skip: Collection[int] = (),
) -> Mismatch | None:
    """None when `actual` may stand in for `expected`; else the first mismatch. `skip`:
    outputs whose values are nobody's (memory made uninitialized and never written,
    passes/ops.py `unwritten_outputs`): everything but their values is compared."""
    if len(expected) != len(actual):
        return Mismatch(-1, "count", f"{len(actual)} outputs, expected {len(expected)}")
    for i, (e, a) in enumerate(zip(expected, actual)):
        if not isinstance(e, torch.Tensor) or not isinstance(a, torch.Tensor):
            if type(e) is not type(a) or e != a:
                return Mismatch(i, "type", f"{type(a).__name__} {a!r:.40}, expected {type(e).__name__} {e!r:.40}")
            continue
        for what, want, got in (("shape", e.shape, a.shape), ("dtype", e.dtype, a.dtype),
                                ("device", e.device, a.device)):
            if want != got:
                return Mismatch(i, what, f"{got}, expected {want}")
        if check_strides and e.numel() > 1 and e.stride() != a.stride():
            return Mismatch(i, "stride", f"{a.stride()}, expected {e.stride()}")
        if (e.is_conj(), e.is_neg()) != (a.is_conj(), a.is_neg()):
            return Mismatch(i, "view", f"conj={a.is_conj()} neg={a.is_neg()}, expected conj={e.is_conj()} "
                                       f"neg={e.is_neg()}")
        if e.numel() == 0 or i in skip:
            continue
        mismatch = _values(i, e, a, mode, rtol, atol)
        if mismatch is not None:
            return mismatch
    return None


def _values(i: int, e: torch.Tensor, a: torch.Tensor, mode: str, rtol: float, atol: float) -> Mismatch | None:
    if mode == "bitwise" or not (e.is_floating_point() or e.is_complex()):
        be, ba = _bits(e), _bits(a)
        if torch.equal(be, ba):
            return None
        differ = (be != ba).reshape(-1)
        if e.is_complex():  # two bit-words per element
            differ = differ.view(-1, 2).any(dim=1)
        gap, first = _diff(e, a, differ)
        return Mismatch(i, "values", "bits differ", gap, first)
    if not e.is_complex() and _within(e, a, rtol, atol):
        return None
    # the places of NaN, then +inf, then -inf, then the finite values: each over the whole
    # output, chunk by chunk (masks and wide copies of _CHUNK elements: bounded memory)
    flat_e, flat_a = _resolved(e).reshape(-1), _resolved(a).reshape(-1)
    n = flat_e.numel()
    for name, fn in (("nan", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        for j in range(0, n, _CHUNK):
            ce, ca = flat_e[j : j + _CHUNK], flat_a[j : j + _CHUNK]
            # Complex: per component, so NaN in the real part never stands in for NaN in the imaginary one.
            me = fn(torch.view_as_real(ce)) if e.is_complex() else fn(ce)
            ma = fn(torch.view_as_real(ca)) if e.is_complex() else fn(ca)
            if not torch.equal(me, ma):
                differ = (me != ma).any(-1) if e.is_complex() else me != ma
                return Mismatch(i, "nan_inf", f"{name} positions differ", None, _where(differ, e.shape, j))
    # NaN/inf sit in the same places in both (checked above); only finite elements are compared
    wide = torch.complex128 if e.is_complex() else torch.float64
    for j in range(0, n, _CHUNK):
        de, da = flat_e[j : j + _CHUNK].to(wide), flat_a[j : j + _CHUNK].to(wide)
        bad = (torch.isfinite(de) & torch.isfinite(da)) & ~torch.isclose(da, de, rtol=rtol, atol=atol)
        if bool(bad.any()):
            return Mismatch(i, "values", f"not within rtol={rtol} atol={atol}", _gap(e, a), _where(bad, e.shape, j))
    return None


def _within(e: torch.Tensor, a: torch.Tensor, rtol: float, atol: float) -> bool:
    """True when every element of real `a` is finite and within `atol + rtol * |e|` of
    `e`'s, which is finite too: what the full allclose comparison (`_values`) finds then,
    in a third of its operations (a check of a graph fused under a tolerance compares
    every output: its cost is their count in small graphs), in float64 chunks of _CHUNK
    elements (bounded memory, whatever the output's size). False says only "not
    certainly": the full comparison decides, and says where.

    `max(gap - room) <= 0` holds exactly when every `gap <= room` (for finite non-negative
    doubles the difference has the sign of the comparison), and fails on NaN (the max
    propagates it) and wherever either value is infinite (gap is inf or NaN there, and
    inf - inf is NaN)."""
    flat_e, flat_a = _resolved(e).reshape(-1), _resolved(a).reshape(-1)
    for i in range(0, flat_e.numel(), _CHUNK):
        # copies (a float64 output's own chunk too: what follows writes them)
        de = flat_e[i : i + _CHUNK].to(torch.float64, copy=True)
        da = flat_a[i : i + _CHUNK].to(torch.float64, copy=True)
        gap = da.sub_(de).abs_()  # |a - e|, as isclose takes it
        room = de.abs_().mul_(rtol).add_(atol)  # atol + rtol * |e|
        if not float(gap.sub_(room).max()) <= 0.0:
            return False
    return True


def _storage(t: Any) -> int | None:
    """The address of a tensor's storage; None for a non-tensor, an empty storage, or a
    tensor subclass with no storage of its own (a DTensor wraps its local shard)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        storage = t.untyped_storage()
        return storage.data_ptr() if storage.nbytes() else None
    except RuntimeError:
        return None


def aliasing(outputs: Sequence[Any], inputs: Sequence[Any]) -> list[tuple[Any, ...] | None]:
    """Per output: which input or earlier output it shares memory with, and where."""
    by_ptr: dict[int, tuple[str, int, int]] = {}
    for j, t in enumerate(inputs):
        ptr = _storage(t)
        if ptr is not None:
            by_ptr.setdefault(ptr, ("input", j, 0))
    shape: list[tuple[Any, ...] | None] = []
    for i, t in enumerate(outputs):
        ptr = _storage(t)
        if ptr is None:
            shape.append(None)
            continue
        hit = by_ptr.get(ptr)
        if hit is None:
            by_ptr[ptr] = ("output", i, t.storage_offset())
            shape.append(("own",))
        elif hit[0] == "input":
            shape.append(("input", hit[1], t.storage_offset()))
        else:
            shape.append(("output", hit[1], t.storage_offset() - hit[2]))
    return shape


def compare_aliasing(expected: Sequence[Any], actual: Sequence[Any], inputs: Sequence[Any],
                     actual_inputs: Sequence[Any] | None = None) -> Mismatch | None:
    """Outputs share memory with the same inputs and outputs, at the same offsets."""
    want = aliasing(expected, inputs)
    got = aliasing(actual, inputs if actual_inputs is None else actual_inputs)
    for i, (w, g) in enumerate(zip(want, got)):
        if w is not None and g is not None and w != g:  # None: no storage of its own to compare
            return Mismatch(i, "aliasing", f"{say_alias(g)}, expected {say_alias(w)}")
    return None


def say_alias(alias: tuple[Any, ...] | None) -> str:
    if alias is None or alias[0] == "own":
        return "its own memory"
    return f"a view of {alias[0]} {alias[1]} at offset {alias[2]}"
