"""AttnRes + RMSNorm, `kimi_k3_layer.md` §3.2 steps 1–4 in one launch; replaces stock vLLM's `_attn_res_kernel` (Triton).

Per token t (batch 1..64; one cluster of CTAs per token), fp32 math:
    1. p ← bf16(p + δ)                       (in place, if `delta`)
    2. B[j] ← p                              (if `write_block`; j is a runtime argument)
    3. v_0..v_{n-1} = B[0..n-1], v_n = p
       ℓ_i = (Σ_c v_i·w_n·w_q) · rsqrt(mean_c(v_i²) + ε);  a = softmax(ℓ);  m = Σ_i a_i v_i
       (n = 0: m = p)
    4. y = RMSNorm(m; w_o, ε_o) if `norm_out` else m, stored bf16.

A token is spread over a cluster of `cluster` CTAs (4: one SM alone cannot
pull a token's 9 × 14 KB fast enough), each thread owning `vec_per_thread`
128-bit vectors of the hidden dim (224 threads per CTA for d = 7168). All n+1
source rows are loaded into registers up front (for batches over 16 with
n >= 5 they are re-read for the weighted sum instead of held, so that more
CTAs fit per SM); the 2(n+1) partial sums are reduced in shared memory,
exchanged between the cluster's CTAs through distributed shared memory (one
cluster barrier), and the optional output norm costs one more round.
"""


import dataclasses
from dataclasses import dataclass

import torch

from .. import compile as kc

VEC = 8  # bf16 per 128-bit load
MAX_BATCH = 64
RELOAD_MIN_N, RELOAD_MIN_BATCH = 5, 17  # reload_sources for n >= 5 at batch >= 17


@dataclass(frozen=True)
class AttnResKey:
    n: int  # block sources (0..slots)
    delta: bool = True  # p += δ first
    write_block: bool = False  # B[j] ← p
    norm_out: bool = True  # y = RMSNorm(m; w_o)
    d: int = 7168
    slots: int = 8
    vec_per_thread: int = 1
    cluster: int = 4  # CTAs per token
    reload_sources: bool = False  # re-read B for the weighted sum (fewer registers; large batches)
    arch: str = "sm_90a"

    def __post_init__(self):
        if not 0 <= self.n <= self.slots:
            raise ValueError(f"n={self.n} outside 0..{self.slots}")
        if not 1 <= self.cluster <= 8:
            raise ValueError(f"cluster={self.cluster} outside 1..8")
        threads, rem = divmod(self.d, VEC * self.vec_per_thread * self.cluster)
        if rem or threads % 32 or threads > 1024:
            raise ValueError(
                f"d={self.d} must split into {self.cluster} CTAs of 32..1024 threads (a multiple of 32) of "
                f"{self.vec_per_thread}×{VEC} elements"
            )

    @property
    def threads(self) -> int:
        return self.d // (VEC * self.vec_per_thread * self.cluster)


