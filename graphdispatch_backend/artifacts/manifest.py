"""Strict parsing of `artifact.json`, schema version 1 (docs/design.md section 3).

Every field is type-checked; unknown keys anywhere are rejected; every error is a
ManifestError naming the dotted field (`signature.inputs[1].dtype`). Parsing never
touches the file system, never executes anything and does not import torch (the
`artifacts verify|hash` commands stay fast): dtype names are checked against a table that
a test keeps equal to torch's own.
"""

from __future__ import annotations

import dataclasses
import math
import posixpath
import re
from typing import Any

from graphdispatch_backend.errors import ManifestError, did_you_mean

SCHEMA_VERSION = 1
MANIFEST_NAME = "artifact.json"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_VERSION = re.compile(r"^\d+(\.\d+){0,2}$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DEVICES = ("cpu", "cuda")
# torch's dtype names (`torch.<name>` is a torch.dtype), each to its canonical spelling
DTYPES: dict[str, str] = {name: name for name in (
    "bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128", "complex32",
    "complex64", "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "int1", "int16", "int2", "int3", "int32", "int4", "int5",
    "int6", "int64", "int7", "int8", "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "uint1", "uint16",
    "uint2", "uint3", "uint32", "uint4", "uint5", "uint6", "uint64", "uint7", "uint8")}
DTYPES.update(bit="uint1", cdouble="complex128", cfloat="complex64", chalf="complex32", double="float64",
              float="float32", half="float16", int="int32", long="int64", short="int16")
_SIZES = ("symint", "symfloat", "symbool")  # the region report's size inputs: never a kernel's


@dataclasses.dataclass(frozen=True)
class SignatureEntry:
    name: str | None
    shape: tuple[int | None, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class FileEntry:
    path: str
    sha256: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class Parity:
    mode: str = "bitwise"
    rtol: float = 0.0
    atol: float = 0.0


@dataclasses.dataclass(frozen=True)
class Manifest:
    id: str
    module: str
    fingerprint: str | None
    inputs: tuple[SignatureEntry, ...]
    outputs: tuple[SignatureEntry, ...]
    entry_file: str
    entry_symbol: str
    files: tuple[FileEntry, ...]
    parity: Parity
    devices: tuple[str, ...]
    capturable: bool
    torch_min: str | None
    torch_max_exclusive: str | None
    description: str
    mutates: tuple[str, ...] = ()  # inputs (by name) the kernel writes in place

    def file(self, path: str) -> FileEntry:
        """The declared entry for `path`; KeyError (naming it) if the manifest does not declare it."""
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(f"{path!r} is not declared in files")


def _keys(obj: Any, field: str, required: set[str], optional: set[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ManifestError(field or "<root>", f"must be an object, got {type(obj).__name__}")
    for key in obj:
        if not isinstance(key, str) or key not in required | optional:
            known = sorted(required | optional)
            # the allowed keys, and apart the ones this object lacks: a list of allowed keys
            # read as the file's own keys once made the mistyped one look present
            absent = ", ".join(k for k in known if k not in obj)
            raise ManifestError(_join(field, str(key)), f"unknown key{did_you_mean(str(key), known)}; allowed keys: "
                                f"{', '.join(known) or 'none'}" + (f"; absent here: {absent}" if absent else ""))
    for key in sorted(required):
        if key not in obj:
            raise ManifestError(_join(field, key), "missing required key")
    return obj


def _join(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


def _str(value: Any, field: str, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
    if not isinstance(value, str) or not value:
        raise ManifestError(field, f"must be a non-empty string, got {value!r}")
    # fullmatch, not match: `$` would accept a trailing newline ("forward\n", an id with "\n").
    if pattern is not None and not pattern.fullmatch(value):
        raise ManifestError(field, f"must be {what}, got {value!r}")
    return value


def _int(value: Any, field: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ManifestError(field, f"must be an integer >= {low}, got {value!r}")
    return value


def _dtype(value: Any, field: str) -> str:
    name = _str(value, field)
    if name in DTYPES:
        return DTYPES[name]
    if name in _SIZES:
        raise ManifestError(field, f"{name!r} is a size symbol: a kernel receives the region's tensor inputs only "
                                   "(list the tensors of the region report's `inputs`, not its `sizes`)")
    raise ManifestError(field, f"unknown dtype {name!r}")


def _entry(obj: Any, field: str, named: bool) -> SignatureEntry:
    data = _keys(obj, field, {"shape", "dtype"} | ({"name"} if named else set()),
                 set() if named else {"name"})
    shape = data["shape"]
    if not isinstance(shape, list):
        raise ManifestError(f"{field}.shape", f"must be a list of sizes (or null), got {shape!r}")
    dims = tuple(None if d is None else _int(d, f"{field}.shape[{i}]") for i, d in enumerate(shape))
    name = _str(data["name"], f"{field}.name") if "name" in data else None
    return SignatureEntry(name, dims, _dtype(data["dtype"], f"{field}.dtype"))


def _path(value: Any, field: str) -> str:
    path = _str(value, field)
    parts = path.split("/")
    if (
        path.startswith("/")
        or "\\" in path
        or "\x00" in path
        or re.match(r"^[A-Za-z]:", path)
        or any(p in ("", ".", "..") for p in parts)
        or posixpath.normpath(path) != path
    ):
        raise ManifestError(field, f"must be a relative path inside the bundle, got {path!r}")
    if path == MANIFEST_NAME:
        raise ManifestError(field, "the manifest does not declare itself")
    if "__pycache__" in parts:
        raise ManifestError(field, "__pycache__ is never part of a bundle")
    return path


def _version(value: Any, field: str) -> str:
    return _str(value, field, _VERSION, "a version like '2.13' or '2.13.0'")


def parse_manifest(data: Any) -> Manifest:
    """Validate a decoded `artifact.json` and return it frozen."""
    top = _keys(
        data, "",
        {"schema_version", "id", "region", "signature", "entry_point", "files"},
        {"parity", "devices", "capturable", "torch", "description"},
    )
    version = top["schema_version"]
    if type(version) is not int or version != SCHEMA_VERSION:  # not True, not 1.0
        raise ManifestError("schema_version", f"must be {SCHEMA_VERSION}, got {version!r}")
    artifact_id = _str(top["id"], "id", _ID, "letters, digits, '.', '_' or '-' (max 128)")
    region = _keys(top["region"], "region", {"module"}, {"fingerprint"})
    module = _str(region["module"], "region.module")
    # Optional means "may be omitted": an explicit null is a type error like any other.
    fp = None
    if "fingerprint" in region:
        fp = _str(region["fingerprint"], "region.fingerprint", _HEX32, "32 lowercase hex characters")
    sig = _keys(top["signature"], "signature", {"inputs", "outputs"}, {"mutates"})
    entries = []
    for side, named in (("inputs", True), ("outputs", False)):
        items = sig[side]
        if not isinstance(items, list) or (side == "outputs" and not items):
            raise ManifestError(f"signature.{side}", "must be a list" + (" (non-empty)" if side == "outputs" else ""))
        entries.append(tuple(_entry(e, f"signature.{side}[{i}]", named) for i, e in enumerate(items)))
    mutates = _mutates(sig.get("mutates", []), [e.name for e in entries[0]])
    entry = _keys(top["entry_point"], "entry_point", {"file", "symbol"}, set())
    entry_file = _path(entry["file"], "entry_point.file")
    if not entry_file.endswith(".py"):
        raise ManifestError("entry_point.file", f"must be a .py file, got {entry_file!r}")
    symbol = _str(entry["symbol"], "entry_point.symbol", _IDENT, "a Python identifier")
    if not isinstance(top["files"], list) or not top["files"]:
        raise ManifestError("files", "must be a non-empty list")
    files = []
    for i, item in enumerate(top["files"]):
        f = _keys(item, f"files[{i}]", {"path", "sha256", "bytes"}, set())
        files.append(FileEntry(
            _path(f["path"], f"files[{i}].path"),
            _str(f["sha256"], f"files[{i}].sha256", _HEX64, "64 lowercase hex characters"),
            _int(f["bytes"], f"files[{i}].bytes"),
        ))
    paths = [f.path for f in files]
    if len(set(paths)) != len(paths):
        raise ManifestError("files", "declares a path twice")
    if entry_file not in paths:
        raise ManifestError("entry_point.file", f"{entry_file!r} is not declared in files")
    return Manifest(
        id=artifact_id,
        module=module,
        fingerprint=fp,
        inputs=entries[0],
        outputs=entries[1],
        entry_file=entry_file,
        entry_symbol=symbol,
        files=tuple(files),
        parity=_parity(top.get("parity", {"mode": "bitwise"})),
        devices=_devices(top.get("devices", list(_DEVICES))),
        capturable=_bool(top.get("capturable", True), "capturable"),
        **(_torch_range(top["torch"]) if "torch" in top else {"torch_min": None, "torch_max_exclusive": None}),
        description=_str(top["description"], "description") if "description" in top else "",
        mutates=mutates,
    )


def _mutates(value: Any, names: list[str | None]) -> tuple[str, ...]:
    """`signature.mutates`: names of inputs the kernel writes in place, each once (as a
    custom op's `mutates_args`)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ManifestError("signature.mutates", f"must be a list of input names, got {value!r}")
    for name in value:
        if name not in names:
            raise ManifestError("signature.mutates", f"{name!r} is not one of signature.inputs' names")
    if len(set(value)) != len(value):
        raise ManifestError("signature.mutates", "names an input twice")
    return tuple(value)


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ManifestError(field, f"must be true or false, got {value!r}")
    return value


def _parity(value: Any) -> Parity:
    data = _keys(value, "parity", {"mode"}, {"rtol", "atol"})
    mode = data["mode"]
    if mode == "bitwise":
        for key in ("rtol", "atol"):
            if key in data:
                raise ManifestError(f"parity.{key}", "bitwise parity takes no tolerances")
        return Parity()
    if mode != "allclose":
        raise ManifestError("parity.mode", f"must be 'bitwise' or 'allclose', got {mode!r}")
    tol = {}
    for key in ("rtol", "atol"):
        v = data.get(key)
        try:  # JSON integers are unbounded: float(10**400) raises OverflowError
            number = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
        except OverflowError:
            number = math.inf
        if not (math.isfinite(number) and number >= 0):
            raise ManifestError(f"parity.{key}", f"must be a finite number >= 0, got {v!r:.40}")
        tol[key] = number
    return Parity("allclose", tol["rtol"], tol["atol"])


def _devices(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ManifestError("devices", "must be a non-empty list")
    for i, d in enumerate(value):
        if d not in _DEVICES:
            raise ManifestError(f"devices[{i}]", f"must be one of {_DEVICES}, got {d!r}")
    return tuple(value)


def _torch_range(value: Any) -> dict[str, str | None]:
    data = _keys(value, "torch", set(), {"min", "max_exclusive"})
    low = _version(data["min"], "torch.min") if "min" in data else None
    high = _version(data["max_exclusive"], "torch.max_exclusive") if "max_exclusive" in data else None
    if low and high and version_tuple(low) >= version_tuple(high):
        raise ManifestError("torch", f"empty range: min {low} >= max_exclusive {high}")
    return {"torch_min": low, "torch_max_exclusive": high}


def version_tuple(text: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); missing parts count as 0."""
    core = re.match(r"^(\d+(?:\.\d+)*)", text)
    nums = tuple(int(p) for p in core.group(1).split(".")) if core else ()
    return (nums + (0, 0, 0))[:3]
