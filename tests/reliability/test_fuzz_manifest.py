"""Fuzzing `artifact.json` parsing: whatever the JSON, only ManifestError, naming the field.

The manifest is the first thing graphdispatch reads from an untrusted folder. Three
generators try to break the parser:

- random JSON values and structures (any type at the root, random keys, deep nesting);
- near-valid manifests: a complete, valid manifest with exactly one field broken (removed,
  wrong JSON type, an unknown key added, or a bad value of the right type); a required
  field removed, an unknown key, a wrong type or a bad value must raise ManifestError whose
  `field` is the broken field's dotted path; an optional field removed must still parse;
- several fields broken at once: the error names one of them.

Any other exception type (KeyError, TypeError, RecursionError, OverflowError, ...) fails
the test: it would escape the registry's error handling and hide good bundles, or crash
the user's run. Through the file system, `verify_bundle` must turn every bad manifest into
BundleRejected(manifest). Example counts scale with GD_FUZZ_SCALE; `--run-slow` runs 10x.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphdispatch_backend.artifacts.bundle import verify_bundle
from graphdispatch_backend.artifacts.manifest import Manifest, parse_manifest
from graphdispatch_backend.artifacts.registry import Registry
from graphdispatch_backend.errors import BundleRejected, BundleRejection, ManifestError

SCALE = float(os.environ.get("GD_FUZZ_SCALE", "1"))


def _settings(n: int) -> settings:
    return settings(settings.get_profile("gd_reliability"), max_examples=max(1, int(n * SCALE)))


# A valid manifest using every optional field, so every field can be broken.
BASE: dict[str, Any] = {
    "schema_version": 1,
    "id": "fuzz-base.v1",
    "region": {"module": "blocks.*.ff", "fingerprint": "0123456789abcdef0123456789abcdef"},
    "signature": {
        "inputs": [
            {"name": "input0", "shape": [1, None, 16], "dtype": "float32"},
            {"name": "net.0.proj.weight", "shape": [64, 16], "dtype": "bfloat16"},
        ],
        "outputs": [
            {"shape": [1, None, 16], "dtype": "float32"},
            {"name": "aux", "shape": [], "dtype": "int64"},
        ],
    },
    "entry_point": {"file": "kernel.py", "symbol": "forward"},
    "files": [
        {"path": "kernel.py", "sha256": "ab" * 32, "bytes": 812},
        {"path": "data/table.bin", "sha256": "cd" * 32, "bytes": 0},
    ],
    "parity": {"mode": "allclose", "rtol": 0.001, "atol": 0},
    "devices": ["cpu", "cuda"],
    "capturable": True,
    "torch": {"min": "2.13", "max_exclusive": "3.0"},
    "description": "every optional field set",
}

# The schema, by path pattern (`[*]` for any list index): JSON kind, required-ness, values
# of the right kind that must be rejected, and other fields an error may name instead
# (cross-field rules: the entry file must be declared in files, a version range must not
# be empty, bitwise parity takes no tolerances).
_KINDS = {
    "int": {"int"},
    "dim": {"int", "null"},
    "number": {"int", "float"},
    "str": {"str"},
    "bool": {"bool"},
    "list": {"list"},
    "dict": {"dict"},
}


def _spec(kind: str, required: bool = True, bad: tuple[Any, ...] = (), also: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"kind": kind, "required": required, "bad": bad, "also": also}


_PATHS = ("../kernel.py", "/kernel.py", "a/../b.py", ".", "..", "./kernel.py", "sub//kernel.py", "C:kernel.py",
          "C:/kernel.py", "sub\\kernel.py", "__pycache__/kernel.py", "sub/__pycache__/k.py", "artifact.json",
          "ker\x00nel.py", "kernel.py/", "sub/./kernel.py")
SCHEMA: dict[str, dict[str, Any]] = {
    "": _spec("dict"),
    "schema_version": _spec("int", bad=(0, 2, -1, 10**30)),
    "id": _spec("str", bad=("", "-x", ".x", "_x", "a b", "a/b", "a:b", "a" * 129, "id\n", "\u00efd", "a\x00b")),
    "region": _spec("dict"),
    "region.module": _spec("str", bad=("",)),
    "region.fingerprint": _spec("str", required=False,
                                bad=("0" * 31, "0" * 33, "A" * 32, "g" * 32, "0" * 32 + "\n", " " + "0" * 31)),
    "signature": _spec("dict"),
    "signature.inputs": _spec("list"),
    "signature.inputs[*]": _spec("dict"),
    "signature.inputs[*].name": _spec("str", bad=("",)),
    "signature.inputs[*].shape": _spec("list"),
    "signature.inputs[*].shape[*]": _spec("dim", bad=(-1, -(10**20))),
    # (torch's aliases "float", "int", "half" are accepted and canonicalized: not bad values)
    "signature.inputs[*].dtype": _spec("str", bad=("", "float31", "Float32", "torch.float32", "float32\n", "tensor",
                                                   "Tensor", "__name__", "cuda", "dtype")),
    "signature.outputs": _spec("list", bad=([],)),
    "signature.outputs[*]": _spec("dict"),
    "signature.outputs[*].name": _spec("str", required=False, bad=("",)),
    "signature.outputs[*].shape": _spec("list"),
    "signature.outputs[*].shape[*]": _spec("dim", bad=(-1,)),
    "signature.outputs[*].dtype": _spec("str", bad=("", "floating", "int128")),
    "entry_point": _spec("dict"),
    "entry_point.file": _spec("str", bad=(*_PATHS, "", "kernel", "kernel.txt", "other.py", "data/table.bin")),
    "entry_point.symbol": _spec("str", bad=("", "1x", "a-b", "a.b", "forward\n", " forward", "for ward")),
    "files": _spec("list", bad=([],)),
    "files[*]": _spec("dict"),
    # renaming the entry file's entry leaves the entry undeclared; reusing a path duplicates it
    "files[*].path": _spec("str", bad=(*_PATHS, ""),
                           also=("files", "entry_point.file")),
    "files[*].sha256": _spec("str", bad=("", "a" * 63, "a" * 65, "A" * 64, "g" * 64, "a" * 64 + "\n")),
    "files[*].bytes": _spec("int", bad=(-1, -(10**20))),
    "parity": _spec("dict", required=False),
    "parity.mode": _spec("str", bad=("", "exact", "BITWISE", "bitwise", "allclose ")),
    # tolerances are required once the mode is allclose
    "parity.rtol": _spec("number", bad=(-1, -0.001, math.nan, math.inf, -math.inf, 10**400)),
    "parity.atol": _spec("number", bad=(-1, math.nan, math.inf, 10**400)),
    "devices": _spec("list", required=False, bad=([],)),
    "devices[*]": _spec("str", bad=("", "gpu", "CUDA", "cuda:0", "cpu ", "mps")),
    "capturable": _spec("bool", required=False),
    "torch": _spec("dict", required=False),
    "torch.min": _spec("str", required=False, bad=("", "2.x", "v2.13", "2.13.0.1", "2.13\n", "3.5", "3.0")),
    "torch.max_exclusive": _spec("str", required=False, bad=("", "2", "2.13", "x", "3.0a")),
    "description": _spec("str", required=False, bad=("",)),
}
# an empty version range is reported on the range itself
SCHEMA["torch.min"]["also"] = SCHEMA["torch.max_exclusive"]["also"] = ("torch",)
# switching to bitwise while tolerances are present may be reported on the parity object or a tolerance
SCHEMA["parity.mode"]["also"] = ("parity", "parity.rtol", "parity.atol")
ALLOWED_KEYS = {
    "": {"schema_version", "id", "region", "signature", "entry_point", "files", "parity", "devices", "capturable",
         "torch", "description"},
    "region": {"module", "fingerprint"},
    "signature": {"inputs", "outputs"},
    "signature.inputs[*]": {"name", "shape", "dtype"},
    "signature.outputs[*]": {"name", "shape", "dtype"},
    "entry_point": {"file", "symbol"},
    "files[*]": {"path", "sha256", "bytes"},
    "parity": {"mode", "rtol", "atol"},
    "torch": {"min", "max_exclusive"},
}

Path_ = tuple[str | int, ...]


def field_name(path: Path_) -> str:
    """('signature', 'inputs', 1, 'dtype') -> 'signature.inputs[1].dtype' (the ManifestError spelling)."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "<root>"


