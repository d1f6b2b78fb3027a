"""Stock-vLLM MXFP4 MoE path on an H200 (`kimi_k3_layer.md` §6.2, §6.3 step 3-4, §9 "MoE half" step 5).

Stands in for, one launch each:
    `moe_align_block_size`  -> `moe_align_block_size`
    Marlin MoE GEMM1 (w13)  -> `mxfp4_moe_gemm1`
    Marlin MoE GEMM2 (w2, × top-k weights) -> `mxfp4_moe_gemm2`
    top-k sum (`moe_sum`)   -> `moe_topk_sum`
(situ_and_mul between the GEMMs is another file's kernel.)

SM90 has no FP4 tensor cores, so — as Marlin W4A16 does — the MXFP4 weights are
dequantised in registers to bf16, activations stay bf16, accumulation is fp32.

Layout (§6.2): packed uint8 [E, out, in/2] (even element in the low nibble,
E2M1 sign bit 3, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}); E8M0 scales uint8
[E, out, in/32] = 2^(s-127). GEMM1 reads the fused w13 = cat(w1, w3) on the row
axis ([E, 2I, L/2], [E, 2I, L/32]; `fuse_w13` builds it once), output rows
[gate(I) | up(I)].

Routing bookkeeping. The N·k (token, slot) pairs are numbered p = token·k + slot
(row-major `topk_ids.view(-1)`). `moe_align_block_size` sorts them by expert
(stable: by p inside an expert) and pads each expert's group to a multiple of
`block_m` with the sentinel N·k; block b of `sorted_token_ids` belongs to expert
`expert_ids[b]` (-1 for the unused trailing blocks). Buffer sizes are static:
the number of blocks is at most
    max_blocks = (N·k + min(E, N·k)·(block_m-1)) // block_m
(Σ_e ceil(c_e/bm) with Σ c_e = N·k over at most min(E, N·k) non-empty experts),
so every grid is static and CUDA-graph capturable; GEMM programs whose block
lies past `num_tokens_post_pad` exit at once.

GEMM design (both GEMMs share one kernel). A program owns (N-tile of BLOCK_N
output rows, block of BLOCK_M routed pairs of one expert); grid =
(out/BLOCK_N, max_blocks). It streams the expert's packed rows [BLOCK_N, K/2]
once, K-tile by K-tile (16-byte loads along K; scales [BLOCK_N, BLOCK_K/32]),
dequantises each [BLOCK_N, BLOCK_K] tile once and multiplies it with the
block's activation rows [BLOCK_M, BLOCK_K] (rows of padding pairs masked):
acc[BLOCK_M, BLOCK_N] += X · W_tileᵀ (mma.sync m16n8k16; `swap_ab=True` puts
the weights on the MMA's M side instead, Hopper wgmma with BLOCK_N = 64 rows).
So each selected expert's bytes are read once per launch for up to BLOCK_M
pairs (an expert chosen by more than BLOCK_M pairs spans several blocks and is
read once per block). K is split into even elements (low nibbles) and odd ones
(high nibbles): the activation tile is split the same way (`tl.split`) and
each K-tile is two dots, so the dequantised weights are never interleaved.
Triton's software pipeliner does not pipeline loads that feed inline asm, so
the loop double-buffers in registers by hand (tile k+1 is loaded before tile
k is dequantised). No split-K: batch 1 already gives 16 × 2I/BLOCK_N programs
for GEMM1 (384 at BLOCK_N = 32) and 16 × L/BLOCK_N for GEMM2, and split-K would
need an fp32 scratch plus a second launch.

Dequant on the GPU (`_DEQ_ASM`, PTX inline asm, 4 packed bytes per call, two
weights per 32-bit op): `prmt` spreads bytes to 16-bit lanes; a nibble
sign|mag becomes the bf16 bit pattern sign<<15 | mag<<6, which *is*
e2m1·2^-126 (E2M1's subnormal 0.5 lands on bf16's subnormal 2^-127; bf16 FMA
keeps subnormals); two bf16x2 multiplies by 2^126 and by 2^(s-127) (built as
s<<7) finish it, both exact. That is ~3.3 instructions per weight; the whole
loop is ~7 per weight (SASS), which bounds the kernel on H200 (see the report).
Exact for every code and 1 <= s <= 254 (s = 0 gives 0 instead of 2^-127).
In the interpreter (`TRITON_INTERPRET=1`, no inline asm) `_dequant_pure` does
the same in plain Triton via fp16 subnormals, and the dots run on the exact
fp32 values (the interpreter's dot multiplies bf16 as raw uint16).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import mxfp4

GROUP = mxfp4.GROUP


# ---------------------------------------------------------------------------
# helpers (host side, no launches)


def max_num_blocks(num_tokens: int, topk: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on the number of block_m-blocks `moe_align_block_size` can produce."""
    nk = num_tokens * topk
    return (nk + min(num_experts, nk) * (block_m - 1)) // block_m


