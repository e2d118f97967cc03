"""Strict manifest schema v1 (docs/design.md section 3): every field's type, unknown and missing
keys at every level, path rules, parity modes, devices, torch range and dtype names.

Every rejection must be a ManifestError whose `.field` is the dotted path of the bad field,
so an author can find it; parsing is pure (no file system, nothing executed).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch

from graphdispatch_backend.artifacts.manifest import DTYPES, parse_manifest, version_tuple
from graphdispatch_backend.errors import GraphDispatchError, ManifestError

SHA = "ab" * 32
DELETE = object()


def valid() -> dict[str, Any]:
    """A manifest using every field, optional ones included."""
    return {
        "schema_version": 1,
        "id": "ff-fused",
        "description": "a test manifest",
        "region": {"module": "blocks.*.ff", "fingerprint": "0123456789abcdef0123456789abcdef"},
        "signature": {
            "inputs": [
                {"name": "input0", "shape": [None, 32, 16], "dtype": "float32"},
                {"name": "net.0.proj.weight", "shape": [64, 16], "dtype": "bfloat16"},
            ],
            "outputs": [{"shape": [1, 32, 16], "dtype": "float32"}],
        },
        "entry_point": {"file": "kernel.py", "symbol": "forward"},
        "files": [
            {"path": "kernel.py", "sha256": SHA, "bytes": 812},
            {"path": "data/table.bin", "sha256": "cd" * 32, "bytes": 0},
        ],
        "parity": {"mode": "allclose", "rtol": 1e-3, "atol": 0},
        "devices": ["cpu", "cuda"],
        "capturable": False,
        "torch": {"min": "2.13", "max_exclusive": "3.0.0"},
    }


_STEP = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def edited(field: str, value: Any, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of `doc` (default: valid()) with the dotted `field` set to `value` (or deleted)."""
    doc = copy.deepcopy(valid() if doc is None else doc)
    steps = [name if name else int(index) for name, index in _STEP.findall(field)]
    parent: Any = doc
    for step in steps[:-1]:
        parent = parent[step]
    if value is DELETE:
        del parent[steps[-1]]
    else:
        parent[steps[-1]] = value
    return doc


def rejects(doc: Any, field: str) -> ManifestError:
    with pytest.raises(ManifestError) as info:
        parse_manifest(doc)
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(f"{field}: ")  # the message names the field too
    return info.value


# -- what is accepted ---------------------------------------------------------------------


def test_full_manifest_parses_with_every_field():
    m = parse_manifest(valid())
    assert m.id == "ff-fused" and m.module == "blocks.*.ff"
    assert m.fingerprint == "0123456789abcdef0123456789abcdef"
    assert [(e.name, e.shape, e.dtype) for e in m.inputs] == [
        ("input0", (None, 32, 16), "float32"), ("net.0.proj.weight", (64, 16), "bfloat16")]
    assert [(e.name, e.shape, e.dtype) for e in m.outputs] == [(None, (1, 32, 16), "float32")]
    assert (m.entry_file, m.entry_symbol) == ("kernel.py", "forward")
    assert [f.path for f in m.files] == ["kernel.py", "data/table.bin"]
    assert m.file("data/table.bin").bytes == 0
    assert (m.parity.mode, m.parity.rtol, m.parity.atol) == ("allclose", 1e-3, 0.0)
    assert isinstance(m.parity.atol, float)
    assert m.devices == ("cpu", "cuda") and m.capturable is False
    assert (m.torch_min, m.torch_max_exclusive) == ("2.13", "3.0.0")
    assert m.description == "a test manifest"


def test_optional_fields_take_their_defaults():
    doc = valid()
    for key in ("description", "parity", "devices", "capturable", "torch"):
        del doc[key]
    del doc["region"]["fingerprint"]
    m = parse_manifest(doc)
    assert m.fingerprint is None and m.description == ""
    assert (m.parity.mode, m.parity.rtol, m.parity.atol) == ("bitwise", 0.0, 0.0)
    assert m.devices == ("cpu", "cuda") and m.capturable is True
    assert m.torch_min is None and m.torch_max_exclusive is None


def test_torch_range_bounds_are_each_optional():
    assert parse_manifest(edited("torch", {})).torch_min is None
    m = parse_manifest(edited("torch", {"min": "2"}))
    assert (m.torch_min, m.torch_max_exclusive) == ("2", None)
    m = parse_manifest(edited("torch", {"max_exclusive": "2.14.1"}))
    assert (m.torch_min, m.torch_max_exclusive) == (None, "2.14.1")


