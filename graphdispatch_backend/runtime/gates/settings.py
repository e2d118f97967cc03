"""Settings: the process-wide torch settings a kernel's run may not change.

A region changes none of torch's process-wide settings; a kernel that does (it sets the
default dtype for its own tensors, turns on flush-to-zero for speed, or enables grad mode)
changes them for every line of the user's code after it, checked or not: a trial's
kernel left `torch.zeros(1)` float64, or `1e-39 * 1.0` 0.0, in the user's own code, the
artifact reported serving. So the run of a kernel beside its region (runtime/gates/beside.py,
a judged call: its first per shape key, and each re-check) reads them before and after:
one that changed is put back, and the kernel is demoted (`changed_settings`). On calls no
check runs they are not read (docs/guarantees.md, what is not checked): most such kernels
set them on their first call, which is judged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _flushes_denormals() -> bool:
    """Whether this thread's CPU flushes subnormal floats to zero (`torch.set_flush_denormal`
    has no getter): a subnormal times one is then zero."""
    return bool((_SUBNORMAL * 1.0).item() == 0.0)


_SUBNORMAL = torch.full((1,), 1e-39, dtype=torch.float32)

# (what a message calls it, its getter, its setter)
_SETTINGS: tuple[tuple[str, Callable[[], Any], Callable[[Any], Any]], ...] = (
    ("the default dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    ("deterministic algorithms (on, warn only)",
     lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
     lambda was: torch.use_deterministic_algorithms(was[0], warn_only=was[1])),
    ("the float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("the number of threads", torch.get_num_threads, torch.set_num_threads),
    ("flush-denormal", _flushes_denormals, torch.set_flush_denormal),
)


def unchanged(run: Callable[[], Any]) -> tuple[Any, str | None]:
    """`run`'s result, and what it changed of torch's process-wide settings (said as
    "the default dtype from torch.float32 to torch.float64"; None: nothing), each put
    back as it was before."""
    before = [get() for _, get, _ in _SETTINGS]
    result = run()
    changed = []
    for (name, get, put), was in zip(_SETTINGS, before):
        now = get()
        if now != was:
            put(was)
            changed.append(f"{name} from {was} to {now}")
    return result, "; ".join(changed) or None
