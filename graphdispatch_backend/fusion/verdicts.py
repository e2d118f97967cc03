"""The verdict cache: what fused graphs learned to keep as ATen calls, kept on disk.

A check that finds an op whose fused result differs from eager keeps that op as an ATen
call for that graph (runtime/program/fused.py). The verdict is written here twice:
- per graph, one file keyed by the graph's code and input layouts, torch's version, the
  device (and its CPU capability or GPU name: kernels differ by ISA) and the recipe, so a
  restarted process starts that graph with those ops unfused (`why: cache`);
- per device and recipe, one file of ops (`ops-*.json`), each with the graph and call it
  was learned at, so every later graph on this device and recipe that holds the op keeps it
  as an ATen call from its first call (`why: device`): an op is isolated once per machine,
  not once per graph. The same set is kept in memory for the session, so with no folder
  (`cache_dir=False`) the graphs of one session still learn from each other.

The cache only ever adds ATen calls: it never lets a check be skipped, and a graph that
starts from it is checked on the same schedule as any other. What it holds is data, never
code. A file that is not one of ours (corrupt, truncated, another format, torch version,
recipe or key) is ignored with one warning; writes go to a temporary file in the same
folder and replace the old one (a reader sees the old file or the new one), and a write
merges with what another process wrote meanwhile, so two processes learning at once lose
no verdict and corrupt nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

FORMAT = "graphdispatch-fusion-verdict"
OPS_FORMAT = "graphdispatch-fusion-op-verdicts"
VERSION = 1


def default_dir() -> Path:
    """Under the user's cache directory, beside other tools' (XDG), as Inductor keeps its own."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "graphdispatch"


def device_identity(device_type: str) -> str:
    """The device as kernels see it: a CPU by its vector ISA, a GPU by its name."""
    if device_type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name()}"
    if device_type == "cpu":
        return f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    return device_type


