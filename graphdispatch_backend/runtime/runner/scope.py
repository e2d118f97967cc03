"""RuntimeScope: what all runners of one compile session share.

- The replay engine, and per device its streams, a device lock and a device guard: one
  pool per device is shared by every capture, so copy-in, replay and clone of one call
  must not interleave with another call's on the same device (the lock orders the
  launches; the streams order the work on the device).
- Static input buffers (runner/inputs.py), shared by every runner.
- Timing, events and the `contain` boundary from backend.py.

The runners hold their scope and the session only finds it (session.py): a scope, with its
engine, pools and buffers, goes with the last runner that uses it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from graphdispatch_backend.diagnostics.events import Events
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Contain
from graphdispatch_backend.runtime.cudagraph.engine import ReplayEngine
from graphdispatch_backend.runtime.cudagraph.streams import Streams
from graphdispatch_backend.runtime.runner.inputs import StaticBuffers


class DeviceRuntime:
    """One device's share of the scope: its streams, its lock and its guard."""

    def __init__(self, engine: ReplayEngine, device: Any) -> None:
        self.device = device
        self.streams: Streams = engine.streams(device)
        self.lock = threading.RLock()  # held for copy-in, replay and clone of one call
        self._engine = engine

    def guard(self) -> contextlib.AbstractContextManager[Any]:
        return self._engine.guard(self.device)


class RuntimeScope:
    def __init__(self, engine: ReplayEngine, timing: Timing, events: Events, contain: Contain) -> None:
        self.engine = engine
        self.timing = timing
        self.events = events
        self.contain = contain
        self.buffers = StaticBuffers()
        self._devices: dict[str, DeviceRuntime] = {}
        self._lock = threading.Lock()

    def device(self, device: Any) -> DeviceRuntime:
        key = str(device)
        with self._lock:
            runtime = self._devices.get(key)
            if runtime is None:
                runtime = self._devices[key] = DeviceRuntime(self.engine, device)
            return runtime
