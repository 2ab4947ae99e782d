"""tpfuse: fused all-reduce + epilogue ops for tensor-parallel inference, as torch ops.

The ops are registered from C++ (``torch.ops.tpfuse.*``, no Python on the per-call path); this
package loads them and wraps teams:

    import tpfuse
    team = tpfuse.Team.from_group(group)          # one rank per process, over NCCL
    norm, residual = tpfuse.allreduce_add_rmsnorm(team, partial, residual, weight, eps)

Ops take the team as an int handle (``team.handle``), which torch.compile and CUDA graphs treat
as a constant.
"""


import torch

from ._library import library_path

torch.ops.load_library(library_path())

# The library's version (CMakeLists.txt's project(VERSION), the one source of the number).
__version__ = torch.ops.tpfuse.version()

from .ops import (  # noqa: E402  (the library must be loaded first)
    ALGORITHMS,
    Algorithm,
    NormWeight,
    Quant,
    RopeStyle,
    allreduce,
    allreduce_add_rmsnorm,
    allreduce_add_rmsnorm_,
    allreduce_add_rmsnorm_fp8,
    allreduce_add_rmsnorm_fp8_,
    allreduce_moe_finalize_add_rmsnorm,
    allreduce_qk_rmsnorm,
    reject_call,
)
from .team import Team, cpu_team, cuda_team  # noqa: E402

__all__ = [
    "__version__",
    "ALGORITHMS",
    "Algorithm",
    "NormWeight",
    "Quant",
    "RopeStyle",
    "Team",
    "allreduce",
    "allreduce_add_rmsnorm",
    "allreduce_add_rmsnorm_",
    "allreduce_add_rmsnorm_fp8",
    "allreduce_add_rmsnorm_fp8_",
    "allreduce_moe_finalize_add_rmsnorm",
    "allreduce_qk_rmsnorm",
    "cpu_team",
    "cuda_team",
    "library_path",
    "reject_call",
]