def pattern(path: Path_) -> str:
    """The SCHEMA key of a path: list indices become `[*]`, the root is ''."""
    return re.sub(r"\[\d+\]", "[*]", field_name(path)) if path else ""


def walk(value: Any, path: Path_ = ()) -> Iterator[Path_]:
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from walk(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from walk(item, (*path, i))


ALL_PATHS: list[Path_] = list(walk(BASE))


def test_schema_table_covers_the_base_manifest():
    """The fuzzer's schema must know every path of BASE, and BASE must parse: otherwise the
    near-valid cases below would test nothing."""
    assert isinstance(parse_manifest(copy.deepcopy(BASE)), Manifest)
    assert {pattern(p) for p in ALL_PATHS} <= set(SCHEMA), sorted({pattern(p) for p in ALL_PATHS} - set(SCHEMA))
    assert set(ALLOWED_KEYS) == {k for k, s in SCHEMA.items() if s["kind"] == "dict"}


def get(doc: Any, path: Path_) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def json_round_trip(doc: Any) -> Any:
    """What `artifact.json` would decode to (Python's json keeps NaN, inf and big ints)."""
    return json.loads(json.dumps(doc))


# -- strategies ------------------------------------------------------------------------

_scalar = (st.none() | st.booleans() | st.integers() | st.integers(-(10**30), 10**30) | st.floats()
           | st.text(max_size=12))
json_values = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
_OF_TYPE = {
    "null": st.none(),
    "bool": st.booleans(),
    "int": st.integers(-(10**20), 10**20),
    "float": st.floats(),
    "str": st.text(max_size=12),
    "list": st.lists(json_values, max_size=3),
    "dict": st.dictionaries(st.text(max_size=8), json_values, max_size=3),
}


def wrong_type(kind: str) -> st.SearchStrategy[Any]:
    return st.sampled_from(sorted(set(_OF_TYPE) - _KINDS[kind])).flatmap(_OF_TYPE.__getitem__)


class Mutation:
    """One broken field: the document after the change, whether parsing must fail, and which
    fields the ManifestError may name."""

    def __init__(self, what: str, path: Path_, must_fail: bool, fields: set[str]) -> None:
        self.what, self.path, self.must_fail, self.fields = what, path, must_fail, fields

    def __repr__(self) -> str:
        return f"{self.what} at {field_name(self.path)}"


def bad_values(doc: Any, path: Path_) -> list[Any]:
    """SCHEMA's bad values, plus those that are bad only here: a file path that duplicates
    another entry's, or that renames the entry file away."""
    bad = list(SCHEMA[pattern(path)]["bad"])
    if pattern(path) == "files[*].path":
        bad += [f["path"] for i, f in enumerate(doc["files"]) if i != path[1] and isinstance(f, dict) and "path" in f]
        entry = doc.get("entry_point")  # another mutation may have broken it already
        if isinstance(entry, dict) and get(doc, path) == entry.get("file"):
            bad.append("other.py")
    return bad


def mutate(draw: st.DrawFn, doc: Any, path: Path_, allow_list_removal: bool = True) -> tuple[Any, Mutation]:
    """Break the field at `path` of `doc` in one drawn way; return the new document (the
    same object, changed in place, unless the root itself was replaced)."""
    spec = SCHEMA[pattern(path)]
    parent = get(doc, path[:-1]) if path else None
    kinds = ["wrong_type"]
    if path and (isinstance(path[-1], str) or allow_list_removal):
        kinds.append("remove")
    if spec["kind"] == "dict":
        kinds.append("unknown_key")
    if spec["bad"]:
        kinds.append("bad_value")
    what = draw(st.sampled_from(kinds))
    own = {field_name(path), *spec["also"]}
    if what == "remove" and isinstance(path[-1], int):
        # a shorter list may still be valid; if not, the list or a cross-field rule says so
        del parent[path[-1]]
        return doc, Mutation(what, path, False, {field_name(path[:-1]), "entry_point.file", *spec["also"]})
    if what == "remove":
        del parent[path[-1]]
        return doc, Mutation(what, path, spec["required"], own)
    if what == "unknown_key":
        key = draw(st.text(max_size=12).filter(lambda k: k not in ALLOWED_KEYS[pattern(path)]))
        get(doc, path)[key] = draw(json_values)
        return doc, Mutation(what, path, True, {field_name((*path, key)) if path else key})
    value = draw(wrong_type(spec["kind"])) if what == "wrong_type" else draw(st.sampled_from(bad_values(doc, path)))
    if not path:
        return value, Mutation(what, path, True, own)
    parent[path[-1]] = value
    return doc, Mutation(what, path, True, own)


def check(doc: Any, mutations: list[Mutation]) -> ManifestError | None:
    """Parse; any exception but ManifestError fails the test by propagating."""
    try:
        manifest = parse_manifest(doc)
    except ManifestError as exc:
        assert isinstance(exc, ValueError)
        allowed = set().union(*(m.fields for m in mutations))
        assert exc.field in allowed, f"{mutations}: the error names {exc.field!r}, expected one of {sorted(allowed)}"
        assert str(exc).startswith(f"{exc.field}: "), str(exc)
        return exc
    assert not any(m.must_fail for m in mutations), f"{mutations}: parsed without an error"
    assert isinstance(manifest, Manifest)
    return None


# -- tests -----------------------------------------------------------------------------


def near_valid_case(data: st.DataObject, counts: Any) -> None:
    path = data.draw(st.sampled_from(ALL_PATHS), label="path")
    doc, mutation = mutate(data.draw, copy.deepcopy(BASE), path)
    check(json_round_trip(doc), [mutation])
    counts["fuzz_cases:manifest_near_valid"] += 1


@_settings(300)
@given(data=st.data())
def test_near_valid_manifest_with_one_broken_field(data, counts):
    near_valid_case(data, counts)


@pytest.mark.slow
@_settings(3000)
@given(data=st.data())
def test_near_valid_manifest_large_sweep(data, counts):
    near_valid_case(data, counts)


CONTEXTUAL = {p for p, spec in SCHEMA.items() if spec["also"]} | {"parity.rtol", "parity.atol"}


def _disjoint(paths: list[Path_]) -> bool:
    return all(a == b or (a[: len(b)] != b and b[: len(a)] != a) for a in paths for b in paths)


@_settings(150)
@given(data=st.data())
def test_manifest_with_several_broken_fields_names_one_of_them(data, counts):
    candidates = [p for p in ALL_PATHS if p]
    paths = data.draw(st.lists(st.sampled_from(candidates), min_size=2, max_size=4, unique=True)
                      .filter(_disjoint), label="paths")
    doc = copy.deepcopy(BASE)
    mutations = []
    for path in paths:  # disjoint, and no list element removed: no mutation moves another's path
        doc, mutation = mutate(data.draw, doc, path, allow_list_removal=False)
        mutations.append(mutation)
    # Cross-field rules can cancel out (torch.min "3.5" is fine once max_exclusive is gone;
    # a duplicated entry path is fine once the other is renamed): such a set may parse.
    if any(pattern(m.path) in CONTEXTUAL for m in mutations):
        for m in mutations:
            m.must_fail = False
    check(json_round_trip(doc), mutations)
    counts["fuzz_cases:manifest_multi"] += 1


@_settings(300)
@given(value=json_values)
def test_random_json_only_raises_manifest_error(value, counts):
    with pytest.raises(ManifestError):
        parse_manifest(json_round_trip(value))
    counts["fuzz_cases:manifest_random_json"] += 1


def _structured() -> st.SearchStrategy[tuple[dict[str, str], dict[str, Any], st.DataObject]]:
    """Top-level keys each kept, dropped, replaced by random JSON, or with one inner item
    replaced by random JSON; plus random extra keys."""
    choice = st.sampled_from(["keep", "keep", "drop", "random", "inner"])
    return st.tuples(st.fixed_dictionaries({k: choice for k in BASE}),
                     st.dictionaries(st.text(max_size=6), json_values, max_size=2), st.data())


@_settings(200)
@given(case=_structured())
def test_random_structures_name_a_changed_field(case, counts):
    plan, extra, data = case
    doc: dict[str, Any] = {}
    changed, dropped = set(), set()
    for key, how in plan.items():
        value = copy.deepcopy(BASE[key])
        if how == "drop":
            dropped.add(key)
            continue
        if how == "random":
            value = data.draw(json_values)
        elif how == "inner" and isinstance(value, (dict, list)):
            inner = data.draw(st.sampled_from(list(value) if isinstance(value, dict) else range(len(value))))
            value[inner] = data.draw(json_values)
        else:
            how = "keep"
        doc[key] = value
        if how != "keep":
            changed.add(key)
    unknown = {k for k in extra if k not in BASE}
    doc.update({k: extra[k] for k in unknown})
    try:
        parse_manifest(json_round_trip(doc))
    except ManifestError as exc:
        # an unknown key may itself contain "." or "["
        root = exc.field if exc.field in unknown else re.split(r"[.\[]", exc.field, maxsplit=1)[0]
        allowed = changed | dropped | unknown | ({"entry_point"} if {"files"} & (changed | dropped) else set())
        assert root in allowed, f"error names {exc.field!r}; changed {sorted(changed | dropped)}, unknown {unknown}"
    else:  # random values may happen to be valid; unknown keys and missing required ones never are
        assert not unknown and not any(SCHEMA[k]["required"] for k in dropped), (unknown, dropped)
    counts["fuzz_cases:manifest_structured"] += 1


@_settings(150)
@given(raw=st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.builds(lambda doc: json.dumps(doc).encode("utf-16"), st.just(BASE)),  # valid JSON, wrong encoding
    st.integers(0, len(json.dumps(BASE)) - 1).map(lambda cut: json.dumps(BASE).encode()[:cut]),  # truncated
    st.sampled_from([b"", b"\xef\xbb\xbf" + json.dumps(BASE).encode(), b"null", b"NaN", b"[]", b"{}",
                     b'{"schema_version": 1, "schema_version": 2}', b"\x00" * 64, b"\xff\xfe{}"]),
))
def test_manifest_bytes_on_disk_are_rejected_as_manifest(raw, tmp_path, counts):
    """Random bytes in artifact.json: verify_bundle raises BundleRejected(manifest) and the
    registry records it; no other exception escapes."""
    folder = Path(tempfile.mkdtemp(dir=tmp_path))  # one folder per example
    (folder / "artifact.json").write_bytes(raw)
    with pytest.raises(BundleRejected) as info:
        verify_bundle(folder)
    assert info.value.reason is BundleRejection.MANIFEST, info.value
    registry = Registry.load([str(folder)])
    assert [e["reason"] for e in registry.errors] == ["manifest"] and not registry.artifacts
    counts["fuzz_cases:manifest_bytes"] += 1


