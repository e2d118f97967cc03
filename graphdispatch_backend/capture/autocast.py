"""Observe the caller's autocast state once and replay it wherever tracing happens later.

Autocast is thread-local. Lowering, region export and artifact probing may run after the
user's `with torch.autocast(...)` block has closed, or on another thread; without a
replay they would trace different matmul dtypes than the live call used.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

# cpu and cuda are always recorded (a disabled state is replayed as disabled, on purpose);
# the other autocast device types are recorded only when the caller enabled them, because
# entering their autocast can fail on builds without that backend.
_ALWAYS = ("cpu", "cuda")
_OPTIONAL = ("xpu", "mps", "hpu", "mtia", "xla", "ipu", "maia")


@dataclasses.dataclass(frozen=True)
class DeviceAutocast:
    device_type: str
    enabled: bool
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """Per-device autocast enablement and dtype, plus the cast-cache flag."""

    devices: tuple[DeviceAutocast, ...]
    cache_enabled: bool

    @classmethod
    def observe(cls) -> AutocastState:
        devices = []
        for device_type in _ALWAYS + _OPTIONAL:
            if device_type in _OPTIONAL and not _enabled(device_type):
                continue
            devices.append(
                DeviceAutocast(
                    device_type, _enabled(device_type), torch.get_autocast_dtype(device_type)
                )
            )
        return cls(tuple(devices), torch.is_autocast_cache_enabled())

    @property
    def any_enabled(self) -> bool:
        return any(d.enabled for d in self.devices)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Enter exactly the observed state (nested `torch.autocast` contexts)."""
        with contextlib.ExitStack() as stack:
            for d in self.devices:
                stack.enter_context(
                    torch.autocast(
                        d.device_type,
                        dtype=d.dtype,
                        enabled=d.enabled,
                        cache_enabled=self.cache_enabled,
                    )
                )
            yield

    def to_dict(self) -> dict[str, Any]:
        return {
            "cache_enabled": self.cache_enabled,
            "devices": {
                d.device_type: {"enabled": d.enabled, "dtype": str(d.dtype).replace("torch.", "")}
                for d in self.devices
            },
        }


def _enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type this build does not know
        return False
