"""Decisions as log records and as structured trace events.

Declines and demotions are WARNING once per reason per session (the origin runtime's fast
path silently declined 1151 calls at INFO); everything else is INFO/DEBUG. With
`TORCH_TRACE=dir` set, each decision is also a `trace_structured` artifact named
`graphdispatch_<kind>`, next to Dynamo's own events, for tlparse.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from torch._logging import trace_structured

log = logging.getLogger("graphdispatch_backend")


class Events:
    def __init__(self) -> None:
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        with self._lock:
            first = key not in self._warned
            self._warned.add(key)
        if first:
            log.warning(message, *args)
        else:
            log.debug(message, *args)

    def decision(self, kind: str, payload: dict[str, Any]) -> None:
        """One structured decision: compile, match, substitution, decline, demotion, export."""
        log.debug("graphdispatch %s: %s", kind, payload)
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"graphdispatch_{kind}", "encoding": "json"},
            payload_fn=lambda: json.dumps(payload, default=str, sort_keys=True),
        )
