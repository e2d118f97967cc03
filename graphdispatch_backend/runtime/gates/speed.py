"""SpeedTrial: with `speed_gate`, is the artifact faster than the native region it replaces?

At a region's gate, once its outputs passed parity, both run SPEED_REPEATS timed times (after
one untimed run each) on the same live inputs, synchronized on CUDA; the artifact serves
only if its median is lower. An artifact that writes inputs in place (a KV cache's rows)
has the written rows snapshotted first and put back after the timed runs; where the
snapshot cannot be taken (memory), this call is not timed and no verdict is given.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphdispatch_backend.errors import Contain, Demotion
from graphdispatch_backend.runtime.gates.beside import Beside
from graphdispatch_backend.runtime.gates.demote import raised

SPEED_REPEATS = 7
Speed = dict[str, Any]  # artifact_ms, native_ms, speedup: the record's `speed`


class SpeedTrial:
    def __init__(self, artifact: Callable[..., Any], native: Callable[..., Sequence[Any]], beside: Beside,
                 contain: Contain, contain_artifact: Contain) -> None:
        self._artifact, self._native = artifact, native
        self._beside = beside  # the inputs the kernel writes: snapshotted around the timed runs
        self._contain = contain
        self._contain_artifact = contain_artifact  # the kernel's runs: a raise is a demotion, even under strict

    def judge(self, inputs: Sequence[Any]) -> tuple[Speed | None, tuple[Demotion, str] | None]:
        """The figures (None when not timed) and the demotion, or None: faster, or not timed."""
        if not self._beside.mutates:
            return self._timed(inputs)
        rewind, exc = self._contain(lambda: self._beside.snapshot(inputs))
        if exc is not None:
            return None, None  # not timed this call (memory): no verdict on speed
        try:
            return self._timed(inputs)
        finally:
            self._contain(rewind)

    def _timed(self, inputs: Sequence[Any]) -> tuple[Speed | None, tuple[Demotion, str] | None]:
        native_ms = _median_ms(lambda: self._native(*inputs), inputs)
        # The artifact runs SPEED_REPEATS + 1 more times here: raising in any of them demotes
        # like raising at any other call, instead of escaping into the user's forward.
        artifact_ms, exc = self._contain_artifact(lambda: _median_ms(lambda: self._artifact(*inputs), inputs))
        if exc is not None:
            return None, (Demotion.RAISED, f"{raised(exc)} (while timing it for speed_gate)")
        speed = {"artifact_ms": artifact_ms, "native_ms": native_ms,
                 "speedup": native_ms / artifact_ms if artifact_ms else None}
        if artifact_ms < native_ms:
            return speed, None
        return speed, (Demotion.SLOWER,
                       f"artifact {artifact_ms:.3f} ms, native {native_ms:.3f} ms (median of {SPEED_REPEATS})")


def _median_ms(fn: Callable[[], Any], inputs: Sequence[Any]) -> float:
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in inputs)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    samples = []
    for _ in range(SPEED_REPEATS):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples)
