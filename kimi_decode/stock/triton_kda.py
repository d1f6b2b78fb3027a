"""Stock vLLM's KDA decode kernels in Triton, `kimi_k3_layer.md` §4.2 eq. 3-8 (§9 "KDA attention half", step 4).

Stands in for (one launch each):

- `fused_kda_decode`          ← `torch.ops._C.fused_kda_decode` (the TP8 path: 12 local heads):
                                 conv4 + SiLU + state shift, gates, β, L2 norms, delta rule, gated RMSNorm.
- `causal_conv1d_update`      ← vLLM's Triton `causal_conv1d_update` (TP16 path, launch 1 of 4).
- `fused_recurrent_kda`       ← vLLM's Triton `fused_recurrent_kda_packed_decode` (TP16, launch 2 of 4).
  (launch 3 of 4 is the caller's `copy_` into core_attn_out)
- `rmsnorm_gated`             ← vLLM's Triton `FusedRMSNormGated` (TP16, launch 4 of 4).

Inputs are the in_proj GEMM output z [N, rows] bf16, laid out
`[qkv (3P) | g_out (P) | f_a (f_rank) | β_raw (H) | pad]`, and g_raw [N, P] bf16
(the f_b GEMM output). Tokens are sequence-major: token i belongs to sequence
i // T (T = `tokens_per_seq`), and the T tokens of a sequence run through the
recurrence in order; only the final state is written. A sequence whose slot is
<= 0 (the null slot) gets zero outputs and leaves every state untouched.

Per token and head (fp32 math; see `reference/kda.py`):
    u   = bf16(SiLU(Σ_i w[c,i]·s[c,i] + w[c,3]·x[c]));  s ← (s1, s2, x)        (eq. 3)
    q̂   = q·rsqrt(Σq² + ε_qk)·D^-½,  k̂ = k·rsqrt(Σk² + ε_qk)                 (eq. 4)
    α   = lower_bound·σ(exp(A_log_h)·(g_raw + dt_bias)),  β = σ(β_raw_h)       (eq. 5-6)
    S   ← S⊙exp(α)[None, :];  r = β(v − S k̂);  S ← S + r k̂ᵀ;  o = bf16(S q̂)   (eq. 7)
    y   = bf16(o·rsqrt(mean(o²) + ε_o)·w_onorm·σ(g_out))                       (eq. 8)

Design (memory-bound: the fp32 recurrent state S [H, D, D] per sequence is
~98 % of the bytes; each kernel reads it once and writes it once, coalesced,
with 128-bit accesses along K):

- `fused_kda_decode` with a `workspace` (int32 arrival counters, `make_fused_workspace`):
  grid (B, H, D/32), num_warps 4. Each program runs eq. 3-7 for 32 rows of V
  ([32, 128] fp32 state tile in registers across the T tokens; q̂, k̂, α of the
  head are recomputed per program) and stores its bf16 pre-norm o rows into y.
  The gated RMSNorm needs the whole V row, so after a barrier + acq_rel atomic
  the last of the 4 programs of a (sequence, head) to arrive shifts the head's
  conv window (nobody reads it any more) and normalises y in place, then
  resets its counter to 0 (the workspace is left zeroed: graph-replay safe).
- `fused_kda_decode` without a workspace: grid (B, H), num_warps 8, one
  program owns the whole [D, D] tile (64 KiB fp32, ~190 registers/thread, no
  spills). Same bits as the V-split kernel, 1.4x slower on an H200 (measured,
  H = 12: B=1 T=1 9.5 vs 7.0 us; B=64 T=1 59 vs 42 us; B=64 T=4 109 vs 75 us).
- `causal_conv1d_update`: grid (B, ⌈3P / 256⌉), the window in registers over T tokens.
- `fused_recurrent_kda`: grid (B, H, D / BV) with BV = 32 rows of V per program
  (4× the programs of the per-head fused kernel); each program recomputes
  q̂, k̂, α of its head (128 values each, from L2).
- `rmsnorm_gated`: grid (⌈N·H / 4⌉,), four (token, head) rows of D per program.

Every entry point validates shapes, dtypes and devices before its single
launch, allocates nothing and syncs nothing (outputs and states are the
caller's), so calls can be captured in a CUDA graph. Slot values are trusted
(not range-checked: that would need a device sync). On CPU tensors the kernels
run under Triton's interpreter (`TRITON_INTERPRET=1` set before importing triton).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

CONV_WIDTH = 4  # short-conv taps (state keeps CONV_WIDTH - 1 inputs)
F_RANK = 128  # width of the f_a section of z (real Kimi K3)
FUSED_WARPS = 8
FUSED_SPLIT_BV = 32  # V rows per program in the V-split fused kernel (with a workspace)
FUSED_SPLIT_WARPS = 4
RECURRENT_BV = 32  # V rows per program in `fused_recurrent_kda`
RECURRENT_WARPS = 4
CONV_BLOCK = 256  # channels per program in `causal_conv1d_update`
CONV_WARPS = 2
NORM_ROWS = 4  # (token, head) rows per program in `rmsnorm_gated`
NORM_WARPS = 4
MAX_HEAD_DIM = 128


# ---------------------------------------------------------------------------
# device helpers


@triton.jit
def _bf16(x, SOFT_RNE: tl.constexpr):
    """fp32 → bf16, round to nearest even. Compiled, `.to` is a native cvt.rn; Triton 3.6's
    interpreter truncates instead, so there (SOFT_RNE) the rounding is done on the bits first."""
    if SOFT_RNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _conv_silu(x, s0, s1, s2, w0, w1, w2, w3, SOFT_RNE: tl.constexpr):
    """Eq. 3 for one vector of channels: SiLU of the 4-tap window, rounded to bf16 (fp32 result)."""
    acc = w0 * s0 + w1 * s1 + w2 * s2 + w3 * x
    u = acc * tl.sigmoid(acc)
    return _bf16(u, SOFT_RNE).to(tl.float32)


@triton.jit
def _l2norm(x, eps, scale):
    return x * (tl.rsqrt(tl.sum(x * x, axis=0) + eps) * scale)


# ---------------------------------------------------------------------------
# kernels


@triton.jit
def _load_window(cs, C: tl.constexpr, ch):
    """The three conv-state rows (oldest first) of channels `ch`, as fp32."""
    return (tl.load(cs + ch).to(tl.float32), tl.load(cs + C + ch).to(tl.float32),
            tl.load(cs + 2 * C + ch).to(tl.float32))


@triton.jit
def _load_taps(conv_w_ptr, ch):
    """The four conv taps (oldest first) of channels `ch` from the [3P, 4] fp32 weight."""
    return (tl.load(conv_w_ptr + ch * 4), tl.load(conv_w_ptr + ch * 4 + 1),
            tl.load(conv_w_ptr + ch * 4 + 2), tl.load(conv_w_ptr + ch * 4 + 3))


@triton.jit
def _fused_kda_decode_kernel(
    y_ptr, z_ptr, g_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, onorm_ptr,
    conv_state_ptr, rec_ptr, slots_ptr,
    y_stride, z_stride, g_stride, cs_stride, rs_stride,
    beta_col, lower_bound, qk_eps, o_eps, q_scale,
    T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, SOFT_RNE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    P: tl.constexpr = H * D
    C: tl.constexpr = 3 * P
    offs = tl.arange(0, D)
    col = h * D + offs  # this head's channels within a P-wide section
    slot = tl.load(slots_ptr + b).to(tl.int64)
    tok0 = b.to(tl.int64) * T

    if slot <= 0:  # null slot: zero output, no state update
        for t in tl.static_range(T):
            tl.store(y_ptr + (tok0 + t) * y_stride + col, tl.zeros([D], dtype=tl.bfloat16))
        return

    # conv window (oldest first) of the head's q, k and v channels, and their taps
    cs = conv_state_ptr + slot * cs_stride
    cq, ck, cv = col, P + col, 2 * P + col
    sq0, sq1, sq2 = _load_window(cs, C, cq)
    sk0, sk1, sk2 = _load_window(cs, C, ck)
    sv0, sv1, sv2 = _load_window(cs, C, cv)
    wq0, wq1, wq2, wq3 = _load_taps(conv_w_ptr, cq)
    wk0, wk1, wk2, wk3 = _load_taps(conv_w_ptr, ck)
    wv0, wv1, wv2, wv3 = _load_taps(conv_w_ptr, cv)

    a_scale = tl.exp(tl.load(a_log_ptr + h))
    dtb = tl.load(dt_bias_ptr + col)
    onw = tl.load(onorm_ptr + offs)

    # the whole [V, K] state of (slot, head): one wide load, all in flight together
    rs = rec_ptr + slot * rs_stride + h * (D * D) + offs[:, None] * D + offs[None, :]
    S = tl.load(rs)

    for t in tl.static_range(T):
        i = tok0 + t
        zr = z_ptr + i * z_stride
        xq = tl.load(zr + cq).to(tl.float32)
        xk = tl.load(zr + ck).to(tl.float32)
        xv = tl.load(zr + cv).to(tl.float32)
        gout = tl.load(zr + 3 * P + col).to(tl.float32)
        braw = tl.load(zr + beta_col + h).to(tl.float32)
        graw = tl.load(g_ptr + i * g_stride + col).to(tl.float32)

        q = _conv_silu(xq, sq0, sq1, sq2, wq0, wq1, wq2, wq3, SOFT_RNE)
        k = _conv_silu(xk, sk0, sk1, sk2, wk0, wk1, wk2, wk3, SOFT_RNE)
        v = _conv_silu(xv, sv0, sv1, sv2, wv0, wv1, wv2, wv3, SOFT_RNE)
        sq0, sq1, sq2 = sq1, sq2, xq
        sk0, sk1, sk2 = sk1, sk2, xk
        sv0, sv1, sv2 = sv1, sv2, xv

        qn = _l2norm(q, qk_eps, q_scale)
        kn = _l2norm(k, qk_eps, 1.0)
        alpha = lower_bound * tl.sigmoid(a_scale * (graw + dtb))
        beta = tl.sigmoid(braw)

        S = S * tl.exp(alpha)[None, :]
        r = beta * (v - tl.sum(S * kn[None, :], axis=1))
        S = S + r[:, None] * kn[None, :]
        o = _bf16(tl.sum(S * qn[None, :], axis=1), SOFT_RNE).to(tl.float32)

        rstd = tl.rsqrt(tl.sum(o * o, axis=0) / D + o_eps)
        out = o * rstd * onw * tl.sigmoid(gout)
        tl.store(y_ptr + i * y_stride + col, _bf16(out, SOFT_RNE))

    tl.store(rs, S)
    tl.store(cs + cq, sq0.to(tl.bfloat16))
    tl.store(cs + C + cq, sq1.to(tl.bfloat16))
    tl.store(cs + 2 * C + cq, sq2.to(tl.bfloat16))
    tl.store(cs + ck, sk0.to(tl.bfloat16))
    tl.store(cs + C + ck, sk1.to(tl.bfloat16))
    tl.store(cs + 2 * C + ck, sk2.to(tl.bfloat16))
    tl.store(cs + cv, sv0.to(tl.bfloat16))
    tl.store(cs + C + cv, sv1.to(tl.bfloat16))
    tl.store(cs + 2 * C + cv, sv2.to(tl.bfloat16))


@triton.jit
def _fused_kda_decode_split_kernel(
    y_ptr, z_ptr, g_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, onorm_ptr,
    conv_state_ptr, rec_ptr, slots_ptr, count_ptr,
    y_stride, z_stride, g_stride, cs_stride, rs_stride,
    beta_col, lower_bound, qk_eps, o_eps, q_scale,
    T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, SOFT_RNE: tl.constexpr,
):
    """V split over grid axis 2. Each program runs eq. 3-7 for BV rows of V and stores its bf16 o
    rows into y; the last program of a (sequence, head) to arrive (an arrival counter) then
    shifts the head's conv window and applies eq. 8 to the whole row in place."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    NV: tl.constexpr = D // BV
    P: tl.constexpr = H * D
    C: tl.constexpr = 3 * P
    offs = tl.arange(0, D)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    col = h * D + offs
    col_v = h * D + offs_v
    slot = tl.load(slots_ptr + b).to(tl.int64)
    tok0 = b.to(tl.int64) * T

    if slot <= 0:
        for t in tl.static_range(T):
            tl.store(y_ptr + (tok0 + t) * y_stride + col_v, tl.zeros([BV], dtype=tl.bfloat16))
        return

    cs = conv_state_ptr + slot * cs_stride
    cq, ck, cv = col, P + col, 2 * P + col_v
    sq0, sq1, sq2 = _load_window(cs, C, cq)
    sk0, sk1, sk2 = _load_window(cs, C, ck)
    sv0, sv1, sv2 = _load_window(cs, C, cv)
    wq0, wq1, wq2, wq3 = _load_taps(conv_w_ptr, cq)
    wk0, wk1, wk2, wk3 = _load_taps(conv_w_ptr, ck)
    wv0, wv1, wv2, wv3 = _load_taps(conv_w_ptr, cv)
    a_scale = tl.exp(tl.load(a_log_ptr + h))
    dtb = tl.load(dt_bias_ptr + col)

    rs = rec_ptr + slot * rs_stride + h * (D * D) + offs_v[:, None] * D + offs[None, :]
    S = tl.load(rs)  # [BV, K]

    for t in tl.static_range(T):
        i = tok0 + t
        zr = z_ptr + i * z_stride
        xq = tl.load(zr + cq).to(tl.float32)
        xk = tl.load(zr + ck).to(tl.float32)
        xv = tl.load(zr + cv).to(tl.float32)
        braw = tl.load(zr + beta_col + h).to(tl.float32)
        graw = tl.load(g_ptr + i * g_stride + col).to(tl.float32)

        q = _conv_silu(xq, sq0, sq1, sq2, wq0, wq1, wq2, wq3, SOFT_RNE)
        k = _conv_silu(xk, sk0, sk1, sk2, wk0, wk1, wk2, wk3, SOFT_RNE)
        v = _conv_silu(xv, sv0, sv1, sv2, wv0, wv1, wv2, wv3, SOFT_RNE)
        sq0, sq1, sq2 = sq1, sq2, xq
        sk0, sk1, sk2 = sk1, sk2, xk
        sv0, sv1, sv2 = sv1, sv2, xv

        qn = _l2norm(q, qk_eps, q_scale)
        kn = _l2norm(k, qk_eps, 1.0)
        alpha = lower_bound * tl.sigmoid(a_scale * (graw + dtb))
        beta = tl.sigmoid(braw)

        S = S * tl.exp(alpha)[None, :]
        r = beta * (v - tl.sum(S * kn[None, :], axis=1))
        S = S + r[:, None] * kn[None, :]
        o = tl.sum(S * qn[None, :], axis=1)
        tl.store(y_ptr + i * y_stride + col_v, _bf16(o, SOFT_RNE))  # pre-norm o, bf16 (as the norm reads it)

    tl.store(rs, S)

    # arrival: every thread's stores precede the release; the last of the NV programs continues
    tl.debug_barrier()
    cnt = count_ptr + b * H + h
    prev = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if prev == NV - 1:
        # all NV programs have read the old conv window: shift the whole head's window now
        tl.store(cs + cq, sq0.to(tl.bfloat16))
        tl.store(cs + C + cq, sq1.to(tl.bfloat16))
        tl.store(cs + 2 * C + cq, sq2.to(tl.bfloat16))
        tl.store(cs + ck, sk0.to(tl.bfloat16))
        tl.store(cs + C + ck, sk1.to(tl.bfloat16))
        tl.store(cs + 2 * C + ck, sk2.to(tl.bfloat16))
        cvf = 2 * P + col
        for p in tl.static_range(3):  # new row p = element T + p of [s0, s1, s2, x_0 .. x_{T-1}]
            if T + p < 3:
                v_row = tl.load(cs + (T + p) * C + cvf)
            else:
                v_row = tl.load(z_ptr + (tok0 + (T + p - 3)) * z_stride + cvf)
            tl.store(cs + p * C + cvf, v_row)
        w_norm = tl.load(onorm_ptr + offs)
        for tt in tl.static_range(T):  # (names differ from the loop above: Triton types them per scope)
            it = tok0 + tt
            o_row = tl.load(y_ptr + it * y_stride + col, cache_modifier=".cg").to(tl.float32)
            g_row = tl.load(z_ptr + it * z_stride + 3 * P + col).to(tl.float32)
            inv = tl.rsqrt(tl.sum(o_row * o_row, axis=0) / D + o_eps)
            y_row = o_row * inv * w_norm * tl.sigmoid(g_row)
            tl.store(y_ptr + it * y_stride + col, _bf16(y_row, SOFT_RNE))
        tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call


