"""Several ranks of a script, each a process of its own (the 2-rank gloo tests).

`run_ranks` runs `python script RANK WORLD RENDEZVOUS OUT MODE` once per rank. The ranks
are forked from a server process that imported torch, torch.distributed and graphdispatch
once (per test process), instead of each starting Python and importing them: that start,
with the modules Dynamo and aot load at a process's first compile, was 3 s of CPU per rank,
6 s of the 6-20 s of each of the suite's 2-rank tests. A forked rank is still a process of
its own (its own memory, Dynamo state, process group and exit), its `__main__` the script
(run by `runpy`), and it exits as a process does (atexit handlers, as the report's write
at exit needs). The server holds no thread and has drawn no random number when it forks;
its environment is the ranks' (the test process's, less GRAPHDISPATCH_*, one torch
thread), so what torch and graphdispatch read from it at import is what a fresh rank reads.

Run as a script, this file is the server: one JSON request per line on stdin
(`{"argv", "env", "cwd", "log"}`: fork a rank with that environment, answer its pid; `{"wait": pid}`: answer its
exit status once it exits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

SERVER = Path(__file__).resolve()


@dataclasses.dataclass
class RankRun:
    """One rank: its exit status, the tail of its output, and the file it was told to write
    its results to."""

    returncode: int
    log: str
    out: Path


class _Server:
    """The fork server of this test process, started at its first use and restarted if the
    ranks' environment changed; it exits when this process closes its stdin."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc = subprocess.Popen([sys.executable, str(SERVER)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, request: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any] | None:
        """Send `request`; its answer, or None if none came within `timeout_s`."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout_s)

    def answer(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        if timeout_s is not None and not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the rank server exited ({self.proc.wait()})")
        return json.loads(line)


_server: list[_Server] = []


# changes between tests (pytest's): each rank is given it, and no server is started for it
VOLATILE = ("PYTEST_CURRENT_TEST",)


def _server_for(env: dict[str, str]) -> _Server:
    env = {k: v for k, v in env.items() if k not in VOLATILE}
    if _server and (_server[0].env != env or _server[0].proc.poll() is not None):
        _server.pop().proc.kill()
    if not _server:
        _server.append(_Server(env))
    return _server[0]


def run_ranks(script: Path, folder: Path, mode: str, world: int = 2, timeout_s: float = 900) -> list[RankRun]:
    """Run `python script RANK WORLD RENDEZVOUS OUT MODE` once per rank, each a process with
    one torch thread and no GRAPHDISPATCH_* variable (RANK, WORLD_SIZE and MASTER_ADDR set
    for torch.distributed); the rendezvous file, each rank's OUT and its log live in
    `folder`. A rank still running after `timeout_s` (collectives out of step) kills them
    all and fails: a hang guard far above a run's seconds, which a loaded machine
    multiplies (a 2-rank test of 10-18 s quiet ran 8x slower at load 14), not a time limit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHDISPATCH_")}
    env.update(WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    server = _server_for(env)
    ranks = []
    for rank in range(world):
        out, log = folder / f"rank{rank}.json", folder / f"rank{rank}.log"
        argv = [str(script), str(rank), str(world), str(folder / "rendezvous"), str(out), mode]
        answer = server.ask({"argv": argv, "env": {**env, "RANK": str(rank)}, "cwd": str(folder), "log": str(log)})
        assert answer is not None
        ranks.append((answer["pid"], out, log))
    runs = []
    for pid, out, log in ranks:
        status = server.ask({"wait": pid}, timeout_s)
        if status is None:
            for other, _, _ in ranks:
                _kill(other)
            server.answer()  # the wait, answered now that the rank is gone
            for other, _, _ in ranks[len(runs) + 1:]:
                server.ask({"wait": other})  # reaped: no rank is left behind
            raise AssertionError(f"{mode}: a rank did not finish in {timeout_s} s (collectives out of step?)")
        runs.append(RankRun(status["returncode"], log.read_text(errors="replace")[-4000:], out))
    return runs


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited already
        os.kill(pid, signal.SIGKILL)


# -- the server ------------------------------------------------------------------------------------

def _rank(request: dict[str, Any]) -> None:
    """In the forked child: the rank's script as `__main__`, its output into its log; exits
    as Python exits (SystemExit unwinds the server's loop: atexit handlers run)."""
    import atexit
    import runpy
    import traceback

    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    sys.path[0] = str(Path(sys.argv[0]).resolve().parent)  # as `python script` puts it
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:  # as Python exits on it: a number, None (0), or a message (1)
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:  # a rank's failure, said in its log as Python says it
        traceback.print_exc()
        code = 1
    # what Python's exit runs that a rank can see (atexit handlers: the report's write at
    # exit), then out at once: tearing the server's modules down, page by page copied on
    # write, took a second a rank
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.compile_fx",
           "graphdispatch_backend")  # imported once for every rank: torch, and what a first compile loads


def _serve() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    gc.freeze()  # the modules' objects: never traversed by a rank's collections, never copied for them
    for line in sys.stdin:
        request = json.loads(line)
        if "wait" in request:
            _, status = os.waitpid(request["wait"], 0)
            answer = {"returncode": os.waitstatus_to_exitcode(status)}
        else:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _rank(request)
            answer = {"pid": pid}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
