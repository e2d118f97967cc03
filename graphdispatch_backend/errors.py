"""Typed errors and typed reasons.

Every fallback, rejection, demotion and decline in graphdispatch names one member of an
enum below; reports count them by value and tests compare them by identity. No code
compares a message string to decide anything.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

# How code outside backend.py runs something that may raise anything (artifact code,
# capture): the callable is run and (result, None) or (None, exception) comes back.
# backend.py supplies the implementation; under `strict` it raises StrictModeError.
Contain: TypeAlias = Callable[[Callable[[], Any]], tuple[Any, Exception | None]]


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "", suffix: str = "") -> str:
    """" (did you mean 'x'?)" (or "'x' or 'y'") for the choices closest to a mistyped
    `word`, or "" when none is close: an error that names its fix (option keys, manifest
    keys, artifact ids, bundle folders). Compared as given; said with `prefix` and `suffix`
    around (`GRAPHDISPATCH_` and an option key; a parent folder, a missing path's rest)."""
    choices = list(choices)
    ratio = {c: difflib.SequenceMatcher(None, word, c).ratio() for c in choices}
    near = sorted((c for c in choices if ratio[c] >= 0.6), key=lambda c: -ratio[c])
    near = [c for c in near[:2] if ratio[c] >= ratio[near[0]] - 0.1]  # a second only when as likely
    if not near:  # a case slip: 'Cuda_Graphs'
        near = [c for c in choices if c.lower() == word.lower()][:1]
    return f" (did you mean {' or '.join(repr(prefix + c + suffix) for c in near)}?)" if near else ""


class GraphDispatchError(Exception):
    """Root of every error graphdispatch raises on purpose (and what `strict` raises)."""


class StrictModeError(GraphDispatchError):
    """Raised only under `strict`, by graphdispatch itself, where it would have fallen back.
    The `contain` boundary lets this type (and no other) through: an artifact that raises
    a GraphDispatchError of its own is contained like any other exception."""


class OptionsError(GraphDispatchError, ValueError):
    """An option key or value is not valid; the message names the key and what is allowed."""


class ManifestError(GraphDispatchError, ValueError):
    """A manifest does not follow schema v1; `field` is the dotted path of the bad field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class RegistryError(GraphDispatchError, ValueError):
    """The artifact selection cannot be honoured (for example an unknown id in `enable`)."""


class CudaGraphUnavailable(GraphDispatchError):
    """The CUDA-graph fast path is refused for one runner entry; eager answers instead."""

    def __init__(self, reason: Decline, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


class CaptureRefused(RuntimeError):
    """An operation a CUDA capture does not permit (a host sync, a data-dependent shape, a
    generator the graph does not own), raised by the host model of a capture where CUDA
    raises (runtime/cudagraph/refusals.py). A RuntimeError, as CUDA's own is."""


class KernelExited(RuntimeError):
    """An artifact's code called `sys.exit()` (raised SystemExit): contained as a raise, so
    the kernel is demoted or its bundle fails to load; the user's process goes on."""


class SnapshotRefused(GraphDispatchError):
    """What one call writes cannot be snapshotted within `max_snapshot_bytes` (runtime/checks/world.py):
    a check or capture that needs the snapshot does not run."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class CudaGraphWarmingUp(CudaGraphUnavailable):
    """Not a refusal: the entry still collects warmup observations. Its own type, so a
    reworded message can never turn every warmup into a permanent decline."""

    def __init__(self, remaining: int) -> None:
        super().__init__(Decline.WARMUP, f"{remaining} warmup call(s) left")
        self.remaining = remaining


class Decline(str, enum.Enum):
    """Why a call ran eager instead of replaying a captured graph."""

    # Not refusals: the fast path is on its way.
    WARMUP = "warmup"
    VERIFYING = "verifying"
    BUSY = "busy"  # another thread holds the runner while it captures or verifies
    # a check of the graph against eager, bit for bit, on a piece holding an allclose
    # artifact: run eagerly, the artifact judged beside its region and answering natively
    CHECKED_NATIVELY = "checked_natively"
    # Warmup that is not on its way: every call brings a new shape key (a growing KV cache).
    SHAPE_CHURN = "shape_churn"
    # Refusals of one runner entry (a shape key) or of a whole graph.
    DISABLED = "disabled"  # cuda_graphs=False
    NOT_CUDA = "not_cuda"  # cuda_graphs="auto" or True, but the graph's tensors are not on CUDA
    NO_CUDA_DEVICE = "no_cuda_device"  # cuda_graphs=True on a machine without CUDA
    AUTOGRAD = "autograd"
    BACKEND_ERROR = "backend_error"
    LOWERING_MISMATCH = "lowering_mismatch"  # the lowered graph is not bitwise equal to eager
    LOWERING_FAILED = "lowering_failed"  # the lowered graph raises where eager does not
    # aot traced an op otherwise than eager runs it, on some inputs only (capture/matmul_folds.py)
    LOWERING_UNFAITHFUL = "lowering_unfaithful"
    CONTRACT_MISMATCH = "contract_mismatch"
    MAX_CAPTURES = "max_captures"
    NON_TENSOR_OUTPUT = "non_tensor_output"
    PARAMETER_MOVED = "parameter_moved"
    PINNED_INPUT_MOVED = "pinned_input_moved"
    CAPTURE_FAILED = "capture_failed"
    REPLAY_FAILED = "replay_failed"
    VERIFY_MISMATCH = "verify_mismatch"
    VERIFY_NOT_DISTINCT = "verify_inputs_not_distinct"
    ARTIFACT_DEMOTED = "artifact_demoted"
    NO_CAPTURABLE_PIECE = "no_capturable_piece"
    CHECK_FAILED = "check_failed"  # graphdispatch's own snapshot, copy or comparison raised
    EAGER_NONDETERMINISTIC = "eager_nondeterministic"  # eager disagrees with itself on the same inputs
    OUT_OF_MEMORY = "out_of_memory"  # an allocation failed: eager this call, tried again later
    MULTI_DEVICE = "multi_device"  # the graph's tensors span several CUDA devices
    # the graph writes an input where graphdispatch cannot locate, and a whole snapshot of it
    # is larger than max_snapshot_bytes: nothing that needs the snapshot (a check, a capture) runs
    SNAPSHOT_TOO_LARGE = "snapshot_too_large"
    # under `strict`, a check failed inside the call, which raised StrictModeError instead of
    # answering: counted, so that a strict run's calls add up too
    STRICT_RAISED = "strict_raised"
    # the graph writes inside a tensor subclass (a DTensor's local tensor): no input of the
    # call is what it writes, for the checks to copy and compare
    SUBCLASS_WRITES = "subclass_writes"
    # the call raised the caller's own error (eager raises it on the same inputs: an index past
    # a static cache's end): counted, answered by no output
    RAISED = "raised"


class SplitReason(str, enum.Enum):
    """Why a node cannot sit inside a captured piece (piecewise capture)."""

    SCALAR_READ = "scalar_read"  # aten._local_scalar_dense: a host sync
    ASSERT_SCALAR = "assert_scalar"
    CUDAGRAPH_UNSAFE_TAG = "cudagraph_unsafe_tag"
    RANDOM_OP = "random_op"  # replays would not advance the RNG the way eager does
    FOREIGN_DEVICE = "foreign_device"  # e.g. a CPU tensor inside a CUDA graph
    ARTIFACT_NOT_CAPTURABLE = "artifact_not_capturable"
    EFFECTFUL_OP = "effectful_op"  # with_effects: a side effect (linalg error checks, prints) on every call
    DYNAMIC_OUTPUT_SHAPE = "dynamic_output_shape"  # nonzero, masked_select, unique: sizes known after the kernel
    # a collective whose process group's backend a CUDA graph cannot hold (gloo, any but NCCL): it runs between pieces
    COLLECTIVE = "collective"
    # a tensor made from a Python-number input, made before the piece: one capture serves every value
    SCALAR_INPUT = "scalar_input"
    # a buffer the graph makes and returns (a new KV cache): its piece runs eager, never a
    # pool copy of it and a copy out per call (passes/split_pieces.py)
    MADE_BUFFER = "made_buffer"
    # a buffer the graph makes uninitialized and returns unwritten (its caller fills it: a
    # collective after a graph break): made at each call, as eager makes it, never captured
    UNWRITTEN_BUFFER = "unwritten_buffer"


class FusionStatus(str, enum.Enum):
    """What a graph's fusion (`fuse`) serves: its report's `fusion.status`."""

    PENDING = "pending"  # built, not compiled yet
    FUSED = "fused"  # Inductor's kernels serve the graph's fused ops
    # Inductor generated no kernel (the ops it was given are views, or it left them to ATen):
    # the graph runs its ATen kernels, as unfused
    NOTHING_FUSED = "nothing_fused"
    OFF = "off"  # not fused, by a rule (autograd, dynamic shapes, collectives, no fusable op)
    FUSION_MISMATCH = "fusion_mismatch"  # checks kept finding fused ops off: given up, ATen kernels run
    FAILED = "failed"  # compiling raised: ATen kernels run


class GraphKind(str, enum.Enum):
    """What a graph's record describes: its report's `kind`."""

    INFERENCE = "inference"
    AUTOGRAD = "autograd"  # a graph that records autograd history: its forward (its backward has a record of its own)
    BACKWARD = "backward"  # an autograd graph's backward
    FALLBACK = "fallback"  # compiling it failed: the graph (or backward) runs as it was given (`backend_error`)


class Engine(str, enum.Enum):
    """What captures a graph's pieces: its report's `cuda_graph.mode`."""

    CUDA = "cuda"
    HOST = "host"  # cuda_graphs="emulate": the host model of a capture (runtime/cudagraph/host.py)
    OFF = "off"  # none: the graph's decline says why


class LoweringStatus(str, enum.Enum):
    """How a graph's lowering compared with eager: its report's `lowering_check.status`.
    A lowering found wrong says so with its Decline (lowering_mismatch, lowering_failed,
    eager_nondeterministic, check_failed); these are the others."""

    BITWISE = "bitwise"  # every check found the lowering equal to eager, bit for bit
    WITHIN_TOLERANCE = "within_tolerance"  # fused under a declared tolerance: every check within it
    UNCHECKED = "unchecked"  # no check ran yet
    NOT_LOWERED = "not_lowered"  # nothing to serve: the Dynamo graph answers its calls, never lowered


class FusionOff(str, enum.Enum):
    """Why plan.py leaves a graph unfused under `fuse`: its report's `fusion.status` is `off`,
    with the detail (as it is where no run of the graph holds an op the recipe fuses)."""

    AUTOGRAD = "autograd"
    UNCHECKABLE = "uncheckable"  # aot did not say which inputs it writes: no check against eager
    COLLECTIVES = "collectives"
    DYNAMIC_SHAPES = "dynamic_shapes"
    # Dynamo fixed every input size but left strides symbolic (automatic dynamic, after a
    # recompile for an input of the same shape laid out otherwise): unfused as dynamic
    # shapes are, with a fix of its own to name
    DYNAMIC_STRIDES = "dynamic_strides"
    # every tensor shape fixed, a Python number input symbolic (a sliding-window cache's
    # token count): unfused as dynamic shapes are, said for what it is
    DYNAMIC_SCALARS = "dynamic_scalars"
    NO_RECIPE = "no_recipe"  # no eager-numerics recipe for the device


class KeptWhy(str, enum.Enum):
    """Why an op of a fused graph runs as its ATen kernel: `fusion.kept[].why`."""

    RECIPE = "recipe"  # the recipe does not fuse it (not exact by construction)
    LEARNED = "learned"  # a check of this graph found its fused result off
    CACHE = "cache"  # this graph learned it in an earlier process (the verdict cache)
    # another graph on this device and recipe learned it (the verdict cache's op verdicts)
    DEVICE = "device"


class Rejection(str, enum.Enum):
    """Why an artifact does not substitute a region (matching, at compile time)."""

    MODULE = "module"
    FINGERPRINT = "fingerprint"
    SIGNATURE = "signature"
    DEVICE = "device"
    TORCH_VERSION = "torch_version"
    NOT_ENABLED = "not_enabled"
    NOT_CONVEX = "not_convex"
    NONDETERMINISTIC = "nondeterministic"  # the region draws random numbers
    # the region holds collectives: a check runs it beside the kernel, and a verdict one rank
    # reached alone (a check for its own new inputs, a demotion) would put the ranks out of step
    COLLECTIVE = "collective"
    NOT_SELECTED = "not_selected"  # another artifact won the region
    OVERLAP = "overlap"  # an enclosing or earlier region was already substituted
    LOAD_FAILED = "load_failed"  # entry code would not load (or was tampered with)
    AUTOGRAD = "autograd"  # the graph needs autograd and manifests declare no backward: the region runs native


class Demotion(str, enum.Enum):
    """Why an artifact was demoted to the native region for the rest of the session."""

    PARITY = "parity"
    RAISED = "raised"
    BAD_OUTPUT = "bad_output"  # wrong count, type, shape, dtype, stride, device or memory shared
    MUTATED_INPUT = "mutated_input"
    SLOWER = "slower"  # speed_gate: not faster than native
    DREW = "drew"  # drew from torch's default generator, which its region does not
    CHANGED_SETTINGS = "changed_settings"  # changed a process-wide torch setting (the default dtype, flush-denormal)
    DEMOTED_ELSEWHERE = "demoted_elsewhere"  # its kernel demoted at another region of this kind (gates/kin.py)


class BundleRejection(str, enum.Enum):
    """Why a bundle folder was refused by the registry (its code never runs)."""

    MANIFEST = "manifest"
    UNREADABLE = "unreadable"
    UNSAFE_PATH = "unsafe_path"
    SYMLINK = "symlink"
    PYCACHE = "pycache"
    UNDECLARED_FILE = "undeclared_file"
    MISSING_FILE = "missing_file"
    SIZE_MISMATCH = "size_mismatch"
    HASH_MISMATCH = "hash_mismatch"
    DUPLICATE_ID = "duplicate_id"
    TAMPERED = "tampered"  # the entry file changed between verification and load
    MISSING_ROOT = "missing_root"  # a root (not a bundle) that is not a folder
    UNREADABLE_ROOT = "unreadable_root"  # a root whose folder cannot be listed
    NO_BUNDLES = "no_bundles"  # a root with no artifact.json in it or its subfolders
    # the manifest's `torch` range excludes the torch this process runs: it could serve nothing
    TORCH_VERSION = "torch_version"
    # no statement at the entry file's top level binds entry_point.symbol (read with `ast`, never
    # run): refused before any of its code executes (bundle.entry_tree)
    MISSING_SYMBOL = "missing_symbol"
    # the entry file does not parse (`artifacts verify`; a compile says the SyntaxError itself)
    ENTRY_SYNTAX = "entry_syntax"


class BundleRejected(GraphDispatchError):
    """A bundle folder failed verification."""

    def __init__(self, reason: BundleRejection, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


class AuthoringFailure(str, enum.Enum):
    """An artifact author's mistake found while compiling a graph: logged once at WARNING,
    listed in the report's `authoring`, raised under `strict`. The others have their own
    record: a rejected bundle or root (BundleRejection, in `registry.errors`) and a
    demotion (Demotion, in `substitutions`)."""

    UNMATCHED = "unmatched"  # an enabled artifact whose pattern names no region of the model
    SIGNATURE = "signature"  # the pattern names a region, the signature does not fit it
    # a pinned region.fingerprint refuses a region the rest of the manifest describes (a
    # recompile with symbolic sizes: a fingerprint covers shapes); graph_artifacts.py says when
    FINGERPRINT = "fingerprint"
