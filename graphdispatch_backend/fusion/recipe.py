"""The recipes: which ATen ops Inductor may fuse in a graph, and the Inductor settings it
fuses them under. Two kinds (`fuse`, options.py):

**Exact** (`fuse=True`): an op is fused where its fused result is eager's bits by
construction: the same function of the same elements. Nothing here is proof: every fused
graph is checked against eager bit for bit like any lowering, and an op found to differ is
kept as an ATen call (runtime/program/fused.py). What the recipe keeps out, and why
(measured on torch 2.13, CPU with AVX512 and MKL; tests/fusion/test_exact_set.py holds the
evidence for what it lets in):

- reductions, norms and softmax (`sum`, `mean`, `var_mean`, `native_layer_norm`,
  `_softmax`, ...) over floats: eager's layer norm takes its moments with a chunked,
  per-lane Welford (`RowwiseMoments`) and combines the lanes one by one after the tail,
  Inductor's Welford and cascade sum reduce in another order; the bits differ on every
  shape tried, even a row of 8. Over integers and bools a sum is exact in any order: fused.
- transcendentals (`exp`, `log`, `tanh`, `erf`, `gelu`, `sin`, `sigmoid`, `silu`, ...):
  eager's float32 kernels call MKL's vector math (or Sleef on the vector body and libm on
  the tail of 2 vectors), so eager's own result for an element depends on where in the
  tensor it sits; no fused form is the same function of the same elements.
- `sqrt` on CPU: eager's float32 `sqrt` of 32 elements or more is MKL's, not correctly
  rounded (Inductor's is); `rsqrt` is `1 / sqrt` correctly rounded in both, in float32
  and float64 only (a bf16 `rsqrt` rounds otherwise). `pow` by 2 and -1 (any float but
  fp16, whose eager `pow` is `std::pow`) and by 3 (float32/64: bf16 rounds `x * x` first
  in eager) is eager's `x * x`, `1 / x`, `x * x * x`; other exponents are `pow`.
- matmuls, convolutions, attention: not fused by Inductor anyway (extern kernels), and
  `addmm` would be rewritten as `mm` plus an add.
- `add`/`sub` with `alpha != 1`: eager computes `a + alpha * b` with one fused
  multiply-add; a fused kernel rounds twice. On CPU, `add`/`sub`/`rsub` of a bf16/fp16
  tensor and a Python number the dtype does not hold: eager rounds the number to the
  tensor's dtype first (its scalar is cast with the tensor operands; `mul` and `div` keep
  it in float), Inductor adds it unrounded (`x - 0.5199` in bf16 differed: op_db's
  `cosine_embedding_loss`). Any of these five with a 0-dim tensor operand of another
  dtype than the result (a float32 scale of a bf16 tensor): eager takes it as a scalar in
  its compute type, unrounded; Inductor rounds it to the result's dtype first.
- `maximum`, `minimum`, `amax`, `amin` of floats are not fused: the value is the same, but
  the sign of a zero result where +0 and -0 tie is eager's by position (its vector body
  returns the second operand, its scalar tail the first; a reduction, by its order), so a
  fused kernel returns the other zero on some elements, and `1 / maximum(x, y)` is +inf
  for -inf. A check catches it only on a call it checks, and a tie has no magnitude the
  novelty checks follow: a trial served 9 of 15 such calls with the other zero
  (2026-12-07). Fused: of integers and bools, and `amax`/`amin` of an `abs` (every zero is
  +0: the novelty statistics, fusion/statistics.py). `clamp`, `clamp_min`, `clamp_max` of
  floats are fused where their bounds are numbers other than zero (a tie with one is then
  the same bits); `relu` is (eager returns the input on a tie in both paths, as the fused
  kernel does: tests/fusion/test_exact_set.py).
- `arange` is fused where every value is an integer its dtype holds exactly (eager counts
  in double, Inductor in int64); a constructor or `masked_fill` of bf16/fp16 where its
  number is exact in that dtype (eager stores it rounded; Inductor may fold it, unrounded,
  into the kernel that reads it: `full(0.3) * x` in bf16 differed).

So the recipe is an allowlist: arithmetic IEEE 754 rounds exactly (add, sub, mul, div,
...), comparisons and selections, casts, copies, views, gathers and constructors.
Everything else runs as its ATen kernel inside the fused graph (Inductor's
`fallback_by_default`, per node: no table of Inductor's is changed).

Settings, per device: bf16/fp16 intermediates rounded as eager rounds them
(`emulate_precision_casts`), no floating-point contraction, no fast math, none of
Inductor's pattern rewrites (pre-, joint- and post-grad passes: they swap ops); on CUDA
also `eager_numerics` (division rounding, no flush-to-zero, PyTorch's libdevice), and no
FMA in Triton kernels (which `emulate_precision_casts` turns off).

**Tolerance** (`fuse={"rtol": r, "atol": a}`): every op, as Inductor compiles a graph
(its decompositions, fusions, reductions, math library and pattern rewrites;
`fallback_by_default` off), judged within the tolerance; an op found beyond it is cut out
of the fused segments and runs as its ATen kernel. Its settings keep Inductor's own CUDA
graphs off (graphdispatch captures and checks its own) and round bf16/fp16 intermediates
where eager rounds them (`emulate_precision_casts`, as the exact recipe does): without it
a fused bf16 softcap and softmax (Gemma 2) computed on float32 logits that eager rounds to
bf16, 16 ulps off eager's attention weights at the first call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

# 2: the exact set of issue 45 (pow, integer sums, amax/amin, arange; no CPU sqrt); 3: no float max/min
RECIPE_VERSION = 3

# ATen op packets whose fused result is exact by construction (IEEE rounding of one
# operation, or no arithmetic at all), subject to the per-node rules of `exact_node`. The
# check is what proves it, per graph.
EXACT_OPS = frozenset({
    # arithmetic rounded once
    "add", "sub", "rsub", "mul", "div", "neg", "abs", "reciprocal", "sqrt", "rsqrt", "square", "pow",
    "relu", "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "floor", "ceil", "trunc", "sign",
    # comparisons and selections
    "eq", "ne", "lt", "le", "gt", "ge", "where", "masked_fill", "logical_and", "logical_or",
    "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
    "isnan", "isinf",
    # reductions exact in any order (amax/amin: of an abs or integers; sum: integers only)
    "amax", "amin", "sum",
    # casts and copies
    "_to_copy", "clone", "copy", "convert_element_type", "lift_fresh_copy", "alias",
    "slice_scatter", "select_scatter", "repeat",
    # views
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze",
    "slice", "select", "split", "split_with_sizes", "unbind", "narrow", "as_strided",
    # gathers and constructors
    "cat", "stack", "index", "index_select", "gather", "embedding", "constant_pad_nd", "flip", "roll",
    "full", "full_like", "zeros", "zeros_like", "ones", "ones_like", "scalar_tensor", "fill",
    "new_zeros", "new_ones", "new_full", "arange",
})

# pow's exponents whose eager kernel is a product or a reciprocal (aten/src/ATen/native/cpu/PowKernel.cpp),
# with the dtypes where Inductor's product rounds as eager's does
_POW = {2: (torch.float32, torch.float64, torch.bfloat16), -1: (torch.float32, torch.float64, torch.bfloat16),
        3: (torch.float32, torch.float64)}
# the largest integer each float dtype holds exactly, with every integer below it
_EXACT_INTEGERS = {torch.float64: 2**53, torch.float32: 2**24, torch.float16: 2**11, torch.bfloat16: 2**8}

_COMMON: dict[str, Any] = {
    "fallback_by_default": True,  # only the nodes annotated below are lowered; the rest run ATen
    "emulate_precision_casts": True,
    "use_fast_math": False,
    "use_pre_grad_passes": False,
    "use_joint_graph_passes": False,
    "use_post_grad_passes": False,
    "freezing": False,
    "cpp_wrapper": False,
    "keep_output_stride": True,
    "layout_optimization": False,  # eager's memory formats (it ran a UNet's convs channels-last, outputs too)
    "triton.cudagraphs": False,  # graphdispatch captures (and checks) its own graphs
}
_DEVICE: dict[str, dict[str, Any]] = {
    "cpu": {
        "cpp.enable_floating_point_contract_flag": "off",
        "cpp.enable_unsafe_math_opt_flag": False,
    },
    "cuda": {
        "eager_numerics.division_rounding": True,
        "eager_numerics.disable_ftz": True,
        "eager_numerics.use_pytorch_libdevice": True,
    },
}
# as Inductor compiles, bar its own CUDA graphs (graphdispatch captures and checks its own), with
# bf16/fp16 intermediates rounded where eager rounds them: a fused softcap (tanh) and softmax
# otherwise keeps Gemma 2's bf16 logits in float32, 16 bf16 ulps off eager's attention weights
_TOLERANCE: dict[str, Any] = {"fallback_by_default": False, "triton.cudagraphs": False,
                              "emulate_precision_casts": True}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What may be fused on one device type, and the Inductor settings to fuse it with.
    `tolerance` (rtol, atol): the tolerance recipe, every op; None: the exact one."""

    device: str
    settings: tuple[tuple[str, Any], ...]
    fusable: frozenset[str]
    version: int = RECIPE_VERSION
    tolerance: tuple[float, float] | None = None

    @property
    def exact(self) -> bool:
        return self.tolerance is None

    @property
    def patches(self) -> dict[str, Any]:
        return dict(self.settings)

    @property
    def id(self) -> str:
        """16 hex naming the recipe (part of every verdict cache key): what an op learned
        under one tolerance says nothing of another."""
        text = json.dumps([self.device, self.settings, sorted(self.fusable), self.version, self.tolerance],
                          default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def allows(self, node: fx.Node) -> bool:
        """The recipe's numeric rule for one ATen node (fusion/segments.py adds the structural
        ones): any op under a tolerance; an exact op, on its arguments, otherwise."""
        if not self.exact:
            return True
        return node.target._opname in self.fusable and exact_node(node, self.device)

def with_inductor_keys(recipe: Recipe, keys: Sequence[tuple[str, Any]]) -> tuple[Recipe, dict[str, Any]]:
    """The recipe with the Inductor settings a caller gave in `options` (Options.inductor)
    added: the fusion compile applies each one the recipe does not set; where the recipe
    sets the key, the recipe's value stays (it is what keeps eager's bits). Returns the
    recipe (its id, part of every verdict cache key, names the settings it compiles with)
    and what became of each key: `{"applied": {key: value}, "overridden": {key: {"given",
    "recipe"}}}` (a key given the recipe's own value is applied)."""
    own = recipe.patches
    applied = {k: v for k, v in keys if k not in own or own[k] == v}
    overridden = {k: {"given": v, "recipe": own[k]} for k, v in keys if k in own and own[k] != v}
    if not applied:
        return recipe, {"applied": {}, "overridden": overridden}
    settings = {**applied, **own}
    return (dataclasses.replace(recipe, settings=tuple(sorted(settings.items()))),
            {"applied": applied, "overridden": overridden})



def _dtypes(node: fx.Node) -> set[torch.dtype]:
    values = [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)]
    return {t.dtype for v in values for t in (v if isinstance(v, (tuple, list)) else (v,))
            if isinstance(t, torch.Tensor)}