def graph_key(codes: Sequence[str], device: str, recipe_id: str) -> str:
    """A graph's key: its units' code and input layouts, torch's version, device and recipe."""
    text = json.dumps([list(codes), torch.__version__, device, recipe_id])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class Verdicts:
    """One cache folder (None: nothing is read or written)."""

    def __init__(self, directory: str | os.PathLike[str] | None, warn: Callable[[str, str], None]) -> None:
        self.directory = Path(directory) / "fusion" if directory is not None else None
        self._warn = warn  # (key, message): logged once per key
        self._lock = threading.Lock()
        self._ops: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}  # (device, recipe) -> op -> entry

    def path(self, key: str) -> Path | None:
        return self.directory / f"{key}.json" if self.directory is not None else None

    def load(self, key: str, device: str, recipe_id: str) -> dict[str, Any] | None:
        """The verdict stored for `key`, or None (none, or one that is not ours: warned once)."""
        path = self.path(key)
        if path is None or not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            self._warn(f"verdict:{path}", f"graphdispatch: ignoring the fusion verdict {path}: unreadable ({exc})")
            return None
        problem = _foreign(entry, key, device, recipe_id)
        if problem is not None:
            self._warn(f"verdict:{path}", f"graphdispatch: ignoring the fusion verdict {path}: {problem}")
            return None
        return entry

    def save(self, key: str, device: str, recipe_id: str, keep: Sequence[dict[str, Any]], gave_up: bool) -> None:
        """Merge `keep` (one dict per op: op, at_call, detail) into the stored verdict and
        replace the file atomically. A folder that cannot be written is warned about once."""
        path = self.path(key)
        if path is None:
            return
        with self._lock:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with _folder_lock(path.parent):
                    self._merge(path, key, device, recipe_id, keep, gave_up)
            except OSError as exc:
                self._warn(f"verdict-write:{self.directory}",
                           f"graphdispatch: cannot write fusion verdicts to {self.directory}: {exc}")

    def _merge(self, path: Path, key: str, device: str, recipe_id: str, keep: Sequence[dict[str, Any]],
               gave_up: bool) -> None:
        stored = self.load(key, device, recipe_id) or {}
        ops = {k["op"]: k for k in stored.get("keep", [])}
        for k in keep:
            ops.setdefault(k["op"], dict(k))
        entry = {"format": FORMAT, "version": VERSION, "torch": torch.__version__, "device": device,
                 "recipe": recipe_id, "key": key, "gave_up": bool(gave_up or stored.get("gave_up")),
                 "keep": sorted(ops.values(), key=lambda k: k["op"])}
        _write_atomic(path, json.dumps(entry, indent=1, sort_keys=True) + "\n")


    # -- per device and recipe: the ops any graph learned --------------------------------
    def ops_path(self, device: str, recipe_id: str) -> Path | None:
        if self.directory is None:
            return None
        text = json.dumps([torch.__version__, device, recipe_id])
        return self.directory / f"ops-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"

    def load_ops(self, device: str, recipe_id: str) -> dict[str, dict[str, Any]]:
        """op -> {op, graph, key, at_call, detail}: what graphs on this device and recipe
        learned, in this session or (from the folder) before it."""
        with self._lock:
            known = self._ops.setdefault((device, recipe_id), {})
            for entry in self._read_ops(device, recipe_id):
                known.setdefault(entry["op"], entry)
            return dict(known)

    def save_ops(self, device: str, recipe_id: str, learned: Sequence[dict[str, Any]]) -> None:
        """Add `learned` (one dict per op: op, graph, key, at_call, detail) to the session's
        set and merge it into the folder's file, atomically."""
        with self._lock:
            known = self._ops.setdefault((device, recipe_id), {})
            for entry in learned:
                known.setdefault(entry["op"], dict(entry))
            path = self.ops_path(device, recipe_id)
            if path is None:
                return
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with _folder_lock(path.parent):
                    ops = {e["op"]: e for e in self._read_ops(device, recipe_id)}
                    for entry in learned:
                        ops.setdefault(entry["op"], dict(entry))
                    text = json.dumps({"format": OPS_FORMAT, "version": VERSION, "torch": torch.__version__,
                                       "device": device, "recipe": recipe_id,
                                       "ops": sorted(ops.values(), key=lambda e: e["op"])}, indent=1, sort_keys=True)
                    _write_atomic(path, text + "\n")
            except OSError as exc:
                self._warn(f"verdict-write:{self.directory}",
                           f"graphdispatch: cannot write fusion verdicts to {self.directory}: {exc}")

    def _read_ops(self, device: str, recipe_id: str) -> list[dict[str, Any]]:
        path = self.ops_path(device, recipe_id)
        if path is None or not path.is_file():
            return []
        try:
            entry = json.loads(path.read_text("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            self._warn(f"verdict:{path}", f"graphdispatch: ignoring the fusion op verdicts {path}: unreadable ({exc})")
            return []
        problem = _foreign_ops(entry, device, recipe_id)
        if problem is not None:
            self._warn(f"verdict:{path}", f"graphdispatch: ignoring the fusion op verdicts {path}: {problem}")
            return []
        return entry["ops"]


def _foreign_ops(entry: Any, device: str, recipe_id: str) -> str | None:
    """Why `entry` is not the op verdicts of this torch, device and recipe (None: it is)."""
    if not isinstance(entry, dict) or entry.get("format") != OPS_FORMAT or entry.get("version") != VERSION:
        return "not graphdispatch fusion op verdicts of this format"
    for field, want in (("torch", torch.__version__), ("device", device), ("recipe", recipe_id)):
        if entry.get(field) != want:
            return f"its {field} is {entry.get(field)!r}, not {want!r}"
    ops = entry.get("ops")
    if not isinstance(ops, list) or not all(isinstance(e, dict) and isinstance(e.get("op"), str) for e in ops):
        return "its list of ops is malformed"
    return None


def _foreign(entry: Any, key: str, device: str, recipe_id: str) -> str | None:
    """Why `entry` is not a verdict of this graph, torch, device and recipe (None: it is)."""
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("version") != VERSION:
        return "not a graphdispatch fusion verdict of this format"
    for field, want in (("torch", torch.__version__), ("device", device), ("recipe", recipe_id), ("key", key)):
        if entry.get(field) != want:
            return f"its {field} is {entry.get(field)!r}, not {want!r}"
    keep = entry.get("keep")
    if not isinstance(keep, list) or not all(isinstance(k, dict) and isinstance(k.get("op"), str) for k in keep):
        return "its list of kept ops is malformed"
    if not isinstance(entry.get("gave_up"), bool):
        return "its gave_up field is malformed"
    return None


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """Writers in other processes wait while one merges (POSIX advisory lock; elsewhere the
    atomic replace alone: a concurrent merge may lose the other's verdict, never corrupt)."""
    if importlib.util.find_spec("fcntl") is None:
        yield
        return
    import fcntl

    with open(folder / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
