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
    ("errors", "table", "region", "codegen", "options", "inductor_options", "patterns"),
    ("diagnostics",),
    ("artifacts",),
    ("capture",),
    ("passes",),
    ("export",),
    ("fusion",),
    ("plan",),  # the compile-side plan: pure, never the runtime
    ("runtime", "runtime.cudagraph"),
    ("runtime.call",),
    ("runtime.checks",),
    ("runtime.gates",),
    ("runtime.runner",),
    ("runtime.program",),
    ("session",),
    ("graph_artifacts",),
    ("__init__", "backend", "assemble", "testing", "examples"),
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


def _classes(path: Path) -> list[ast.ClassDef]:
    return [node for node in ast.walk(ast.parse(path.read_text("utf-8"))) if isinstance(node, ast.ClassDef)]


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [ast.unparse(base) for base in cls.bases]


def test_the_runtime_composes_objects_and_mixes_in_no_class():
    """No runtime class takes its methods from two classes (an enum's value type aside), and
    GraphRunner composes its parts: it derives from nothing but object."""
    mixed = []
    for module, path in sorted(_modules().items()):
        if not module.startswith("runtime"):
            continue
        for cls in _classes(path):
            bases = [b for b in _base_names(cls) if b not in ("str", "int", "enum.Enum", "enum.IntEnum")]
            if len(bases) > 1 or any(b.endswith(("Mixin", "HotPath", "Publish", "Transitions")) for b in bases):
                mixed.append(f"{module}.{cls.name}({', '.join(_base_names(cls))})")
            if cls.name == "GraphRunner" and bases:
                mixed.append(f"{module}.GraphRunner derives from {', '.join(bases)}")
    assert not mixed, "classes mixed together:\n" + "\n".join(mixed)


def test_the_runners_parts_never_import_the_runner():
    """The parts answer GraphRunner and never call back into it (runtime/runner/runner.py's docstring)."""
    runner = PACKAGE / "runtime" / "runner"
    the_runner = ("runtime.runner.runner", "runtime.runner.GraphRunner")
    back = [path.name for path in sorted(runner.glob("*.py"))
            if path.name not in ("runner.py", "__init__.py")
            and any(t in the_runner or t.startswith("runtime.runner.runner.")
                    for t in _imports(path, f"runtime.runner.{path.stem}"))]
    assert not back, f"runner parts that import the runner: {back}"


def test_a_module_past_400_lines_says_why():
    """A module grows past about 400 lines only with a reason in its docstring (one that
    says '400 lines')."""
    long = []
    for module, path in sorted(_modules().items()):
        text = path.read_text("utf-8")
        if text.count("\n") > 400 and "400 lines" not in " ".join((ast.get_docstring(ast.parse(text)) or "").split()):
            long.append(f"{module}: {text.count(chr(10))} lines")
    assert not long, "modules past 400 lines that do not say why:\n" + "\n".join(long)


def _phase_writes(path: Path) -> list[int]:
    """Lines of `path` that assign an attribute named `phase` (`entry.phase = ...`, in a
    tuple assignment too, or augmented)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in ast.walk(target)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Attribute) and t.attr == "phase" for t in targets):
            lines.append(node.lineno)
    return lines


def test_an_entrys_phase_is_assigned_in_one_file():
    """A shape key's phase (runtime/runner/phase.py) changes only through the runner's
    Transitions (runtime/runner/transitions.py): no other module assigns one."""
    writers = {module: lines for module, path in sorted(_modules().items()) if (lines := _phase_writes(path))}
    assert set(writers) == {"runtime.runner.transitions"}, f"modules that assign an entry's phase: {writers}"


def test_the_world_is_taken_swapped_and_restored_only_in_checks():
    """One side-by-side comparison owns the world of every extra run
    (runtime/checks/side_by_side.py): outside runtime/checks/, no module names `World` nor
    calls a `swap()` or `restore()` (a judge asks its SideBySide; an extra run compared
    with nothing keeps the world with `held`)."""
    import re

    found = []
    for module, path in sorted(_modules().items()):
        if module.startswith("runtime.checks"):
            continue
        for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
            if re.search(r"\bWorld\b|\.swap\(|\.restore\b", line):
                found.append(f"{module}:{number}: {line.strip()}")
    assert not found, "the world handled outside runtime/checks/:\n" + "\n".join(found)


def test_the_nondeterminism_message_is_written_once():
    """Every judge that runs eager again says an eager that disagrees with itself in the same
    words, written once (runtime/checks/side_by_side.py `nondeterministic`)."""
    texts = [path.read_text("utf-8") for path in _modules().values()]
    assert sum(text.count('f"eager disagrees with itself (') for text in texts) == 1