def exact_node(node: fx.Node, device: str) -> bool:
    """Whether this node of an exact op computes eager's bits when fused, on its arguments
    (the module docstring says why for each rule)."""
    name, args, kwargs = node.target._opname, node.args, node.kwargs
    if name in ("add", "sub", "rsub") and kwargs.get("alpha", 1) != 1:
        return False  # eager's a + alpha * b is one fused multiply-add
    dtypes = _dtypes(node)
    if device == "cpu" and name in ("add", "sub", "rsub") and not all(_held(float(a), dtypes) for a in _numbers(node)):
        return False  # eager rounds a number added to a bf16/fp16 tensor to that dtype first; Inductor does not
    if name in ("add", "sub", "rsub", "mul", "div") and _other_zero_dim(node):
        return False  # eager computes with a 0-dim operand of another dtype as it is; Inductor rounds it first
    if name == "div" and kwargs.get("rounding_mode") is not None:
        return False  # floor/trunc division: eager's formula, not a / b
    if device == "cpu" and name == "sqrt":
        return False  # eager's float32 sqrt is MKL's, not correctly rounded; bf16's rounds that
    if device == "cpu" and name == "rsqrt":
        return dtypes <= {torch.float32, torch.float64}
    if name == "pow":
        exponent = args[1] if len(args) > 1 else None
        if str(node.target) != "aten.pow.Tensor_Scalar" or not isinstance(exponent, (int, float)) \
                or isinstance(exponent, bool) or exponent not in _POW:
            return False
        return all(d in _POW[exponent] or not (d.is_floating_point or d.is_complex) for d in dtypes)
    if name == "sum":  # integers and bools add exactly in any order
        return all(not (d.is_floating_point or d.is_complex) for d in dtypes)
    if name in _SIGNED_ZERO_TIES and any(d.is_floating_point or d.is_complex for d in dtypes):
        if name.startswith("clamp"):  # a tie with a bound other than zero is the same bits
            bounds = [a for a in (*args[1:], *kwargs.values()) if a is not None]
            return all(isinstance(b, (int, float)) and not isinstance(b, bool) and b != 0 for b in bounds)
        source = args[0] if args else None  # amax/amin of an abs: every zero is +0
        return name in ("amax", "amin") and isinstance(source, fx.Node) and source.target is torch.ops.aten.abs.default
    if name == "arange":
        return _exact_range(node)
    if name in _STORES:  # a number stored in a bf16/fp16 tensor: eager rounds it there first
        return all(_held(a, dtypes) for a in (*node.args, *node.kwargs.values()) if isinstance(a, float))
    return True