def align_buffers(num_tokens: int, topk: int, num_experts: int, block_m: int, device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids int32 [max_blocks·block_m], expert_ids int32 [max_blocks],
    num_tokens_post_pad int32 [1]) for `moe_align_block_size` (allocation only)."""
    if num_tokens < 1 or topk < 1 or num_experts < 1 or block_m < 1:
        raise ValueError("num_tokens, topk, num_experts and block_m must be positive")
    nb = max_num_blocks(num_tokens, topk, num_experts, block_m)
    return (torch.empty(nb * block_m, dtype=torch.int32, device=device),
            torch.empty(nb, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device))


def choose_block_m(num_tokens: int, topk: int, num_experts: int) -> int:
    """Pairs per GEMM block: 16 at decode (≤ 16 pairs per expert on average), larger for prefill-like loads."""
    avg = num_tokens * topk / num_experts
    if avg <= 16:
        return 16
    if avg <= 32:
        return 32
    return 64


def fuse_w13(w1_packed, w1_scale, w3_packed, w3_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 = cat(w1, w3) on the row axis (built once at load time, not per step)."""
    return torch.cat([w1_packed, w3_packed], 1).contiguous(), torch.cat([w1_scale, w3_scale], 1).contiguous()


def _check(name, t, shape=None, dtype=None, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None:
        ok = t.dtype in dtype if isinstance(dtype, tuple) else t.dtype == dtype
        if not ok:
            raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all operands on one device)")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _pick(n: int, choices) -> int:
    for c in choices:
        if n % c == 0:
            return c
    raise ValueError(f"{n} is not a multiple of any of {choices}")


# ---------------------------------------------------------------------------
# 1. moe_align_block_size


