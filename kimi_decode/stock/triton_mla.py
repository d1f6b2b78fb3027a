"""MLA decode attention in Triton, `kimi_k3_layer.md` §5.2 eq. 5–6; stands in for stock vLLM's
`fused_mla_decode_q_concat_kv_cache_insert` and its MLA decode backend (FLASH_ATTN_MLA /
FlashMLA main kernel + split-KV combine) on the H200 (§9, MLA steps 7–8).

Three launches, each one Triton kernel (no other device work, outputs and scratch
preallocated by the caller, so the sequence is CUDA-graph capturable):

1. `mla_q_concat_cache_insert` (grid = N tokens)
       mqa_q[i, h] = [q_lat[h, i] | q_pe[i, h]]                    (bf16, 512 + 64)
       kv_cache.view(-1, 576)[slot_mapping[i]] = [c[i] | k_pe[i]]   (skipped when slot < 0)
2. `mla_decode_split_kv` (grid = (B · ⌈T / TG⌉) × num_splits)
       one program = one KV chunk of one sequence for ALL local heads of TG of the
       sequence's step tokens (rows = TG·H padded to BLOCK_H = 16 for tl.dot), so every
       latent cache row of the chunk is read once:
       s = scale · Q[BLOCK_H, 576] · C[BLOCK_N, 576]ᵀ  (causal: position ≤ ctx + t)
       online softmax (exp2, fp32), acc += P[BLOCK_H, BLOCK_N] · C[:, :512]
       writes o_part[i, h, split] = acc / l (fp32, 0 for an empty split) and
       lse_part[i, h, split] = m + ln l (natural log, −inf for an empty split).
       Sequence b's kv_len = ctx_b + (last step token of the group) + 1 is cut into
       num_splits chunks of ⌈kv_len / num_splits⌉ rounded up to BLOCK_N, so trailing
       splits of short sequences are empty. BLOCK_N (64) divides the page (64), so one tile
       lies in one page and is one contiguous 1152·BLOCK_N-byte run. The latent is split
       into two 256-column halves: three independent score mma chains (K = 256, 256, 64)
       and two [16, 256] P·V accumulators. 8 warps, 2-stage software pipeline.
3. `mla_decode_combine` (grid = N × H × 512 / BLOCK_D, BLOCK_D 32..512 chosen for ≥ 264 programs)
       o_lat[h, i] = Σ_s exp(lse_s − LSE) · o_part[i, h, s],  LSE = log Σ_s exp(lse_s)
       stored bf16 in any layout (the natural one is [H, N, 512], read directly by the
       W_UV bmm).

Decode context parallelism (DCP D, `docs/stock_schedule.md`): a rank's cache holds the positions
τ ≡ rank (mod D) of each sequence (τ at local row τ // D); launch 2 takes the DCP-gathered queries
[D, N, H, 576] (all D ranks' heads, cut into groups of ≤ 16 per program) and attends over the local
rows only, the combine also writes each (head, token)'s log-sum-exp, and `mla_dcp_merge` (the
combine kernel with ranks as splits) merges the ranks' partials for this rank's heads exactly.

Tokens are sequence-major: N = B·T, token i is step token t = i % T of sequence
b = i // T and attends to cache positions 0 .. context_lens[b] + t (inclusive); the
step's rows must already be in the cache (launch 1).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

SCALE = 192 ** -0.5  # (qk_nope 128 + rope 64)^-1/2, §5
LOG2E = 1.4426950408889634

# launch configuration of the split-KV kernel (tuned for sm_90; exposed so a GPU tuner can override)
DECODE_BLOCK_N = 64  # cache rows per tile: divides the page of 64
DECODE_ROWS = 16  # (token, head) rows per program; tl.dot needs M >= 16
DECODE_WARPS = 8
DECODE_STAGES = 2
COMBINE_TARGET_PROGRAMS = 264  # combine: narrow the latent slice per program until ~2 per SM
COMBINE_TILE_ELEMS = 2048  # fp32 partials per warp per combine tile (64 registers a thread)

PROGRAMS_PER_SM = 2  # split-KV programs per SM that choose_num_splits aims for (two waves of 1 CTA/SM)
MIN_SPLIT_TOKENS = 64  # never cut a sequence finer than one page per split
MAX_SPLITS = 512


# ------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _q_concat_cache_insert_kernel(
    MQA_Q, Q_LAT, Q_PE, KV, C, K_PE, SLOT,
    s_mq_n, s_mq_h,
    s_ql_h, s_ql_n,
    s_qp_n, s_qp_h,
    s_kv_b, s_kv_r,
    s_c_n, s_kpe_n,
    H: tl.constexpr, BLOCK_H: tl.constexpr, D_LAT: tl.constexpr, D_PE: tl.constexpr,
    PAGE: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    hm = h < H
    d = tl.arange(0, D_LAT)
    e = tl.arange(0, D_PE)

    # mqa_q[i, h] = [q_lat[h, i] | q_pe[i, h]]
    ql = tl.load(Q_LAT + h[:, None] * s_ql_h + i * s_ql_n + d[None, :], mask=hm[:, None])
    qp = tl.load(Q_PE + i * s_qp_n + h[:, None] * s_qp_h + e[None, :], mask=hm[:, None])
    dst = MQA_Q + i * s_mq_n + h[:, None] * s_mq_h
    tl.store(dst + d[None, :], ql, mask=hm[:, None])
    tl.store(dst + D_LAT + e[None, :], qp, mask=hm[:, None])

    # cache row at slot_mapping[i] = [c[i] | k_pe[i]]; a negative slot is a padding token
    slot = tl.load(SLOT + i).to(tl.int64)
    if slot >= 0:
        row = KV + (slot // PAGE) * s_kv_b + (slot % PAGE) * s_kv_r
        tl.store(row + d, tl.load(C + i * s_c_n + d))
        tl.store(row + D_LAT + e, tl.load(K_PE + i * s_kpe_n + e))


@triton.jit
def _attend_tile(q_lo, q_hi, q_pe, m_i, l_i, acc_lo, acc_hi, KV, bt_row, n0, end, limit,
                 s_kv_b, s_kv_r, qk_scale,
                 BLOCK_N: tl.constexpr, D_HALF: tl.constexpr, D_PE: tl.constexpr, PE_BLOCK: tl.constexpr,
                 PAGE: tl.constexpr, UPCAST: tl.constexpr):
    """One BLOCK_N-row tile of cache positions n0.. (< end) for all rows: online-softmax update.

    The latent is handled as two halves so the score is three independent mma chains
    (K = 256, 256, 64) instead of one K = 576 chain, and P·V is two [BLOCK_H, 256] outputs.
    """
    dh = tl.arange(0, D_HALF)
    e = tl.arange(0, PE_BLOCK)  # rope dims padded to the tl.dot minimum of 16
    # a tile never crosses a page: BLOCK_N divides PAGE and n0 is a multiple of BLOCK_N
    page = tl.load(bt_row + n0 // PAGE).to(tl.int64)
    pos = n0 + tl.arange(0, BLOCK_N)
    in_chunk = pos < end
    kv_row = KV + page * s_kv_b + (pos % PAGE).to(tl.int64) * s_kv_r
    c_lo = tl.load(kv_row[:, None] + dh[None, :], mask=in_chunk[:, None], other=0.0)
    c_hi = tl.load(kv_row[:, None] + D_HALF + dh[None, :], mask=in_chunk[:, None], other=0.0)
    c_pe = tl.load(kv_row[:, None] + 2 * D_HALF + e[None, :], mask=in_chunk[:, None] & (e < D_PE)[None, :],
                   other=0.0)
    if UPCAST:  # interpreter: its tl.dot multiplies bf16 bit patterns, so feed it fp32
        c_lo = c_lo.to(tl.float32)
        c_hi = c_hi.to(tl.float32)
        c_pe = c_pe.to(tl.float32)

    s = tl.dot(q_lo, tl.trans(c_lo))
    s_hi = tl.dot(q_hi, tl.trans(c_hi))
    s_pe = tl.dot(q_pe, tl.trans(c_pe))
    s = (s + s_hi + s_pe) * qk_scale
    keep = in_chunk[None, :] & (pos[None, :] <= limit[:, None])
    s = tl.where(keep, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        p = p.to(tl.bfloat16).to(tl.float32)
    else:
        p = p.to(c_lo.dtype)
    acc_lo = tl.dot(p, c_lo, acc=acc_lo * alpha[:, None])
    acc_hi = tl.dot(p, c_hi, acc=acc_hi * alpha[:, None])
    return m_new, l_i, acc_lo, acc_hi


@triton.jit
def _decode_split_kv_kernel(
    O_PART, LSE_PART, Q, KV, BT, CTX,
    s_q_slot, s_q_n, s_q_h,
    s_kv_b, s_kv_r,
    s_bt_b,
    s_o_n, s_o_h, s_o_s,
    s_l_n, s_l_h,
    qk_scale,  # softmax scale · log2(e)
    T, NUM_SPLITS, DCP, DCP_RANK,
    H: tl.constexpr, HS: tl.constexpr, HG: tl.constexpr, N_HG: tl.constexpr, TG: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D_HALF: tl.constexpr, D_PE: tl.constexpr, PE_BLOCK: tl.constexpr, PAGE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # the head groups and token groups of one split are neighbours: they share the chunk in L2
    pid = tl.program_id(0)
    hg = pid % N_HG
    bg = pid // N_HG
    split = tl.program_id(1)
    n_groups = tl.cdiv(T, TG)
    b = bg // n_groups
    t0 = (bg % n_groups) * TG

    # rows of this program: r = t_loc·HG + j for step tokens t0 .. t0+TG-1 of sequence b and heads
    # h = hg·HG + j of the H query heads; head h is head h % HS of query slot h // HS (DCP: the slots
    # are the DCP ranks' gathered queries, one slot without DCP)
    r = tl.arange(0, BLOCK_H)
    t_loc = r // HG
    h = hg * HG + r % HG
    t = t0 + t_loc
    row_ok = (t_loc < TG) & (t < T) & (h < H)
    tok = (b * T + t).to(tl.int64)

    # the cache holds the positions τ ≡ DCP_RANK (mod DCP) of the sequence, τ at local row τ // DCP
    # (all positions in order without DCP); contexts are global positions
    ctx = tl.load(CTX + b).to(tl.int32)
    x = ctx + t - DCP_RANK
    limit = tl.where(x >= 0, x // DCP, -1)  # last local row row r may attend to
    x_last = ctx + tl.minimum(t0 + TG, T) - 1 - DCP_RANK
    kv_len = tl.where(x_last >= 0, x_last // DCP + 1, 0)  # local rows any row of the group attends to
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)

    dh = tl.arange(0, D_HALF)
    e = tl.arange(0, PE_BLOCK)
    q_row = Q + (h // HS).to(tl.int64) * s_q_slot + tok * s_q_n + (h % HS) * s_q_h
    q_lo = tl.load(q_row[:, None] + dh[None, :], mask=row_ok[:, None], other=0.0)
    q_hi = tl.load(q_row[:, None] + D_HALF + dh[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_row[:, None] + 2 * D_HALF + e[None, :], mask=row_ok[:, None] & (e < D_PE)[None, :],
                   other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_lo = tl.zeros([BLOCK_H, D_HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_H, D_HALF], tl.float32)
    bt_row = BT + b.to(tl.int64) * s_bt_b

    if INTERPRET:
        # the CPU interpreter cannot take data-dependent `range` bounds (numpy 2 scalars),
        # and its bf16 tl.dot is wrong: loop with `while`, dot in fp32 on bf16-rounded values
        q_lo = q_lo.to(tl.float32)
        q_hi = q_hi.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
        n0 = start
        while n0 < end:
            m_i, l_i, acc_lo, acc_hi = _attend_tile(
                q_lo, q_hi, q_pe, m_i, l_i, acc_lo, acc_hi, KV, bt_row, n0, end, limit, s_kv_b, s_kv_r,
                qk_scale, BLOCK_N, D_HALF, D_PE, PE_BLOCK, PAGE, True)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc_lo, acc_hi = _attend_tile(
                q_lo, q_hi, q_pe, m_i, l_i, acc_lo, acc_hi, KV, bt_row, n0, end, limit, s_kv_b, s_kv_r,
                qk_scale, BLOCK_N, D_HALF, D_PE, PE_BLOCK, PAGE, False)

    has = l_i > 0.0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_ptr = (O_PART + tok * s_o_n + h * s_o_h + split * s_o_s)[:, None] + dh[None, :]
    tl.store(o_ptr, acc_lo * inv_l[:, None], mask=row_ok[:, None])
    tl.store(o_ptr + D_HALF, acc_hi * inv_l[:, None], mask=row_ok[:, None])
    tl.store(LSE_PART + tok * s_l_n + h * s_l_h + split, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    O_LAT, O_PART, LSE_PART, LSE_OUT,
    s_out_h, s_out_n, s_out_d,
    s_o_n, s_o_h, s_o_s,
    s_l_n, s_l_h, s_l_s,
    s_lo_h, s_lo_n,
    NUM_SPLITS: tl.constexpr, S_POW2: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    lse_row = LSE_PART + i * s_l_n + h * s_l_h

    # all splits' log-sum-exps in one load: LSE = m + ln Σ exp(lse_s - m)
    sa = tl.arange(0, S_POW2)
    lse_all = tl.load(lse_row + sa * s_l_s, mask=sa < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse_all, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    z = tl.sum(tl.exp(lse_all - m_use), 0)
    lse_tot = m_use + tl.log(tl.where(z > 0.0, z, 1.0))
    if WRITE_LSE:  # the merged log-sum-exp (−inf where nothing was visible), once per (token, head)
        if tl.program_id(2) == 0:
            tl.store(LSE_OUT + h * s_lo_h + i * s_lo_n, tl.where(z > 0.0, lse_tot, float("-inf")))

    # weighted sum of the partial outputs (empty splits have weight 0 and are not read);
    # the tiles are independent, so their loads overlap
    acc = tl.zeros([BLOCK_D], tl.float32)
    o_row = O_PART + i * s_o_n + h * s_o_h
    s_off = tl.arange(0, BLOCK_S)
    for s0 in tl.static_range(0, NUM_SPLITS, BLOCK_S):
        sv = s0 + s_off
        v = tl.load(lse_row + sv * s_l_s, mask=sv < NUM_SPLITS, other=float("-inf"))
        w = tl.exp(v - lse_tot)
        part = tl.load(o_row + sv[:, None] * s_o_s + d[None, :], mask=(w > 0.0)[:, None], other=0.0)
        acc += tl.sum(part * w[:, None], 0)
    tl.store(O_LAT + h * s_out_h + i * s_out_n + d * s_out_d, acc.to(O_LAT.dtype.element_ty))


# ------------------------------------------------------------------------------------------
# host side: validation (before any launch) and launches


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _fail(msg: str):
    raise ValueError(f"triton_mla: {msg}")


def _need(ok: bool, msg: str):
    if not ok:
        _fail(msg)


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _check_tensor(name: str, t, shape: tuple, dtypes, device, last_contiguous: bool = True):
    _need(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _need(tuple(t.shape) == tuple(shape), f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    _need(t.dtype in dtypes, f"{name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    _need(t.device == device, f"{name} is on {t.device}, expected {device} (all tensors on one device)")
    if last_contiguous and t.dim() and t.shape[-1] > 1:
        _need(t.stride(-1) == 1, f"{name} must have unit stride in its last dim, got strides {t.stride()}")


_INT = (torch.int32, torch.int64)


def _check_cache(kv_cache, device):
    _need(isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 3,
          "kv_cache must be a 3-d tensor [num_blocks, block_size, 576]")
    nb, page, width = kv_cache.shape
    _check_tensor("kv_cache", kv_cache, (nb, page, width), torch.bfloat16, device)
    _need(_is_pow2(page), f"kv_cache block_size {page} must be a power of two")
    return nb, page, width


def _dims(width: int, d_lat: int) -> tuple[int, int]:
    d_pe = width - d_lat
    _need(_is_pow2(d_lat) and d_lat >= 32, f"latent dim {d_lat} must be a power of two >= 32")
    _need(_is_pow2(d_pe) and d_pe >= 1, f"rope dim {d_pe} (= {width} - {d_lat}) must be a power of two")
    return d_lat, d_pe


def _grid_groups(H: int, T: int) -> tuple[int, int, int, int]:
    """(TG step tokens per program, HG heads per program, N_HG head groups, BLOCK_H rows).

    Up to DECODE_ROWS heads: all H heads of TG tokens in one program (≤ DECODE_ROWS rows). More heads
    (the DCP-gathered queries): one token per program and the heads cut into ⌈H / DECODE_ROWS⌉ equal
    groups, each a program that reads the chunk (its neighbours read it from L2)."""
    if H <= DECODE_ROWS:
        tg = max(1, min(T, DECODE_ROWS // H))
        return tg, H, 1, max(16, triton.next_power_of_2(tg * H))
    n_hg = triton.cdiv(H, DECODE_ROWS)
    hg = triton.cdiv(H, n_hg)
    return 1, hg, n_hg, max(16, triton.next_power_of_2(hg))


def mla_q_concat_cache_insert(mqa_q: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
                              kv_cache: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                              slot_mapping: torch.Tensor) -> None:
    """One launch: mqa_q[i, h] = [q_lat[h, i] | q_pe[i, h]] and cache row slot_mapping[i] = [c[i] | k_pe[i]].

    mqa_q [N, H, 576] bf16 (written); q_lat [H, N, 512] bf16 (any strides, unit last);
    q_pe [N, H, 64] bf16 (e.g. the strided rope columns of the q_b output); kv_cache
    [num_blocks, block_size, 576] bf16 (written in place at slot_mapping only); c [N, 512],
    k_pe [N, 64] bf16 (row-strided views allowed); slot_mapping [N] int32/int64
    (flat row = block · block_size + offset; negative = skip the cache write).
    """
    _need(isinstance(mqa_q, torch.Tensor) and mqa_q.dim() == 3, "mqa_q must be a 3-d tensor [N, H, 576]")
    dev = mqa_q.device
    N, H, width = mqa_q.shape
    _, _, kv_width = _check_cache(kv_cache, dev)
    _need(kv_width == width, f"mqa_q width {width} differs from the cache row width {kv_width}")
    _need(isinstance(c, torch.Tensor) and c.dim() == 2, "c must be a 2-d tensor [N, 512]")
    d_lat, d_pe = _dims(width, c.shape[1])
    _check_tensor("mqa_q", mqa_q, (N, H, width), torch.bfloat16, dev)
    _check_tensor("q_lat", q_lat, (H, N, d_lat), torch.bfloat16, dev)
    _check_tensor("q_pe", q_pe, (N, H, d_pe), torch.bfloat16, dev)
    _check_tensor("c", c, (N, d_lat), torch.bfloat16, dev)
    _check_tensor("k_pe", k_pe, (N, d_pe), torch.bfloat16, dev)
    _check_tensor("slot_mapping", slot_mapping, (N,), _INT, dev)
    if N == 0:
        return
    _q_concat_cache_insert_kernel[(N,)](
        mqa_q, q_lat, q_pe, kv_cache, c, k_pe, slot_mapping,
        mqa_q.stride(0), mqa_q.stride(1),
        q_lat.stride(0), q_lat.stride(1),
        q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        c.stride(0), k_pe.stride(0),
        H=H, BLOCK_H=triton.next_power_of_2(H), D_LAT=d_lat, D_PE=d_pe, PAGE=kv_cache.shape[1],
        num_warps=4,
    )


def mla_decode_split_kv(o_part: torch.Tensor, lse_part: torch.Tensor, mqa_q: torch.Tensor,
                        kv_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                        tokens_per_seq: int, scale: float = SCALE, num_splits: int | None = None,
                        dcp: int = 1, dcp_rank: int = 0) -> None:
    """One launch: split-KV MLA decode over the paged latent cache, all heads per program.

    o_part [N, H, num_splits, 512] fp32 and lse_part [N, H, num_splits] fp32 (written,
    natural-log LSE, −inf and zeros for an empty split); mqa_q [N, H, 576] bf16, or the
    DCP-gathered queries [D, N, H/D, 576] (head h = slot h // (H/D), head h % (H/D));
    kv_cache [num_blocks, block_size, 576] bf16 (block_size a multiple of DECODE_BLOCK_N);
    block_table [B, max_blocks] and context_lens [B] int32/int64 with N = B · tokens_per_seq.
    num_splits defaults to o_part.shape[2] and must equal it.

    dcp, dcp_rank: decode context parallelism. The cache then holds only the positions
    τ ≡ dcp_rank (mod dcp) of each sequence, position τ at the sequence's local row τ // dcp;
    context_lens stay global positions. The outputs are this rank's partials over its rows.
    """
    _need(isinstance(mqa_q, torch.Tensor) and mqa_q.dim() in (3, 4),
          "mqa_q must be a 3-d tensor [N, H, 576] or DCP-gathered [D, N, H/D, 576]")
    dev = mqa_q.device
    slots = mqa_q.shape[0] if mqa_q.dim() == 4 else 1
    N, HS, width = mqa_q.shape[-3:]
    H = slots * HS
    _, page, kv_width = _check_cache(kv_cache, dev)
    _need(kv_width == width, f"mqa_q width {width} differs from the cache row width {kv_width}")
    _need(isinstance(o_part, torch.Tensor) and o_part.dim() == 4,
          "o_part must be a 4-d tensor [N, H, num_splits, 512]")
    S = o_part.shape[2]
    if num_splits is None:
        num_splits = S
    _need(isinstance(num_splits, int) and num_splits >= 1, f"num_splits must be a positive int, got {num_splits!r}")
    _need(num_splits == S, f"num_splits={num_splits} differs from o_part.shape[2]={S}")
    d_lat, d_pe = _dims(width, o_part.shape[3])
    _need(isinstance(tokens_per_seq, int) and tokens_per_seq >= 1,
          f"tokens_per_seq must be a positive int, got {tokens_per_seq!r}")
    _need(isinstance(dcp, int) and dcp >= 1 and isinstance(dcp_rank, int) and 0 <= dcp_rank < dcp,
          f"need dcp >= 1 and 0 <= dcp_rank < dcp, got dcp={dcp!r}, dcp_rank={dcp_rank!r}")
    _need(mqa_q.dim() == 3 or slots == dcp, f"gathered queries hold {slots} DCP ranks' heads, expected dcp={dcp}")
    _need(isinstance(block_table, torch.Tensor) and block_table.dim() == 2,
          "block_table must be a 2-d tensor [B, max_blocks]")
    B = block_table.shape[0]
    _need(N == B * tokens_per_seq, f"{N} query tokens for {B} sequences × {tokens_per_seq} tokens")
    _check_tensor("o_part", o_part, (N, H, S, d_lat), torch.float32, dev)
    _check_tensor("lse_part", lse_part, (N, H, S), torch.float32, dev)
    _check_tensor("mqa_q", mqa_q, tuple(mqa_q.shape), torch.bfloat16, dev)
    _check_tensor("block_table", block_table, tuple(block_table.shape), _INT, dev)
    _check_tensor("context_lens", context_lens, (B,), _INT, dev)
    _need(page % DECODE_BLOCK_N == 0, f"cache block_size {page} must be a multiple of {DECODE_BLOCK_N}")
    _need(isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0,
          f"scale must be a positive finite float, got {scale!r}")
    if N == 0:
        return
    tg, hg, n_hg, block_h = _grid_groups(H, tokens_per_seq)
    grid = (B * triton.cdiv(tokens_per_seq, tg) * n_hg, S)
    s_slot = mqa_q.stride(0) if mqa_q.dim() == 4 else 0
    _decode_split_kv_kernel[grid](
        o_part, lse_part, mqa_q, kv_cache, block_table, context_lens,
        s_slot, mqa_q.stride(-3), mqa_q.stride(-2),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        float(scale) * LOG2E,
        tokens_per_seq, S, dcp, dcp_rank,
        H=H, HS=HS, HG=hg, N_HG=n_hg, TG=tg, BLOCK_H=block_h, BLOCK_N=DECODE_BLOCK_N, D_HALF=d_lat // 2,
        D_PE=d_pe, PE_BLOCK=max(16, d_pe), PAGE=page, INTERPRET=_interpreting(),
        num_warps=DECODE_WARPS, num_stages=DECODE_STAGES,
    )


def _combine_config(N: int, H: int, S: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_D, num_warps, BLOCK_S) of the combine (measured on the H200, 12 heads: 1 token ×
    264 splits wants 32 columns and 1 warp, 3.8 µs; 64 tokens × 5 splits 512 columns and 4 warps,
    2.8 µs; the kernel is latency-bound, so many narrow programs beat few wide ones)."""
    block_d = triton.next_power_of_2(D)
    while block_d > 32 and N * H * triton.cdiv(D, block_d) < COMBINE_TARGET_PROGRAMS:
        block_d //= 2
    warps = 4 if block_d >= 512 else 2 if block_d >= 256 else 1
    block_s = min(triton.next_power_of_2(S), max(1, COMBINE_TILE_ELEMS * warps // block_d))
    return block_d, warps, block_s


def _combine(o_lat, o_part, lse_part, lse_out, o_strides, l_strides) -> None:
    N, H, S, D = o_part.shape
    block_d, warps, block_s = _combine_config(N, H, S, D)
    _need(_is_pow2(block_d) and D % block_d == 0, f"latent dim {D} must be a power of two")
    if N == 0 or H == 0:
        return
    write_lse = lse_out is not None
    _combine_kernel[(N, H, D // block_d)](
        o_lat, o_part, lse_part, lse_out if write_lse else lse_part,
        o_lat.stride(0), o_lat.stride(1), o_lat.stride(2),
        *o_strides, *l_strides,
        lse_out.stride(0) if write_lse else 0, lse_out.stride(1) if write_lse else 0,
        NUM_SPLITS=S, S_POW2=triton.next_power_of_2(S), BLOCK_S=block_s, BLOCK_D=block_d,
        WRITE_LSE=write_lse, num_warps=warps,
    )


def mla_decode_combine(o_lat: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor,
                       lse_out: torch.Tensor | None = None) -> None:
    """One launch: o_lat[h, i] = Σ_s softmax_s(lse_part[i, h, :]) · o_part[i, h, s] (bf16 out).

    o_lat [H, N, 512] bf16, any strides (e.g. the input of the W_UV bmm); o_part
    [N, H, S, 512] fp32 and lse_part [N, H, S] fp32 from `mla_decode_split_kv`.
    lse_out [H, N] fp32 (optional, any strides): the merged log-sum-exp of each (head, token),
    −inf where no row was visible (a DCP rank's partial, merged across ranks by `mla_dcp_merge`).
    """
    _need(isinstance(o_part, torch.Tensor) and o_part.dim() == 4,
          "o_part must be a 4-d tensor [N, H, num_splits, 512]")
    dev = o_part.device
    N, H, S, D = o_part.shape
    _check_tensor("o_part", o_part, (N, H, S, D), torch.float32, dev)
    _check_tensor("lse_part", lse_part, (N, H, S), torch.float32, dev, last_contiguous=False)
    _check_tensor("o_lat", o_lat, (H, N, D), torch.bfloat16, dev, last_contiguous=False)
    if lse_out is not None:
        _check_tensor("lse_out", lse_out, (H, N), torch.float32, dev, last_contiguous=False)
    _need(S >= 1, "o_part has no splits")
    _combine(o_lat, o_part, lse_part, lse_out, (o_part.stride(0), o_part.stride(1), o_part.stride(2)),
             (lse_part.stride(0), lse_part.stride(1), lse_part.stride(2)))


def mla_dcp_merge(o_lat: torch.Tensor, o_ranks: torch.Tensor, lse_ranks: torch.Tensor) -> None:
    """One launch: the exact merge of D DCP ranks' partial attention outputs for this rank's heads,
    o_lat[h, i] = Σ_r exp(lse_r − LSE) · o_r[h, i], LSE = log Σ_r exp(lse_r) (the combine kernel with the
    ranks as its splits).

    o_lat [H, N, 512] bf16 (written, any strides); o_ranks [D, H, N, 512] bf16 or fp32 and lse_ranks
    [D, H, N] fp32: rank r's normalised partial over its rows and its log-sum-exp (−inf: nothing visible).
    """
    _need(isinstance(o_ranks, torch.Tensor) and o_ranks.dim() == 4, "o_ranks must be a 4-d tensor [D, H, N, 512]")
    dev = o_ranks.device
    D, H, N, C = o_ranks.shape
    _check_tensor("o_ranks", o_ranks, (D, H, N, C), (torch.bfloat16, torch.float32), dev)
    _check_tensor("lse_ranks", lse_ranks, (D, H, N), torch.float32, dev, last_contiguous=False)
    _check_tensor("o_lat", o_lat, (H, N, C), torch.bfloat16, dev, last_contiguous=False)
    # as the combine's o_part [N, H, S = D, C] and lse_part [N, H, S]
    view = o_ranks.permute(2, 1, 0, 3)
    _combine(o_lat, view, lse_ranks.permute(2, 1, 0), None, (view.stride(0), view.stride(1), view.stride(2)),
             (lse_ranks.stride(2), lse_ranks.stride(1), lse_ranks.stride(0)))


def choose_num_splits(batch: int, tokens_per_seq: int, max_context: int, num_sms: int = 132,
                      heads: int = 1, dcp: int = 1) -> int:
    """Splits per sequence for `mla_decode_split_kv` (pure Python).

    Aim for PROGRAMS_PER_SM programs per SM (B · T · splits ≈ PROGRAMS_PER_SM · num_sms; a
    program with 2-stage 64-row tiles holds ~150 KB of shared memory, so one is resident per SM
    and the second wave evens out the tail: on the H200, 1 × 32K context took 18.1 µs with 264
    splits against 20.0 µs with 132) while keeping at least MIN_SPLIT_TOKENS cache rows per
    split. Programs per split are counted as B · T (a program takes more than one step token
    only for ≤ 8 heads, where this errs towards fewer splits). `heads` above DECODE_ROWS (the
    DCP-gathered queries) multiplies the programs per split by the head groups; with `dcp` a rank's
    sequence holds ⌈(context + tokens) / dcp⌉ rows.
    """
    for name, v in (("batch", batch), ("tokens_per_seq", tokens_per_seq), ("num_sms", num_sms),
                    ("heads", heads), ("dcp", dcp)):
        if not isinstance(v, int) or v < 1:
            _fail(f"{name} must be a positive int, got {v!r}")
    if not isinstance(max_context, int) or max_context < 0:
        _fail(f"max_context must be a non-negative int, got {max_context!r}")
    kv_len = triton.cdiv(max_context + tokens_per_seq, dcp)
    head_groups = triton.cdiv(heads, DECODE_ROWS) if heads > DECODE_ROWS else 1
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms, batch * tokens_per_seq * head_groups)
    return max(1, min(want, triton.cdiv(kv_len, MIN_SPLIT_TOKENS), MAX_SPLITS))


def split_kv_scratch(N: int, H: int, num_splits: int, device, d_lat: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_part [N, H, num_splits, d_lat] fp32, lse_part [N, H, num_splits] fp32), uninitialised."""
    o_part = torch.empty(N, H, num_splits, d_lat, dtype=torch.float32, device=device)
    lse_part = torch.empty(N, H, num_splits, dtype=torch.float32, device=device)
    return o_part, lse_part