def test_outputs_may_carry_a_name_and_inputs_may_be_empty():
    doc = edited("signature.outputs[0].name", "out")
    doc = edited("signature.inputs", [], doc)
    m = parse_manifest(doc)
    assert m.outputs[0].name == "out" and m.inputs == ()


@pytest.mark.parametrize("name, canonical", [
    ("float32", "float32"), ("float", "float32"), ("half", "float16"), ("bfloat16", "bfloat16"),
    ("int64", "int64"), ("long", "int64"), ("bool", "bool"), ("complex64", "complex64"),
    ("uint8", "uint8"), ("float8_e4m3fn", "float8_e4m3fn"), ("cfloat", "complex64"),
])
def test_dtype_names_are_canonicalised(name, canonical):
    m = parse_manifest(edited("signature.inputs[0].dtype", name))
    assert m.inputs[0].dtype == canonical


def test_dtype_table_is_torchs_own():
    """The manifest parser does not import torch; its dtype table must still be torch's."""
    dtypes = {n: getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    assert {n: str(d).replace("torch.", "") for n, d in dtypes.items()} == DTYPES


@pytest.mark.parametrize("kind", ["symint", "symfloat", "symbool"])
def test_size_symbols_are_no_kernel_input(kind):
    with pytest.raises(ManifestError) as info:
        parse_manifest(edited("signature.inputs[0].dtype", kind))
    assert info.value.field == "signature.inputs[0].dtype" and "tensor inputs only" in str(info.value)


@pytest.mark.parametrize("path", ["sub/kernel.py", "a.b/c-d_e.py", "sub/artifact.json", "deep/er/x.bin", ".hidden"])
def test_relative_paths_inside_the_bundle_are_accepted(path):
    assert parse_manifest(edited("files[1].path", path)).files[1].path == path


def test_entry_file_may_sit_in_a_subfolder():
    doc = edited("files[1].path", "impl/kernel.py")
    assert parse_manifest(edited("entry_point.file", "impl/kernel.py", doc)).entry_file == "impl/kernel.py"


def test_id_may_use_its_whole_alphabet_and_length():
    assert parse_manifest(edited("id", "A0._-" + "x" * 123)).id == "A0._-" + "x" * 123


# -- version and top level -----------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 2, "1", 1.0, True, None, [1]])
def test_schema_version_other_than_integer_1_is_rejected(version):
    err = rejects(edited("schema_version", version), "schema_version")
    assert "must be 1" in str(err)


@pytest.mark.parametrize("doc", [[], "manifest", None, 1])
def test_top_level_must_be_an_object(doc):
    rejects(doc, "<root>")


def test_manifest_error_is_a_typed_value_error():
    err = rejects(edited("id", 5), "id")
    assert isinstance(err, ValueError) and isinstance(err, GraphDispatchError)


# -- unknown keys at every level ------------------------------------------------------------


@pytest.mark.parametrize("where", [
    "", "region", "signature", "signature.inputs[1]", "signature.outputs[0]", "entry_point",
    "files[1]", "parity", "torch",
])
def test_unknown_key_is_rejected_at_every_level(where):
    field = f"{where}.colour" if where else "colour"
    rejects(edited(field, "blue"), field)


@pytest.mark.parametrize(("field", "meant"), [
    ("regoin", "region"), ("region.fingerprnt", "fingerprint"), ("signature.mutate", "mutates"),
    ("parity.tol", "atol"), ("entry_point.symbl", "symbol"),
])
def test_a_mistyped_key_gets_did_you_mean_and_the_keys_allowed_there(field, meant):
    doc = edited(field, "x")
    message = str(rejects(doc, field))
    assert f"unknown key (did you mean {meant!r}" in message, message
    assert "allowed keys: " in message and meant in message.split("allowed keys: ")[1]


def test_a_renamed_key_is_named_as_absent_not_listed_as_if_the_file_had_it():
    """`capturabel` in place of `capturable`: the message listed the allowed keys as "keys
    here", which read as the file holding both; it says "allowed keys" and names the key
    the object lacks."""
    doc = valid()
    doc["capturabel"] = doc.pop("capturable", True)
    message = str(rejects(doc, "capturabel"))
    assert "keys here" not in message, message
    allowed, absent = message.split("allowed keys: ")[1].split("; absent here: ")
    assert "capturable" in allowed.split(", ") and "capturable" in absent.split(", "), message
    assert "id" not in absent.split(", ")  # a key the object has is never called absent


# -- missing required keys ------------------------------------------------------------------


@pytest.mark.parametrize("field", [
    "schema_version", "id", "region", "signature", "entry_point", "files",
    "region.module",
    "signature.inputs", "signature.outputs",
    "signature.inputs[0].name", "signature.inputs[1].shape", "signature.inputs[0].dtype",
    "signature.outputs[0].shape", "signature.outputs[0].dtype",
    "entry_point.file", "entry_point.symbol",
    "files[0].path", "files[1].sha256", "files[0].bytes",
    "parity.mode",
])
def test_missing_required_key_is_named(field):
    err = rejects(edited(field, DELETE), field)
    assert "missing" in str(err)


@pytest.mark.parametrize("tol", ["rtol", "atol"])
def test_allclose_needs_both_tolerances(tol):
    rejects(edited(f"parity.{tol}", DELETE), f"parity.{tol}")


# -- type errors, field by field -------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("id", 5), ("id", None), ("id", ""), ("id", "-leading-dash"), ("id", ".hidden"), ("id", "has space"),
    ("id", "slash/id"), ("id", "x" * 129), ("id", "ok\n"), ("id", "é"),
    ("region", "blocks.*.ff"), ("region", None),
    ("region.module", 3), ("region.module", ""), ("region.module", ["a"]),
    ("region.fingerprint", None), ("region.fingerprint", 5), ("region.fingerprint", "0" * 31),
    ("region.fingerprint", "0" * 33), ("region.fingerprint", "A" * 32), ("region.fingerprint", "g" * 32),
    ("region.fingerprint", "0" * 32 + "\n"),
    ("signature", []), ("signature.inputs", {}), ("signature.inputs", None),
    ("signature.outputs", {}), ("signature.outputs", []),
    ("signature.inputs[0]", "input0"), ("signature.outputs[0]", [1, 32, 16]),
    ("signature.inputs[0].name", 3), ("signature.inputs[0].name", ""), ("signature.inputs[0].name", None),
    ("signature.outputs[0].name", 0),
    ("signature.inputs[0].shape", "1x32"), ("signature.inputs[0].shape", None), ("signature.inputs[0].shape", 32),
    ("signature.outputs[0].shape", {"0": 1}),
    ("signature.inputs[0].dtype", "floaty"), ("signature.inputs[0].dtype", 3), ("signature.inputs[0].dtype", ""),
    ("signature.inputs[0].dtype", "Tensor"), ("signature.inputs[0].dtype", "torch.float32"),
    ("signature.outputs[0].dtype", None),
    ("entry_point", "kernel.py:forward"), ("entry_point.file", 3), ("entry_point.file", ""),
    ("entry_point.symbol", 3), ("entry_point.symbol", ""), ("entry_point.symbol", "1forward"),
    ("entry_point.symbol", "mod.forward"), ("entry_point.symbol", "for-ward"), ("entry_point.symbol", "forward\n"),
    ("files", {}), ("files", []), ("files", None), ("files[0]", "kernel.py"),
    ("files[0].path", 3), ("files[0].path", ""),
    ("files[0].sha256", 3), ("files[0].sha256", "AB" * 32), ("files[0].sha256", "ab" * 31),
    ("files[0].sha256", "ab" * 33), ("files[0].sha256", "zz" * 32), ("files[0].sha256", SHA + "\n"),
    ("files[1].bytes", -1), ("files[1].bytes", 1.5), ("files[1].bytes", True), ("files[1].bytes", "10"),
    ("files[1].bytes", None),
    ("parity", "bitwise"), ("parity", None), ("parity.mode", "exact"), ("parity.mode", 3), ("parity.mode", None),
    ("devices", "cpu"), ("devices", []), ("devices", None),
    ("capturable", "yes"), ("capturable", 1), ("capturable", None),
    ("torch", "2.13"), ("torch", None), ("torch", ["2.13"]),
    ("torch.min", 2.13), ("torch.min", "v2.13"), ("torch.min", "2.13.0.1"), ("torch.min", "2.13.0+cpu"),
    ("torch.min", ""), ("torch.min", "2.13\n"), ("torch.max_exclusive", "2.x"), ("torch.max_exclusive", 3),
    ("description", 3), ("description", ""), ("description", None),
])
def test_type_error_names_the_field(field, value):
    rejects(edited(field, value), field)