@triton.jit
def _align_kernel(topk_ids_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr,
                  NK: tl.constexpr, NKP: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                  BLOCK_M: tl.constexpr, CAP_BLOCKS: tl.constexpr, FILL: tl.constexpr,
                  EP: tl.constexpr):
    i = tl.arange(0, NKP)
    valid = i < NK
    e = tl.load(topk_ids_ptr + i, mask=valid, other=NUM_EXPERTS).to(tl.int64)
    # unique keys: expert-major, pair index minor -> stable grouping; padding lanes sort last
    key = tl.sort(e * NKP + i)
    se = key // NKP  # expert of the r-th sorted pair
    sp = (key - se * NKP).to(tl.int32)  # its pair index
    r = tl.arange(0, NKP)
    svalid = se < NUM_EXPERTS
    # per-expert counts -> unpadded and padded group starts; pos = r + (pstart - start)[expert]
    cnt = tl.histogram(e.to(tl.int32), EP, mask=valid)  # [EP]
    pcnt = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    diff = (tl.cumsum(pcnt, axis=0) - pcnt) - (tl.cumsum(cnt, axis=0) - cnt)
    pos = r + tl.gather(diff, tl.where(svalid, se, 0).to(tl.int32), 0)
    is_bs = ((pos % BLOCK_M) == 0) & svalid  # first pair of a block (groups start block-aligned)
    blk = pos // BLOCK_M
    total_blocks = tl.sum(pcnt, axis=0) // BLOCK_M
    # sentinel everywhere first, then the pairs (barrier orders the two within the CTA)
    for c in tl.static_range(0, CAP_BLOCKS * BLOCK_M, FILL):
        o = c + tl.arange(0, FILL)
        tl.store(sorted_ptr + o, tl.full([FILL], NK, tl.int32), mask=o < CAP_BLOCKS * BLOCK_M)
    for c in tl.static_range(0, CAP_BLOCKS, FILL):
        o = c + tl.arange(0, FILL)
        tl.store(expert_ids_ptr + o, tl.full([FILL], -1, tl.int32), mask=(o < CAP_BLOCKS) & (o >= total_blocks))
    tl.debug_barrier()
    tl.store(sorted_ptr + pos, sp, mask=svalid)
    tl.store(expert_ids_ptr + blk, se.to(tl.int32), mask=is_bs)
    tl.store(ntpp_ptr, total_blocks * BLOCK_M)


