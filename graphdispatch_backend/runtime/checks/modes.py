"""modes: how a check asks the artifact gates that run inside it to answer.

A check runs the lowered graph, whose artifact calls go through their gates
(runtime/gates/gate.py). Two modes, thread-local, set by the checks and read by the gates:
`judging` (culprit isolation, runtime/checks/isolate.py: every gate judges its artifact
beside the native region on these inputs and answers natively) and `native_regions` (the
eager check, runtime/checks/eager_check.py: artifacts with a tolerance answer natively, as
the whole graph is compared bit for bit). They live here, below the gates, so that the
checks never import the gates they steer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class _Reference(threading.local):
    # class defaults: read by every gate call, and a missing thread-local attribute costs a
    # swallowed AttributeError per read (runtime/cudagraph/engine.py `_Recording`)
    judging: str | None = None
    on = False


_reference = _Reference()


def judging_call() -> str | None:
    """The call being judged on this thread, or None."""
    return _reference.judging


def natively() -> bool:
    """Whether gates of artifacts with a tolerance answer natively on this thread."""
    return _reference.on


@contextlib.contextmanager
def judging(call: str) -> Iterator[None]:
    """Inside this block every gate that runs judges its artifact beside the native region
    on these inputs (a demotion names `call`, and the inputs), and answers natively: the
    eager check's culprit isolation (runtime/checks/eager_check.py) runs the lowered graph so."""
    _reference.judging = call
    try:
        yield
    finally:
        _reference.judging = None


@contextlib.contextmanager
def native_regions() -> Iterator[None]:
    """Inside this block, gates of artifacts with a tolerance (allclose parity) answer with
    their native region: the eager check (runtime/checks/eager_check.py) compares the whole graph
    with eager bit for bit, which such an artifact is not meant to be. A bitwise artifact
    that passed its gate has the native bits, so it serves as usual."""
    _reference.on = True
    try:
        yield
    finally:
        _reference.on = False
