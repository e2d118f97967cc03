"""Sessions: one per Options value (the compile identity), holding what its graphs share.

A session owns the artifact registry, the report, timing, events and the region exporter,
and finds the runtime scopes (engine, pools, static buffers per engine) its runners share.
`flush()` finalizes exports and writes `dispatch.json` and `timing.json`; it runs at
process exit too, and `reset()` runs it for the sessions it forgets.

Several ranks (torch.distributed initialized, world size > 1) may share one `report_dir`:
each rank but 0 writes `dispatch.rank<N>.json` and `timing.rank<N>.json`, rank 0 (like a
single process) `dispatch.json` and `timing.json`, and the report records the rank
(`distributed`). The rank is remembered from the last time the process group was seen,
so the write at exit, usually after `destroy_process_group()`, still goes to the rank's file.

Lifetime: sessions are kept for the process (their reports, plain data, are written at
exit), but a session holds its scopes weakly: the runners hold their scope, so a scope,
its engine, pools and buffers go with the last runner (when every compiled model of the
session is gone), and the next compile makes a new one.
"""

from __future__ import annotations

import atexit
import os
import platform
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from graphdispatch_backend.artifacts.registry import Registry
from graphdispatch_backend.diagnostics.events import Events, log
from graphdispatch_backend.diagnostics.report_file import rank_file_names, write_json_atomic
from graphdispatch_backend.diagnostics.session_report import SessionReport
from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.errors import Contain, StrictModeError
from graphdispatch_backend.export import RegionExporter
from graphdispatch_backend.fusion.verdicts import Verdicts, default_dir
from graphdispatch_backend.options import FuseTolerance, Options
from graphdispatch_backend.runtime.cudagraph.cuda import CudaGraphEngine
from graphdispatch_backend.runtime.cudagraph.host import HostReplayEngine
from graphdispatch_backend.runtime.runner import RuntimeScope


class Session:
    def __init__(self, options: Options, make_contain: Callable[[bool], Contain]) -> None:
        self.options = options
        self.registry = Registry.load(options.artifacts, options.enable)
        self.timing = Timing(options.timing)
        self.events = Events()
        self.contain = make_contain(options.strict)
        # artifact code: what it raises comes back even under strict, so the gate demotes it and
        # (under strict) raises that, naming the artifact, region and call (runtime/gates/gate.py)
        self.contain_artifact = make_contain(False, kernels=True)  # its sys.exit() too: KernelExited
        self.report = SessionReport(
            options=options.to_dict(),
            registry=self.registry.summary(),
            environment={
                "torch": torch.__version__,
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cuda_available": torch.cuda.is_available(),
            },
        )
        self.exporter = RegionExporter(options.report_dir) if options.export_regions else None
        # Dynamo's recompile-limit hits before this session: the report counts those since
        self._recompile_hits = recompile_limit_hits()
        # what fused graphs learned (fuse=True): None is the user's cache directory, False none
        cache = default_dir() if options.cache_dir is None else options.cache_dir or None
        self.verdicts = Verdicts(cache, lambda key, message: self.events.warn_once(key, "%s", message))
        # weak: the runners hold their scope (module docstring)
        self._scopes: weakref.WeakValueDictionary[str, RuntimeScope] = weakref.WeakValueDictionary()
        self.report.runtime = self._runtime_figures
        self._note_rank()
        self._lock = threading.Lock()
        # artifact -> the gates one kernel serves its regions through (runtime/gates/kin.py,
        # made by graph_artifacts.py): a fault of the kernel's met at one demotes the others
        self.kin: dict[str, Any] = {}
        for error in self.registry.errors:
            self.events.warn_once(
                f"bundle:{error['bundle']}", "graphdispatch: artifacts: %s rejected (%s): %s",
                error["bundle"], error["reason"], error["message"],
            )
        if options.inductor.given:  # a framework passes them to every backend: said once, never an error
            self.events.warn_once("inductor_keys", "graphdispatch: options hold Inductor settings (%s): %s",
                                  ", ".join(options.inductor.given), _inductor_keys_fate(options.fuse))
        if self.registry.errors and options.strict:
            # an author's CI must fail on a root or bundle that would silently serve nothing
            raise StrictModeError("artifact bundles rejected: " + "; ".join(
                f"{e['bundle']} ({e['reason']}): {e['message']}" for e in self.registry.errors))

    def scope(self, engine: str) -> RuntimeScope:
        """The scope the session's live runners of `engine` share, or a new one when none lives."""
        with self._lock:
            scope = self._scopes.get(engine)
            if scope is None:
                impl = CudaGraphEngine() if engine == "cuda" else HostReplayEngine()
                scope = self._scopes[engine] = RuntimeScope(impl, self.timing, self.events, self.contain)
            return scope

    def _runtime_figures(self) -> dict[str, Any]:
        """Static input buffers are shared by every graph of the session: count them once
        (those live runners hold; none once the session's models are gone)."""
        with self._lock:
            scopes = dict(self._scopes.items())
        return {"static_buffers": {name: {"count": len(s.buffers), "bytes": s.buffers.nbytes}
                                   for name, s in scopes.items()},
                "pools": {name: {"pool_bytes": s.engine.pool_bytes()} for name, s in scopes.items()},
                "dynamo_recompile_limit_hits": recompile_limit_hits() - self._recompile_hits}

    def _note_rank(self) -> None:
        """Record the process's rank while its process group is up (module docstring)."""
        found = process_rank()
        if found is not None:
            self.report.distributed = found

    def write(self) -> None:
        """Write dispatch.json and timing.json (a rank's own names: module docstring). A
        report directory that cannot be written is a warning (once), never a failure of the
        user's compile or run."""
        if self.options.report_dir is None:
            return
        self._note_rank()
        report_name, timing_name = rank_file_names((self.report.distributed or {}).get("rank"))
        try:
            path = self.report.write(self.options.report_dir, report_name)
            write_json_atomic(path.with_name(timing_name), self.timing.to_dict())
        except OSError as exc:
            self.events.warn_once("report_dir", "graphdispatch: cannot write the report to %s: %s",
                                  self.options.report_dir, exc)

    def flush(self) -> None:
        if self.exporter is not None:
            self.exporter.finalize(self.events, self.contain)
        self.write()