# ops whose result is one of their operands: where +0 and -0 tie, eager's sign is its loop's (module docstring)
_SIGNED_ZERO_TIES = frozenset({"maximum", "minimum", "clamp", "clamp_min", "clamp_max", "amax", "amin"})

# ops that store a Python number into their output (as its dtype); Inductor may fold the number
# into the kernel that reads it, unrounded: measured (full(0.3, bf16) * x differs)
_STORES = frozenset({"full", "full_like", "new_full", "fill", "scalar_tensor", "masked_fill", "where"})


def _other_zero_dim(node: fx.Node) -> bool:
    """An operand is a 0-dim tensor of another dtype than the result (a float32 scale of a
    bf16 tensor): eager's kernel takes it as a scalar in its compute type, unrounded; the
    fused kernel rounds it to the result's dtype first (a trial, 2026-12-07: `x * s` and
    `x / s` in bf16 differed, learned at call 1)."""
    out = node.meta.get("val")
    return isinstance(out, torch.Tensor) and any(
        isinstance(v := a.meta.get("val"), torch.Tensor) and v.dim() == 0 and v.dtype != out.dtype
        for a in node.all_input_nodes)


def _numbers(node: fx.Node) -> list[int | float]:
    """The Python numbers among a node's arguments (not bools)."""
    return [a for a in (*node.args, *node.kwargs.values())
            if isinstance(a, (int, float)) and not isinstance(a, bool)]