def build(key: AttnResKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, const_expr

    D, S, NSRC, V, C = key.d, key.slots, key.n, key.vec_per_thread, key.cluster
    T = key.threads
    NW = T // 32
    NV = 2 * (NSRC + 1)  # (dot, sum of squares) per source
    DELTA, WRITE, NORM, RELOAD = key.delta, key.write_block, key.norm_out, key.reload_sources
    INV_D = 1.0 / D

    @cute.jit
    def cluster_sum(vals: list, buf: cute.Tensor, xbuf: cute.Tensor, tid, lane, warp, rank):
        """Sum each scalar of `vals` over the token's CTAs: warps -> smem -> peers' smem (DSMEM)."""
        for i in cutlass.range_constexpr(len(vals)):
            s = cute.arch.warp_reduction_sum(vals[i])
            if lane == 0:
                buf[warp, i] = s
        cute.arch.barrier()
        out = []
        for i in cutlass.range_constexpr(len(vals)):
            v = Float32(0.0)
            if lane < NW:
                v = buf[lane, i]
            out.append(cute.arch.warp_reduction_sum(v))
        if const_expr(C == 1):
            return out
        # thread c < C writes this CTA's sums into row `rank` of CTA c's exchange buffer
        if tid < C:
            for i in cutlass.range_constexpr(len(vals)):
                remote = cute.arch.map_dsmem_ptr(xbuf.iterator + (rank * len(vals) + i), tid)
                cute.arch.inline_ptx(
                    "st.shared::cluster.f32 [{$r0}], {$r1};", read_only_args=[Int32(remote.toint()), out[i]]
                )
        cute.arch.cluster_arrive()  # release: the DSMEM stores above are visible after the wait
        cute.arch.cluster_wait()
        total = []
        for i in cutlass.range_constexpr(len(vals)):
            acc = xbuf[0, i]
            for c in cutlass.range_constexpr(1, C):
                acc = acc + xbuf[c, i]
            total.append(acc)
        return total

    @cute.kernel
    def attn_res_kernel(
        mP: cute.Tensor,
        mD: cute.Tensor,
        mB: cute.Tensor,
        mWn: cute.Tensor,
        mWq: cute.Tensor,
        mWo: cute.Tensor,
        mY: cute.Tensor,
        j: Int32,
        eps: Float32,
        eps_o: Float32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        t = bx // C
        rank = bx - t * C  # == block rank in the cluster (cluster = (C, 1, 1) along x)
        if const_expr(C > 1):
            cute.arch.cluster_arrive_relaxed()  # peers must have started before DSMEM stores
        smem = cutlass.utils.SmemAllocator()
        buf = smem.allocate_tensor(Float32, cute.make_layout((NW, NV), stride=(NV, 1)), byte_alignment=16)
        buf_o = smem.allocate_tensor(Float32, cute.make_layout((NW, 1), stride=(1, 1)), byte_alignment=16)
        xbuf = smem.allocate_tensor(Float32, cute.make_layout((C, NV), stride=(NV, 1)), byte_alignment=16)
        xbuf_o = smem.allocate_tensor(Float32, cute.make_layout((C, 1), stride=(1, 1)), byte_alignment=16)
        base = rank * (V * T) + tid  # this thread's first vector of the hidden dim
        gP = cute.zipped_divide(mP[t, None], (VEC,))  # this token's row as ((VEC), (D / VEC))
        gD = cute.zipped_divide(mD[t, None], (VEC,))
        gY = cute.zipped_divide(mY[t, None], (VEC,))
        gWn = cute.zipped_divide(mWn, (VEC,))
        gWq = cute.zipped_divide(mWq, (VEC,))
        gWo = cute.zipped_divide(mWo, (VEC,))

        # 1-2: p (+ δ), written back and into its block slot
        p = []
        for v in cutlass.range_constexpr(V):
            vi = base + v * T
            pv = gP[(None, vi)].load()
            if const_expr(DELTA):
                pv = (pv.to(Float32) + gD[(None, vi)].load().to(Float32)).to(BFloat16)
                gP[(None, vi)].store(pv)
            if const_expr(WRITE):
                cute.zipped_divide(mB[t, j, None], (VEC,))[(None, vi)].store(pv)
            p.append(pv)

        # 3: softmax over the n block sources and p
        m = []
        if const_expr(NSRC == 0):
            for v in cutlass.range_constexpr(V):
                m.append(p[v].to(Float32))
        else:
            src = []
            for i in cutlass.range_constexpr(NSRC):
                row = []
                gB = cute.zipped_divide(mB[t, i, None], (VEC,))
                for v in cutlass.range_constexpr(V):
                    row.append(gB[(None, base + v * T)].load())
                src.append(row)
            src.append(p)
            wq = []
            for v in cutlass.range_constexpr(V):
                vi = base + v * T
                wq.append(gWn[(None, vi)].load().to(Float32) * gWq[(None, vi)].load().to(Float32))
            partial = []
            for i in cutlass.range_constexpr(NSRC + 1):
                dot = Float32(0.0)
                ss = Float32(0.0)
                for v in cutlass.range_constexpr(V):
                    x = src[i][v].to(Float32)
                    dot = dot + (x * wq[v]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    ss = ss + (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                partial.append(dot)
                partial.append(ss)
            if const_expr(C > 1):
                cute.arch.cluster_wait()
            total = cluster_sum(partial, buf, xbuf, tid, lane, warp, rank)
            logit = []
            for i in cutlass.range_constexpr(NSRC + 1):
                logit.append(total[2 * i] * cute.math.rsqrt(total[2 * i + 1] * INV_D + eps))
            mx = logit[0]
            for i in cutlass.range_constexpr(1, NSRC + 1):
                mx = cute.arch.fmax(mx, logit[i])
            e = []
            z = Float32(0.0)
            for i in cutlass.range_constexpr(NSRC + 1):
                e.append(cute.math.exp(logit[i] - mx))
                z = z + e[i]
            rz = Float32(1.0) / z
            if const_expr(RELOAD):  # re-read the blocks (L2-hot) instead of holding them: fewer registers
                for i in cutlass.range_constexpr(NSRC):
                    gB = cute.zipped_divide(mB[t, i, None], (VEC,))
                    for v in cutlass.range_constexpr(V):
                        src[i][v] = gB[(None, base + v * T)].load()
            for v in cutlass.range_constexpr(V):
                acc = src[0][v].to(Float32) * (e[0] * rz)
                for i in cutlass.range_constexpr(1, NSRC + 1):
                    acc = acc + src[i][v].to(Float32) * (e[i] * rz)
                m.append(acc)

        # 4: output RMSNorm
        if const_expr(NORM):
            ss = Float32(0.0)
            for v in cutlass.range_constexpr(V):
                ss = ss + (m[v] * m[v]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if const_expr(NSRC == 0 and C > 1):
                cute.arch.cluster_wait()
            tot = cluster_sum([ss], buf_o, xbuf_o, tid, lane, warp, rank)
            r = cute.math.rsqrt(tot[0] * INV_D + eps_o)
            for v in cutlass.range_constexpr(V):
                vi = base + v * T
                gY[(None, vi)].store((m[v] * r * gWo[(None, vi)].load().to(Float32)).to(BFloat16))
        else:
            if const_expr(NSRC == 0 and C > 1):
                cute.arch.cluster_wait()  # pair the opening arrive
            for v in cutlass.range_constexpr(V):
                gY[(None, base + v * T)].store(m[v].to(BFloat16))

    @cute.jit
    def attn_res_host(
        mP: cute.Tensor,
        mD: cute.Tensor,
        mB: cute.Tensor,
        mWn: cute.Tensor,
        mWq: cute.Tensor,
        mWo: cute.Tensor,
        mY: cute.Tensor,
        j: Int32,
        eps: Float32,
        eps_o: Float32,
        stream,
    ):
        tokens = mP.shape[0]
        attn_res_kernel(mP, mD, mB, mWn, mWq, mWo, mY, j, eps, eps_o).launch(
            grid=(tokens * C, 1, 1),
            block=(T, 1, 1),
            cluster=(C, 1, 1),
            smem=4 * (NW + C) * (NV + 1) + 128,
            stream=stream,
        )

    fake = cute.runtime.make_fake_compact_tensor
    tok = cute.sym_int()
    row = fake(BFloat16, (tok, D), stride_order=(1, 0), assumed_align=16)
    blocks = fake(BFloat16, (tok, S, D), stride_order=(2, 1, 0), assumed_align=16)
    vec = fake(BFloat16, (D,), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    # p, δ (p when absent: never read), B, w_n, w_q, w_o (w_n when absent), y, j, ε, ε_o
    return attn_res_host, (row, row, blocks, vec, vec, vec, row, Int32(0), Float32(1e-5), Float32(1e-5), stream)


def aot_keys(arch: str) -> list[AttnResKey]:
    """The variants one decode step uses (`kimi_k3_layer.md` §3.3), batch 1..64 each."""
    keys = set()
    for layer in range(93):
        nb = -(-layer // 12)
        bw = layer % 12 == 0
        keys.add(AttnResKey(n=nb, delta=layer > 0, write_block=bw, arch=arch))  # before attention
        keys.add(AttnResKey(n=nb + bw, delta=not bw, arch=arch))  # before the MLP
    keys.add(AttnResKey(n=8, delta=True, norm_out=False, arch=arch))  # after layer 92
    keys |= {dataclasses.replace(k, reload_sources=True) for k in keys if k.n >= RELOAD_MIN_N}
    return sorted(keys, key=lambda k: (k.n, k.delta, k.write_block, k.norm_out, k.reload_sources))


SPEC = kc.register(
    kc.KernelSpec(
        name="attn_res",
        module=__name__,
        key_type=AttnResKey,
        build=build,
        aot_keys=aot_keys,
        ptx_checks=("ld.global.v4",),
    )
)


def _check(name: str, t: torch.Tensor, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be torch.bfloat16, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all operands on one CUDA device)")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned for 128-bit loads")


def attn_res_fused(
    p: torch.Tensor,
    delta: torch.Tensor | None,
    blocks: torch.Tensor,
    n: int,
    j: int,
    w_n: torch.Tensor,
    w_q: torch.Tensor,
    w_o: torch.Tensor | None,
    eps: float = 1e-5,
    eps_o: float = 1e-5,
    out: torch.Tensor | None = None,
    arch: str | None = None,
) -> torch.Tensor:
    """AR of §3.2 on CUDA tensors, same arguments as `kimi_decode.reference.attn_res.attn_res`.

    Updates `p` (p + δ) and `blocks[:, j]` in place as the stock kernel does,
    and returns y [T, d] bf16 (written into `out` if given).
    """
    if not isinstance(p, torch.Tensor) or p.dim() != 2:
        raise ValueError(f"p must be a [T, d] tensor, got {getattr(p, 'shape', type(p))}")
    T, d = p.shape
    if not 1 <= T <= MAX_BATCH:
        raise ValueError(f"batch T={T} outside the supported 1..{MAX_BATCH}")
    if p.device.type != "cuda":
        raise ValueError(f"attn_res_fused runs on a CUDA device, got p on {p.device}")
    dev = p.device
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 3:
        raise ValueError(f"blocks must be [T, slots, d], got {getattr(blocks, 'shape', type(blocks))}")
    slots = blocks.shape[1]
    if not 0 <= n <= slots:
        raise ValueError(f"n={n} outside 0..{slots}")
    if not -1 <= j < slots:
        raise ValueError(f"j={j} outside -1..{slots - 1}")
    _check("p", p, (T, d), dev)
    _check("blocks", blocks, (T, slots, d), dev)
    if delta is not None:
        _check("delta", delta, (T, d), dev)
    _check("w_n", w_n, (d,), dev)
    _check("w_q", w_q, (d,), dev)
    if w_o is not None:
        _check("w_o", w_o, (d,), dev)
    if out is None:
        out = torch.empty((T, d), dtype=torch.bfloat16, device=dev)
    else:
        _check("out", out, (T, d), dev)
    key = AttnResKey(
        n=n,
        delta=delta is not None,
        write_block=j >= 0,
        norm_out=w_o is not None,
        d=d,
        slots=slots,
        reload_sources=n >= RELOAD_MIN_N and T >= RELOAD_MIN_BATCH,
        arch=kc.resolve_arch(arch),
    )
    fn = kc.load(key)
    fn(
        p,
        delta if delta is not None else p,
        blocks,
        w_n,
        w_q,
        w_o if w_o is not None else w_n,
        out,
        max(j, 0),
        float(eps),
        float(eps_o),
    )
    return out
