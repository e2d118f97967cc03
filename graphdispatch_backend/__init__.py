"""graphdispatch: a torch.compile backend for verified kernel substitution and CUDA-graph replay.

    compiled = torch.compile(model, backend="graphdispatch",
                             options={"artifacts": "my_kernels/", "report_dir": "gd_out"})

The backend is registered through the `torch_dynamo_backends` entry point; importing this
package is not needed to use it. The public API here is for reports and tooling.

Importing the package imports nothing heavy: the names below are loaded on first use
(`flush`, `latest_report` and `reset` bring in torch through the session; `load_report`,
which reads a report directory, does not), so the command line (`python -m
graphdispatch_backend --help`, `report`, `artifacts verify`) starts in well under a second
where `import torch` alone takes seconds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "CudaGraphUnavailable": "graphdispatch_backend.errors",
    "CudaGraphWarmingUp": "graphdispatch_backend.errors",
    "Decline": "graphdispatch_backend.errors",
    "Demotion": "graphdispatch_backend.errors",
    "GraphDispatchError": "graphdispatch_backend.errors",
    "ManifestError": "graphdispatch_backend.errors",
    "OptionsError": "graphdispatch_backend.errors",
    "RegistryError": "graphdispatch_backend.errors",
    "Rejection": "graphdispatch_backend.errors",
    "StrictModeError": "graphdispatch_backend.errors",
    "ReportError": "graphdispatch_backend.diagnostics.report_dir",
    "load_report": "graphdispatch_backend.diagnostics.report_dir",
    "Options": "graphdispatch_backend.options",
    "flush": "graphdispatch_backend.session",
    "latest_report": "graphdispatch_backend.session",
    "reset": "graphdispatch_backend.session",
}

__all__ = [
    "CudaGraphUnavailable",
    "CudaGraphWarmingUp",
    "Decline",
    "Demotion",
    "GraphDispatchError",
    "ManifestError",
    "Options",
    "OptionsError",
    "RegistryError",
    "Rejection",
    "ReportError",
    "StrictModeError",
    "flush",
    "latest_report",
    "load_report",
    "reset",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'graphdispatch_backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:
    from graphdispatch_backend.diagnostics.report_dir import ReportError, load_report
    from graphdispatch_backend.errors import (
        CudaGraphUnavailable,
        CudaGraphWarmingUp,
        Decline,
        Demotion,
        GraphDispatchError,
        ManifestError,
        OptionsError,
        RegistryError,
        Rejection,
        StrictModeError,
    )
    from graphdispatch_backend.options import Options
    from graphdispatch_backend.session import flush, latest_report, reset
