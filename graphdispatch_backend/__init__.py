"""graphdispatch: a torch.compile backend for verified kernel substitution and CUDA-graph replay.

    compiled = torch.compile(model, backend="graphdispatch",
                             options={"artifacts": "my_kernels/", "report_dir": "gd_out"})

The backend is registered through the `torch_dynamo_backends` entry point; importing this
package is not needed to use it. The public API here is for reports and tooling.
"""

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

__version__ = "0.1.0"

__all__ = [
    "CudaGraphUnavailable",
    "CudaGraphWarmingUp",
    "Decline",
    "Demotion",
    "GraphDispatchError",
    "ManifestError",
    "Options",
    "OptionsError",
    "Rejection",
    "RegistryError",
    "StrictModeError",
    "flush",
    "latest_report",
    "reset",
]
