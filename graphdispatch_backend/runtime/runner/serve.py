"""One replay of a captured entry, on the stream the caller will read from.

    caller waits for the last replay's stream   (only when the device's last replay was
                                                 launched on another stream)
    copy-in, replay, copy-out                   (on the caller's stream, in that order)

Work on one stream runs in launch order, so a replay from the stream that made the inputs
and will read the outputs needs no event at all: the common case (one serving stream) pays
none, as cudagraph trees and vLLM, which replay on the current stream. Every replay of a
device follows the one before it, whichever stream that was on: when the caller's stream
is not the one the device's last replay went to, it waits for that stream first (one
event round trip), so two callers on two streams (a server's per-request streams) never
see a copy-in overwrite a static buffer that another replay still reads, nor a replay
overwrite static outputs (or pool memory shared with another graph) before the last
copy-out read them. The device lock (held by the caller) keeps one call's launches
together and `streams.replayed_on` true. The same code runs on CUDA streams and on the
CPU model (cudagraph/streams.py), where a missing wait gives a wrong value.

Outputs: where the streams launch at once (CUDA, ImmediateStreams), each output base is
cloned right after the replay, one op each, unless the graph writes into a pinned input:
then the destinations are allocated first (an allocation failure after the replay would
leave that write done, and the eager answer to the call would do it a second time). The
CPU model queues work that runs later, so there the destinations are always allocated
first and written by the queued copy-out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graphdispatch_backend.diagnostics.timing import Timing
from graphdispatch_backend.runtime.cudagraph.streams import Streams
from graphdispatch_backend.runtime.runner.phase import Capture


def copy_out(capture: Capture, dsts: list[Any], args: Sequence[Any]) -> None:
    capture.outputs.copy_out(dsts)
    capture.inputs.copy_back(args)


def follow(streams: Streams, caller: Any) -> None:
    """Order the caller's next work after the device's last replay, launched on another
    stream (see module docstring): a replay, or a capture's first copy-in into the shared
    buffers (runner/record.py); the caller holds the device lock."""
    last = streams.replayed_on
    if last is not None and caller != last:
        streams.wait(caller, last)
    streams.replayed_on = caller


def serve(capture: Capture, args: Sequence[Any], streams: Streams) -> list[Any]:
    """Copy in, replay and copy out `capture` (a verified entry's, or one being verified);
    the caller holds the device lock."""
    outputs, inputs, graph = capture.outputs, capture.inputs, capture.graph
    caller = streams.current()
    if caller is not streams.replayed_on:
        follow(streams, caller)
    if streams.immediate:  # each call below launches its work now, on the caller's stream
        if outputs.late and not inputs.writes_pinned:
            if inputs.copies:
                inputs.copy_in(args)
            graph.replay()
            dsts = outputs.clones()
        else:
            dsts = outputs.allocate()
            inputs.copy_in(args)
            graph.replay()
            outputs.copy_out(dsts)
        if inputs.backs:
            inputs.copy_back(args)
        return dsts if outputs.plain else outputs.assemble(dsts, args)
    dsts = outputs.allocate()
    streams.launch(inputs.copy_in, args)
    streams.launch(graph.replay)
    streams.launch(copy_out, capture, dsts, args)
    return outputs.assemble(dsts, args)


def serve_timed(capture: Capture, args: Sequence[Any], streams: Streams, timing: Timing) -> list[Any]:
    """`serve` with its phases timed (host time of the launches; `sync` mode synchronizes)."""
    outputs, inputs, graph = capture.outputs, capture.inputs, capture.graph
    start = timing.now()
    caller = streams.current()
    if caller is not streams.replayed_on:
        follow(streams, caller)
    dsts = outputs.allocate()
    streams.launch(inputs.copy_in, args)
    mid = timing.now()
    streams.launch(graph.replay)
    end = timing.now()
    streams.launch(copy_out, capture, dsts, args)
    out = outputs.assemble(dsts, args)
    timing.add("copy_in", mid - start)
    timing.add("replay", end - mid)
    timing.add("unflatten", timing.now() - end)
    return out
