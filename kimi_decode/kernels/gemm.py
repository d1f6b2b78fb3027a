"""out = x @ W.T (fp32) for steps of more than 64 tokens: both operands staged in shared memory, tensor cores.

The tensor-core GEMV (`gemv.gemv_partials_mma`, the MoE front and tail above 8 tokens) splits K over its warps and
keeps every warp's accumulators for all of a CTA's rows: 32 rows × 64 tokens a CTA, 232 registers at 64 rows. Above
64 tokens it walks M tiles of 64, so its weights are read once per 64 tokens and every CTA reads its tokens' x from
L2 once per 32 rows: at 512 tokens the MoE front moves about 2 GB through L2 and took 282 µs on an H100 (run 79,
`moe_breakdown_512_h100_tp8`), the tail 233.

Here a CTA computes a tile of `bn` weight rows × `bm` tokens. A producer warp streams the tile's K slices (`bk` wide)
of both operands into a ring of `stages` shared-memory slots by bulk copies, one per row segment (the 32 lanes issue
a slot's copies together; its mbarrier counts the bytes), the rows padded by 16 bytes so that the mma fragments'
32-bit loads (lane 4g + c: row g, word c) hit 32 distinct banks. Eight compute warps, 4 × 2 over (rows, tokens), each
take 32 rows × bm/2 tokens: two m16 row tiles × bm/16 n8 token tiles of `mma.sync.m16n8k16` (A: the weight rows, B:
the tokens' x), accumulating in registers over all of K; they hand each slot back on a named barrier of its own
(bar.arrive), which the producer waits on before the refill. The M tiles of a row block are adjacent in the grid
(x: M tile, y: row block), so that they run together and their weight slices are read from HBM once.

Tokens past M in the last M tile are not copied: their B columns hold whatever the slot held, and their outputs are
not stored (the mma's columns are independent).

With `tail_tp` (the MoE tail above 64 tokens, `fused_moe`'s 'tgemm') the epilogue is the tensor-core tail GEMV's
(`kernels.moe.build_tail`): x is r ⊙ w_norm, each output is scaled by the RMSNorm's rsqrt(Σ r² / K + eps) of its
token, the shared all-reduce's `tail_tp` buffers are added with their runtime weights, and the sum is stored as
bf16; the same fp32 operations in the same order. Estimated at 512 tokens (docs/fused_moe.md, "What would close the
gap"): about 0.69 GB through L2 for the front at bm = 128, 110-150 µs; not yet measured on a GPU.
"""

from dataclasses import dataclass

import torch

from .. import compile as kc

GEMM_WARPS = 8  # compute warps: 4 along the rows × 2 along the tokens; warp GEMM_WARPS is the producer
ROW_PAD = 16  # bytes after each staged row segment (a row's words start 4 banks after the previous row's)
SMEM_BUDGET = 227 * 1024
SLOT_BAR = 1  # named barriers SLOT_BAR .. SLOT_BAR + stages - 1: slot s handed back to the producer


@dataclass(frozen=True)
class GemmKey:
    n: int  # weight rows (output columns)
    k: int
    bn: int = 128  # weight rows per CTA (4 warps of 32)
    bm: int = 128  # tokens per CTA (2 warps of bm / 2)
    bk: int = 64  # K per ring slot
    stages: int = 4
    tail_tp: int = 0  # 0: out = x @ W.T in fp32; 8 or 16: the MoE tail's epilogue over that many shared buffers
    eps: float = 1e-5  # the RMSNorm's, with tail_tp
    arch: str = "sm_90a"

    def __post_init__(self):
        if self.bn != 128:
            raise ValueError(f"gemm: bn must be 128 (4 row warps of 32 rows), got {self.bn}")
        if self.bm not in (64, 128):
            raise ValueError(f"gemm: bm must be 64 or 128 tokens a CTA, got {self.bm}")
        if self.bk not in (32, 64, 128):
            raise ValueError(f"gemm: bk must be 32, 64 or 128, got {self.bk}")
        if self.n % self.bn:
            raise ValueError(f"gemm: N={self.n} must be a multiple of bn={self.bn}")
        if self.k % self.bk:
            raise ValueError(f"gemm: K={self.k} must be a multiple of bk={self.bk}")
        if self.tail_tp not in (0, 8, 16):
            raise ValueError(f"gemm: tail_tp must be 0 (plain fp32 out) or the MoE tail's TP (8 or 16), got "
                             f"{self.tail_tp}")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"gemm: stages must be 2..8, got {self.stages}")
        if gemm_smem_bytes(self) > SMEM_BUDGET:
            raise ValueError(f"gemm: {self.stages} slots of {slot_bytes(self)} B need {gemm_smem_bytes(self)} B of "
                             f"shared memory, over the {SMEM_BUDGET} B a CTA may take")