@triton.jit
def _causal_conv1d_update_kernel(
    u_ptr, z_ptr, conv_w_ptr, conv_state_ptr, slots_ptr,
    u_stride, z_stride, cs_stride,
    T: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr, SOFT_RNE: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    tok0 = b.to(tl.int64) * T

    if slot <= 0:
        for t in tl.static_range(T):
            tl.store(u_ptr + (tok0 + t) * u_stride + c, tl.zeros([BLOCK], dtype=tl.bfloat16), mask=m)
        return

    cs = conv_state_ptr + slot * cs_stride
    s0 = tl.load(cs + c, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(cs + C + c, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(cs + 2 * C + c, mask=m, other=0.0).to(tl.float32)
    w0 = tl.load(conv_w_ptr + c * 4, mask=m, other=0.0)
    w1 = tl.load(conv_w_ptr + c * 4 + 1, mask=m, other=0.0)
    w2 = tl.load(conv_w_ptr + c * 4 + 2, mask=m, other=0.0)
    w3 = tl.load(conv_w_ptr + c * 4 + 3, mask=m, other=0.0)
    for t in tl.static_range(T):
        i = tok0 + t
        x = tl.load(z_ptr + i * z_stride + c, mask=m, other=0.0).to(tl.float32)
        u = _conv_silu(x, s0, s1, s2, w0, w1, w2, w3, SOFT_RNE)
        s0, s1, s2 = s1, s2, x
        tl.store(u_ptr + i * u_stride + c, u.to(tl.bfloat16), mask=m)  # u is already bf16-exact
    tl.store(cs + c, s0.to(tl.bfloat16), mask=m)
    tl.store(cs + C + c, s1.to(tl.bfloat16), mask=m)
    tl.store(cs + 2 * C + c, s2.to(tl.bfloat16), mask=m)


@triton.jit
def _fused_recurrent_kda_kernel(
    o_ptr, u_ptr, g_ptr, z_ptr, a_log_ptr, dt_bias_ptr, rec_ptr, slots_ptr,
    o_stride, u_stride, g_stride, z_stride, rs_stride,
    beta_col, lower_bound, qk_eps, q_scale,
    T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr,
    SOFT_RNE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    P: tl.constexpr = H * D
    offs_k = tl.arange(0, D)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    col_k = h * D + offs_k
    col_v = h * D + offs_v
    slot = tl.load(slots_ptr + b).to(tl.int64)
    tok0 = b.to(tl.int64) * T

    if slot <= 0:
        for t in tl.static_range(T):
            tl.store(o_ptr + (tok0 + t) * o_stride + col_v, tl.zeros([BV], dtype=tl.bfloat16))
        return

    a_scale = tl.exp(tl.load(a_log_ptr + h))
    dtb = tl.load(dt_bias_ptr + col_k)
    rs = rec_ptr + slot * rs_stride + h * (D * D) + offs_v[:, None] * D + offs_k[None, :]
    S = tl.load(rs)  # [BV, K]

    for t in tl.static_range(T):
        i = tok0 + t
        ur = u_ptr + i * u_stride
        q = tl.load(ur + col_k).to(tl.float32)
        k = tl.load(ur + P + col_k).to(tl.float32)
        v = tl.load(ur + 2 * P + col_v).to(tl.float32)
        graw = tl.load(g_ptr + i * g_stride + col_k).to(tl.float32)
        braw = tl.load(z_ptr + i * z_stride + beta_col + h).to(tl.float32)

        qn = _l2norm(q, qk_eps, q_scale)
        kn = _l2norm(k, qk_eps, 1.0)
        alpha = lower_bound * tl.sigmoid(a_scale * (graw + dtb))
        beta = tl.sigmoid(braw)

        S = S * tl.exp(alpha)[None, :]
        r = beta * (v - tl.sum(S * kn[None, :], axis=1))
        S = S + r[:, None] * kn[None, :]
        o = tl.sum(S * qn[None, :], axis=1)
        tl.store(o_ptr + i * o_stride + col_v, _bf16(o, SOFT_RNE))

    tl.store(rs, S)


@triton.jit
def _rmsnorm_gated_kernel(
    y_ptr, o_ptr, z_ptr, onorm_ptr,
    rows, y_stride, o_stride, z_stride, eps,
    H: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, SOFT_RNE: tl.constexpr,
):
    P: tl.constexpr = H * D
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (token, head) rows
    offs = tl.arange(0, D)
    rm = r < rows
    tok = (r // H).to(tl.int64)
    col = (r % H) * D
    m = rm[:, None]
    o = tl.load(o_ptr + tok[:, None] * o_stride + col[:, None] + offs[None, :], mask=m, other=0.0)
    o = o.to(tl.float32)
    gout = tl.load(z_ptr + tok[:, None] * z_stride + 3 * P + col[:, None] + offs[None, :], mask=m, other=0.0)
    onw = tl.load(onorm_ptr + offs)
    rstd = tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)
    out = o * rstd[:, None] * onw[None, :] * tl.sigmoid(gout.to(tl.float32))
    tl.store(y_ptr + tok[:, None] * y_stride + col[:, None] + offs[None, :], _bf16(out, SOFT_RNE), mask=m)


# ---------------------------------------------------------------------------
# validation (host side, before any launch)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_device(**tensors: torch.Tensor) -> None:
    devs = {str(t.device) for t in tensors.values()}
    if len(devs) != 1:
        raise ValueError("all tensors must be on one device, got "
                         + ", ".join(f"{n}: {t.device}" for n, t in tensors.items()))
    dev = next(iter(tensors.values())).device
    if dev.type == "cpu":
        if not _interpreting():
            raise ValueError("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before importing "
                             "triton); pass CUDA tensors otherwise")
    elif dev.type != "cuda":
        raise ValueError(f"tensors must be on a CUDA device (or CPU under TRITON_INTERPRET=1), got {dev}")


def _check(name: str, t: torch.Tensor, shape: tuple, dtypes, last_contig: bool = True,
           contiguous: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if last_contig and t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension")


def _check_z(z: torch.Tensor, n: int, P: int, H: int, f_rank: int) -> int:
    """Checks z [N, >= 4P + f_rank + H] bf16; returns the column of β_raw."""
    if not isinstance(z, torch.Tensor) or z.dim() != 2:
        raise ValueError("z must be a 2-D tensor [N, rows]")
    need = 4 * P + f_rank + H
    if z.shape[1] < need:
        raise ValueError(f"z has {z.shape[1]} columns; [qkv|g_out|f_a|β] needs {need} "
                         f"(P={P}, f_rank={f_rank}, heads={H})")
    _check("z", z, (n, z.shape[1]), torch.bfloat16)
    return 4 * P + f_rank


def _geometry(heads: int, rec_state: torch.Tensor, slots: torch.Tensor, tokens_per_seq: int,
              n_tokens: int) -> tuple[int, int, int]:
    """(B, D, P) from the recurrent state and slots; checks heads, D and N = B·T."""
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    if not isinstance(tokens_per_seq, int) or tokens_per_seq < 1:
        raise ValueError(f"tokens_per_seq must be a positive int, got {tokens_per_seq!r}")
    if not isinstance(rec_state, torch.Tensor) or rec_state.dim() != 4:
        raise ValueError("rec_state must be a 4-D tensor [slots, H, V, K]")
    D = rec_state.shape[-1]
    if rec_state.shape[1] != heads or rec_state.shape[2] != D:
        raise ValueError(f"rec_state must be [slots, {heads}, D, D], got {tuple(rec_state.shape)}")
    if D < 16 or D > MAX_HEAD_DIM or D & (D - 1):
        raise ValueError(f"head dim D={D} must be a power of two in 16..{MAX_HEAD_DIM}")
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.shape[0] < 1:
        raise ValueError("slots must be a 1-D tensor [B] with B >= 1")
    _check("slots", slots, (slots.shape[0],), (torch.int32, torch.int64))
    B = slots.shape[0]
    if n_tokens != B * tokens_per_seq:
        raise ValueError(f"{n_tokens} tokens for {B} sequences x {tokens_per_seq} tokens per sequence")
    return B, D, heads * D


def _check_rec(rec_state: torch.Tensor) -> None:
    if rec_state.dtype != torch.float32:
        raise ValueError(f"rec_state must be torch.float32, got {rec_state.dtype}")
    if not rec_state[0].is_contiguous():
        raise ValueError("rec_state must be contiguous within a slot ([H, V, K] row-major)")


def _check_conv_state(conv_state: torch.Tensor, P: int) -> None:
    if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3:
        raise ValueError("conv_state must be a 3-D tensor [slots, 3, 3P] (SD layout)")
    _check("conv_state", conv_state, (conv_state.shape[0], CONV_WIDTH - 1, 3 * P), torch.bfloat16)
    if not conv_state[0].is_contiguous():
        raise ValueError("conv_state must be contiguous within a slot ([3, 3P] row-major, SD layout)")


def _n_tokens(t: torch.Tensor, name: str) -> int:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [N, ...]")
    return t.shape[0]


# ---------------------------------------------------------------------------
# entry points: one launch each


def fused_kda_decode(y: torch.Tensor, z: torch.Tensor, g_raw: torch.Tensor, conv_w: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_w: torch.Tensor,
                     conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
                     tokens_per_seq: int, heads: int, lower_bound: float = -5.0,
                     qk_eps: float = 1e-6, o_eps: float = 1e-5, f_rank: int = F_RANK,
                     workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Stands in for `torch.ops._C.fused_kda_decode` (TP8): eq. 3-8 in one launch.

    y [N, P] bf16 (out), z [N, >= 4P+f_rank+H] bf16, g_raw [N, P] bf16,
    conv_w [3P, 4] fp32, A_log [H] fp32, dt_bias [P] fp32, o_norm_w [D] fp32,
    conv_state [slots, 3, 3P] bf16 and rec_state [slots, H, D, D] fp32 (updated
    in place at `slots` [B] int32/int64; slot <= 0 gives y = 0 and no update).

    `workspace` (int32 zeros, >= B·H elements, from `make_fused_workspace`; left
    zeroed by every call) selects the V-split kernel: grid (B, H, D/32), 4× the
    programs of the one-program-per-head kernel used without it. Returns y.
    """
    N = _n_tokens(z, "z")
    B, D, P = _geometry(heads, rec_state, slots, tokens_per_seq, N)
    beta_col = _check_z(z, N, P, heads, f_rank)
    _check("y", y, (N, P), torch.bfloat16)
    _check("g_raw", g_raw, (N, P), torch.bfloat16)
    _check("conv_w", conv_w, (3 * P, CONV_WIDTH), torch.float32, contiguous=True)
    _check("A_log", A_log, (heads,), torch.float32)
    _check("dt_bias", dt_bias, (P,), torch.float32)
    _check("o_norm_w", o_norm_w, (D,), torch.float32)
    _check_conv_state(conv_state, P)
    _check_rec(rec_state)
    ws = {} if workspace is None else {"workspace": workspace}
    _check_device(y=y, z=z, g_raw=g_raw, conv_w=conv_w, A_log=A_log, dt_bias=dt_bias, o_norm_w=o_norm_w,
                  conv_state=conv_state, rec_state=rec_state, slots=slots, **ws)
    if workspace is not None:
        if workspace.dtype != torch.int32 or workspace.dim() != 1 or not workspace.is_contiguous():
            raise ValueError("workspace must be a contiguous 1-D int32 tensor (see make_fused_workspace)")
        if workspace.numel() < B * heads:
            raise ValueError(f"workspace has {workspace.numel()} counters; {B} sequences x {heads} heads "
                             f"need {B * heads}")
        BV = min(FUSED_SPLIT_BV, D)
        _fused_kda_decode_split_kernel[(B, heads, D // BV)](
            y, z, g_raw, conv_w, A_log, dt_bias, o_norm_w, conv_state, rec_state, slots, workspace,
            y.stride(0), z.stride(0), g_raw.stride(0), conv_state.stride(0), rec_state.stride(0),
            beta_col, float(lower_bound), float(qk_eps), float(o_eps), D ** -0.5,
            T=tokens_per_seq, H=heads, D=D, BV=BV, SOFT_RNE=_interpreting(), num_warps=FUSED_SPLIT_WARPS,
        )
        return y
    _fused_kda_decode_kernel[(B, heads)](
        y, z, g_raw, conv_w, A_log, dt_bias, o_norm_w, conv_state, rec_state, slots,
        y.stride(0), z.stride(0), g_raw.stride(0), conv_state.stride(0), rec_state.stride(0),
        beta_col, float(lower_bound), float(qk_eps), float(o_eps), D ** -0.5,
        T=tokens_per_seq, H=heads, D=D, SOFT_RNE=_interpreting(), num_warps=FUSED_WARPS,
    )
    return y


def make_fused_workspace(max_batch: int, heads: int, device) -> torch.Tensor:
    """Arrival counters for the V-split `fused_kda_decode` (int32 zeros [max_batch·heads]).

    Allocate once, outside graph capture, and pass to every call (any layer;
    calls on one stream may share it: each call leaves it zeroed).
    """
    return torch.zeros(max_batch * heads, dtype=torch.int32, device=device)


def causal_conv1d_update(u: torch.Tensor, z: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor,
                         slots: torch.Tensor, tokens_per_seq: int) -> torch.Tensor:
    """Stands in for vLLM's Triton `causal_conv1d_update` (TP16 launch 1 of 4): eq. 3.

    u [N, 3P] bf16 (out) = bf16(SiLU(conv4)) of z[:, :3P] (the packed q|k|v);
    conv_w [3P, 4] fp32; conv_state [slots, 3, 3P] bf16 shifted in place.
    Slot <= 0: u = 0 and no update. Returns u.
    """
    N = _n_tokens(u, "u")
    if not isinstance(tokens_per_seq, int) or tokens_per_seq < 1:
        raise ValueError(f"tokens_per_seq must be a positive int, got {tokens_per_seq!r}")
    C = u.shape[1]
    if C % 3:
        raise ValueError(f"u must be [N, 3P], got {C} columns")
    P = C // 3
    _check("u", u, (N, C), torch.bfloat16)
    if not isinstance(z, torch.Tensor) or z.dim() != 2 or z.shape[1] < C:
        raise ValueError(f"z must be [N, >= {C}] (its first 3P columns are the packed q|k|v)")
    _check("z", z, (N, z.shape[1]), torch.bfloat16)
    _check("conv_w", conv_w, (C, CONV_WIDTH), torch.float32, contiguous=True)
    _check_conv_state(conv_state, P)
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.shape[0] < 1:
        raise ValueError("slots must be a 1-D tensor [B] with B >= 1")
    _check("slots", slots, (slots.shape[0],), (torch.int32, torch.int64))
    B = slots.shape[0]
    if N != B * tokens_per_seq:
        raise ValueError(f"{N} tokens for {B} sequences x {tokens_per_seq} tokens per sequence")
    _check_device(u=u, z=z, conv_w=conv_w, conv_state=conv_state, slots=slots)
    _causal_conv1d_update_kernel[(B, triton.cdiv(C, CONV_BLOCK))](
        u, z, conv_w, conv_state, slots,
        u.stride(0), z.stride(0), conv_state.stride(0),
        T=tokens_per_seq, C=C, BLOCK=CONV_BLOCK, SOFT_RNE=_interpreting(), num_warps=CONV_WARPS,
    )
    return u


def fused_recurrent_kda(o: torch.Tensor, u: torch.Tensor, g_raw: torch.Tensor, z: torch.Tensor,
                        A_log: torch.Tensor, dt_bias: torch.Tensor, rec_state: torch.Tensor,
                        slots: torch.Tensor, tokens_per_seq: int, heads: int, lower_bound: float = -5.0,
                        qk_eps: float = 1e-6, f_rank: int = F_RANK) -> torch.Tensor:
    """Stands in for vLLM's Triton `fused_recurrent_kda_packed_decode` (TP16 launch 2 of 4): eq. 4-7.

    o [N, P] bf16 (out, pre-norm), u [N, 3P] bf16 (conv output q|k|v),
    g_raw [N, P] bf16, z (β_raw read from its section), A_log [H], dt_bias [P]
    fp32, rec_state [slots, H, D, D] fp32 updated in place. Returns o.
    """
    N = _n_tokens(u, "u")
    B, D, P = _geometry(heads, rec_state, slots, tokens_per_seq, N)
    beta_col = _check_z(z, N, P, heads, f_rank)
    _check("o", o, (N, P), torch.bfloat16)
    _check("u", u, (N, 3 * P), torch.bfloat16)
    _check("g_raw", g_raw, (N, P), torch.bfloat16)
    _check("A_log", A_log, (heads,), torch.float32)
    _check("dt_bias", dt_bias, (P,), torch.float32)
    _check_rec(rec_state)
    _check_device(o=o, u=u, g_raw=g_raw, z=z, A_log=A_log, dt_bias=dt_bias, rec_state=rec_state, slots=slots)
    BV = min(RECURRENT_BV, D)
    _fused_recurrent_kda_kernel[(B, heads, D // BV)](
        o, u, g_raw, z, A_log, dt_bias, rec_state, slots,
        o.stride(0), u.stride(0), g_raw.stride(0), z.stride(0), rec_state.stride(0),
        beta_col, float(lower_bound), float(qk_eps), D ** -0.5,
        T=tokens_per_seq, H=heads, D=D, BV=BV, SOFT_RNE=_interpreting(), num_warps=RECURRENT_WARPS,
    )
    return o


def rmsnorm_gated(y: torch.Tensor, o: torch.Tensor, z: torch.Tensor, o_norm_w: torch.Tensor, heads: int,
                  eps: float = 1e-5) -> torch.Tensor:
    """Stands in for vLLM's Triton `FusedRMSNormGated` (TP16 launch 4 of 4): eq. 8.

    y [N, P] bf16 (out) = bf16(RMSNorm(o per head)·o_norm_w·σ(g_out)), with
    o [N, P] bf16, g_out = z[:, 3P:4P] and o_norm_w [D] fp32. Returns y.
    """
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    if not isinstance(o_norm_w, torch.Tensor) or o_norm_w.dim() != 1:
        raise ValueError("o_norm_w must be a 1-D tensor [D]")
    D = o_norm_w.shape[0]
    if D < 16 or D > MAX_HEAD_DIM or D & (D - 1):
        raise ValueError(f"head dim D={D} must be a power of two in 16..{MAX_HEAD_DIM}")
    P = heads * D
    N = _n_tokens(o, "o")
    _check("o", o, (N, P), torch.bfloat16)
    _check("y", y, (N, P), torch.bfloat16)
    _check("o_norm_w", o_norm_w, (D,), torch.float32)
    if not isinstance(z, torch.Tensor) or z.dim() != 2 or z.shape[1] < 4 * P:
        raise ValueError(f"z must be [N, >= {4 * P}] (g_out is z[:, 3P:4P])")
    _check("z", z, (N, z.shape[1]), torch.bfloat16)
    _check_device(y=y, o=o, z=z, o_norm_w=o_norm_w)
    rows = N * heads
    _rmsnorm_gated_kernel[(triton.cdiv(rows, NORM_ROWS),)](
        y, o, z, o_norm_w, rows, y.stride(0), o.stride(0), z.stride(0), float(eps),
        H=heads, D=D, ROWS=NORM_ROWS, SOFT_RNE=_interpreting(), num_warps=NORM_WARPS,
    )
    return y


__all__ = ["fused_kda_decode", "make_fused_workspace", "causal_conv1d_update", "fused_recurrent_kda", "rmsnorm_gated"]
