"""The one frozen options object, and the one place that reads `GRAPHDISPATCH_*` variables.

`Options.resolve(options, mode)` copies the caller's dict, merges the environment (an
explicit option wins), validates every value once and freezes the result. Equal options
are one compile identity: they share a session (report, registry, static buffers).

Frameworks pass `torch.compile` arguments meant for Inductor to whatever backend they are
given (FastVideo's regional compile always adds `emulate_precision_casts` to `options`):
a key of Inductor's config (`torch._inductor.config`, dotted keys included) is accepted
and kept apart (`Options.inductor`), its value of the type the config declares for it,
generic types included (inductor_options.py); the fusion compile applies it unless the
eager-numerics recipe sets the key (fusion/recipe.py `with_inductor_keys`).
`mode` maps torch.compile's modes onto graphdispatch's own options (MODES).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from numbers import Integral
from typing import Any

from graphdispatch_backend.errors import OptionsError, did_you_mean
from graphdispatch_backend.inductor_options import InductorKeys, inductor_keys

ENV_PREFIX = "GRAPHDISPATCH_"
# String choices are matched ignoring case and kept lowercase ("EVERY" is "every", one
# compile identity): the environment's words were read so already (TRUE, Off), and
# cuda_graphs took "EMULATE", so this is the one rule that refuses nothing taken before.
CUDA_GRAPH_MODES = ("auto", "emulate", True, False)
RECHECK_MODES = ("doubling", "dense", "every")  # and an integer N, 1 to RECHECK_MAX (runtime/checks/schedule.py)
# The sparsest integer schedule: a check every RECHECK_MAX calls, the interval "doubling"
# settles at (schedule.py CAP; not imported: this module imports no torch, and
# tests/test_options.py holds the two equal). The checks never stop (docs/guarantees.md):
# an N past it leaves them stopped in practice (10**30: never a second check), and saves
# less than 0.1% of a call, where "doubling" already costs within 1% (bench/recheck.py).
RECHECK_MAX = 1024


def is_recheck_mode(value: object) -> bool:
    """A value `recheck` and `artifact_recheck` take: a named schedule, or every Nth call."""
    if isinstance(value, str):
        return value in RECHECK_MODES
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= RECHECK_MAX


TIMING_MODES = ("off", "host", "sync", "shadow")
# torch.compile's modes (torch._inductor.list_mode_options()) and what each means here: the
# options it sets (an explicit option wins) and the Inductor settings it hands the fusion
# compile, as Inductor's own mode would set them (an explicit Inductor key wins)
MODES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "default": ({}, {}),
    "lite": ({}, {}),  # Inductor's lite mode runs ATen kernels: what graphdispatch runs without fuse
    "reduce-overhead": ({"cuda_graphs": True}, {}),
    "max-autotune-no-cudagraphs": ({"fuse": True}, {"max_autotune": True, "coordinate_descent_tuning": True}),
    "max-autotune": ({"fuse": True, "cuda_graphs": True}, {"max_autotune": True, "coordinate_descent_tuning": True}),
}
_TRUE = ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class FuseTolerance:
    """`fuse={"rtol": r, "atol": a}`: Inductor as it compiles, each fused value checked
    within `atol + rtol * |eager|` (as an artifact's `allclose` parity)."""

    rtol: float
    atol: float

    def to_dict(self) -> dict[str, float]:
        return {"rtol": self.rtol, "atol": self.atol}


_FALSE = ("0", "false", "no", "off")
_OFF = (*_FALSE, "never", "none")  # `recheck` values that ask for the checks off


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated backend options (DESIGN.md section 2).

    artifacts: bundle roots, searched one level deep.
    enable: allowlist of artifact ids; None admits every verified bundle.
    cuda_graphs: "auto" (on when the graph's inputs are all on CUDA), True, False, or
        "emulate" (the full state machine on any device through HostReplayEngine).
    warmup: eager calls per shape key before capture (at least 1, so every artifact
        gate settles before a capture records it).
    max_captures: distinct shape keys captured per graph piece; later keys run eager.
    verify_inputs: distinct live input sets a capture must match eager on, bit for bit.
    speed_gate: time artifact against native on live inputs; keep the faster.
    timing: "off", "host", "sync" or "shadow".
    report_dir: where dispatch.json, timing.json and region exports go.
    export_regions: export every region for kernel authors at flush.
    strict: raise GraphDispatchError instead of falling back.
    recheck: the calls checked against eager for the graph's whole life (runtime/checks/schedule.py):
        "doubling" (1st, 2nd, 4th, ... call of each shape key, then every ~1024, jittered),
        "dense", an integer N from 1 to RECHECK_MAX (the first call, then every Nth) or "every".
    artifact_recheck: the calls on which each artifact is checked beside its native region,
        its own schedule (runtime/checks/schedule.py), denser than the lowering's by default: "dense"
        (1st, 2nd, 4th, 8th, then twice per doubling: 12, 16, 24, 32, ..., 1024, then every
        ~256, jittered), or any value `recheck` takes. Where the graph replays, its eager check also
        follows it (a replay runs no gate).
    max_snapshot_bytes: the largest whole copy of an input one check may take where the graph
        writes it at places graphdispatch cannot locate (runtime/checks/world.py); located writes
        (a KV cache's rows) are snapshotted row by row, whatever this says. Where a kernel serves
        from replays, its graph's check also copies the inputs kernels write or read whole while
        the copies fit this, together, to put back a write beyond its rows (runtime/checks/side_by_side.py).
    fuse: lower each inference graph (each captured piece) through Inductor (runtime/program/fused.py).
        True: under the device's eager-numerics recipe, checked against eager bit for bit
        like any lowering, op by op. A FuseTolerance (given as {"rtol": r, "atol": a}):
        as Inductor compiles it (its fusions, reductions, math library, pattern rewrites),
        checked within `atol + rtol * |eager|` (dtype, shape, strides, NaN and inf places
        exact), on the "dense" schedule where `recheck` is left "doubling"; an op that puts a
        call beyond it runs as its ATen kernel from then on.
    cache_dir: where fused graphs keep what they learned (fusion/verdicts.py); None: the
        user's cache directory; False: nothing is kept on disk.
    inductor: keys of Inductor's config given in `options` (a framework's, or a mode's
        Inductor settings); under `fuse` the fusion compile applies them unless the
        eager-numerics recipe sets the key (fusion/recipe.py `with_inductor_keys`).
    """

    artifacts: tuple[str, ...] = ()
    enable: tuple[str, ...] | None = None
    cuda_graphs: bool | str = "auto"
    warmup: int = 1
    max_captures: int = 8
    verify_inputs: int = 2
    speed_gate: bool = False
    timing: str = "off"
    report_dir: str | None = None
    export_regions: bool = False
    strict: bool = False
    recheck: str | int = "doubling"
    artifact_recheck: str | int = "dense"
    max_snapshot_bytes: int = 256 * 2**20
    fuse: bool | FuseTolerance = False
    cache_dir: str | bool | None = None
    # Inductor config keys given in `options` (not a key of its own: `names()` leaves it out)
    inductor: InductorKeys = dataclasses.field(default_factory=InductorKeys)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "inductor")

    @classmethod
    def resolve(
        cls,
        options: Mapping[str, Any] | None = None,
        mode: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Options:
        """Copy, merge with the environment, validate and freeze."""
        if options is not None and not isinstance(options, Mapping):  # dict() would take "ab" or pairs
            raise OptionsError(f"options must be a dict of option names (strings) to values, as "
                               f"options={{'cuda_graphs': 'emulate'}}; got {options!r} ({type(options).__name__})")
        given = dict(options or {})  # a copy: torch.compile mutates the caller's dict
        for key in given:
            if not isinstance(key, str):  # else len() or .lower() on it raised a TypeError in here
                guess = _key_text(key)
                near = did_you_mean(guess, cls.names()) if guess is not None else ""
                raise OptionsError(f"option names are strings, got the key {key!r} ({type(key).__name__}){near}; "
                                   f"valid keys: {', '.join(cls.names())}")
        inductor = inductor_keys(given, cls.names())
        unknown = sorted(k for k in given if k not in cls.names())
        if unknown:
            raise OptionsError(f"unknown option {unknown[0]!r}{did_you_mean(unknown[0], cls.names())}; "
                               f"valid keys: {', '.join(cls.names())}")
        merged: dict[str, Any] = {}
        env = os.environ if environ is None else environ
        for name, text in env.items():
            if not name.startswith(ENV_PREFIX):
                continue
            key = name[len(ENV_PREFIX) :].lower()
            if not text.strip():  # `export GRAPHDISPATCH_ENABLE=` means unset, not "enable nothing"
                continue
            if key not in cls.names():
                near = did_you_mean(key.upper(), [k.upper() for k in cls.names()], ENV_PREFIX)
                raise OptionsError(f"unknown environment variable {name!r}{near}; valid: "
                                   + ", ".join(ENV_PREFIX + k.upper() for k in cls.names()))
            value = _from_env(key, text)
            try:  # validated here too, so the error names the variable, not only the key
                merged[key] = _validate(key, value)
            except OptionsError as exc:
                raise OptionsError(f"{name}={text!r}: {exc}") from None
        written = list(inductor)
        if mode is not None:
            found = mode.lower() if isinstance(mode, str) else None  # ignoring case, as every string choice
            if found not in MODES:
                near = did_you_mean(mode.lower(), MODES) if isinstance(mode, str) else ""
                raise OptionsError(f"mode {mode!r}{near} is not one of torch.compile's: {', '.join(map(repr, MODES))}")
            own, settings = MODES[found]
            merged.update(own)
            inductor = {**settings, **inductor}
        merged.update(given)
        return cls(**{k: _validate(k, v) for k, v in merged.items()}, inductor=InductorKeys(inductor, written))

    def to_dict(self) -> dict[str, Any]:
        out = {name: list(v) if isinstance(v := getattr(self, name), tuple) else
               v.to_dict() if isinstance(v, FuseTolerance) else v for name in self.names()}
        out["inductor"] = self.inductor.to_dict()
        return out


def _from_env(key: str, text: str) -> Any:
    """Turn an environment string into the value the option would have in a dict."""
    text = text.strip()
    kind = _KINDS[key]
    if key == "fuse" and text.lower() not in _TRUE + _FALSE:
        return _tolerance_text(text)
    if kind == "bool" or (key == "cuda_graphs" and text.lower() in _TRUE + _FALSE):
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise OptionsError(f"{ENV_PREFIX}{key.upper()}={text!r}: expected one of {_TRUE + _FALSE}")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise OptionsError(f"{ENV_PREFIX}{key.upper()}={text!r}: expected an integer") from None
    if key == "artifacts":
        return [p for p in text.split(os.pathsep) if p]
    if kind == "recheck":
        try:  # "-1" and "10000" as numbers, so the error says what range an integer has
            return int(text)
        except ValueError:
            return text
    if key == "enable":
        return text
    if key == "cache_dir" and text.lower() in _FALSE:
        return False
    return text


_KINDS = {
    "artifacts": "paths",
    "enable": "ids",
    "cuda_graphs": "mode",
    "warmup": "int",
    "max_captures": "int",
    "verify_inputs": "int",
    "speed_gate": "bool",
    "timing": "str",
    "report_dir": "path",
    "export_regions": "bool",
    "strict": "bool",
    "recheck": "recheck",
    "artifact_recheck": "recheck",
    "max_snapshot_bytes": "int",
    "fuse": "bool",
    "cache_dir": "path",
}


def _key_text(key: Any) -> str | None:
    """What a key that is no string may have meant, for "did you mean": ('warmup',) or b'warmup'."""
    if isinstance(key, (tuple, list)) and len(key) == 1:
        key = key[0]
    if isinstance(key, bytes):
        key = key.decode("utf-8", "replace")
    return key if isinstance(key, str) else None


def _named(key: str, value: Any, names: tuple[str, ...], others: str = "") -> str:
    """`value` as one of the string choices `names`, matched ignoring case (the module's rule,
    at CUDA_GRAPH_MODES); else an OptionsError naming what is allowed (`others`: what else
    the option takes) and, for a near miss, the choice meant."""
    if isinstance(value, str) and value.lower() in names:
        return value.lower()
    near = did_you_mean(value.lower(), names) if isinstance(value, str) else ""
    allowed = ", ".join(map(repr, names)) + (f" or {others}" if others else "")
    raise OptionsError(f"option {key!r} must be one of {allowed}, got {value!r}{near}")


def _tolerance_text(text: str) -> Any:
    """GRAPHDISPATCH_FUSE as a tolerance: JSON (`{"rtol": 1e-3, "atol": 1e-5}`) or
    `rtol=1e-3,atol=1e-5`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return {k.strip(): float(v) for k, v in (part.split("=", 1) for part in text.split(",") if part.strip())}
    except ValueError:
        raise OptionsError(f"{ENV_PREFIX}FUSE={text!r}: expected one of {_TRUE + _FALSE}, JSON "
                           f"'{{\"rtol\": r, \"atol\": a}}' or 'rtol=r,atol=a'") from None


def _fuse(value: Any) -> bool | FuseTolerance:
    """`fuse`: True, False, or a tolerance {"rtol": r, "atol": a}, both finite numbers >= 0."""
    if isinstance(value, (bool, FuseTolerance)):
        return value
    wanted = ("rtol", "atol")
    if isinstance(value, Mapping) and set(value) != set(wanted):
        missing = [k for k in wanted if k not in value]
        # a mistyped key is named with its fix, as an unknown option key is
        said = [f"unknown key {k!r}" + (did_you_mean(k, missing or wanted) if isinstance(k, str) else "")
                for k in value if k not in wanted] or [" and ".join(map(repr, missing)) + " missing"]
        raise OptionsError(f"option 'fuse': {'; '.join(said)}: a tolerance is {{'rtol': r, 'atol': a}} (both "
                           f"keys), got {value!r}")
    if not isinstance(value, Mapping):
        raise OptionsError(f"option 'fuse' must be True, False or a tolerance {{'rtol': r, 'atol': a}} (both "
                           f"keys), got {value!r}")
    tol = {}
    for key in ("rtol", "atol"):
        v = value[key]
        try:  # float(10**400) raises OverflowError
            number = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
        except OverflowError:
            number = math.inf
        if not (math.isfinite(number) and number >= 0):
            raise OptionsError(f"option 'fuse': {key} must be a finite number >= 0, got {v!r}")
        tol[key] = number
    return FuseTolerance(tol["rtol"], tol["atol"])


def _validate(key: str, value: Any) -> Any:
    kind = _KINDS[key]
    if key == "fuse":
        return _fuse(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise OptionsError(f"option {key!r} must be True or False, got {value!r}")
        return value
    if kind == "int":
        # No upper bound: a large warmup, verify_inputs or max_captures costs speed or memory,
        # never a check (the report counts each eager call's reason), and max_snapshot_bytes
        # is the user's memory to give. An Integral (numpy's int64) is kept as an int; a bool
        # or a float is refused, not read as a count.
        low = 1 if key in ("warmup", "verify_inputs", "max_captures") else 0
        if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
            raise OptionsError(f"option {key!r} must be an integer >= {low}, got {value!r}")
        return int(value)
    if key == "cuda_graphs":
        if isinstance(value, bool):
            return value
        return _named(key, value, ("auto", "emulate"), "True or False")
    if kind == "recheck":  # recheck, artifact_recheck: runtime/checks/schedule.py
        every = f"an integer N from 1 to {RECHECK_MAX} (the first call, then every Nth)"
        integer = isinstance(value, Integral) and not isinstance(value, bool)
        if integer and is_recheck_mode(int(value)):
            return int(value)
        # 0, 10**30 and "never" ask for the checks off: say why not and what comes nearest
        # ("never" is not a near miss of "every")
        if integer or value is None or value is False or (isinstance(value, str) and value.lower() in _OFF):
            raise OptionsError(f"option {key!r} must be one of {', '.join(map(repr, RECHECK_MODES))} or {every}, "
                               f"got {value!r}: the checks never stop, and {RECHECK_MAX}, the interval 'doubling' "
                               f"settles at, is the sparsest they go ({key}={RECHECK_MAX} for the fewest)")
        return _named(key, value, RECHECK_MODES, every)
    if key == "timing":
        return _named(key, value, TIMING_MODES)
    if key == "cache_dir":
        if value is None or value is False:
            return value
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise OptionsError(f"option 'cache_dir' must be a path, None (the user's cache directory) or False "
                               f"(nothing kept on disk), got {value!r}")
        return os.path.abspath(os.fspath(value))
    if key == "report_dir":
        if value is None:
            return None
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise OptionsError(f"option 'report_dir' must be a path, got {value!r}")
        return os.path.abspath(os.fspath(value))
    if key == "artifacts":
        paths = [value] if isinstance(value, (str, os.PathLike)) else value
        if value is None:
            return ()
        if not isinstance(paths, (list, tuple)) or not all(
            isinstance(p, (str, os.PathLike)) and str(p) for p in paths
        ):
            raise OptionsError(f"option 'artifacts' must be a path or a list of paths, got {value!r}")
        return tuple(os.path.abspath(os.fspath(p)) for p in paths)
    # enable
    if value is None:
        return None
    ids = value.split(",") if isinstance(value, str) else value
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) for i in ids):
        raise OptionsError(
            f"option 'enable' must be a list of artifact ids or a comma-separated string, got {value!r}"
        )
    cleaned = tuple(sorted({i.strip() for i in ids if i.strip()}))
    return cleaned