def process_rank() -> dict[str, Any] | None:
    """`{rank, world_size, backend}` of this process's default process group, or None
    where torch.distributed is not initialized (a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        backend: str | None = str(dist.get_backend())
    except (RuntimeError, ValueError):  # a group without a backend name still has a rank
        backend = None
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": backend}


def _inductor_keys_fate(fuse: bool | FuseTolerance) -> str:
    if isinstance(fuse, FuseTolerance):
        return ("the tolerance's compile applies each one but its own few (fallback_by_default, triton.cudagraphs, "
                "emulate_precision_casts: bf16 intermediates rounded where eager rounds them); graphs holding "
                "collectives are not fused; each graph's fusion.inductor_keys says which were applied and which "
                "overridden")
    if fuse:
        return ("the fusion compile applies each one the eager-numerics recipe does not set (the recipe's "
                "settings keep eager's bits); graphs holding collectives are not fused; each graph's "
                "fusion.inductor_keys says which were applied and which overridden")
    return ("graphdispatch compiles nothing with Inductor without fuse=True (or mode='max-autotune-no-cudagraphs'): "
            "they change nothing here")


_SESSIONS: dict[Options, Session] = {}
_LATEST: list[Session] = []
_GLOBAL = threading.Lock()


def session_for(options: Options, make_contain: Callable[[bool], Contain]) -> Session:
    """The session of `options` (one per option set), made at its first compile; it is
    the latest session from now on (`latest_report()`)."""
    with _GLOBAL:
        session = _SESSIONS.get(options)
        made = session is None
        if session is None:
            session = _SESSIONS[options] = Session(options, make_contain)
        _LATEST[:] = [session]
        sharing = [s for s in _SESSIONS.values() if s is not session and _same_dir(s, session)] if made else []
    if sharing:  # two option sets, one dispatch.json: the last written would hide the other's calls
        session.events.warn_once(
            "report_dir_shared", "graphdispatch: compiles with different options share report_dir %s: each option "
            "set's session writes dispatch.json over the other's (the file holds whichever wrote last); give each "
            "its own report_dir", options.report_dir)
    return session


def _same_dir(a: Session, b: Session) -> bool:
    if a.options.report_dir is None or b.options.report_dir is None:
        return False
    return os.path.abspath(a.options.report_dir) == os.path.abspath(b.options.report_dir)


def latest_report() -> dict[str, Any] | None:
    """The report of the session that compiled last, as a dict (None before any compile):
    a process compiling with several option sets has a session, and a report, per set."""
    with _GLOBAL:
        session = _LATEST[0] if _LATEST else None
    return session.report.to_dict() if session is not None else None


def flush() -> None:
    """Finalize region exports and write every session's reports now."""
    with _GLOBAL:
        sessions = list(_SESSIONS.values())
    for session in sessions:
        session.flush()


def reset() -> None:
    """Write every session's report (as `flush()` does) and forget every session: a new
    compile starts a fresh session and report. A report that cannot be written is a
    warning, never an error of reset(): the sessions are forgotten all the same. Call
    torch._dynamo.reset() too if compiled code should be dropped."""
    with _GLOBAL:
        sessions = list(_SESSIONS.values())
        _SESSIONS.clear()
        _LATEST.clear()
    # forgotten first: a flush that raises (strict exports) leaves no half-reset state
    _flush_each(sessions, "at reset()")


def _flush_each(sessions: list[Session], when: str) -> None:
    """Flush each session; one whose report or exports cannot be written (OSError) is a
    warning and the others are still written."""
    for session in sessions:
        try:
            session.flush()
        except OSError as exc:  # exports into a directory that vanished must fail neither exit nor reset()
            log.warning("graphdispatch: could not write the report %s: %s", when, exc)


def _flush_at_exit() -> None:
    with _GLOBAL:
        sessions = list(_SESSIONS.values())
    _flush_each(sessions, "at exit")


atexit.register(_flush_at_exit)


def recompile_limit_hits() -> int:
    """Times Dynamo hit its `recompile_limit` in this process, under any backend (read from
    Dynamo's own counters, never changed here): each time, that function's later calls run
    without Dynamo, outside every backend, and reach no report (a static-cache server's
    prefill per prompt length, a sliding-window cache per position: a trial's report held
    60 of 192 forward calls and said nothing of the rest)."""
    from torch._dynamo.utils import counters

    return sum(n for msg, n in counters["unimplemented"].items() if "recompile limit exceeded" in msg.lower())
