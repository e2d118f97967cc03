"""Scripts run as processes of their own, forked from a server that imported torch once.

The suite's 2-rank tests (`run_ranks`: `python script RANK WORLD RENDEZVOUS OUT MODE` once
per rank) and its bench smokes (`run_script`) start processes. Each is forked from a server
process that imported torch, Dynamo, aot, Inductor's compile_fx and graphdispatch once (per
test process and environment), instead of starting Python and importing them: that start,
with the modules a process's first compile loads, was 3 s of CPU a process (6 s of each
2-rank test of 6-20 s). A forked process is still one of its own (its own memory, Dynamo
state, process group and exit), its `__main__` the script (run by `runpy`, `sys.path[0]` the
script's folder), and it exits as Python exits for what it can see (atexit handlers: the
report's write at exit), then at once. The server holds no thread and has drawn no random
number when it forks; its environment is the process's (the test process's, with what the
caller sets), so what torch and graphdispatch read from it at import (and the warnings
filters PYTHONWARNINGS sets at startup) is what a fresh process reads.

Run as a script, this file is the server: one JSON request per line on stdin
(`{"argv", "env", "cwd", "log"}`: fork a process with that environment, answer its pid;
`{"wait": pid}`: answer its exit status once it exits).
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
    """A fork server of this test process for one environment, started at its first use; it
    exits when this process closes its stdin (at this process's exit)."""

    def __init__(self, env: dict[str, str]) -> None:
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
            raise RuntimeError(f"the fork server exited ({self.proc.wait()})")
        return json.loads(line)


_servers: dict[frozenset[tuple[str, str]], _Server] = {}
# changes between tests (pytest's): each process is given it, and no server is started for it
VOLATILE = ("PYTEST_CURRENT_TEST",)


def _server_for(env: dict[str, str]) -> _Server:
    key = frozenset((k, v) for k, v in env.items() if k not in VOLATILE)
    server = _servers.get(key)
    if server is None or server.proc.poll() is not None:
        server = _servers[key] = _Server(dict(key))
    return server


def _spawn(server: _Server, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> int:
    answer = server.ask({"argv": argv, "env": env, "cwd": str(cwd), "log": str(log)})
    assert answer is not None
    return answer["pid"]


def _wait(server: _Server, pids: list[int], what: str, timeout_s: float) -> list[int]:
    """The exit status of each of `pids`, in order. One still running after `timeout_s` (from
    when its wait began) kills them all and fails: a hang guard far above a run's seconds,
    which a loaded machine multiplies (a 2-rank test of 10-18 s quiet ran 8x slower at
    load 14), not a time limit."""
    codes = []
    for i, pid in enumerate(pids):
        status = server.ask({"wait": pid}, timeout_s)
        if status is None:
            for other in pids[i:]:
                _kill(other)
            server.answer()  # the wait, answered now that it is gone
            for other in pids[i + 1:]:
                server.ask({"wait": other})  # reaped: nothing is left behind
            raise AssertionError(f"{what}: did not finish in {timeout_s} s")
        codes.append(status["returncode"])
    return codes


def run_ranks(script: Path, folder: Path, mode: str, world: int = 2, timeout_s: float = 900) -> list[RankRun]:
    """Run `python script RANK WORLD RENDEZVOUS OUT MODE` once per rank, each a process with
    one torch thread and no GRAPHDISPATCH_* variable (RANK, WORLD_SIZE and MASTER_ADDR set
    for torch.distributed); the rendezvous file, each rank's OUT and its log live in
    `folder`. A rank still running after `timeout_s` (collectives out of step) kills them
    all and fails (`_wait`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHDISPATCH_")}
    env.update(WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    server = _server_for(env)
    ranks = [(folder / f"rank{rank}.json", folder / f"rank{rank}.log") for rank in range(world)]
    pids = [_spawn(server, [str(script), str(rank), str(world), str(folder / "rendezvous"), str(out), mode],
                   {**env, "RANK": str(rank)}, folder, log) for rank, (out, log) in enumerate(ranks)]
    codes = _wait(server, pids, f"{mode}: a rank (collectives out of step?)", timeout_s)
    return [RankRun(code, log.read_text(errors="replace")[-4000:], out) for code, (out, log) in zip(codes, ranks)]


def run_script(argv: list[str], cwd: Path, env: dict[str, str], log: Path, timeout_s: float) -> tuple[int, str]:
    """`python *argv` in `cwd` with environment `env`, its output into `log`: its exit status
    and output. Still running after `timeout_s`: killed, and an AssertionError (`_wait`)."""
    server = _server_for(env)
    (code,) = _wait(server, [_spawn(server, argv, env, cwd, log)], " ".join(argv), timeout_s)
    return code, log.read_text(errors="replace")


def _kill(pid: int) -> None:
    """The process and every process it started (its group: `_child`)."""
    with contextlib.suppress(ProcessLookupError):  # exited already
        os.killpg(pid, signal.SIGKILL)


# -- the server ------------------------------------------------------------------------------------

def _child(request: dict[str, Any]) -> None:
    """In the forked child: the script as `__main__`, its output into its log, in a process
    group of its own (a hang guard kills what it started too); exits as Python exits for
    what the script can see."""
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
    os.setpgid(0, 0)
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
    except BaseException:  # a failure, said in the log as Python says it
        traceback.print_exc()
        code = 1
    # what Python's exit runs that a script can see (atexit handlers: the report's write at
    # exit), then out at once: tearing the server's modules down, page by page copied on
    # write, took a second a process
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.compile_fx",
           "graphdispatch_backend")  # imported once for every process: torch, and what a first compile loads


def _serve() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    gc.freeze()  # the modules' objects: never traversed by a child's collections, never copied for them
    for line in sys.stdin:
        request = json.loads(line)
        if "wait" in request:
            _, status = os.waitpid(request["wait"], 0)
            answer = {"returncode": os.waitstatus_to_exitcode(status)}
        else:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(request)
            answer = {"pid": pid}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
