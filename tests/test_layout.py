"""The package's imports point down the pipeline (docs/design.md, "Layout").

Each module belongs to a layer; a module may import its own layer and the layers below,
never one above. Read from the source (`ast`), every import, at any depth of the module
(an import inside a function is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "graphdispatch_backend"

# lowest first: what everyone may use, then the pipeline's stages in order, then its entry points
LAYERS: list[tuple[str, ...]] = [
    ("errors", "table", "region", "codegen", "options", "patterns"),
    ("diagnostics",),
    ("artifacts",),
    ("capture",),
    ("passes",),
    ("export",),
    ("fusion",),
    ("runtime", "runtime.cudagraph"),
    ("runtime.call",),
    ("runtime.checks",),
    ("runtime.gates",),
    ("runtime.runner",),
    ("runtime.program",),
    ("session",),
    ("graph_artifacts",),
    ("__init__", "backend", "testing", "examples"),
    ("__main__",),
]


def _layer(module: str) -> int:
    """The layer of `module` (dotted, relative to the package; "" is the package itself)."""
    best, found = -1, None
    name = module or "__init__"
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise AssertionError(f"graphdispatch_backend.{name} belongs to no layer: add it to LAYERS")
    return found


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, module: str) -> set[str]:
    """The package's modules `path` imports (relative to the package)."""
    found = set()
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                prefix = ".".join(["graphdispatch_backend", *[b for b in base if b]])
                names = [f"{prefix}.{node.module}" if node.module else prefix]
            else:
                names = [node.module or ""]
            names += [f"{names[0]}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == "graphdispatch_backend" or name.startswith("graphdispatch_backend."):
                found.add(name.removeprefix("graphdispatch_backend").lstrip("."))
    return found


def test_imports_point_down_the_pipeline():
    modules = _modules()
    upward = []
    for module, path in sorted(modules.items()):
        mine = _layer(module if module != "__init__" else "")
        for target in sorted(_imports(path, module)):
            # `from pkg import name` names a module or an attribute: judge the module it is
            while target and target not in modules and target != "":
                target = target.rsplit(".", 1)[0] if "." in target else ""
            theirs = _layer(target)
            if theirs > mine:
                upward.append(f"{module} (layer {mine}) imports {target or 'the package'} (layer {theirs})")
    assert not upward, "imports that run up the pipeline:\n" + "\n".join(sorted(set(upward)))


def test_every_module_has_a_layer():
    for module in _modules():
        _layer(module if module != "__init__" else "")
