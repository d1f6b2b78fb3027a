"""CuTe DSL decode kernels, one file per fused kernel.

Each file holds its compile key (a frozen dataclass), `build(key)` (the CuTe
DSL code; imports cutlass only when called), the keys compiled ahead of time,
and a torch-facing entry point that validates its inputs before any launch.
Importing this package registers every kernel with `kimi_decode.compile`; it
does not need the CuTe DSL compiler.
"""

from . import attn_res, gemm, gemv, mma_rate, moe, moe_front_ring, moe_pipe, moe_wide, moe_tail_ring, ring_rate  # noqa: F401  (registers the kernels)

# entry points: kimi_decode.kernels.gemv.gemv, kimi_decode.kernels.gemm.gemm, kimi_decode.kernels.attn_res.attn_res_fused
__all__ = ["attn_res", "gemm", "gemv", "mma_rate", "moe", "moe_front_ring", "moe_pipe", "moe_tail_ring", "moe_wide", "ring_rate"]