def test_oversized_manifest_is_refused_before_parsing(tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()
    doc = dict(BASE, description="x" * (1 << 20))
    (folder / "artifact.json").write_text(json.dumps(doc))
    with pytest.raises(BundleRejected) as info:
        verify_bundle(folder)
    assert info.value.reason is BundleRejection.MANIFEST and "larger than" in info.value.detail


@pytest.mark.parametrize("depth", [100, 5_000, 100_000])
def test_deeply_nested_manifest_is_a_manifest_rejection(tmp_path, depth):
    """JSON nesting within the 1 MiB manifest limit must not raise RecursionError: it would
    escape Registry.load (hiding every good bundle) and fail the user's compile."""
    folder = tmp_path / "deep"
    folder.mkdir()
    (folder / "artifact.json").write_text("[" * depth + "]" * depth)
    with pytest.raises(BundleRejected) as info:
        verify_bundle(folder)
    assert info.value.reason is BundleRejection.MANIFEST
    assert [e["reason"] for e in Registry.load([str(tmp_path)]).errors] == ["manifest"]


def test_deep_nesting_inside_a_field_is_a_manifest_error():
    doc = copy.deepcopy(BASE)
    value: Any = []
    for _ in range(900):  # deep, but within what json.loads decodes
        value = [value]
    doc["description"] = value
    with pytest.raises(ManifestError) as info:
        parse_manifest(json_round_trip(doc))
    assert info.value.field == "description"


def test_base_manifest_on_disk_verifies(tmp_path):
    """Write the valid BASE (with real sizes and hashes) to disk: it must verify, so the
    on-disk rejections above come from the broken bytes and not from the fixture."""
    folder = tmp_path / "ok"
    (folder / "data").mkdir(parents=True)
    files = {"kernel.py": b"def forward(*a):\n    return a[0]\n", "data/table.bin": b""}
    for rel, blob in files.items():
        (folder / rel).write_bytes(blob)
    doc = copy.deepcopy(BASE)
    doc["files"] = [{"path": rel, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
                    for rel, blob in files.items()]
    (folder / "artifact.json").write_text(json.dumps(doc))
    assert verify_bundle(Path(folder)).manifest.id == BASE["id"]
