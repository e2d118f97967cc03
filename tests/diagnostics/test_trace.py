"""With TORCH_TRACE set, graphdispatch's decisions are structured trace events in the same
files as Dynamo's own, so tlparse users see them.

torch 2.13 writes one `dedicated_log_torch_trace_*.log` per process: each record is a
glog-style line `V<date> <time> <pid> <file>:<line>] {json metadata}`, followed by its
payload as tab-indented lines when the metadata has `has_payload`. Our events are
`{"artifact": {"name": "graphdispatch_<kind>", "encoding": "json"}, ...}` with a JSON payload.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn

    from graphdispatch_backend.testing import Stack

    torch.manual_seed(0)
    model = Stack(act=nn.GELU).eval()  # blocks.0.mlp, blocks.1.mlp
    options = {"artifacts": sys.argv[1], "cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 1}
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(compiled(x), model(x))
""")


def _records(trace_dir: Path) -> list[tuple[dict, str]]:
    """(metadata, payload) of every record in every trace file of the directory."""
    records: list[tuple[dict, list[str]]] = []
    for path in sorted(trace_dir.iterdir()):
        for line in path.read_text("utf-8").splitlines():
            if line.startswith("\t"):
                if records:
                    records[-1][1].append(line[1:])
                continue
            head, sep, body = line.partition("] ")
            if not sep or not body.startswith("{"):
                continue
            records.append((json.loads(body), []))
    return [(meta, "\n".join(payload)) for meta, payload in records]


def test_trace_holds_graphdispatch_events_next_to_dynamos(tmp_path, make_bundle):
    make_bundle("mlp-exact", "exact", module="blocks.0.mlp")
    root = make_bundle("mlp-off", "off", module="blocks.1.mlp")
    trace_dir = tmp_path / "trace"
    env = {**os.environ, "TORCH_TRACE": str(trace_dir)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(root)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stderr
    assert trace_dir.is_dir() and any(trace_dir.iterdir()), "TORCH_TRACE wrote no file"
    records = _records(trace_dir)
    kinds = {next(iter(meta)) for meta, _ in records}
    assert {"dynamo_start", "dynamo_output_graph"} <= kinds  # Dynamo's own events, in the same file

    ours: dict[str, list[tuple[dict, dict]]] = {}
    for meta, payload in records:
        name = meta.get("artifact", {}).get("name", "")
        if name.startswith("graphdispatch_"):
            assert meta["artifact"]["encoding"] == "json"
            ours.setdefault(name, []).append((meta, json.loads(payload)))
    assert {"graphdispatch_compile", "graphdispatch_substitution", "graphdispatch_parity",
            "graphdispatch_demotion"} <= set(ours), sorted(ours)

    ((compile_meta, compile_event),) = ours["graphdispatch_compile"]
    # emitted while Dynamo compiled frame 0: tlparse files it under that compile
    assert compile_meta["frame_id"] == 0 and compile_meta["frame_compile_id"] == 0
    assert compile_event["graph"] == "graph_0" and compile_event["substitutions"] == 2
    assert compile_event["cuda_graph"] == "host" and compile_event["kind"] == "inference"

    subs = sorted((e["region"], e["artifact"]) for _, e in ours["graphdispatch_substitution"])
    assert subs == [("blocks.0.mlp", "mlp-exact"), ("blocks.1.mlp", "mlp-off")]
    parity = [e for _, e in ours["graphdispatch_parity"]]
    assert {"region": "blocks.0.mlp", "artifact": "mlp-exact", "verdict": "passed", "mode": "bitwise"} in parity
    ((_, demotion),) = ours["graphdispatch_demotion"]
    assert demotion["artifact"] == "mlp-off" and demotion["reason"] == "parity" and "bits differ" in demotion["detail"]