@pytest.mark.parametrize("field, value", [
    ("signature.inputs[0].shape", [None, -1, 16]),
    ("signature.inputs[0].shape", [None, 1.5, 16]),
    ("signature.inputs[0].shape", [None, True, 16]),
    ("signature.inputs[0].shape", [None, "32", 16]),
])
def test_bad_shape_entry_names_its_index(field, value):
    rejects(edited(field, value), f"{field}[1]")


@pytest.mark.parametrize("devices, field", [
    (["tpu"], "devices[0]"), (["cpu", "CUDA"], "devices[1]"), (["cpu", None], "devices[1]"),
    (["cuda:0"], "devices[0]"), ([["cpu"]], "devices[0]"),
])
def test_device_must_be_cpu_or_cuda(devices, field):
    rejects(edited("devices", devices), field)


# -- paths ------------------------------------------------------------------------------------


UNSAFE_PATHS = [
    "/abs/kernel.py",         # absolute
    "../kernel.py",           # leaves the bundle
    "sub/../../kernel.py",
    "sub/../kernel.py",       # not normalized (even though it stays inside)
    "sub\\kernel.py",         # backslash
    "./kernel.py",            # not normalized
    "sub/./kernel.py",
    "sub//kernel.py",
    "sub/",
    ".",
    "..",
    "C:/kernel.py",           # drive letter
    "ker\x00nel.py",          # NUL
    "__pycache__/kernel.py",  # bytecode is never part of a bundle
    "sub/__pycache__/kernel.cpython-311.pyc",
]


