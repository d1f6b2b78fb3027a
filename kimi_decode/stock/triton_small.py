"""Triton stand-ins for stock vLLM's small fused decode kernels on H200 (`kimi_k3_layer.md` §9).

Each public function launches exactly one Triton kernel, writes into caller-preallocated
outputs (so a call is CUDA-graph capturable) and checks shapes, dtypes, devices and strides
before the launch. Math is fp32; stored tensors are bf16 unless stated.

| function                     | equations              | stands in for (stock vLLM on H200)                        |
|------------------------------|------------------------|-----------------------------------------------------------|
| `attn_res`                   | §3.2 steps 1–4         | `_attn_res_kernel` (Triton)                               |
| `situ_and_mul`               | §2 SiTU-GLU            | `torch.ops._C.situ_and_mul`                               |
| `sigmoid_gate_mul`           | §5.2 eq. 9             | the torch.compile'd `o * sigmoid(g)` elementwise kernel   |
| `fused_q_kv_rmsnorm`         | §5.2 eq. 2             | `fused_q_kv_rmsnorm`                                      |
| `grouped_topk`               | §6.3 eq. 1             | `ops.grouped_topk(..., scoring_func="sigmoid")`, 1 group  |
| `allreduce_emulated`         | §4.2 eq. 9, §5.2 eq. 10| vLLM's one-shot custom all-reduce, one rank's work        |
| `allreduce_rmsnorm_emulated` | §6.3 eq. 4             | flashinfer `trtllm_allreduce_fusion` (AR + RMSNorm)       |

The all-reduce stand-ins run on one GPU: `bufs[r]` plays rank r's partial (the peer buffers
of the one-shot all-reduce) and `coef` [tp] fp32 weights them, so callers pass
[1, 0, ..., 0] to get the rank's own partial back while every peer buffer is still read.

Row-strided views are accepted where stated; the innermost dimension must be contiguous
(stride 1) so loads vectorise. Triton specialises integer arguments equal to 1 or divisible
by 16, so the usual strides compile to aligned 128-bit accesses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BF16 = torch.bfloat16
_F32 = torch.float32


# Warps per program, measured on the H200 (CUDA-graph replay of 64 calls, L2-warm inputs,
# 2026-12-02). attn_res, d = 7168, batch 1, n = 0 / 1 / 4 / 8 sources: 8 warps 1.9 / 3.0 /
# 4.4 / 7.1 us, 16 warps 2.2 / 3.2 / 4.5 / 7.5 us (at batch 64, 16 warps win by ~5% at n = 8).
# grouped_topk (E = 896 padded to 1024, bitonic top-16): 4 / 8 / 16 warps 4.7 / 3.7 / 4.0 us
# (the 16-step iterative argmax it replaced took 6.0 us). Elsewhere the width follows the
# block: about 8 bf16 (one 128-bit vector) per thread.
ATTN_RES_WARPS = 8
TOPK_WARPS = 8

# --------------------------------------------------------------------------- checks


def _check(name: str, t, dtypes, ndim: int, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(dtypes, tuple):
        dtypes = (dtypes,)
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must be {want}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all tensors on one device)")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}")


def _shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _warps(block: int, per_thread: int = 8, lo: int = 1, hi: int = 16) -> int:
    """Warps so that each thread holds about `per_thread` elements (one 128-bit bf16 vector)."""
    return max(lo, min(hi, block // (32 * per_thread)))


# --------------------------------------------------------------------------- shared jit helpers


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # tanh via exp(-2|x|): no overflow, exact limits ±1; fp32 abs error ~1e-7
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


# --------------------------------------------------------------------------- 1. attn_res


@triton.jit(do_not_specialize=["j"])  # j = 1 would otherwise compile a variant of its own
def _attn_res_kernel(
    y_ptr, p_ptr, delta_ptr, b_ptr, wn_ptr, wq_ptr, wo_ptr,
    j, D,
    stride_y, stride_p, stride_delta, stride_bt, stride_bs,
    eps, eps_o,
    N_SRC: tl.constexpr, HAS_DELTA: tl.constexpr, WRITE_BLOCK: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per token. The whole row of every source sits in registers: the n block
    rows as one [BLOCK_S, BLOCK_D] tile, so all 2n logit partial sums reduce in one pass and
    m = Σ a_i v_i is a reduction over the (in-thread) source axis. Every load is issued
    before the first store, so the kernel pays one memory round trip, not one per step."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    p_row = p_ptr + t * stride_p
    b_row = b_ptr + t * stride_bt

    # ---- loads
    p = tl.load(p_row + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        dl = tl.load(delta_ptr + t * stride_delta + offs, mask=mask, other=0.0)
    if N_SRC > 0:
        rows = tl.arange(0, BLOCK_S)
        r2 = rows[:, None]
        # slot j is overwritten with the new p below: never read it from memory
        vb = tl.load(b_row + r2 * stride_bs + offs[None, :],
                     mask=(r2 < N_SRC) & (r2 != j) & mask[None, :], other=0.0)
        wq = tl.load(wn_ptr + offs, mask=mask, other=0.0).to(tl.float32) * \
            tl.load(wq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        wo = tl.load(wo_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    # ---- 1. p <- bf16(p + delta), in place; 2. B[j] <- p
    if HAS_DELTA:
        p = (p.to(tl.float32) + dl.to(tl.float32)).to(tl.bfloat16)
        tl.store(p_row + offs, p, mask=mask)
    if WRITE_BLOCK:
        tl.store(b_row + j * stride_bs + offs, p, mask=mask)
    pf = p.to(tl.float32)

    # ---- 3. softmax over the sources B[0..n-1], p (max-subtracted, exact)
    if N_SRC == 0:
        m = pf
    else:
        vf = tl.where(r2 == j, p[None, :], vb).to(tl.float32)
        # (Σ v·w, Σ v²) of every source in one reduction each: join makes a size-2 inner axis
        dots, sss = tl.split(tl.sum(tl.join(vf * wq[None, :], vf * vf), axis=1))
        dp, sp = tl.split(tl.sum(tl.join(pf * wq, pf * pf), axis=0))
        lb = tl.where(rows < N_SRC, dots * tl.rsqrt(sss / D + eps), float("-inf"))
        lp = dp * tl.rsqrt(sp / D + eps)
        mx = tl.maximum(tl.max(lb, axis=0), lp)
        eb = tl.exp(lb - mx)
        ep = tl.exp(lp - mx)
        m = (tl.sum(vf * eb[:, None], axis=0) + pf * ep) / (tl.sum(eb, axis=0) + ep)

    # ---- 4. y = RMSNorm(m; w_o, eps_o) or m
    if HAS_NORM:
        m = m * tl.rsqrt(tl.sum(m * m, axis=0) / D + eps_o) * wo
    tl.store(y_ptr + t * stride_y + offs, m.to(tl.bfloat16), mask=mask)


def attn_res(
    y: torch.Tensor,
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
) -> torch.Tensor:
    """AttnRes (§3.2) in one launch, one program per token; returns y.

    y [N, d] bf16 (out); p [N, d] bf16, updated in place to bf16(p + delta) when delta
    (bf16 or fp32 [N, d]) is given; blocks [N, S, d] bf16, blocks[:, j] = p written when
    j >= 0; n block sources (0..S) plus p; w_n, w_q [d] bf16; w_o [d] bf16 or None (no
    output norm). Row-strided p / delta / y / blocks are accepted (last dim contiguous).
    n is a compile-time constant (one specialisation per n), j a runtime argument.
    """
    _check("p", p, _BF16, 2)
    dev = p.device
    N, d = p.shape
    _check("y", y, _BF16, 2, dev)
    _shape("y", y, (N, d))
    if delta is not None:
        _check("delta", delta, (_BF16, _F32), 2, dev)
        _shape("delta", delta, (N, d))
    _check("blocks", blocks, _BF16, 3, dev)
    if blocks.shape[0] != N or blocks.shape[2] != d:
        raise ValueError(f"blocks must be [N={N}, S, d={d}], got {tuple(blocks.shape)}")
    S = blocks.shape[1]
    for name, w in (("w_n", w_n), ("w_q", w_q)) + ((("w_o", w_o),) if w_o is not None else ()):
        _check(name, w, _BF16, 1, dev)
        _shape(name, w, (d,))
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= S:
        raise ValueError(f"n must be an int in 0..{S}, got {n!r}")
    if isinstance(j, bool) or not isinstance(j, int) or not -1 <= j < S:
        raise ValueError(f"j must be an int in -1..{S - 1}, got {j!r}")
    if N == 0:
        return y
    BLOCK_D = _pow2(d)
    _attn_res_kernel[(N,)](
        y, p, delta if delta is not None else p, blocks, w_n, w_q, w_o if w_o is not None else w_n,
        j, d,
        y.stride(0), p.stride(0), delta.stride(0) if delta is not None else 0,
        blocks.stride(0), blocks.stride(1),
        float(eps), float(eps_o),
        N_SRC=n, HAS_DELTA=delta is not None, WRITE_BLOCK=j >= 0, HAS_NORM=w_o is not None,
        BLOCK_D=BLOCK_D, BLOCK_S=_pow2(n), num_warps=ATTN_RES_WARPS,
    )
    return y


# --------------------------------------------------------------------------- 2. situ_and_mul


@triton.jit
def _situ_and_mul_kernel(
    out_ptr, x_ptr, I, stride_out, stride_x, beta, beta_lin,
    HAS_LIN: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    x_row = x_ptr + row * stride_x
    g = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + I + offs, mask=mask, other=0.0).to(tl.float32)
    a = beta * _tanh(g / beta) * _sigmoid(g)
    if HAS_LIN:
        u = beta_lin * _tanh(u / beta_lin)
    tl.store(out_ptr + row * stride_out + offs, (a * u).to(tl.bfloat16), mask=mask)


def situ_and_mul(out: torch.Tensor, x: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """out [M, I] bf16 = β·tanh(g/β)·σ(g) · (β_lin·tanh(u/β_lin)), x = [g | u] [M, 2I] bf16.

    β_lin <= 0 leaves u unchanged. x (and out) may be row-strided views. Grid (M, cdiv(I, BLOCK)),
    BLOCK <= 2048, so a wide row (dense MLP, I = 4224) spreads over several SMs.
    """
    _check("x", x, _BF16, 2)
    _check("out", out, _BF16, 2, x.device)
    M, I2 = x.shape
    if I2 % 2:
        raise ValueError(f"x must be [M, 2I] ([gate | up]), got odd last dim {I2}")
    I = I2 // 2
    _shape("out", out, (M, I))
    if not float(beta) > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if M == 0 or I == 0:
        return out
    BLOCK = min(_pow2(I), 2048)
    _situ_and_mul_kernel[(M, triton.cdiv(I, BLOCK))](
        out, x, I, out.stride(0), x.stride(0), float(beta), float(beta_lin) if beta_lin > 0 else 1.0,
        HAS_LIN=beta_lin > 0, BLOCK=BLOCK, num_warps=_warps(BLOCK, lo=1, hi=8),
    )
    return out


# --------------------------------------------------------------------------- 3. sigmoid_gate_mul


@triton.jit
def _sigmoid_gate_mul_kernel(
    out_ptr, o_ptr, g_ptr, H, V,
    stride_out, stride_oh, stride_on, stride_ov, stride_g,
    BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    v = tl.arange(0, BLOCK_V)[None, :]
    mask = (h < H) & (v < V)
    col = h * V + v  # column in the [N, H*V] layout
    o = tl.load(o_ptr + h * stride_oh + t * stride_on + v * stride_ov, mask=mask, other=0.0)
    g = tl.load(g_ptr + t * stride_g + col, mask=mask, other=0.0)
    r = o.to(tl.float32) * _sigmoid(g.to(tl.float32))
    tl.store(out_ptr + t * stride_out + col, r.to(tl.bfloat16), mask=mask)


def sigmoid_gate_mul(out: torch.Tensor, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """out [N, H*V] bf16 = o ⊙ σ(g) (§5.2 eq. 9), with o [H, N, V] bf16 (the bmm-over-heads
    output, any strides) and g [N, H*V] bf16 (row-strided view allowed). One program per token.
    """
    if not isinstance(o, torch.Tensor):
        raise TypeError(f"o must be a torch.Tensor, got {type(o).__name__}")
    if o.dtype != _BF16:
        raise TypeError(f"o must be {_BF16}, got {o.dtype}")
    if o.dim() != 3:
        raise ValueError(f"o must be [H, N, V], got shape {tuple(o.shape)}")
    H, N, V = o.shape
    _check("g", g, _BF16, 2, o.device)
    _shape("g", g, (N, H * V))
    _check("out", out, _BF16, 2, o.device)
    _shape("out", out, (N, H * V))
    if N == 0 or H * V == 0:
        return out
    BLOCK_H, BLOCK_V = _pow2(H), _pow2(V)
    _sigmoid_gate_mul_kernel[(N,)](
        out, o, g, H, V,
        out.stride(0), o.stride(0), o.stride(1), o.stride(2), g.stride(0),
        BLOCK_H=BLOCK_H, BLOCK_V=BLOCK_V, num_warps=_warps(BLOCK_H * BLOCK_V, lo=1, hi=8),
    )
    return out


# --------------------------------------------------------------------------- 4. fused_q_kv_rmsnorm


@triton.jit
def _rms_row(out_ptr, x_ptr, w_ptr, D, eps, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(out_ptr + offs, (x * r * w).to(tl.bfloat16), mask=mask)


@triton.jit
def _q_kv_rmsnorm_kernel(
    q_out_ptr, kv_out_ptr, q_ptr, kv_ptr, wq_ptr, wkv_ptr, DQ, DKV,
    stride_qo, stride_kvo, stride_q, stride_kv, eps,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _rms_row(q_out_ptr + t * stride_qo, q_ptr + t * stride_q, wq_ptr, DQ, eps, BLOCK_Q)
    else:
        _rms_row(kv_out_ptr + t * stride_kvo, kv_ptr + t * stride_kv, wkv_ptr, DKV, eps, BLOCK_KV)


def fused_q_kv_rmsnorm(
    q_out: torch.Tensor,
    kv_out: torch.Tensor,
    q_in: torch.Tensor,
    kv_in: torch.Tensor,
    w_q: torch.Tensor,
    w_kv: torch.Tensor,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both MLA RMSNorms (§5.2 eq. 2) in one launch, grid (N, 2): axis 1 picks q or kv.

    q_in [N, Dq] and kv_in [N, Dkv] bf16, typically row-strided views into the fused_qkv_a
    output [N, 2112]; w_q [Dq], w_kv [Dkv] bf16; q_out [N, Dq], kv_out [N, Dkv] bf16
    (row strides are passed, last dim must be contiguous).
    """
    _check("q_in", q_in, _BF16, 2)
    dev = q_in.device
    N, DQ = q_in.shape
    _check("kv_in", kv_in, _BF16, 2, dev)
    if kv_in.shape[0] != N:
        raise ValueError(f"kv_in must have N={N} rows, got {tuple(kv_in.shape)}")
    DKV = kv_in.shape[1]
    _check("q_out", q_out, _BF16, 2, dev)
    _shape("q_out", q_out, (N, DQ))
    _check("kv_out", kv_out, _BF16, 2, dev)
    _shape("kv_out", kv_out, (N, DKV))
    _check("w_q", w_q, _BF16, 1, dev)
    _shape("w_q", w_q, (DQ,))
    _check("w_kv", w_kv, _BF16, 1, dev)
    _shape("w_kv", w_kv, (DKV,))
    if N == 0:
        return q_out, kv_out
    BLOCK_Q, BLOCK_KV = _pow2(DQ), _pow2(DKV)
    _q_kv_rmsnorm_kernel[(N, 2)](
        q_out, kv_out, q_in, kv_in, w_q, w_kv, DQ, DKV,
        q_out.stride(0), kv_out.stride(0), q_in.stride(0), kv_in.stride(0), float(eps),
        BLOCK_Q=BLOCK_Q, BLOCK_KV=BLOCK_KV, num_warps=_warps(max(BLOCK_Q, BLOCK_KV), lo=1, hi=8),
    )
    return q_out, kv_out


