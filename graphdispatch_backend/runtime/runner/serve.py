"""One replay of a captured entry, ordered on the device's streams.

    outputs allocated            (caller's stream; before any side effect)
    side waits for caller        (the inputs the caller produced are ready)
    on side: copy-in, replay, copy-out (clones, and mutated moving inputs copied back)
    caller waits for side        (the caller reads the outputs after the clones ran)

Every replay of a device goes through its one side stream, so two callers on two streams
(a server's per-request streams) never see a copy-in overwrite a static buffer that
another replay still reads, nor a replay overwrite static outputs before the last clone
read them; the device lock (held by the caller) keeps one call's launches together. The
same code runs on CUDA streams and on the CPU model (cudagraph/streams.py), where a
missing wait gives a wrong value. cudagraph trees replay on the caller's stream under a
single-threaded tree per thread; vLLM replays on the current stream and trusts one caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.runtime.cudagraph.streams import Streams
from graphdispatch_backend.runtime.runner.entry import Entry


def copy_out(entry: Entry, dsts: list[Any], args: Sequence[Any]) -> None:
    assert entry.outputs is not None and entry.inputs is not None
    entry.outputs.copy_out(dsts)
    entry.inputs.copy_back(args)


def serve(entry: Entry, args: Sequence[Any], streams: Streams) -> list[Any]:
    """Copy in, replay and copy out; the caller holds the device lock."""
    outputs, inputs, graph = entry.outputs, entry.inputs, entry.graph
    assert outputs is not None and inputs is not None and graph is not None
    dsts = outputs.allocate()
    caller, side = streams.current(), streams.side()
    streams.wait(side, caller)
    with streams.on(side):
        streams.launch(inputs.copy_in, args)
        streams.launch(graph.replay)
        streams.launch(copy_out, entry, dsts, args)
    streams.wait(caller, side)
    return outputs.assemble(dsts, args)


def serve_timed(entry: Entry, args: Sequence[Any], streams: Streams, timing: Timing) -> list[Any]:
    """`serve` with its phases timed (host time of the launches; `sync` mode synchronizes)."""
    outputs, inputs, graph = entry.outputs, entry.inputs, entry.graph
    assert outputs is not None and inputs is not None and graph is not None
    start = timing.now()
    dsts = outputs.allocate()
    caller, side = streams.current(), streams.side()
    streams.wait(side, caller)
    with streams.on(side):
        streams.launch(inputs.copy_in, args)
        mid = timing.now()
        streams.launch(graph.replay)
        end = timing.now()
        streams.launch(copy_out, entry, dsts, args)
    streams.wait(caller, side)
    out = outputs.assemble(dsts, args)
    timing.add("copy_in", mid - start)
    timing.add("replay", end - mid)
    timing.add("unflatten", timing.now() - end)
    return out