@pytest.mark.parametrize("path", UNSAFE_PATHS)
def test_unsafe_file_path_is_rejected(path):
    rejects(edited("files[1].path", path), "files[1].path")


@pytest.mark.parametrize("path", [p for p in UNSAFE_PATHS if p.endswith(".py")])
def test_unsafe_entry_file_is_rejected(path):
    rejects(edited("entry_point.file", path), "entry_point.file")


def test_manifest_may_not_declare_itself():
    err = rejects(edited("files[1].path", "artifact.json"), "files[1].path")
    assert "manifest" in str(err)


def test_a_path_declared_twice_is_rejected():
    rejects(edited("files[1].path", "kernel.py"), "files")


def test_entry_file_must_be_declared():
    err = rejects(edited("entry_point.file", "other.py"), "entry_point.file")
    assert "other.py" in str(err) and "not declared" in str(err)


@pytest.mark.parametrize("name", ["kernel.txt", "kernel.pyc", "kernel.so", "kernel"])
def test_entry_file_must_be_python_source(name):
    doc = edited("files[0].path", name)
    err = rejects(edited("entry_point.file", name, doc), "entry_point.file")
    assert ".py" in str(err)


# -- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tol", ["rtol", "atol"])
def test_bitwise_parity_takes_no_tolerances(tol):
    err = rejects(edited("parity", {"mode": "bitwise", tol: 0.0}), f"parity.{tol}")
    assert "bitwise" in str(err)


@pytest.mark.parametrize("value", [-1e-3, float("nan"), float("inf"), float("-inf"), "0.1", True, None, [0.1],
                                   10**400])
@pytest.mark.parametrize("tol", ["rtol", "atol"])
def test_allclose_tolerances_must_be_finite_and_non_negative(tol, value):
    rejects(edited(f"parity.{tol}", value), f"parity.{tol}")


def test_allclose_accepts_zero_and_integer_tolerances():
    m = parse_manifest(edited("parity", {"mode": "allclose", "rtol": 0, "atol": 2}))
    assert (m.parity.rtol, m.parity.atol) == (0.0, 2.0)


# -- torch range -----------------------------------------------------------------------------


@pytest.mark.parametrize("low, high", [("2.13", "2.13"), ("2.13.0", "2.13"), ("2.14", "2.13.9"), ("3", "2.99")])
def test_empty_torch_range_is_rejected(low, high):
    err = rejects(edited("torch", {"min": low, "max_exclusive": high}), "torch")
    assert low in str(err) and high in str(err)


@pytest.mark.parametrize("text, expected", [
    ("2.13.0+cpu", (2, 13, 0)), ("2.13", (2, 13, 0)), ("2", (2, 0, 0)), ("2.14.0a0+git1234", (2, 14, 0)),
    ("10.1.2", (10, 1, 2)), ("2.13.0.dev20250101", (2, 13, 0)),
])
def test_version_tuple(text, expected):
    assert version_tuple(text) == expected


def test_mutates_names_inputs_the_kernel_writes_in_place():
    assert parse_manifest(valid()).mutates == ()
    doc = edited("signature.mutates", ["input0"])
    assert parse_manifest(doc).mutates == ("input0",)


@pytest.mark.parametrize(("value", "message"), [
    ("input0", "must be a list of input names"),
    ([0], "must be a list of input names"),
    (["cache"], "'cache' is not one of signature.inputs' names"),
    (["input0", "input0"], "names an input twice"),
])
def test_a_bad_mutates_names_the_field(value, message):
    with pytest.raises(ManifestError, match=re.escape(message)) as info:
        parse_manifest(edited("signature.mutates", value))
    assert info.value.field == "signature.mutates"