# --------------------------------------------------------------------------- 5. grouped_topk


@triton.jit
def _grouped_topk_kernel(
    ids_ptr, w_ptr, logits_ptr, bias_ptr, E,
    stride_ids, stride_w, stride_l, scaling,
    K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    l_row = logits_ptr + t * stride_l
    lg = tl.load(l_row + offs, mask=mask, other=0.0)
    b = tl.load(bias_ptr + offs, mask=mask, other=0.0)
    sc = _sigmoid(lg) + b
    # order-preserving int32 image of the fp32 score, index in the low word (lower index wins ties)
    bits = sc.to(tl.int32, bitcast=True)
    key32 = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (key32.to(tl.int64) << 32) | (BLOCK_E - 1 - offs).to(tl.int64)
    key = tl.where(mask, key, -9223372036854775807 - 1)
    top = tl.topk(key, BLOCK_K)  # bitonic top-k, descending
    ids = (BLOCK_E - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    w = _sigmoid(tl.load(l_row + ids, mask=kmask, other=0.0))
    w = tl.where(kmask, w, 0.0)
    if RENORM:
        w = w / tl.sum(w, axis=0)
    w = w * scaling
    tl.store(ids_ptr + t * stride_ids + kk, ids, mask=kmask)
    tl.store(w_ptr + t * stride_w + kk, w, mask=kmask)


def grouped_topk(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    logits: torch.Tensor,
    bias: torch.Tensor,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing with one expert group (§6.3 eq. 1), one program per token.

    logits [N, E] fp32 (row-strided allowed), bias [E] fp32; s = σ(logits); the k =
    topk_ids.shape[1] experts with the largest s + bias are selected (ties: lowest index);
    topk_weights = s of the picks (unbiased), renormalised to sum 1 if `renormalize`, × scaling.
    topk_ids int32 [N, k], topk_weights fp32 [N, k]. Outputs come in descending s + bias order.
    """
    _check("logits", logits, _F32, 2)
    dev = logits.device
    N, E = logits.shape
    _check("bias", bias, _F32, 1, dev)
    _shape("bias", bias, (E,))
    _check("topk_ids", topk_ids, torch.int32, 2, dev)
    K = topk_ids.shape[1]
    _shape("topk_ids", topk_ids, (N, K))
    _check("topk_weights", topk_weights, _F32, 2, dev)
    _shape("topk_weights", topk_weights, (N, K))
    if not 1 <= K <= E:
        raise ValueError(f"k = topk_ids.shape[1] = {K} must be in 1..E={E}")
    if N == 0:
        return topk_ids, topk_weights
    BLOCK_E = _pow2(E)
    _grouped_topk_kernel[(N,)](
        topk_ids, topk_weights, logits, bias, E,
        topk_ids.stride(0), topk_weights.stride(0), logits.stride(0), float(scaling),
        K=K, RENORM=bool(renormalize), BLOCK_E=BLOCK_E, BLOCK_K=_pow2(K),
        num_warps=TOPK_WARPS,
    )
    return topk_ids, topk_weights


# --------------------------------------------------------------------------- 6-7. all-reduce stand-ins


@triton.jit
def _allreduce_kernel(
    out_ptr, bufs_ptr, coef_ptr, w_ptr, D,
    stride_out, stride_br, stride_bn, eps,
    TP: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    row = bufs_ptr + t * stride_bn + offs
    if HAS_NORM:  # loaded up front, with the peer rows
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(TP):  # unrolled: all TP peer rows are in flight at once
        c = tl.load(coef_ptr + r)
        x = tl.load(row + r * stride_br, mask=mask, other=0.0)
        acc += c * x.to(tl.float32)
    if HAS_NORM:
        acc = acc * tl.rsqrt(tl.sum(acc * acc, axis=0) / D + eps) * w
    tl.store(out_ptr + t * stride_out + offs, acc.to(tl.bfloat16), mask=mask)


def _check_allreduce(out, bufs, coef):
    _check("bufs", bufs, _BF16, 3)
    dev = bufs.device
    tp, N, d = bufs.shape
    if tp < 1:
        raise ValueError("bufs must hold at least one rank's buffer")
    _check("out", out, _BF16, 2, dev)
    _shape("out", out, (N, d))
    _check("coef", coef, _F32, 1, dev)
    _shape("coef", coef, (tp,))
    return tp, N, d


def allreduce_emulated(out: torch.Tensor, bufs: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """out [N, d] bf16 = Σ_r coef[r]·bufs[r], fp32 accumulation (one rank of a one-shot all-reduce).

    bufs [tp, N, d] bf16 (strided over r and N allowed), coef [tp] fp32 runtime tensor.
    Grid (N, cdiv(d, 1024)): d = 7168 spreads over 7 programs per token.
    """
    tp, N, d = _check_allreduce(out, bufs, coef)
    if N == 0 or d == 0:
        return out
    BLOCK = min(_pow2(d), 1024)
    _allreduce_kernel[(N, triton.cdiv(d, BLOCK))](
        out, bufs, coef, coef, d, out.stride(0), bufs.stride(0), bufs.stride(1), 0.0,
        TP=tp, HAS_NORM=False, BLOCK=BLOCK, num_warps=_warps(BLOCK, lo=1, hi=4),
    )
    return out


def allreduce_rmsnorm_emulated(out: torch.Tensor, bufs: torch.Tensor, coef: torch.Tensor,
                               w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """out [N, d] bf16 = RMSNorm(Σ_r coef[r]·bufs[r]; w, eps), one launch, one program per token
    (the norm needs the whole row). bufs [tp, N, d] bf16, coef [tp] fp32, w [d] bf16.
    """
    tp, N, d = _check_allreduce(out, bufs, coef)
    _check("w", w, _BF16, 1, bufs.device)
    _shape("w", w, (d,))
    if N == 0 or d == 0:
        return out
    BLOCK = _pow2(d)
    _allreduce_kernel[(N, 1)](
        out, bufs, coef, w, d, out.stride(0), bufs.stride(0), bufs.stride(1), float(eps),
        TP=tp, HAS_NORM=True, BLOCK=BLOCK, num_warps=_warps(BLOCK, lo=4, hi=16),
    )
    return out