def row_bytes(key: GemmKey) -> int:
    """Bytes between two staged rows of a slot: a row segment of bk bf16 and the pad."""
    return 2 * key.bk + ROW_PAD


def slot_bytes(key: GemmKey) -> int:
    return (key.bn + key.bm) * row_bytes(key)


def gemm_smem_bytes(key: GemmKey) -> int:
    return key.stages * slot_bytes(key) + 8 * key.stages + 128


def build(key: GemmKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Int64

    from .moe_pipe import ring_init
    from .ptx_ops import bulk_g2s, mma_bf16

    N, K, BN, BM, BK, ST = key.n, key.k, key.bn, key.bm, key.bk, key.stages
    TP, EPS = key.tail_tp, key.eps
    RW = row_bytes(key) // 4  # words between staged rows
    SEG = 2 * BK  # bytes of one row segment
    W_SLOT = BN * RW  # words of a slot's weight rows
    SLOT = (BN + BM) * RW  # words of a slot
    NK = K // BK
    KS = BK // 16  # k16 steps a slot
    TM = BM // 2 // 8  # n8 token tiles a warp
    WARPS = GEMM_WARPS
    THREADS = 32 * (WARPS + 1)
    COPIES = (BN + BM) // 32  # row segments a producer lane copies for a full slot
    assert (BN + BM) % 32 == 0 and SLOT_BAR + ST <= 16
    mma, bulk = mma_bf16(), bulk_g2s()

    @cute.jit
    def fill(it: Int32, slot: Int32, lane: Int32, n0: Int32, m0: Int32, mrows: Int32, mW: cute.Tensor,
             mX: cute.Tensor, bars: cute.Tensor, base: Int32):
        """(the producer warp, inlined) K slice `it` of the tile's BN weight rows and its mrows tokens into `slot`:
        lane 0 arms the slot's mbarrier with the bytes, then each lane copies its share of the row segments"""
        bar = bars.iterator + slot
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, (BN + mrows) * SEG)
        cute.arch.sync_warp()
        k0 = it * BK
        dst = base + slot * (SLOT * 4)
        for j in cutlass.range_constexpr(COPIES):
            r = lane + 32 * j
            if r < BN:
                bulk(dst + r * (RW * 4), mW.iterator.toint() + (Int64(n0 + r) * K + k0) * 2, SEG, bar.toint())
            elif r - BN < mrows:
                t = r - BN
                bulk(dst + (W_SLOT + t * RW) * 4, mX.iterator.toint() + (Int64(m0 + t) * K + k0) * 2, SEG,
                     bar.toint())

    def store(mO, t, n, v, mSsq, mSh, cf):
        """(traced in line, no control flow of its own) output (token t, row n) from its fp32 sum v: as it is, or
        with the MoE tail's epilogue"""
        if TP == 0:
            mO[t, n] = v
        else:
            s = v * cute.math.rsqrt(mSsq[t] * Float32(1.0 / K) + Float32(EPS))
            for p_ in range(TP):
                s = s + cf[p_] * mSh[p_, t, n].to(Float32)
            mO[t, n] = s.to(BFloat16)

    @cute.kernel
    def gemm_kernel(mW: cute.Tensor, mX: cute.Tensor, mSsq: cute.Tensor, mSh: cute.Tensor, mCoef: cute.Tensor,
                    mO: cute.Tensor):
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, by, _ = cute.arch.block_idx()
        M = mX.shape[0]
        m0 = bx * BM
        n0 = by * BN
        mrows = cutlass.min(M - m0, BM)
        smem = cutlass.utils.SmemAllocator()
        ring = smem.allocate_tensor(Int32, cute.make_layout((ST, SLOT), stride=(SLOT, 1)), byte_alignment=128)
        bars = smem.allocate_tensor(cutlass.Int64, cute.make_layout((ST,)), byte_alignment=8)
        ring_init()(bars, ST)
        base = ring.iterator.toint()
        if warp == WARPS:
            for s in cutlass.range_constexpr(ST):
                if s < NK:
                    fill(Int32(s), Int32(s), lane, n0, m0, mrows, mW, mX, bars, base)
        g = lane // 4
        c = lane - 4 * g
        wr = warp % 4  # rows 32·wr .. 32·wr + 31 of the tile
        wm = warp // 4  # tokens (bm/2)·wm ..
        acc = cute.make_rmem_tensor((2 * TM * 4,), Float32)  # (row tile i, token tile j) at 4 (TM i + j)
        for q in cutlass.range_constexpr(2 * TM * 4):
            acc[q] = Float32(0.0)
        for it in cutlass.range(NK, unroll=1):
            slot = it % ST
            if warp < WARPS:
                cute.arch.mbarrier_wait(bars.iterator + slot, (it // ST) % 2)
                for ks in cutlass.range_constexpr(KS):
                    wo = 8 * ks + c
                    a = []
                    for i in cutlass.range_constexpr(2):
                        r = (32 * wr + 16 * i + g) * RW + wo
                        a.append([ring[slot, r], ring[slot, r + 8 * RW], ring[slot, r + 4], ring[slot, r + 8 * RW + 4]])
                    for j in cutlass.range_constexpr(TM):
                        t = W_SLOT + ((BM // 2) * wm + 8 * j + g) * RW + wo
                        b = [ring[slot, t], ring[slot, t + 4]]
                        for i in cutlass.range_constexpr(2):
                            o = 4 * (TM * i + j)
                            d = mma(a[i], b, [acc[o], acc[o + 1], acc[o + 2], acc[o + 3]])
                            for q in cutlass.range_constexpr(4):
                                acc[o + q] = d[q]
                cute.arch.barrier_arrive(barrier_id=SLOT_BAR + slot, number_of_threads=THREADS)
            else:  # the producer: once the compute warps are done with this slot, the slice ST later into it
                cute.arch.barrier(barrier_id=SLOT_BAR + slot, number_of_threads=THREADS)
                if it + ST < NK:
                    cute.arch.fence_view_async_shared()
                    fill(it + ST, slot, lane, n0, m0, mrows, mW, mX, bars, base)
        if warp < WARPS:  # c0 c1: row g, tokens 2c, 2c + 1 of the n8 tile; c2 c3: row g + 8, the same tokens
            cf = []
            for p_ in cutlass.range_constexpr(TP):
                cf.append(mCoef[p_])
            for i in cutlass.range_constexpr(2):
                for j in cutlass.range_constexpr(TM):
                    for q in cutlass.range_constexpr(4):
                        t = (BM // 2) * wm + 8 * j + 2 * c + (q % 2)
                        if t < mrows:
                            store(mO, m0 + t, n0 + 32 * wr + 16 * i + g + 8 * (q // 2), acc[4 * (TM * i + j) + q],
                                  mSsq, mSh, cf)

    def launch(mW, mX, mSsq, mSh, mCoef, mO, stream):
        M = mX.shape[0]
        gemm_kernel(mW, mX, mSsq, mSh, mCoef, mO).launch(grid=(cute.ceil_div(M, BM), N // BN, 1),
                                                         block=(THREADS, 1, 1), smem=gemm_smem_bytes(key),
                                                         stream=stream)

    @cute.jit
    def gemm_host(mW: cute.Tensor, mX: cute.Tensor, mO: cute.Tensor, stream):
        launch(mW, mX, mX, mX, mX, mO, stream)  # no epilogue inputs: x in their places, never read

    @cute.jit
    def tail_host(mW: cute.Tensor, mX: cute.Tensor, mSsq: cute.Tensor, mSh: cute.Tensor, mCoef: cute.Tensor,
                  mO: cute.Tensor, stream):  # the arguments of the MoE tail GEMV (`kernels.moe.build_tail`)
        launch(mW, mX, mSsq, mSh, mCoef, mO, stream)

    fake = cute.runtime.make_fake_compact_tensor
    m = cute.sym_int()
    w = fake(BFloat16, (N, K), stride_order=(1, 0), assumed_align=16)
    x = fake(BFloat16, (m, K), stride_order=(1, 0), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if TP == 0:
        return gemm_host, (w, x, fake(Float32, (m, N), stride_order=(1, 0), assumed_align=16), stream)
    return tail_host, (w, x, fake(Float32, (m,), assumed_align=16),
                       fake(BFloat16, (TP, m, N), stride_order=(2, 1, 0), assumed_align=16),
                       fake(Float32, (TP,), assumed_align=16),
                       fake(BFloat16, (m, N), stride_order=(1, 0), assumed_align=16), stream)


# (K, N) of the MoE front (router, latent down, shared gate/up) and tail (W_up) at TP8 and TP16, and a test shape
# whose K is not a multiple of a whole ring of slices
MOE_SHAPES = [(7168, 6016), (3584, 7168), (7168, 5248)]
TEST_SHAPE = (1472, 256)


TAIL_SHAPE = (3584, 7168)  # (K, N) of W_up (replicated: the same at TP8 and TP16)


def tail_key(tp: int, bm: int, arch: str = "sm_90a", eps: float = 1e-5) -> GemmKey:
    """The MoE tail as this GEMM ('tgemm'): r ⊙ w_norm against W_up with the tail's epilogue over tp buffers (eps:
    the RMSNorm's, `moe.MoEShape.eps`; built ahead of time at 1e-5)."""
    k, n = TAIL_SHAPE
    return GemmKey(n=n, k=k, bm=bm, tail_tp=tp, eps=eps, arch=arch)


def aot_keys(arch: str) -> list[GemmKey]:
    keys = [GemmKey(n=n, k=k, bm=bm, arch=arch) for k, n in MOE_SHAPES for bm in (64, 128)]
    keys += [GemmKey(n=TEST_SHAPE[1], k=TEST_SHAPE[0], bm=bm, arch=arch) for bm in (64, 128)]
    keys += [tail_key(tp, bm, arch) for tp in (8, 16) for bm in (64, 128)]
    keys += [GemmKey(n=TEST_SHAPE[1], k=TEST_SHAPE[0], bm=64, tail_tp=8, arch=arch)]  # the epilogue's quick test
    return keys


SPEC = kc.register(kc.KernelSpec(name="gemm", module=__name__, key_type=GemmKey, build=build, aot_keys=aot_keys,
                                 ptx_checks=("cp.async.bulk", "mma.sync", "bar.arrive")))

MIN_M = 65  # below this the tensor-core GEMV (one M tile of 64) is the kernel for it
MAX_M = 512


def gemm(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None, bm: int = 128,
         arch: str | None = None) -> torch.Tensor:
    """out = x @ weight.T in fp32 for x [M, K] bf16 (M = 65..512), weight [N, K] bf16 (N a multiple of 128, K of 64),
    on one CUDA device. `out` ([M, N] fp32) may be given (NaN-poisoned in tests). bm: tokens per CTA (64 or 128)."""
    from .gemv import _check, check_operands

    M, K, N, dev = check_operands("gemm", x, weight, MIN_M, MAX_M, " (fewer: the tensor-core GEMV, gemv.gemv)")
    if out is None:
        out = torch.empty((M, N), dtype=torch.float32, device=dev)
    else:
        _check("out", out, (M, N), torch.float32, dev)
    key = GemmKey(n=N, k=K, bm=bm, arch=kc.resolve_arch(arch))  # a shape outside it raises before any launch
    kc.load(key)(weight, x, out)
    return out


def tail_gemm(x: torch.Tensor, weight: torch.Tensor, ssq: torch.Tensor, shared: torch.Tensor, coef: torch.Tensor, *,
              out: torch.Tensor | None = None, bm: int = 128, eps: float = 1e-5,
              arch: str | None = None) -> torch.Tensor:
    """The MoE tail above 64 tokens as this GEMM, with the tail GEMV's epilogue (`kernels.moe.build_tail`):
    out[t, n] = bf16((x[t] · weight[n]) · rsqrt(ssq[t] / K + eps) + Σ_p coef[p] · shared[p, t, n]) for x [M, K] bf16
    (r ⊙ w_norm, M = 65..512), weight [N, K] bf16, ssq [M] fp32 (Σ r² of each token), shared [tp, M, N] bf16 (the
    shared all-reduce's buffers, tp 8 or 16) and coef [tp] fp32 (their weights). `out` ([M, N] bf16) may be given."""
    from .gemv import _check, check_operands

    M, K, N, dev = check_operands("tail_gemm", x, weight, MIN_M, MAX_M, " (fewer: the tensor-core tail GEMV)")
    if not isinstance(shared, torch.Tensor) or shared.dim() != 3:
        raise ValueError(f"shared must be [tp, M, N], got {tuple(getattr(shared, 'shape', ()))}")
    tp = shared.shape[0]
    if tp not in (8, 16):
        raise ValueError(f"tail_gemm: shared must hold the MoE tail's 8 or 16 all-reduce buffers (TP8, TP16), got {tp}")
    _check("ssq", ssq, (M,), torch.float32, dev)
    _check("shared", shared, (tp, M, N), torch.bfloat16, dev)
    _check("coef", coef, (tp,), torch.float32, dev)
    if out is None:
        out = torch.empty((M, N), dtype=torch.bfloat16, device=dev)
    else:
        _check("out", out, (M, N), torch.bfloat16, dev)
    key = GemmKey(n=N, k=K, bm=bm, tail_tp=tp, eps=eps, arch=kc.resolve_arch(arch))  # raises before any launch
    kc.load(key)(weight, x, ssq, shared, coef, out)
    return out


__all__ = ["GemmKey", "gemm", "tail_gemm", "tail_key", "gemm_smem_bytes", "slot_bytes", "MOE_SHAPES", "TAIL_SHAPE"]
