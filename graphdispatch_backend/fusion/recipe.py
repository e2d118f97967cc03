"""The eager-numerics recipe: which ATen ops Inductor may fuse, and the Inductor settings
under which a fused op computes the bits its ATen kernel computes.

Nothing here is proof: the recipe only picks what to try. Every fused graph is checked
against eager bit for bit like any lowering, and an op found to differ is kept as an ATen
call for that graph (runtime/fusion/fused.py). What the recipe keeps out of fusion, and
why (measured on torch 2.13, CPU):

- reductions, norms and softmax (`sum`, `mean`, `var_mean`, `native_layer_norm`,
  `_softmax`, ...): Inductor reduces with one vector accumulator and a horizontal sum,
  eager with a cascade or Welford; the bits differ.
- transcendentals (`exp`, `tanh`, `erf`, `gelu`, `silu`, `sigmoid`, `pow`, ...): Inductor's
  math library (Sleef) and eager's (MKL's vector math on CPU) round differently.
- matmuls, convolutions, attention: not fused by Inductor anyway (extern kernels), and
  `addmm` would be rewritten as `mm` plus an add.
- `add`/`sub` with `alpha != 1`: eager computes `a + alpha * b` with one fused
  multiply-add; a fused kernel rounds twice.

So the recipe is an allowlist: arithmetic IEEE 754 rounds exactly (add, sub, mul, div,
sqrt, ...), comparisons and selections, casts, copies, views, gathers and constructors.
Everything else runs as its ATen kernel inside the fused graph (Inductor's
`fallback_by_default`, per node: no table of Inductor's is changed).

Settings, per device: bf16/fp16 intermediates rounded as eager rounds them
(`emulate_precision_casts`), no floating-point contraction, no fast math, none of
Inductor's pattern rewrites (pre-, joint- and post-grad passes: they swap ops); on CUDA
also `eager_numerics` (division rounding, no flush-to-zero, PyTorch's libdevice), and no
FMA in Triton kernels (which `emulate_precision_casts` turns off).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

RECIPE_VERSION = 1

# ATen op packets whose fused result is exact by construction (IEEE rounding of one
# operation, or no arithmetic at all). The check is what proves it, per graph.
EXACT_OPS = frozenset({
    # arithmetic rounded once
    "add", "sub", "rsub", "mul", "div", "neg", "abs", "reciprocal", "sqrt", "rsqrt", "square",
    "relu", "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "floor", "ceil", "trunc", "sign",
    # comparisons and selections
    "eq", "ne", "lt", "le", "gt", "ge", "where", "masked_fill", "logical_and", "logical_or",
    "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
    "isnan", "isinf",
    # casts and copies
    "_to_copy", "clone", "copy", "convert_element_type", "lift_fresh_copy", "alias",
    # views
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze",
    "slice", "select", "split", "split_with_sizes", "unbind", "narrow", "as_strided",
    # gathers and constructors
    "cat", "index", "index_select", "gather", "embedding", "constant_pad_nd", "flip", "roll",
    "full", "full_like", "zeros", "zeros_like", "ones", "ones_like", "scalar_tensor", "fill",
    "new_zeros", "new_ones", "new_full",
})

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


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What may be fused on one device type, and the Inductor settings to fuse it with."""

    device: str
    settings: tuple[tuple[str, Any], ...]
    fusable: frozenset[str]
    version: int = RECIPE_VERSION

    @property
    def patches(self) -> dict[str, Any]:
        return dict(self.settings)

    @property
    def id(self) -> str:
        """16 hex naming the recipe (part of every verdict cache key)."""
        text = json.dumps([self.device, self.settings, sorted(self.fusable), self.version], default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


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


def recipe_for(device_type: str) -> Recipe:
    settings = {**_COMMON, **_DEVICE.get(device_type, {})}
    return Recipe(device_type, tuple(sorted(settings.items())), EXACT_OPS)
