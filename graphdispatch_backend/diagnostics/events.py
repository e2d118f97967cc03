"""Decisions as log records and as structured trace events.

Logging goes through `logging.getLogger("graphdispatch_backend")`. What the user must see
is WARNING once per key per session (`warn_once`; a repeat is DEBUG): the origin runtime's
fast path silently declined 1151 calls at INFO. The key is the caller's: a CUDA-graph or
lowering decline is keyed by its reason alone (the first graph declined for it is named;
the report names every one; `autograd` and contract mismatches by graph), a demotion by
artifact, region and reason (every demoted region is named), an authoring failure by its
kind and key. Decisions a user may want to follow (a graph compiled, a region substituted,
a parity verdict, an export) are INFO; the structured record of a decline or demotion,
which `warn_once` already reported, is DEBUG.

With `TORCH_TRACE=dir` set, each decision is also a `trace_structured` artifact named
`graphdispatch_<kind>` with a JSON payload, next to Dynamo's own events, for tlparse.
Events raised while Dynamo compiles carry its frame and compile ids; runtime events
(parity, declines, demotions) carry the stack of the call instead, as torch does.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from torch._logging import trace_structured

from graphdispatch_backend.diagnostics.report_file import json_default

log = logging.getLogger("graphdispatch_backend")

# Kinds logged at INFO; every other kind is DEBUG (declines and demotions reach WARNING
# through warn_once, as does a compile fallback, so their structured record would only repeat it).
INFO_KINDS = frozenset({"compile", "substitution", "parity", "export"})
TRACE_PREFIX = "graphdispatch_"


class Events:
    def __init__(self) -> None:
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        """WARNING the first time `key` is seen in this session, DEBUG after."""
        with self._lock:
            first = key not in self._warned
            self._warned.add(key)
        if first:
            log.warning(message, *args)
        else:
            log.debug(message, *args)

    def decision(self, kind: str, payload: dict[str, Any]) -> None:
        """One structured decision: compile, substitution, parity, decline, demotion, fallback, export."""
        level = logging.INFO if kind in INFO_KINDS else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(level, "graphdispatch %s: %s", kind, json.dumps(payload, default=json_default, sort_keys=True))
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"{TRACE_PREFIX}{kind}", "encoding": "json"},
            payload_fn=lambda: json.dumps(payload, default=json_default, sort_keys=True),
        )
