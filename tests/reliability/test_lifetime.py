"""Concurrency and lifetime: threads, long runs, kept references, and what lands on disk.

- 4 threads call one compiled model at once (cuda_graphs="emulate", an artifact
  substituted), from a cold start (the first calls race the compile, the capture and the
  verification): every output equals eager, and the report balances.
- 1000 calls with changing inputs (three shape keys) after warmup: the number of live
  tensors and of live storages does not grow.
- export_regions keeps references to example inputs until flush(); after flush() a weakref
  to such an input dies.
- A run in a fresh process, with its own working directory, HOME and TMPDIR: everything
  graphdispatch writes (reports at compile, at flush() and at exit; region exports; timing)
  lands under report_dir, nothing anywhere else.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import graphdispatch_backend
from graphdispatch_backend.testing import region_entry, write_bundle

EMULATE = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 2}
KERNEL = """
import torch.nn.functional as F

NAMES = {names!r}  # the region report's input order


def forward(*inputs):
    a = dict(zip(NAMES, inputs))
    h = F.gelu(F.linear(a["input0"], a["fc1.weight"], a["fc1.bias"]))
    return F.linear(h, a["fc2.weight"], a["fc2.bias"])
"""


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def make() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def mlp_bundle(root: Path) -> Path:
    """An exact MLP kernel, its manifest written from the region report of `mlp` (as an
    author would), batch size left open."""
    region = region_entry(make(), torch.randn(4, 16), name="mlp", cuda_graphs=False)
    names = [i["name"] for i in region["inputs"]]
    inputs = [{"name": i["name"], "shape": [None, 16] if i["name"] == "input0" else i["shape"], "dtype": i["dtype"]}
              for i in region["inputs"]]
    write_bundle(root / "mlp", "mlp-exact", "mlp", inputs, [{"shape": [None, 16], "dtype": "float32"}],
                 KERNEL.format(names=names))
    return root


def balanced(report: dict) -> None:
    for graph in report["graphs"]:
        cg = graph["cuda_graph"]
        assert graph["calls"] == cg["replays"] + cg["eager_calls"], graph["name"]


def test_the_artifact_serves(tmp_path):
    options = {**EMULATE, "artifacts": str(mlp_bundle(tmp_path))}
    compiled = torch.compile(make(), backend="graphdispatch", options=options)
    with torch.no_grad():
        for _ in range(5):
            compiled(torch.randn(4, 16))
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    (sub,) = graph["substitutions"]
    assert sub["parity"] == "passed" and not sub["demoted"] and graph["cuda_graph"]["replays"] == 2, graph


def test_four_threads_on_one_compiled_model(tmp_path, counts):
    options = {**EMULATE, "artifacts": str(mlp_bundle(tmp_path))}
    model = make()
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    start = threading.Barrier(4)
    errors: list[str] = []
    calls_per_thread = 60

    def worker(index: int) -> None:
        gen = torch.Generator().manual_seed(index)
        start.wait()  # a cold start: the first calls race the compile and the capture
        try:
            with torch.no_grad():
                for call in range(calls_per_thread):
                    x = torch.randn(4, 16, generator=gen)
                    got, want = compiled(x), model(x)
                    if not torch.equal(got, want):
                        errors.append(f"thread {index} call {call}: max abs diff {(got - want).abs().max().item()}")
        except Exception as exc:  # reported below with the thread that raised it
            errors.append(f"thread {index}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[:5]
    report = graphdispatch_backend.latest_report()
    balanced(report)
    assert sum(g["calls"] for g in report["graphs"]) == 4 * calls_per_thread
    assert sum(g["cuda_graph"]["replays"] for g in report["graphs"]) > 0, "the threads never replayed"
    counts["lifetime:thread_calls"] += 4 * calls_per_thread


def live_tensors() -> tuple[int, int]:
    """(live tensor objects, distinct live storages), after a full collection."""
    gc.collect()
    # type(), not isinstance(): isinstance reads __class__, which some deprecated torch objects warn on
    tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and not issubclass(type(o), FakeTensor)]
    storages = set()
    for t in tensors:
        if t.device.type != "meta" and not torch._C._functorch.is_functorch_wrapped_tensor(t):
            storages.add(t.untyped_storage().data_ptr())
    return len(tensors), len(storages)


def test_a_thousand_calls_do_not_grow_live_tensors(tmp_path, counts):
    options = {**EMULATE, "artifacts": str(mlp_bundle(tmp_path))}
    model = make()
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    gen = torch.Generator().manual_seed(0)
    sizes = [4, 8, 12]  # three shape keys: three captures, each with its own buffers

    def inputs() -> Iterator[torch.Tensor]:
        for i in range(10**9):
            x = torch.randn(sizes[i % 3], 16, generator=gen)
            torch._dynamo.mark_dynamic(x, 0)
            yield x

    feed = inputs()
    with torch.no_grad():
        for _ in range(30):  # every shape key warmed, captured and verified
            x = next(feed)
            assert torch.equal(compiled(x), model(x))
        before = live_tensors()
        for _ in range(1000):
            x = next(feed)
            out = compiled(x)
        assert torch.equal(out, model(x))
        del x, out
        after = live_tensors()
    assert after == before, f"live (tensors, storages) grew from {before} to {after} over 1000 calls"
    report = graphdispatch_backend.latest_report()
    balanced(report)
    replays = sum(g["cuda_graph"]["replays"] for g in report["graphs"])
    assert replays >= 1000, [(g["calls"], g["cuda_graph"]["eager_by_reason"]) for g in report["graphs"]]
    counts["lifetime:long_run_calls"] += 1030


def test_export_regions_releases_kept_inputs_at_flush(tmp_path):
    model = make()
    compiled = torch.compile(model, backend="graphdispatch",
                             options={**EMULATE, "export_regions": True, "report_dir": str(tmp_path / "gd_out")})
    x = torch.randn(4, 16)
    with torch.no_grad():
        compiled(x)
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is not None, "the exporter kept no reference: this test would prove nothing"
    graphdispatch_backend.flush()
    gc.collect()
    assert ref() is None, "an input kept for export_regions is still alive after flush()"
    regions = tmp_path / "gd_out" / "regions"
    assert regions.is_dir() and any(regions.iterdir())


ISOLATED = textwrap.dedent('''
    import sys, torch
    import torch.nn.functional as F
    from torch import nn
    import graphdispatch_backend
    from graphdispatch_backend.testing import write_bundle

    artifacts, report_dir = sys.argv[1], sys.argv[2]

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.mlp = nn.LayerNorm(16), Mlp()

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    model = Net().eval()
    options = {"cuda_graphs": "emulate", "warmup": 1, "verify_inputs": 2, "artifacts": artifacts,
               "report_dir": report_dir, "export_regions": True, "timing": "host"}
    compiled = torch.compile(model, backend="graphdispatch", options=options)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 16)
            assert torch.equal(compiled(x), model(x))
    graphdispatch_backend.flush()
    with torch.no_grad():
        compiled(torch.randn(4, 16))  # after flush: the report is written again at exit
    print("ok")
''')


def listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_nothing_is_written_outside_report_dir(tmp_path):
    artifacts = mlp_bundle(tmp_path / "artifacts")
    bundle_files = listing(artifacts)
    cwd, home, tmp = tmp_path / "cwd", tmp_path / "home", tmp_path / "tmp"
    for folder in (cwd, home, tmp):
        folder.mkdir()
    (cwd / "keep.txt").write_text("a file the user had")
    report_dir = cwd / "gd_out"
    script = tmp_path / "run.py"
    script.write_text(ISOLATED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHDISPATCH_", "TORCH_"))}
    env.update(HOME=str(home), TMPDIR=str(tmp), TEMP=str(tmp), TMP=str(tmp), XDG_CACHE_HOME=str(home / ".cache"))
    done = subprocess.run([sys.executable, str(script), str(artifacts), str(report_dir)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    outside = (listing(cwd) - {"keep.txt"}) - {p for p in listing(cwd) if p.startswith("gd_out")}
    assert not outside, f"written into the working directory: {sorted(outside)}"
    assert not listing(home), f"written under HOME: {sorted(listing(home))}"
    assert not listing(tmp), f"written under TMPDIR: {sorted(listing(tmp))}"
    assert listing(artifacts) == bundle_files, "the bundle folder changed (a __pycache__?)"
    written = listing(report_dir)
    assert {"dispatch.json", "timing.json", "regions"} <= written, sorted(written)
    assert not [p for p in written if p.endswith(".tmp")], sorted(written)  # atomic writes left nothing behind
    report = json.loads((report_dir / "dispatch.json").read_text())
    assert report["graphs"][0]["calls"] == 6  # the last call, after flush(), was written at exit
