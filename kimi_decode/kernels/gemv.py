"""Decode GEMV, `kimi_k3_layer.md` §2 "Linears" (bf16 × bf16, fp32 accumulate; router fp32 out); replaces a cuBLAS GEMM launch (+ the sigmoid-gate multiply / residual add launch when fused).

    out[m, n] = epi( Σ_k x[m, k] · W[n, k] )           W: [N, K] bf16, x: [M, K] bf16, M = 1..64
    epi(a)    = a · σ(gate[m, n])   if gate       (sigmoid output gate, e.g. KDA/MLA g_out)
              + residual[m, n]      if residual
    stored bf16, or fp32 with `out_fp32` (the MoE router logits).

Memory-bound at decode batch: one warp per weight row, each lane loads 8
consecutive bf16 (128-bit `ld.global.v4`) per 256-wide chunk; K is static so
the chunk loop unrolls and every load of a row is in flight together. M is a
symbolic size; rows of x are processed in compile-time tiles of `m_tile`
(grid.y walks the tiles), so for M > m_tile the weights are read M/m_tile
times — the bandwidth-optimal path is M <= 8 (see docs/toolchain.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import compile as kc

VEC = 8  # bf16 per 128-bit load
CHUNK = 32 * VEC  # elements of one row a warp reads per step
MAX_M = 64
M_TILES = (1, 2, 4, 8)
WARPS_CHOICES = (4, 2, 1)


@dataclass(frozen=True)
class GemvKey:
    n: int
    k: int
    m_tile: int = 1
    gate: bool = False
    residual: bool = False
    out_fp32: bool = False
    warps: int = 4  # weight rows (one per warp) per CTA
    arch: str = "sm_90a"

    def __post_init__(self):
        if self.k % VEC:
            raise ValueError(f"K={self.k} must be a multiple of {VEC} (128-bit loads)")
        if self.n % self.warps:
            raise ValueError(f"N={self.n} must be a multiple of warps={self.warps}")
        if self.warps not in WARPS_CHOICES:
            raise ValueError(f"warps={self.warps} not in {WARPS_CHOICES}")
        if self.m_tile not in M_TILES:
            raise ValueError(f"m_tile={self.m_tile} not in {M_TILES}")


def build(key: GemvKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, const_expr

    N, K, MT, WARPS = key.n, key.k, key.m_tile, key.warps
    FULL = K // CHUNK  # chunks every lane reads
    TAIL = (K % CHUNK) // VEC  # lanes that read one more vector
    OUT = Float32 if key.out_fp32 else BFloat16
    GATE, RES = key.gate, key.residual

    @cute.kernel
    def gemv_kernel(mW: cute.Tensor, mX: cute.Tensor, mO: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor):
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, by, _ = cute.arch.block_idx()
        row = bx * WARPS + warp
        m0 = by * MT
        M = mX.shape[0]
        gW = cute.zipped_divide(mW, (1, VEC))  # ((1, VEC), (N, K / VEC))
        gX = cute.zipped_divide(mX, (1, VEC))
        acc = cute.make_rmem_tensor((MT,), Float32)
        for mi in cutlass.range_constexpr(MT):
            acc[mi] = Float32(0.0)
        for c in cutlass.range_constexpr(FULL):
            kv = c * 32 + lane
            w = gW[(None, (row, kv))].load().to(Float32)
            for mi in cutlass.range_constexpr(MT):
                if m0 + mi < M:
                    x = gX[(None, (m0 + mi, kv))].load().to(Float32)
                    acc[mi] = acc[mi] + (w * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        if const_expr(TAIL > 0):
            if lane < TAIL:
                kv = FULL * 32 + lane
                w = gW[(None, (row, kv))].load().to(Float32)
                for mi in cutlass.range_constexpr(MT):
                    if m0 + mi < M:
                        x = gX[(None, (m0 + mi, kv))].load().to(Float32)
                        acc[mi] = acc[mi] + (w * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        for mi in cutlass.range_constexpr(MT):
            s = cute.arch.warp_reduction_sum(acc[mi])
            if lane == mi and m0 + mi < M:
                if const_expr(GATE):
                    g = mG[m0 + mi, row].to(Float32)
                    s = s / (Float32(1.0) + cute.math.exp(-g, fastmath=True))
                if const_expr(RES):
                    s = s + mR[m0 + mi, row].to(Float32)
                mO[m0 + mi, row] = s.to(OUT)

    @cute.jit
    def gemv_host(mW: cute.Tensor, mX: cute.Tensor, mO: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor, stream):
        M = mX.shape[0]
        gemv_kernel(mW, mX, mO, mG, mR).launch(
            grid=(N // WARPS, cute.ceil_div(M, MT), 1), block=(32 * WARPS, 1, 1), stream=stream
        )

    fake = cute.runtime.make_fake_compact_tensor
    m = cute.sym_int()
    w = fake(BFloat16, (N, K), stride_order=(1, 0), assumed_align=16)
    x = fake(BFloat16, (m, K), stride_order=(1, 0), assumed_align=16)
    o = fake(OUT, (m, N), stride_order=(1, 0), assumed_align=16)
    mn = fake(BFloat16, (m, N), stride_order=(1, 0), assumed_align=16)
    # absent epilogue inputs are compiled as (and called with) x, and never read
    g = mn if GATE else fake(BFloat16, (cute.sym_int(), K), stride_order=(1, 0), assumed_align=16)
    r = mn if RES else fake(BFloat16, (cute.sym_int(), K), stride_order=(1, 0), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return gemv_host, (w, x, o, g, r, stream)


# Decode shapes of one TP8 rank (M×K×N of `gpu_facts.md`), compiled ahead of time.
DECODE_SHAPES = [  # (K, N)
    (7168, 2112),
    (7168, 3584),
    (7168, 12288),
    (12288, 7168),
    (3584, 6144),
    (7168, 18432),
]


def aot_keys(arch: str) -> list[GemvKey]:
    keys = [GemvKey(n=n, k=k, m_tile=mt, arch=arch) for k, n in DECODE_SHAPES for mt in (1, 8)]
    keys.append(GemvKey(n=7168, k=12288, gate=False, residual=True, arch=arch))
    keys.append(GemvKey(n=12288, k=7168, gate=True, arch=arch))
    keys.append(GemvKey(n=896, k=7168, out_fp32=True, arch=arch))  # router logits (TP-replicated, 896 experts)
    return keys


SPEC = kc.register(
    kc.KernelSpec(
        name="gemv",
        module=__name__,
        key_type=GemvKey,
        build=build,
        aot_keys=aot_keys,
        ptx_checks=("ld.global.v4",),
    )
)


def pick_m_tile(m: int) -> int:
    return next((t for t in M_TILES if t >= m), M_TILES[-1])


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all operands on one CUDA device)")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major)")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned for 128-bit loads")


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_fp32: bool = False,
    out: torch.Tensor | None = None,
    arch: str | None = None,
) -> torch.Tensor:
    """out = epi(x @ weight.T) for x [M, K] bf16 (M = 1..64), weight [N, K] bf16, on one CUDA device.

    gate, residual: optional [M, N] bf16 (out = (x@Wᵀ)·σ(gate) + residual);
    out_fp32: fp32 output (router). `out` may be given (NaN-poisoned in tests).
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("x and weight must be torch tensors")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"batch M={M} outside the supported 1..{MAX_M}")
    if x.device.type != "cuda":
        raise ValueError(f"gemv runs on a CUDA device, got x on {x.device}")
    dev = x.device
    _check("weight", weight, (N, K), torch.bfloat16, dev)
    _check("x", x, (M, K), torch.bfloat16, dev)
    if gate is not None:
        _check("gate", gate, (M, N), torch.bfloat16, dev)
    if residual is not None:
        _check("residual", residual, (M, N), torch.bfloat16, dev)
    out_dtype = torch.float32 if out_fp32 else torch.bfloat16
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=dev)
    else:
        _check("out", out, (M, N), out_dtype, dev)
    key = GemvKey(
        n=N,
        k=K,
        m_tile=pick_m_tile(M),
        gate=gate is not None,
        residual=residual is not None,
        out_fp32=out_fp32,
        warps=next(w for w in WARPS_CHOICES if N % w == 0),
        arch=kc.resolve_arch(arch),
    )
    fn = kc.load(key)
    fn(weight, x, out, gate if gate is not None else x, residual if residual is not None else x)
    return out