def _held(number: float, dtypes: set[torch.dtype]) -> bool:
    """`number` is exact in every bf16/fp16 dtype of the node (or there is none)."""
    return all(float(torch.tensor(number, dtype=d)) == number or not math.isfinite(number)
               for d in dtypes if d in (torch.bfloat16, torch.float16))


def _exact_range(node: fx.Node) -> bool:
    """An arange whose every value is an integer its dtype holds: eager computes `start +
    step * i` in double and rounds once, Inductor converts `start + step * i` from int64."""
    numbers = [a for a in node.args if not isinstance(a, fx.Node)]
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not numbers \
            or not all(isinstance(a, int) and not isinstance(a, bool) for a in numbers):
        return False
    if not val.dtype.is_floating_point:
        return not val.dtype.is_complex
    bound = _EXACT_INTEGERS.get(val.dtype)
    return bound is not None and max(abs(a) for a in numbers) <= bound


def recipe_for(device_type: str, tolerance: Any = None) -> Recipe:
    """The device's exact recipe, or (`tolerance`: options.FuseTolerance) its tolerance recipe."""
    if tolerance is not None:
        return Recipe(device_type, tuple(sorted(_TOLERANCE.items())), frozenset(),
                      tolerance=(float(tolerance.rtol), float(tolerance.atol)))
    settings = {**_COMMON, **_DEVICE.get(device_type, {})}
    return Recipe(device_type, tuple(sorted(settings.items())), EXACT_OPS)