def moe_align_block_size(sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                         num_tokens_post_pad: torch.Tensor, topk_ids: torch.Tensor,
                         block_m: int, num_experts: int) -> None:
    """Group the N·k pairs of `topk_ids` [N, k] (int32/int64, values in [0, E)) by expert (one launch).

    Writes sorted_token_ids int32 [max_blocks·block_m] (pair indices, stable within an
    expert, padding = N·k), expert_ids int32 [max_blocks] (-1 past the used blocks) and
    num_tokens_post_pad int32 [1]. Buffers come from `align_buffers`.
    """
    _check("topk_ids", topk_ids, dtype=(torch.int32, torch.int64))
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [N, k], got {tuple(topk_ids.shape)}")
    N, k = topk_ids.shape
    if N < 1 or k < 1:
        raise ValueError(f"topk_ids must be non-empty, got {tuple(topk_ids.shape)}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    nb = max_num_blocks(N, k, num_experts, block_m)
    dev = topk_ids.device
    _check("sorted_token_ids", sorted_token_ids, (nb * block_m,), torch.int32, dev)
    _check("expert_ids", expert_ids, (nb,), torch.int32, dev)
    _check("num_tokens_post_pad", num_tokens_post_pad, (1,), torch.int32, dev)
    nk = N * k
    nkp = max(16, triton.next_power_of_2(nk))
    fill = min(1024, triton.next_power_of_2(nb * block_m))
    _align_kernel[(1,)](topk_ids, sorted_token_ids, expert_ids, num_tokens_post_pad,
                        NK=nk, NKP=nkp, NUM_EXPERTS=num_experts, BLOCK_M=block_m,
                        CAP_BLOCKS=nb, FILL=fill, EP=triton.next_power_of_2(num_experts),
                        num_warps=4 if nkp <= 256 else 8)


# ---------------------------------------------------------------------------
# 2./3. the MXFP4 grouped GEMMs


# PTX (sm_80+): 4 packed bytes -> the 4 bf16 of their low nibbles ($0, $1) and of their high
# nibbles ($2, $3), times the group scale ($5 = bf16x2 (2^(s-127), 2^(s-127))). A nibble
# sign|mag becomes the bf16 bit pattern sign<<15 | mag<<6, which *is* e2m1·2^-126 (E2M1's
# subnormal 0.5 lands on bf16's subnormal 2^-127; bf16 FMA keeps subnormals); then ×2^126 and
# ×2^(s-127) by two bf16x2 multiplies (both exact: powers of two, in range). prmt spreads bytes
# (b0, b1) / (b2, b3) to the two 16-bit halves first, so every op below works on two weights.
_DEQ_ASM = tl.constexpr("""{
.reg .b32 t0, t1, a0, a1, b0, b1, c0, c1, d0, d1, msk, c126, nz, zr;
mov.b32 zr, 0;
mov.b32 msk, 0x01C001C0;
mov.b32 c126, 0x7E807E80;
mov.b32 nz, 0x80008000;
prmt.b32 t0, $4, zr, 0x4140;
prmt.b32 t1, $4, zr, 0x4342;
shl.b32 a0, t0, 6;
shl.b32 a1, t1, 6;
and.b32 b0, t0, 0x00080008;
and.b32 b1, t1, 0x00080008;
shl.b32 b0, b0, 12;
shl.b32 b1, b1, 12;
lop3.b32 a0, a0, msk, b0, 0xEA;
lop3.b32 a1, a1, msk, b1, 0xEA;
shl.b32 c0, t0, 2;
shl.b32 c1, t1, 2;
and.b32 d0, t0, 0x00800080;
and.b32 d1, t1, 0x00800080;
shl.b32 d0, d0, 8;
shl.b32 d1, d1, 8;
lop3.b32 c0, c0, msk, d0, 0xEA;
lop3.b32 c1, c1, msk, d1, 0xEA;
fma.rn.bf16x2 a0, a0, c126, nz;
fma.rn.bf16x2 a1, a1, c126, nz;
fma.rn.bf16x2 c0, c0, c126, nz;
fma.rn.bf16x2 c1, c1, c126, nz;
fma.rn.bf16x2 $0, a0, $5, nz;
fma.rn.bf16x2 $1, a1, $5, nz;
fma.rn.bf16x2 $2, c0, $5, nz;
fma.rn.bf16x2 $3, c1, $5, nz;
}""")


@triton.jit
def _dequant_ptx(q, s):
    """q uint8 [BN, G·16], s uint8 [BN, G] -> (lo, hi) bf16 [BN, G·16]: even / odd K elements."""
    s32 = s.to(tl.int32)
    sb = ((s32 << 7) | (s32 << 23))[:, :, None]  # bf16x2 (2^(s-127), same)
    sb = tl.reshape(tl.broadcast_to(sb, [q.shape[0], s.shape[1], 16]), q.shape)  # one per packed byte
    # pack = 4: four consecutive bytes of one 16-byte group per call, so their scale is one register ($5)
    lo, hi = tl.inline_asm_elementwise(_DEQ_ASM, "=r,=r,=r,=r,r,r,r,r,r", [q, sb],
                                       dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _dequant_pure(q, s):
    """Same as `_dequant_ptx` in plain Triton (the interpreter path): fp16 bits (c&8)<<12 | (c&7)<<9
    are e2m1(c)·2^-14 (the subnormal 0.5 is fp16's 2^-15), widened to fp32, times 2^(s-127)·2^14."""
    q16 = q.to(tl.uint16)
    lo = ((q16 & 0x8) << 12) | ((q16 & 0x7) << 9)
    hi = ((q16 & 0x80) << 8) | ((q16 & 0x70) << 5)
    sc = ((s.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0)[:, :, None]
    sc = tl.reshape(tl.broadcast_to(sc, [q.shape[0], s.shape[1], 16]), q.shape)
    wlo = (lo.to(tl.float16, bitcast=True).to(tl.float32) * sc).to(tl.bfloat16)
    whi = (hi.to(tl.float16, bitcast=True).to(tl.float32) * sc).to(tl.bfloat16)
    return wlo, whi


@triton.jit
def _tile_mma(acc, q, s, x, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              INTERPRET: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc += dequant(q, s) · xᵀ (acc [BLOCK_N, BLOCK_M] with SWAP_AB, else its transpose).

    K is split into its even elements (low nibbles, `lo`) and odd ones (high nibbles, `hi`);
    the activation tile is split the same way, so the weights are never interleaved.
    """
    xe, xo = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))
    if INTERPRET:
        lo, hi = _dequant_pure(q, s)
        # the interpreter's dot multiplies bf16 as raw uint16: give it the (exact) fp32 values
        lo, hi, xe, xo = lo.to(tl.float32), hi.to(tl.float32), xe.to(tl.float32), xo.to(tl.float32)
        if SWAP_AB:
            acc = tl.dot(lo, tl.trans(xe), acc, input_precision="ieee")
            acc = tl.dot(hi, tl.trans(xo), acc, input_precision="ieee")
        else:
            acc = tl.dot(xe, tl.trans(lo), acc, input_precision="ieee")
            acc = tl.dot(xo, tl.trans(hi), acc, input_precision="ieee")
    else:
        lo, hi = _dequant_ptx(q, s)
        if SWAP_AB:
            acc = tl.dot(lo, tl.trans(xe), acc)
            acc = tl.dot(hi, tl.trans(xo), acc)
        else:
            acc = tl.dot(xe, tl.trans(lo), acc)
            acc = tl.dot(xo, tl.trans(hi), acc)
    return acc


@triton.jit
def _moe_gemm_kernel(out_ptr, x_ptr, wq_ptr, ws_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr,
                     num_pairs,
                     N_OUT: tl.constexpr, K: tl.constexpr, X_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     INTERPRET: tl.constexpr, SWAP_AB: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    ntpp = tl.load(ntpp_ptr)
    if pid_b * BLOCK_M >= ntpp:
        return
    expert = tl.load(expert_ids_ptr + pid_b)
    if expert < 0:
        return
    G: tl.constexpr = BLOCK_K // 32
    offs_m = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + offs_m)
    valid = pairs < num_pairs
    xrow = tl.where(valid, pairs // X_DIV, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    e64 = expert.to(tl.int64)
    # packed rows [BLOCK_N, K/2] of this expert, K-tile by K-tile; scales [BLOCK_N, K/32]
    q_ptrs = wq_ptr + e64 * (N_OUT * (K // 2)) + offs_n[:, None] * (K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]
    s_ptrs = ws_ptr + e64 * (N_OUT * (K // 32)) + offs_n[:, None] * (K // 32) + tl.arange(0, G)[None, :]
    x_ptrs = x_ptr + xrow[:, None] * K + tl.arange(0, BLOCK_K)[None, :]  # [BLOCK_M, BLOCK_K], contiguous
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # register double buffering (Triton's pipeliner does not pipeline loads that feed inline asm):
    # the loads of tile k+1 are issued before tile k is dequantised and multiplied
    q = tl.load(q_ptrs)
    s = tl.load(s_ptrs)
    x = tl.load(x_ptrs, mask=valid[:, None], other=0.0)
    for kt in range(1, K // BLOCK_K):  # offsets as kt·const keep their divisibility -> 16-byte loads
        qn = tl.load(q_ptrs + kt * (BLOCK_K // 2))
        sn = tl.load(s_ptrs + kt * G)
        xn = tl.load(x_ptrs + kt * BLOCK_K, mask=valid[:, None], other=0.0)
        acc = _tile_mma(acc, q, s, x, BLOCK_N, BLOCK_M, BLOCK_K, INTERPRET, SWAP_AB)
        q, s, x = qn, sn, xn
    acc = _tile_mma(acc, q, s, x, BLOCK_N, BLOCK_M, BLOCK_K, INTERPRET, SWAP_AB)
    if SWAP_AB:
        acc = tl.trans(acc)
    if MUL_WEIGHT:
        tw = tl.load(topk_w_ptr + tl.where(valid, pairs, 0), mask=valid, other=0.0)
        acc = acc * tw[:, None]
    o_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * N_OUT + offs_n[None, :]
    tl.store(o_ptrs, acc.to(tl.bfloat16), mask=valid[:, None])


def _gemm_blocks(n_out: int, k: int, block_n: int | None, block_k: int | None) -> tuple[int, int]:
    # measured on the H200 at batch 1 (GEMM1 768×3584, GEMM2 3584×384): 32 × 128 with 4 warps was best
    bn = block_n or _pick(n_out, (32, 16))
    bk = block_k or _pick(k, (128, 64, 32))
    if n_out % bn or k % bk or bk % 32 or bn < 16 or bn & (bn - 1) or bk & (bk - 1):
        raise ValueError(f"block_n={bn} / block_k={bk} must be powers of two (≥16 / multiple of 32) "
                         f"dividing out={n_out} / in={k}")
    return bn, bk


def _check_routing(sorted_token_ids, expert_ids, num_tokens_post_pad, block_m, dev):
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two ≥ 16 (tl.dot), got {block_m}")
    _check("sorted_token_ids", sorted_token_ids, dtype=torch.int32, device=dev)
    _check("expert_ids", expert_ids, dtype=torch.int32, device=dev)
    _check("num_tokens_post_pad", num_tokens_post_pad, (1,), torch.int32, dev)
    if (sorted_token_ids.dim() != 1 or expert_ids.dim() != 1
            or sorted_token_ids.numel() != expert_ids.numel() * block_m):
        raise ValueError(f"sorted_token_ids {tuple(sorted_token_ids.shape)} must be [expert_ids.numel()·block_m] "
                         f"= [{expert_ids.numel()}·{block_m}] (buffers from align_buffers with the same block_m)")


def _check_weights(name, wq, ws, n_out, k, dev):
    _check(f"{name}_packed", wq, dtype=torch.uint8, device=dev)
    _check(f"{name}_scale", ws, dtype=torch.uint8, device=dev)
    if wq.dim() != 3 or tuple(wq.shape[1:]) != (n_out, k // 2):
        raise ValueError(f"{name}_packed must be [E, {n_out}, {k // 2}], got {tuple(wq.shape)}")
    if tuple(ws.shape) != (wq.shape[0], n_out, k // GROUP):
        raise ValueError(f"{name}_scale must be [{wq.shape[0]}, {n_out}, {k // GROUP}], got {tuple(ws.shape)}")


def mxfp4_moe_gemm1(out: torch.Tensor, z: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor,
                    sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                    num_tokens_post_pad: torch.Tensor, topk: int, block_m: int,
                    *, block_n: int | None = None, block_k: int | None = None, num_warps: int = 4,
                    swap_ab: bool = False) -> None:
    """out[p] = z[p // topk] · W13[e(p)]ᵀ for every routed pair p (one launch).

    out bf16 [N·topk, 2I] (row p = token·topk + slot; rows [gate(I) | up(I)]);
    z bf16 [N, L]; w13_packed uint8 [E, 2I, L/2]; w13_scale uint8 [E, 2I, L/32];
    the routing buffers from `moe_align_block_size` with the same block_m.
    """
    _check("z", z, dtype=torch.bfloat16)
    if z.dim() != 2:
        raise ValueError(f"z must be [N, L], got {tuple(z.shape)}")
    dev = z.device
    N, L = z.shape
    if topk < 1:
        raise ValueError(f"topk must be positive, got {topk}")
    if L % GROUP:
        raise ValueError(f"L={L} must be a multiple of {GROUP}")
    if not isinstance(w13_packed, torch.Tensor) or w13_packed.dim() != 3:
        raise ValueError("w13_packed must be a [E, 2I, L/2] tensor")
    n_out = w13_packed.shape[1]
    _check_weights("w13", w13_packed, w13_scale, n_out, L, dev)
    _check("out", out, (N * topk, n_out), torch.bfloat16, dev)
    _check_routing(sorted_token_ids, expert_ids, num_tokens_post_pad, block_m, dev)
    bn, bk = _gemm_blocks(n_out, L, block_n, block_k)
    grid = (n_out // bn, expert_ids.numel())
    _moe_gemm_kernel[grid](out, z, w13_packed, w13_scale, z, sorted_token_ids, expert_ids, num_tokens_post_pad,
                           N * topk, N_OUT=n_out, K=L, X_DIV=topk, MUL_WEIGHT=False,
                           BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, INTERPRET=_interpreting(), SWAP_AB=swap_ab,
                           num_warps=num_warps)


def mxfp4_moe_gemm2(out: torch.Tensor, a: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor,
                    topk_weights: torch.Tensor, sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                    num_tokens_post_pad: torch.Tensor, block_m: int,
                    *, block_n: int | None = None, block_k: int | None = None, num_warps: int = 4,
                    swap_ab: bool = False) -> None:
    """out[p] = topk_weights.view(-1)[p] · (a[p] · W2[e(p)]ᵀ) for every routed pair p (one launch).

    out bf16 [N·k, L]; a bf16 [N·k, I] (the SiTU output); w2_packed uint8 [E, L, I/2];
    w2_scale uint8 [E, L, I/32]; topk_weights fp32 [N, k].
    """
    _check("topk_weights", topk_weights, dtype=torch.float32)
    if topk_weights.dim() != 2:
        raise ValueError(f"topk_weights must be [N, k], got {tuple(topk_weights.shape)}")
    dev = topk_weights.device
    N, k = topk_weights.shape
    _check("a", a, dtype=torch.bfloat16, device=dev)
    if a.dim() != 2 or a.shape[0] != N * k:
        raise ValueError(f"a must be [N·k = {N * k}, I], got {tuple(a.shape)}")
    I = a.shape[1]
    if I % GROUP:
        raise ValueError(f"I={I} must be a multiple of {GROUP}")
    if not isinstance(w2_packed, torch.Tensor) or w2_packed.dim() != 3:
        raise ValueError("w2_packed must be a [E, L, I/2] tensor")
    n_out = w2_packed.shape[1]
    _check_weights("w2", w2_packed, w2_scale, n_out, I, dev)
    _check("out", out, (N * k, n_out), torch.bfloat16, dev)
    _check_routing(sorted_token_ids, expert_ids, num_tokens_post_pad, block_m, dev)
    bn, bk = _gemm_blocks(n_out, I, block_n, block_k)
    grid = (n_out // bn, expert_ids.numel())
    _moe_gemm_kernel[grid](out, a, w2_packed, w2_scale, topk_weights, sorted_token_ids, expert_ids,
                           num_tokens_post_pad, N * k, N_OUT=n_out, K=I, X_DIV=1, MUL_WEIGHT=True,
                           BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, INTERPRET=_interpreting(), SWAP_AB=swap_ab,
                           num_warps=num_warps)


# ---------------------------------------------------------------------------
# 4. top-k sum


@triton.jit
def _topk_sum_kernel(out_ptr, y_ptr, L: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < L
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(TOPK):
        acc += tl.load(y_ptr + (t * TOPK + s) * L + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * L + offs, acc.to(tl.bfloat16), mask=m)


def moe_topk_sum(out: torch.Tensor, y: torch.Tensor) -> None:
    """out bf16 [N, L] = Σ_slot y.view(N, k, L) (fp32 accumulation, one launch); y bf16 [N·k, L]."""
    _check("out", out, dtype=torch.bfloat16)
    if out.dim() != 2:
        raise ValueError(f"out must be [N, L], got {tuple(out.shape)}")
    N, L = out.shape
    _check("y", y, dtype=torch.bfloat16, device=out.device)
    if y.dim() != 2 or y.shape[1] != L or y.shape[0] % N or y.shape[0] == 0:
        raise ValueError(f"y must be [N·k, L] = [{N}·k, {L}], got {tuple(y.shape)}")
    k = y.shape[0] // N
    block = min(1024, triton.next_power_of_2(L))
    _topk_sum_kernel[(N, triton.cdiv(L, block))](out, y, L=L, TOPK=k, BLOCK=block, num_warps=4)
