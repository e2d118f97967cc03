"""`python -m graphdispatch_backend demo`: the built-in example, end to end.

Compiles the TinyDiT with the two example bundles (one passes bitwise parity, one fails
it on purpose; `--fuse`: with fusion), runs a few denoising steps under bf16 autocast next
to eager, and prints
what matched, what was demoted or declined and why, the call accounting, and whether the
compiled output is bitwise equal to eager.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import graphdispatch_backend
from graphdispatch_backend.artifacts.bundle import verify_bundle
from graphdispatch_backend.examples.dit import denoise, example_inputs, make_model

BUNDLES = Path(__file__).with_name("bundles")


def stage_bundles(target: Path) -> Path:
    """Copy the example bundles (declared files only) to `target`. An installed package
    may hold `__pycache__` next to them, which the registry rightly refuses."""
    for folder in sorted(p for p in BUNDLES.iterdir() if (p / "artifact.json").exists()):
        manifest = verify_bundle(folder).manifest if not (folder / "__pycache__").exists() else None
        dest = target / folder.name
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / "artifact.json", dest / "artifact.json")
        names = [f.path for f in manifest.files] if manifest else [p.name for p in folder.glob("*.py")]
        for name in names:
            shutil.copyfile(folder / name, dest / name)
    return target


def run(report_dir: str = "gd_out", steps: int = 8, cuda_graphs: Any = None, fuse: bool = False) -> int:
    mode = cuda_graphs if cuda_graphs is not None else ("auto" if torch.cuda.is_available() else "emulate")
    device = "cuda" if torch.cuda.is_available() and mode != "emulate" else "cpu"
    print(f"graphdispatch demo: TinyDiT, {steps} denoising steps, bf16 autocast on {device}, cuda_graphs={mode!r}"
          + (", fuse=True" if fuse else ""))
    with tempfile.TemporaryDirectory(prefix="gd_bundles_") as tmp:
        roots = stage_bundles(Path(tmp))
        model = make_model().to(device)
        x, _ = example_inputs()
        x = x.to(device)
        options = {"artifacts": str(roots), "cuda_graphs": mode, "report_dir": report_dir, "fuse": fuse}
        compiled = torch.compile(model, backend="graphdispatch", options=options)
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            ours = denoise(compiled, x, steps)
            reference = denoise(model, x, steps)
        elapsed = time.perf_counter() - start
    graphdispatch_backend.flush()
    report = graphdispatch_backend.latest_report() or {}
    equal = all(torch.equal(a, b) for a, b in zip(ours, reference))
    _summary(report, elapsed)
    print(f"\ncompiled output bitwise equal to eager on all {steps} steps: {'YES' if equal else 'NO'}")
    print(f"report: {Path(report_dir) / 'dispatch.json'}"
          f"  (render: python -m graphdispatch_backend report {report_dir})")
    return 0 if equal else 1


def _summary(report: dict[str, Any], elapsed: float) -> None:
    registry = report.get("registry", {})
    print(f"\nartifacts loaded: {', '.join(registry.get('loaded', [])) or 'none'}"
          + (f"; rejected bundles: {len(registry['errors'])}" if registry.get("errors") else ""))
    for graph in report.get("graphs", []):
        cg = graph["cuda_graph"]
        print(f"\n{graph['name']} ({graph['kind']}, {graph['nodes']} nodes, {len(graph['regions'])} regions, "
              f"compiled+ran in {elapsed:.1f}s)")
        for sub in graph["substitutions"]:
            verdict = f"parity {sub['parity']}"
            if sub["demoted"]:
                verdict += f", DEMOTED to native ({sub['reason']}: {sub['detail']})"
            print(f"  {sub['region']:<16} <- {sub['artifact']:<20} {verdict}; "
                  f"served {sub['calls']} eager calls + {sub.get('replays', 0)} replays")
        rejected = [(r["name"], j) for r in graph["regions"] for j in r.get("rejections", [])]
        for name, rej in rejected[:5]:
            print(f"  {name:<16} x  {rej['artifact']:<20} rejected: {rej['reason']} ({rej['detail']})")
        print(f"  cuda graph ({cg['mode']}): state {cg['state']}, captures {cg['captures']}, replays {cg['replays']}, "
              f"eager {cg['eager_calls']} {cg['eager_by_reason']}")
        for reason, detail in cg["decline_details"].items():
            print(f"  declined: {reason}: {detail}")
        fusion = graph.get("fusion")
        if fusion:
            learned = [k["op"] for k in fusion.get("kept", []) if k["why"] != "recipe"]
            recipe = [k["op"] for k in fusion.get("kept", []) if k["why"] == "recipe"]
            print(f"  fusion: {fusion['status']}" + (f" ({fusion['detail']})" if fusion.get("detail") else "")
                  + (f", {fusion.get('kernels', 0)} Inductor kernels, {sum(fusion.get('fused_ops', {}).values())} "
                     f"nodes fused; left to ATen: {len(recipe)} ops by the recipe, "
                     f"{', '.join(learned) or 'none'} learned" if fusion["status"] == "fused" else ""))
        lowering = graph.get("lowering_check", {})
        print(f"  lowered graph vs eager (Dynamo graph run eagerly, bit for bit): {lowering.get('status')}"
              + (f" ({lowering['detail']})" if lowering.get("detail") else ""))
        ok = graph["calls"] == cg["replays"] + cg["eager_calls"]
        print(f"  calls {graph['calls']} == replays {cg['replays']} + eager {cg['eager_calls']}: {ok}")
