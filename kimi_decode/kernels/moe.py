"""The MoE half of a Kimi K3 layer (`kimi_k3_layer.md` §6.3) in four CuTe DSL launches, one rank.

    1. moe_front   GEMV of x [M, d] against [router | latent down | shared gate/up] rows (fp32 out),
                   and in the CTA that finishes the router rows last: sigmoid, top-16 on s + bias,
                   renormalised weights, and the expert-major tables (active experts, token lists).
    2. moe_up      for every active expert and every token routed to it: z·W1ᵀ, z·W3ᵀ with the
                   MXFP4 codes decoded in registers, SiTU → a [active expert, M, I]; plus the
                   shared SiTU, and zeroing the rank's latent accumulator.
    3. moe_down    for every latent row block, split over `expert_splits` CTAs: Σ over their
                   active experts and tokens of w · a·W2ᵀ (MXFP4), added into the rank's latent
                   partial (red.add); the block's last CTA does the one-shot all-reduce read of
                   the slice, bf16 r. Other CTAs: the shared experts' down projection.
    4. moe_tail    RMSNorm(r)·W_upᵀ, plus the shared all-reduce read, stored bf16. The norm is folded
                   around the GEMV: moe_down's all-reduce read stores r ⊙ w_norm and adds Σ r² into a
                   per-token sum (`rms_sumsq`, zeroed by moe_up); the tail is a plain GEMV of that, times
                   rsqrt(Σ r² / L + eps).

Stock vLLM spends 15 launches on the same work (docs/stock_schedule.md). Each active
expert's packed bytes are read once per step (expert-major loops over token lists).
All-reduces on one GPU are emulated as in the stock schedule: the kernel reads
`tp` buffers (its own partial and the stand-ins of the peers') weighted by a
runtime coefficient vector [1, 0, …]; the cross-rank wait is not emulated.

PDL (programmatic dependent launch, keys' `pdl`): launches 2–4 (and the separate routing
launch) are launched as dependents of the launch before them. Every kernel lets its
dependent start as soon as it has started itself (`griddepcontrol.launch_dependents`,
after its own wait), so the next kernel's CTAs are scheduled into the SM slots the
previous one frees in its last wave, and do what does not depend on it before
`griddepcontrol.wait`: moe_down loads its experts' W2 codes and the shared-down rows
(the routing tables it reads come from moe_front, which has completed by then: moe_up
triggers only after its own wait), moe_tail loads its W_up rows. What a kernel reads
from its predecessor is read after the wait.
"""


from dataclasses import dataclass

import torch

from .. import compile as kc
from .gemv import CHUNK, VEC, default_tiling, gemv_partials, gemv_partials_mma, mma_tiling, warp_sum
from .mxfp4_decode import MAX_E8M0, decode_word, scale_pair

MAX_M = 512  # tokens in a step (batch 64 × 8 tokens per sequence)
ACC_WORDS = 12288  # fp32 words of moe_down's per-CTA accumulator (48 KB): tokens ≤ ACC_WORDS / latent rows per CTA
TOPK = 16
E = 896
L = 3584  # latent
D = 7168  # hidden


@dataclass(frozen=True)
class MoEShape:
    """Static sizes of one rank's MoE block."""

    inter: int  # the rank's expert intermediate rows (384 at TP8, 256 at TP16 incl. padding)
    shared: int  # the rank's shared-expert intermediate (768 at TP8, 384 at TP16)
    tp: int
    beta: float = 4.0
    beta_lin: float = 25.0
    eps: float = 1e-5
    scaling: float = 1.0

    @property
    def ncat(self) -> int:
        return E + L + 2 * self.shared

    @property
    def z0(self) -> int:
        return E

    @property
    def sh0(self) -> int:
        return E + L


def split_front_options(variant: str | None) -> tuple[dict, str | None]:
    """Take the routing kernels' options out of a fused variant string: 'focc12-cand0-run35' ->
    ({'min_ctas': 12, 'candidates': False}, 'run35'); what is left goes to the expert kernels' variant parser
    (None if nothing is). fring0 / fring: the one-token front kernel as the plain GEMV (the default) / as the
    persistent bulk-copy ring (`moe_front_ring`; runs 50-51: slower); fringRxS: the ring front with R rows per slot
    and S slots (`MoEFrontRingKey.rows_per_stage`, `.stages`; plain 'fring' is 4x3), fringRxScN with N CTAs per
    SM; tringRxS[cN]: the one-token tail ring's geometry, the same way (`moe_tail_ring.TAIL_RING_GEOMETRIES`,
    default 4x7); focc N: the plain one-token front built for N resident CTAs per SM (with skeys: FRONT_SKEYS_CTAS
    by default); skeys0 / skeys: its routing keys in registers (the default) / in shared memory (`route_tokens` SKEYS; run 49: slower); tring0 / tring: the one-token tail as the plain GEMV / as
    the persistent bulk-copy ring (`moe_tail_ring`, the default since run 49); cotail: at one token moe_down
    staged for one token (`downmax1`) and a tail ring small enough to sit beside it (`moe_tail_ring.cotail_key`),
    so that the tail streams W_up while moe_down runs; tringco: that tail ring alone, after the usual moe_down
    (what the ring itself costs); cand0 / cand1:
    routing without / with the candidate selection (`route_tokens`, on by default); mtfit0 / mtfit: the front and
    tail GEMVs at m_tile 8 for 2-8 tokens (`M8_TILES`, the kernels before run 49) / at the smallest m_tile of
    `M_TILES` that holds the step's tokens (2 at 2 tokens, 4 at 3-4; the default since run 49); fpdl: at one token
    the plain front as a programmatic dependent of the previous launch (its weight rows loaded before the wait,
    `MoEFrontKey.pdl`), and the tail ring letting the next launch be scheduled at its start (`MoETailRingKey.trigger`);
    mma0 / mma: the front and tail GEMVs from MMA_MIN_TOKENS tokens on CUDA cores at m_tile 8 (the kernels before
    2026-12-07) / on tensor cores (the default; `MoEFrontKey.mma`, `MoETailKey.mma`, `tail_key_for`); rspread0 /
    rspread: above 8 tokens, the routing launch as one CTA (the kernel before 2026-12-07) / over one CTA per 16
    tokens (the default; `MoERouteKey.spread`); mrowsR[wW]: the tensor-core front and tail at m_tile 64 (9-512 tokens) with
    R rows a CTA over W warps (`MoEFrontKey.mma_rows`)."""
    import re

    if not variant:
        return {}, variant
    front, rest = {}, []
    for tok in variant.split("-"):
        if m := re.fullmatch(r"cand([01]?)", tok):
            front["candidates"] = m.group(1) != "0"
        elif m := re.fullmatch(r"mtfit([01]?)", tok):
            front["m_tile_fit"] = m.group(1) != "0"
        elif m := re.fullmatch(r"skeys([01]?)", tok):
            front["smem_keys"] = m.group(1) != "0"
        elif m := re.fullmatch(r"tring([01]?)", tok):
            front["tail_ring"] = m.group(1) != "0"
        elif m := re.fullmatch(r"fring([01]?)", tok):
            front["front_ring"] = m.group(1) != "0"
        elif m := re.fullmatch(r"cotail([01]?)", tok):
            front["co_tail"] = m.group(1) != "0"
        elif m := re.fullmatch(r"fpdl([01]?)", tok):
            front["front_pdl"] = m.group(1) != "0"
        elif m := re.fullmatch(r"mma([01]?)", tok):
            front["tensor_cores"] = m.group(1) != "0"
        elif m := re.fullmatch(r"rspread([01]?)", tok):
            front["route_spread"] = m.group(1) != "0"
        elif m := re.fullmatch(r"mrows(\d+)(?:w(\d+))?", tok):
            front["mma_rows"] = (int(m.group(1)), int(m.group(2) or 0))
        elif tok == "tringco":  # the cotail tail ring alone, beside the usual moe_down (which leaves it no room)
            front["co_tail_ring_only"] = True
        elif m := re.fullmatch(r"fring(\d+)x(\d+)(?:c(\d+))?", tok):  # ring front: R rows per slot, S slots, N CTAs/SM
            front["front_ring"] = True
            front["front_ring_geometry"] = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 1))
        elif m := re.fullmatch(r"tring(\d+)x(\d+)(?:c(\d+))?", tok):  # the tail ring's geometry, the same way
            front["tail_ring"] = True
            front["tail_ring_geometry"] = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 1))
        elif m := re.fullmatch(r"focc(\d+)", tok):
            n = int(m.group(1))
            if not 1 <= n <= FRONT_MAX_CTAS:
                raise ValueError(f"foccN asks for N resident front CTAs per SM, 1..{FRONT_MAX_CTAS}; got {tok!r}")
            front["min_ctas"] = n
        else:
            rest.append(tok)
    return front, "-".join(rest) or None


# resident front CTAs per SM asked for with the keys in shared memory ('skeys'): 48 registers, no spills (at 12, 40
# registers, ptxas spills in the GEMV path too)
FRONT_SKEYS_CTAS = 10
FRONT_MAX_CTAS = 16  # CTAs of 4 warps that fit the SM's 64 warps
FRONT_SMEM_CARVEOUT = 50  # percent of the SM's 256 KB for shared memory with 'foccN': room for 16 front CTAs


@dataclass(frozen=True)
class MoEFrontKey:
    shape: MoEShape
    m_tile: int = 1
    route: bool = True  # route in the CTA that finishes the router rows last (False: the GEMV alone)
    # 'foccN': ask ptxas for N resident CTAs per SM (.minnctapersm). The routing code raises the kernel's registers
    # from 40 (the GEMV alone) to 95, which leaves 5 CTAs of 128 threads per SM (70 KB of loads in flight) where
    # the GEMV alone has 12; capped, the routing path (one CTA) may spill. 0: no cap
    min_ctas: int = 0
    candidates: bool = True  # routing by candidates (`route_tokens`); 'cand0': by the bitwise search alone
    # the routing's keys in shared memory (`route_tokens` SKEYS): the kernel keeps about the GEMV's registers
    # instead of 128 (4 CTAs per SM); 'skeys0': in registers (the kernels before run 49)
    smem_keys: bool = False
    # 'fpdl' (one token): launched as a programmatic dependent of the previous launch (the tail of the layer before,
    # which then lets it be scheduled at its own start): each CTA loads its weight rows before griddepcontrol.wait
    # and x after it, so the first CTAs' loads fly while the previous launch drains
    pdl: bool = False
    # 'uflag' (with the pipelined moe_up's route_early): once the routing tables are written, the routing CTA sets
    # meta[ROUTED_FLAG] (release), so that moe_up can request its first ring slots before the front ends
    route_flag: bool = False
    # the shared experts' gate/up rows in the GEMV (the default). False ('shup', one or two tokens): the front stops
    # after the router and latent-down rows and the pipelined moe_up streams the shared gate/up rows itself
    shared_rows: bool = True
    # ('shfrontK', with shared_rows False) the GEMV keeps the gate and up rows of the first K shared columns (after
    # the router and latent-down rows, the up rows' outputs where the full GEMV puts them) and moe_up streams the
    # rest: a share of the shared bytes between the two launches. 0: none kept
    shared_keep: int = 0
    # the GEMV on tensor cores (`gemv.gemv_partials_mma`, its register-ring loop): m_tile in MMA_TILES, the
    # default from MMA_MIN_TOKENS tokens ('mma0': the CUDA-core GEMV at m_tile 8)
    mma: bool = False
    # ('mrowsR[wW]', tensor cores at m_tile 64: every step of 9-512 tokens with the routing as its own launch) R rows
    # a CTA over W warps instead of `gemv.mma_tiling`'s 32 over 4: every CTA reads all of its M tile's x (64 tokens:
    # 917 KB at K 7168) from L2, so 32-row CTAs read twice the weight's bytes of x again. Run 78 (H100): no faster
    # at 64 tokens (front 51.9-68.2 µs against 49.2); 256 and 512 tokens wait for stage moe-mrows512. 0: the default
    mma_rows: int = 0
    mma_warps: int = 0
    arch: str = "sm_90a"


# meta's words (int32; every kernel is built for this length): [0] active experts and [1] the router-row counter (the
# routing's), [2] and [3] the 'dflag' handshake (moe_up's finished-CTA counter and moe_down's pass count); [2] is
# also the 'uflag' routing flag (set by the front, cleared by moe_down), so the two options exclude each other
# (fused_moe.check_flag_handshake)
META_WORDS = 4
DONE_FLAG, PASS_COUNT = 2, 3
ROUTED_FLAG = DONE_FLAG


@dataclass(frozen=True)
class MoERouteKey:
    """Routing as its own launch, one warp per token, in CTAs of `warps` warps (16 warps: 128 registers a thread,
    no spills; 32 would cap them at 64). spread (the default since 2026-12-07): one CTA per `warps` tokens, the last
    CTA to finish builds the tables (`route_spread`); otherwise (option 'rspread0') one CTA routes every token, each
    warp a token after another (0.3 µs a token on the H200: 25 µs at 64 tokens)."""

    shape: MoEShape
    warps: int = 16
    pdl: bool = True  # programmatic dependent launch (see PDL below)
    candidates: bool = True  # as MoEFrontKey.candidates
    arch: str = "sm_90a"
    spread: bool = True


@dataclass(frozen=True)
class MoEUpKey:
    shape: MoEShape
    warps: int = 4
    rows_per_warp: int = 2
    pdl: bool = True
    arch: str = "sm_90a"


@dataclass(frozen=True)
class MoEDownKey:
    shape: MoEShape
    warps: int = 4
    rows_per_warp: int = 4  # latent rows per warp (lane groups of 32 / rows_per_warp)
    experts_ahead: int = 4  # experts whose W2 rows are loaded before any is used
    expert_splits: int = 4  # CTAs sharing a row block's experts (partials meet through red.add)
    pdl: bool = True
    arch: str = "sm_90a"

    @property
    def rows_per_item(self) -> int:
        """Latent rows a CTA sums (one completion counter each), as `moe_pipe.MoEDownPipeKey.rows_per_item`."""
        return self.warps * self.rows_per_warp


@dataclass(frozen=True)
class MoETailKey:
    shape: MoEShape
    m_tile: int = 1
    pdl: bool = True
    mma: bool = False  # the GEMV on tensor cores, as MoEFrontKey.mma
    mma_rows: int = 0  # as MoEFrontKey.mma_rows
    mma_warps: int = 0
    arch: str = "sm_90a"


def tile_output(e, rows: int, m_tile: int, token_major: bool):
    """(row, token) of output e of a front or tail GEMV tile (traced, module level so that it may be called inside
    a staged if): token-major with the tensor-core partials (`gemv_partials_mma`), row-major without."""
    if token_major:
        mi = e // rows
        return e - mi * rows, mi
    r = e // m_tile
    return r, e - r * m_tile


def _situ(g, u, beta, beta_lin):
    """SiTU-GLU of fp32 DSL scalars (traced)."""
    import cutlass.cute as cute
    from cutlass import Float32

    sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g))
    a = Float32(beta) * cute.math.tanh(g * Float32(1.0 / beta)) * sig
    if beta_lin > 0:
        u = Float32(beta_lin) * cute.math.tanh(u * Float32(1.0 / beta_lin))
    return a * u


_SHARED_SITU = None


def shared_situ_and_zeroing():
    """`@cute.jit` shared_situ_and_zeroing()(mF, mAsh, mLat, mSsq, start, step, SHAPE, SITU=True, COLS=0): the part
    of moe_up that does not depend on the routing, over a grid-stride range (start, step) of threads: the shared
    experts' SiTU (a_shared, bf16, from the front kernel's fp32 gate/up pre-activations; SITU=False: the zeroing
    alone, for the pipelined moe_up's 'shup', which computes a_shared itself, or with COLS > 0 ('shfrontK') only its
    first COLS columns, whose rows the front kept) and zeroing this rank's fp32 latent partial and the per-token Σ r²
    that moe_down adds into."""
    global _SHARED_SITU
    if _SHARED_SITU is None:
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Constexpr, Float32, const_expr

        @cute.jit
        def run(mF: cute.Tensor, mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor, start, step,
                SHAPE: Constexpr, SITU: Constexpr = True, COLS: Constexpr = 0):
            M = mF.shape[0]
            S, SH0 = SHAPE.shared, SHAPE.sh0
            NC = S if SITU else COLS  # columns of a_shared computed here
            if const_expr(NC > 0):
                for idx in cutlass.range(start, M * NC, step):
                    t = idx // NC
                    c = idx - t * NC
                    a = _situ(mF[t, SH0 + c], mF[t, SH0 + S + c], SHAPE.beta, SHAPE.beta_lin)
                    mAsh[t, c] = a.to(BFloat16)
            for idx in cutlass.range(start, M * L, step):
                t = idx // L
                mLat[0, t, idx - t * L] = Float32(0.0)
            for idx in cutlass.range(start, M, step):
                mSsq[idx] = Float32(0.0)

        _SHARED_SITU = run
    return _SHARED_SITU


_SUMSQ = None


def rms_sumsq():
    """`@cute.jit` rms_sumsq()(acc, mSsq, M, RB, WARPS): one warp per token adds Σ_rl acc[t, rl] (a row block's
    r², left in shared memory by the all-reduce read) into mSsq[t] (`red.add`): the RMSNorm's sum of squares,
    complete when every row block is in, read by the tail after its wait."""
    global _SUMSQ
    if _SUMSQ is None:
        import cutlass
        import cutlass.cute as cute
        from cutlass import Constexpr, Float32

        @cute.jit
        def sumsq(acc: cute.Tensor, mSsq: cute.Tensor, M, RB: Constexpr, WARPS: Constexpr):
            lane = cute.arch.lane_idx()
            warp = cute.arch.warp_idx()
            for t in cutlass.range(warp, M, WARPS):
                v = Float32(0.0)
                for rl in cutlass.range_constexpr(0, RB, 32):
                    if rl + lane < RB:
                        v = v + acc[t, rl + lane]
                v = cute.arch.warp_reduction_sum(v)
                if lane == 0:
                    cute.arch.red(mSsq.iterator + t, v, op="add", dtype=Float32, sem="relaxed", scope="gpu")

        _SUMSQ = sumsq
    return _SUMSQ


# --------------------------------------------------------------------------- 1. front + routing


def _routing_fakes(m):
    """Compile-time stand-ins of the routing tensors (bias, meta, ids, weights, expert-major weights, active
    experts, their (offset, count) lists, the grouped token ids) and the stream, shared by the front and route kernels; m: the token count."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    fake = cute.runtime.make_fake_compact_tensor
    return (
        fake(Float32, (E,), assumed_align=16),
        fake(Int32, (META_WORDS,), assumed_align=16),
        fake(Int32, (m, TOPK), stride_order=(1, 0), assumed_align=16),
        fake(Float32, (m, TOPK), stride_order=(1, 0), assumed_align=16),
        fake(Float32, (E, m), stride_order=(1, 0), assumed_align=16),
        fake(Int32, (E,), assumed_align=16),
        fake(Int32, (E, 2), stride_order=(1, 0), assumed_align=16),
        fake(Int32, (cute.sym_int(),), assumed_align=16),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )

_ROUTE = None


def route_tokens():
    """`@cute.jit` routing of every token from the router logits (§6.3 eq. 1), by one CTA:

        route_tokens()(mO, mBias, mMeta, mIds, mWts, mWe, mAct, mList, mTok, cnt, lst, wtot, kys, WARPS, SCALING,
                       CAND, SKEYS, T0, BAR)

    One warp per token. Each lane holds 28 keys s + bias (s = σ(logit)) as order-preserving integers.
    With CAND (the default since run 43): the 16th largest of the 32 lane maxima, m16, bounds the 16th
    largest key from below, so the top 16 lie among the keys >= m16 (about 21 for random scores); up to
    ROUTE_LIST of them are compacted into shared memory (`lst`, [WARPS * ROUTE_LIST, 2] Int32: key, index),
    one per lane, and each ranks itself against the others by (key desc, index asc), as torch.topk with
    lowest-index ties: a few hundred instructions. Without CAND, or with more candidates, the 16th largest
    key T is found exactly by a 32-step bitwise search (each step counts the keys >= a candidate with one
    `redux.sync`), keys > T and the lowest-index ties = T are compacted and ranked: about 4400 instructions
    of one warp, 12-15 µs a token on the H200 (run 42's source counters). Weights s / Σ s · scaling. Then the
    expert-major tables, from per-expert token counts in shared memory (`cnt` [E] Int32, `wtot` [WARPS]
    Int32) and one CTA scan: mMeta[0] = number of active experts, mAct[j] the j-th active expert
    (ascending), mList[j] = (offset, count) of its tokens in mTok [TOPK · M] (the (expert, token) pairs,
    grouped by expert). T0 and BAR (for routing warps inside a larger CTA): the routing threads are T0 ..
    T0 + 32 · WARPS - 1, and they meet on named barrier BAR instead of the CTA barrier. With SKEYS warp 0 routes every token, one after the other, with the keys in shared
    memory (`kys`, [E] Int32) instead of 28 registers a lane, the logits and biases loaded in two groups: the
    front kernel can then be capped at the GEMV's registers without spilling the routing (its occupancy),
    at the price of shared-memory loads in the routing (and, above one token, of one warp routing them all).
    """
    return _routes()[0]


def _routes():
    global _ROUTE
    if _ROUTE is None:
        _ROUTE = _make_route()
    return _ROUTE


def route_spread():
    """`@cute.jit` the routing spread over a grid (`MoERouteKey.spread`):

        route_spread()(mO, mBias, mMeta, mIds, mWts, mWe, mAct, mList, mTok, mCnt, cnt, lst, wtot, flag, WARPS,
                       SCALING, CAND)

    Each warp of the grid routes one token as `route_tokens` does (grid-stride), adding one count per chosen expert
    into mCnt ([E] Int32 in global memory, zero on entry); the CTA that finishes last (an atomic counter in
    mMeta[1]) takes the counts into shared memory (`cnt`), leaves mCnt and the counter at zero for the next step,
    and builds the expert-major tables with its warps, the token-list loads ROUTE_FILL a thread in flight.
    `flag`: two Int32 of shared memory."""
    return _routes()[1]


ROUTE_FILL = 8  # (expert, token) pairs a thread loads together when the spread routing fills the token lists
ROUTE_LIST = 32  # (key, index) entries per routing warp: the candidates of the top 16, or the top 16 itself
ROUTE_LIST_WORDS = 2 * ROUTE_LIST  # Int32 words of shared memory per routing warp


def route_smem_bytes(warps: int, smem_keys: bool = False) -> int:
    """Shared memory the routing of a CTA of `warps` warps needs (`route_smem`), with alignment slack."""
    return 4 * E + 4 * warps * (ROUTE_LIST_WORDS + 1) + (4 * E if smem_keys else 0) + 144


def route_smem(smem, warps: int, smem_keys: bool = False):
    """(cnt, lst, wtot, kys): the routing's shared-memory tensors, allocated from `smem` (traced in a kernel);
    kys ([E] Int32, the keys of the token being routed) only with `smem_keys`, else kys is lst (unused)."""
    import cutlass.cute as cute
    from cutlass import Int32

    cnt = smem.allocate_tensor(Int32, cute.make_layout((E,)), byte_alignment=16)
    lst = smem.allocate_tensor(Int32, cute.make_layout((warps * ROUTE_LIST_WORDS,)), byte_alignment=16)
    wtot = smem.allocate_tensor(Int32, cute.make_layout((warps,)), byte_alignment=16)
    kys = smem.allocate_tensor(Int32, cute.make_layout((E,)), byte_alignment=16) if smem_keys else lst
    return cnt, lst, wtot, kys


def _group_sync(bar: int, threads: int) -> None:
    """(traced) The routing's barrier: the whole CTA (bar 0), or named barrier `bar` over its `threads` threads
    when the routing warps are part of a larger CTA (`moe_front_ring`)."""
    import cutlass.cute as cute

    if bar:
        cute.arch.barrier(barrier_id=bar, number_of_threads=threads)
    else:
        cute.arch.barrier()


def _token_step(smem_keys: bool, warps: int) -> int:
    """The routing's stride over tokens: one warp per token, or (smem_keys) warp 0 for all of them."""
    return 1 if smem_keys else warps


class _SmemKeys:
    """Trace-time view of one lane's keys in shared memory: keys[j] is the key of expert lane + 32 j, at
    kys[lane + 32 j] (each lane reads only what it wrote, no barrier needed)."""

    def __init__(self, kys, base):
        self.kys, self.base = kys, base

    def __getitem__(self, j):
        return self.kys[self.base + 32 * j]

    def __setitem__(self, j, value):
        self.kys[self.base + 32 * j] = value


def _f32_bits(f):
    """fp32 -> its bits as Int32 (traced)."""
    from cutlass import Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    return Int32(llvm.bitcast(T.i32(), f.ir_value()))


def _bits_f32(i):
    """Int32 bits -> fp32 (traced)."""
    from cutlass import Float32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    return Float32(llvm.bitcast(T.f32(), i.ir_value()))


def _order_key(f):
    """fp32 -> Int32 whose signed order is the float order (traced)."""
    from cutlass import Int32

    bits = _f32_bits(f)
    return bits ^ ((bits >> 31) & Int32(0x7FFFFFFF))


def _make_route():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Constexpr, Float32, Int32, const_expr

    NPL = E // 32
    INT_MIN = -(1 << 31)
    INT_MAX = (1 << 31) - 1
    LIST = ROUTE_LIST  # entries of a warp's (key, index) list
    SHFL_BATCH = 8  # shuffles per round of the ranking loops (unrolled in full: 128 registers in the front kernel)

    @cute.jit
    def route(mO: cute.Tensor, mBias: cute.Tensor, mMeta: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
              mWe: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, cnt: cute.Tensor,
              lst: cute.Tensor, wtot: cute.Tensor, kys: cute.Tensor, WARPS: Constexpr, SCALING: Constexpr,
              CAND: Constexpr = True, SKEYS: Constexpr = False, T0: Constexpr = 0, BAR: Constexpr = 0):
        THREADS = 32 * WARPS
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        if const_expr(T0):  # the routing warps are threads T0 .. T0 + THREADS - 1 of a larger CTA
            tid = tid - T0
            warp = warp - T0 // 32
        M = mIds.shape[0]
        lt = Int32(cute.arch.lanemask_lt())
        for e in cutlass.range(tid, E, THREADS):
            cnt[e] = Int32(0)
        _group_sync(BAR, THREADS)
        t0 = warp
        if const_expr(SKEYS):  # warp 0 routes every token, one after the other (the others start past the last)
            t0 = warp * M
        tokens(mO, mBias, mIds, mWts, mWe, cnt, lst, kys, t0, _token_step(SKEYS, WARPS), lane, warp, lt, SCALING,
               CAND, SKEYS)
        _group_sync(BAR, THREADS)
        tables(mMeta, mIds, mAct, mList, mTok, cnt, wtot, tid, lane, warp, WARPS, BAR, 1)

    @cute.jit
    def tokens(mO: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mWe: cute.Tensor,
               cnt: cute.Tensor, lst: cute.Tensor, kys: cute.Tensor, t0, tstep, lane, warp, lt, SCALING: Constexpr,
               CAND: Constexpr, SKEYS: Constexpr):
        """Route tokens t0, t0 + tstep, ... < M, one warp each: ids, weights, expert-major weights, and one count
        per chosen expert added into `cnt` (shared memory, or global memory in the spread routing)."""
        M = mIds.shape[0]
        for t in cutlass.range(t0, M, tstep):
            if const_expr(SKEYS):
                # the keys in shared memory (SKEYS): no 28 key registers, and the logits and the biases in
                # flight one group after the other (28 registers, two round trips), so that the kernel holding
                # the routing keeps the GEMV's registers. The same arithmetic: σ rounded to fp32, plus the bias
                ky = _SmemKeys(kys, lane)
                lgs = [mO[t, lane + 32 * j] for j in range(NPL)]
                for j in cutlass.range_constexpr(NPL):
                    ky[j] = _f32_bits(Float32(1.0) / (Float32(1.0) + cute.math.exp(-lgs[j])))
                bss = [mBias[lane + 32 * j] for j in range(NPL)]
                for j in cutlass.range_constexpr(NPL):
                    ky[j] = _order_key(_bits_f32(ky[j]) + bss[j])
            else:
                ky = cute.make_rmem_tensor((NPL,), Int32)
                # every logit and bias load is issued before any arithmetic: the IEEE reciprocal of the sigmoid
                # has a slow-path branch that loads are not moved across, so interleaved they ran one L2 round
                # trip after another (56 of them: about 19 µs for one token on the H200)
                lgs = [mO[t, lane + 32 * j] for j in range(NPL)]
                bss = [mBias[lane + 32 * j] for j in range(NPL)]
                for j in cutlass.range_constexpr(NPL):
                    sj = Float32(1.0) / (Float32(1.0) + cute.math.exp(-lgs[j])) + bss[j]
                    ky[j] = _order_key(sj)
            lw = warp * LIST  # this warp's (key, index) list in shared memory
            mk = Int32(INT_MIN)  # this lane's entry of the list: key and expert index
            mine = Int32(0)
            rank = Int32(TOPK)  # the entry's place in the top 16 (TOPK: not chosen)
            ncand = Int32(LIST + 1)
            c = Int32(0)
            pos = Int32(0)
            if const_expr(CAND):
                # the 16 largest lane maxima are 16 distinct keys, so the 16th of them, m16, is at most the
                # 16th largest key: the top 16 lie among the keys >= m16 (ncand of them, about 21 for random
                # scores; at most LIST takes this path, more the bitwise search below)
                mx = ky[0]
                for j in cutlass.range_constexpr(1, NPL):
                    mx = cutlass.max(mx, ky[j])
                rk = Int32(0)  # this lane's maximum's rank among the 32 (ties by lane)
                for q0 in cutlass.range(0, 32, SHFL_BATCH):  # a few shuffles in flight: registers stay low
                    for u in cutlass.range_constexpr(SHFL_BATCH):
                        o = cute.arch.shuffle_sync(mx, q0 + u)
                        rk = rk + (Int32(o > mx) | (Int32(o == mx) & Int32(lane > q0 + u)))
                m16 = cute.arch.warp_redux_sync(cutlass.select_(rk < TOPK, mx, Int32(INT_MAX)), "min")
                c = Int32(0)
                for j in cutlass.range_constexpr(NPL):
                    c = c + Int32(ky[j] >= m16)
                ncand = cute.arch.warp_redux_sync(c, "add")
                if ncand <= LIST:
                    pos = c  # exclusive prefix of the lanes' counts: this lane's first place in the list
                    for off in cutlass.range_constexpr(5):
                        o = cute.arch.shuffle_sync_up(pos, offset=1 << off)
                        if lane >= (1 << off):
                            pos = pos + o
                    pos = pos - c
                    for j in cutlass.range_constexpr(NPL):
                        if ky[j] >= m16:
                            lst[(lw + pos) * 2] = ky[j]
                            lst[(lw + pos) * 2 + 1] = lane + 32 * j
                            pos = pos + 1
                    cute.arch.sync_warp()
                    if lane < ncand:
                        mk = lst[(lw + lane) * 2]
                        mine = lst[(lw + lane) * 2 + 1]
                    rank = Int32(0)  # keys above this one, or equal with a lower index (torch.topk's order)
                    for q0 in cutlass.range(0, LIST, SHFL_BATCH):
                        for u in cutlass.range_constexpr(SHFL_BATCH):
                            ok = cute.arch.shuffle_sync(mk, q0 + u)
                            oi = cute.arch.shuffle_sync(mine, q0 + u)
                            rank = rank + (Int32(ncand > q0 + u) & (Int32(ok > mk) | (Int32(ok == mk) & Int32(oi < mine))))
                    if lane >= ncand:
                        rank = Int32(TOPK)
            if ncand > LIST:
                # T (as unsigned bits tu): the largest value with at least TOPK keys >= it, bit by bit
                tu = Int32(0)
                for b in cutlass.range_constexpr(32):
                    cu = tu | Int32((1 << (31 - b)) if b else INT_MIN)
                    cs = cu ^ Int32(INT_MIN)
                    cq = [Int32(0), Int32(0), Int32(0), Int32(0)]  # four partial counts: a short add chain
                    for j in cutlass.range_constexpr(NPL):
                        cq[j % 4] = cq[j % 4] + Int32(ky[j] >= cs)
                    if cute.arch.warp_redux_sync((cq[0] + cq[1]) + (cq[2] + cq[3]), "add") >= TOPK:
                        tu = cu
                th = tu ^ Int32(INT_MIN)
                c = Int32(0)
                for j in cutlass.range_constexpr(NPL):
                    c = c + Int32(ky[j] > th)
                need = Int32(TOPK) - cute.arch.warp_redux_sync(c, "add")  # ties at T to take, lowest index first
                base = Int32(0)
                tb = Int32(0)
                for j in cutlass.range_constexpr(NPL):
                    eq = ky[j] == th
                    be = cute.arch.vote_ballot_sync(eq)
                    sel = ky[j] > th
                    if eq:
                        sel = tb + cute.arch.popc(be & lt) < need
                    bs = cute.arch.vote_ballot_sync(sel)
                    if sel:
                        pos = (lw + base + cute.arch.popc(bs & lt)) * 2
                        lst[pos] = ky[j]
                        lst[pos + 1] = lane + 32 * j
                    base = base + cute.arch.popc(bs)
                    tb = tb + cute.arch.popc(be)
                cute.arch.sync_warp()
                if lane < TOPK:
                    mk = lst[(lw + lane) * 2]
                    mine = lst[(lw + lane) * 2 + 1]
                    rank = Int32(0)
                    for q in cutlass.range_constexpr(TOPK):
                        okey = lst[(lw + q) * 2]
                        oid = lst[(lw + q) * 2 + 1]
                        if okey > mk or (okey == mk and oid < mine):
                            rank = rank + Int32(1)
            # the chosen experts into lanes 0..15 by rank, whichever path chose them: Σ s is then summed in one
            # order (the weights are bit-identical between the paths) and the stores are coalesced
            cute.arch.sync_warp()
            if rank < TOPK:
                lst[(lw + rank) * 2 + 1] = mine
            cute.arch.sync_warp()
            s = Float32(0.0)
            if lane < TOPK:
                mine = lst[(lw + lane) * 2 + 1]
                s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-mO[t, mine]))
            tot = cute.arch.warp_reduction_sum(s)
            cute.arch.sync_warp()  # the list is reused by this warp's next token
            if lane < TOPK:
                mIds[t, lane] = mine
                mWts[t, lane] = s / tot * Float32(SCALING)
                mWe[mine, t] = s / tot * Float32(SCALING)
                cute.arch.atomic_add(cnt.iterator + mine, Int32(1))

    @cute.jit
    def tables(mMeta: cute.Tensor, mIds: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor,
               cnt: cute.Tensor, wtot: cute.Tensor, tid, lane, warp, WARPS: Constexpr, BAR: Constexpr,
               FILL: Constexpr):
        """The expert-major tables from the per-expert token counts in `cnt` (shared memory, complete); FILL: the
        token-list pass takes FILL (expert, token) pairs a thread per round, their loads in flight together."""
        THREADS = 32 * WARPS
        CH = -(-E // THREADS)
        M = mIds.shape[0]
        # expert-major tables: one exclusive scan over the experts (in index order, so the active list is
        # deterministic) of (tokens << 16 | active), each thread owning a contiguous run of CH experts
        e0 = tid * CH
        run = Int32(0)
        for q in cutlass.range_constexpr(CH):
            if e0 + q < E:
                c = cnt[e0 + q]
                run = run + (c << 16) + Int32(c > 0)
        inc = run
        for off in cutlass.range_constexpr(5):
            o = cute.arch.shuffle_sync_up(inc, offset=1 << off)
            if lane >= (1 << off):
                inc = inc + o
        if lane == 31:
            wtot[warp] = inc
        _group_sync(BAR, THREADS)
        base = Int32(0)
        for w_ in cutlass.range_constexpr(WARPS):
            if w_ < warp:
                base = base + wtot[w_]
        pre = base + inc - run
        for q in cutlass.range_constexpr(CH):
            if e0 + q < E:
                c = cnt[e0 + q]
                if c > 0:
                    j = pre & Int32(0xFFFF)
                    mAct[j] = e0 + q
                    mList[j, 0] = pre >> 16
                    mList[j, 1] = c
                    cnt[e0 + q] = pre >> 16  # from here on: the expert's next free place in mTok
                pre = pre + (c << 16) + Int32(c > 0)
        if tid == THREADS - 1:
            mMeta[0] = pre & Int32(0xFFFF)
        _group_sync(BAR, THREADS)
        if const_expr(FILL == 1):
            for idx in cutlass.range(tid, M * TOPK, THREADS):  # token lists (order within an expert: arrival)
                t = idx // TOPK
                e = mIds[t, idx - t * TOPK]
                mTok[cute.arch.atomic_add(cnt.iterator + e, Int32(1))] = t
        else:
            last = M * TOPK - 1
            for i0 in cutlass.range(tid, M * TOPK, THREADS * FILL):
                es = [mIds[cutlass.min(i0 + u * THREADS, last) // TOPK, cutlass.min(i0 + u * THREADS, last) % TOPK]
                      for u in range(FILL)]  # loaded together, the index clamped: no branch between them
                for u in cutlass.range_constexpr(FILL):
                    idx = i0 + u * THREADS
                    if idx <= last:
                        mTok[cute.arch.atomic_add(cnt.iterator + es[u], Int32(1))] = idx // TOPK

    @cute.jit
    def spread(mO: cute.Tensor, mBias: cute.Tensor, mMeta: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
               mWe: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mCnt: cute.Tensor,
               cnt: cute.Tensor, lst: cute.Tensor, wtot: cute.Tensor, flag: cute.Tensor, WARPS: Constexpr,
               SCALING: Constexpr, CAND: Constexpr):
        THREADS = 32 * WARPS
        tid, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        gx, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        lt = Int32(cute.arch.lanemask_lt())
        # one warp per token over the grid, counting the chosen experts in global memory (mCnt, zero on entry)
        tokens(mO, mBias, mIds, mWts, mWe, mCnt, lst, lst, bx * WARPS + warp, gx * WARPS, lane, warp, lt, SCALING,
               CAND, False)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        if tid == 0:
            old = cute.arch.atomic_add(mMeta.iterator + 1, Int32(1), sem="acq_rel", scope="gpu")
            flag[0] = Int32(old == gx - 1)
        cute.arch.barrier()
        if flag[0] != 0:  # the last CTA: every token is routed and counted
            cute.arch.fence_acq_rel_gpu()
            for e in cutlass.range(tid, E, THREADS):  # the counts, and zero left for the next step
                cnt[e] = cute.arch.atomic_exch(mCnt.iterator + e, Int32(0), sem="relaxed", scope="gpu")
            if tid == 0:
                mMeta[1] = Int32(0)  # re-arm the CTA counter
            cute.arch.barrier()
            tables(mMeta, mIds, mAct, mList, mTok, cnt, wtot, tid, lane, warp, WARPS, 0, ROUTE_FILL)

    return route, spread




def build_front(key: MoEFrontKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr

    sh = key.shape
    KEEP = key.shared_keep  # ('shfrontK') shared columns whose gate and up rows stay in the GEMV
    assert KEEP == 0 or (not key.shared_rows and 0 < KEEP < sh.shared), "shared_keep: a share of the shared rows"
    N, K, MT = (sh.ncat if key.shared_rows else sh.sh0 + 2 * KEEP), D, key.m_tile  # rows it computes
    NCAT = sh.ncat  # the weight's and the output's rows (the shared rows' outputs left unwritten without them)
    MMA = key.mma
    if MMA:  # tensor cores: token-major partials, 8 warps a CTA at 8 tokens (their routing warps too), 4 at 64
        assert MT in MMA_TILES, f"the tensor-core front takes m_tile in {MMA_TILES}"
        assert key.shared_rows and not (key.pdl or key.smem_keys or key.min_ctas or key.route_flag), \
            "the tensor-core front has none of the one-token options (shup, fpdl, skeys, foccN, uflag)"
        R, WARPS, U = mma_tiling(MT, True, key.mma_rows, key.mma_warps)
    else:
        R, WARPS, U = default_tiling(N, K, MT)
    assert N % R == 0 and K % (32 * WARPS) == 0, f"the front's {N} rows x {K} in CTAs of {R} rows, {WARPS} warps"
    UP0 = sh.sh0 + KEEP  # ('shfrontK') the rows it computes from here on are the kept up rows, S - KEEP further on
    assert KEEP % R == 0, "shared_keep: whole CTAs of gate rows and of up rows"
    RM = R * MT
    THREADS = 32 * WARPS
    ROUTER_CTAS = E // R
    SCALING = sh.scaling
    ROUTE = key.route
    SKEYS = key.route and key.smem_keys
    assert E % R == 0 and N % R == 0
    assert ROUTE or not key.route_flag, "route_flag is set by the routing: the front must route"
    # a carveout given keeps the DSL from asking a GPU for the SM's shared memory (the build runs without one)
    occupancy = dict(min_blocks_per_mp=key.min_ctas, preferred_smem_carveout=FRONT_SMEM_CARVEOUT) if key.min_ctas else {}

    @cute.kernel
    def front_kernel(mW: cute.Tensor, mX: cute.Tensor, mO: cute.Tensor, mBias: cute.Tensor, mMeta: cute.Tensor,
                     mIds: cute.Tensor, mWts: cute.Tensor, mWe: cute.Tensor, mAct: cute.Tensor,
                     mList: cute.Tensor, mTok: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        _, gy, _ = cute.arch.grid_dim()
        row0 = bx * R
        if const_expr(KEEP):  # the kept up rows lie S - KEEP rows after the kept gate rows, in the weight and output
            row0 = row0 + (sh.shared - KEEP) * Int32(row0 >= UP0)
        m0 = by * MT
        M = mX.shape[0]
        smem = cutlass.utils.SmemAllocator()
        buf = smem.allocate_tensor(Float32, cute.make_layout((WARPS, RM), stride=(RM, 1)), byte_alignment=16)
        cnt, lst, wtot, kys = route_smem(smem, WARPS, SKEYS)
        flag = smem.allocate_tensor(Int32, cute.make_layout((2,)), byte_alignment=16)
        cute.arch.griddepcontrol_launch_dependents()  # the next launch may be scheduled into freed slots
        if const_expr(MMA):
            gemv_partials_mma()(mW, mX, buf, row0, m0, K, MT, R, WARPS, U, False, None, True)
        else:
            # ('fpdl') the weight rows are loaded before griddepcontrol.wait, x after it
            gemv_partials()(mW, mX, mX, buf, row0, m0, K, MT, R, WARPS, U, False, False, key.pdl)
        for j in cutlass.range_constexpr(-(-RM // THREADS)):  # one output a thread (16 with tensor cores at 64)
            e = tid + j * THREADS
            if e < RM:
                r, mi = tile_output(e, R, MT, MMA)
                s = warp_sum()(buf, e, WARPS)
                if m0 + mi < M:
                    mO[m0 + mi, row0 + r] = s
        if const_expr(ROUTE):
            if bx < ROUTER_CTAS:
                cute.arch.fence_acq_rel_gpu()
                cute.arch.barrier()
                if tid == 0:
                    old = cute.arch.atomic_add(mMeta.iterator + 1, Int32(1), sem="acq_rel", scope="gpu")
                    flag[0] = Int32(old == ROUTER_CTAS * gy - 1)
                cute.arch.barrier()
                if flag[0] != 0:  # the last router CTA: every logit of the step is written
                    cute.arch.fence_acq_rel_gpu()
                    route_tokens()(mO, mBias, mMeta, mIds, mWts, mWe, mAct, mList, mTok, cnt, lst, wtot, kys,
                                   WARPS, SCALING, key.candidates, SKEYS)
                    if const_expr(key.route_flag):  # every thread's table writes, then the flag (release)
                        cute.arch.barrier()
                    if tid == 0:
                        mMeta[1] = Int32(0)  # re-arm the counter for the next step
                        if const_expr(key.route_flag):
                            cute.arch.fence_acq_rel_gpu()
                            cute.arch.store(mMeta.iterator + ROUTED_FLAG, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def front_host(mW: cute.Tensor, mX: cute.Tensor, mO: cute.Tensor, mBias: cute.Tensor, mMeta: cute.Tensor,
                   mIds: cute.Tensor, mWts: cute.Tensor, mWe: cute.Tensor, mAct: cute.Tensor,
                   mList: cute.Tensor, mTok: cute.Tensor, stream):
        M = mX.shape[0]
        front_kernel(mW, mX, mO, mBias, mMeta, mIds, mWts, mWe, mAct, mList, mTok).launch(
            grid=(N // R, cute.ceil_div(M, MT), 1), block=(THREADS, 1, 1),
            smem=4 * WARPS * RM + route_smem_bytes(WARPS, SKEYS), stream=stream, use_pdl=key.pdl, **occupancy)

    fake = cute.runtime.make_fake_compact_tensor
    m = cute.sym_int()
    from cutlass import BFloat16
    args = (
        fake(BFloat16, (NCAT, K), stride_order=(1, 0), assumed_align=16),
        fake(BFloat16, (m, K), stride_order=(1, 0), assumed_align=16),
        fake(Float32, (m, NCAT), stride_order=(1, 0), assumed_align=16),
        *_routing_fakes(m),
    )
    return front_host, args


def build_route(key: MoERouteKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from cutlass import const_expr

    sh = key.shape
    WARPS, SCALING, PDL = key.warps, sh.scaling, key.pdl

    SPREAD = key.spread

    @cute.kernel
    def route_kernel(mO: cute.Tensor, mBias: cute.Tensor, mMeta: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
                     mWe: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mCnt: cute.Tensor):
        smem = cutlass.utils.SmemAllocator()
        cnt, lst, wtot, kys = route_smem(smem, WARPS)
        if const_expr(PDL):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(SPREAD):
            flag = smem.allocate_tensor(Int32, cute.make_layout((2,)), byte_alignment=16)
            route_spread()(mO, mBias, mMeta, mIds, mWts, mWe, mAct, mList, mTok, mCnt, cnt, lst, wtot, flag, WARPS,
                           SCALING, key.candidates)
        else:
            route_tokens()(mO, mBias, mMeta, mIds, mWts, mWe, mAct, mList, mTok, cnt, lst, wtot, kys, WARPS, SCALING,
                           key.candidates)

    @cute.jit
    def route_host(mO: cute.Tensor, mBias: cute.Tensor, mMeta: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
                   mWe: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mCnt: cute.Tensor,
                   stream):
        ctas = (mIds.shape[0] + WARPS - 1) // WARPS if const_expr(SPREAD) else 1
        route_kernel(mO, mBias, mMeta, mIds, mWts, mWe, mAct, mList, mTok, mCnt).launch(
            grid=(ctas, 1, 1), block=(32 * WARPS, 1, 1), smem=route_smem_bytes(WARPS) + 32,
            stream=stream, use_pdl=PDL)

    fake = cute.runtime.make_fake_compact_tensor
    m = cute.sym_int()
    routing = _routing_fakes(m)
    args = (
        fake(Float32, (m, sh.ncat), stride_order=(1, 0), assumed_align=16),
        *routing[:-1],
        fake(Int32, (E,), assumed_align=16),  # mCnt: the spread routing's per-expert counts (zero between steps)
        routing[-1],
    )
    return route_host, args


# --------------------------------------------------------------------------- 2. experts gate/up + SiTU


def build_up(key: MoEUpKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, const_expr

    sh = key.shape
    I = sh.inter
    WARPS, RPW = key.warps, key.rows_per_warp
    RB = WARPS * RPW
    THREADS = 32 * WARPS
    NV = (L // 16) // 32  # 16-code vectors per lane per row
    assert I % RB == 0 and (L // 16) % 32 == 0
    decode = decode_word()
    Z0, BETA, BETA_LIN = sh.z0, sh.beta, sh.beta_lin
    PDL = key.pdl

    @cute.kernel
    def up_kernel(mF: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                  mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mA: cute.Tensor,
                  mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, by, _ = cute.arch.block_idx()
        gx, gy, _ = cute.arch.grid_dim()
        if const_expr(PDL):  # everything here reads the front (and routing) launch's outputs
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        if by == gy - 1:  # the shared experts' SiTU, and zeroing this rank's latent accumulator
            shared_situ_and_zeroing()(mF, mAsh, mLat, mSsq, bx * THREADS + tid, gx * THREADS, sh)
        else:
            nact = mMeta[0]
            if by < nact:
                e = mAct[by]
                off = mList[by, 0]
                num = mList[by, 1]
                gW1 = cute.zipped_divide(mW1, (1, 1, 2))
                gW3 = cute.zipped_divide(mW3, (1, 1, 2))
                gF = cute.zipped_divide(mF, (1, 4))
                i0 = bx * RB + warp * RPW
                w1 = []
                w3 = []
                s1 = []
                s3 = []
                for r in cutlass.range_constexpr(RPW):
                    for j in cutlass.range_constexpr(NV):
                        v = lane + 32 * j
                        q1 = gW1[(None, (e, i0 + r, v))].load()
                        q3 = gW3[(None, (e, i0 + r, v))].load()
                        w1.append([q1[0], q1[1]])
                        w3.append([q3[0], q3[1]])
                        s1.append(scale_pair(Int32(mS1[e, i0 + r, v // 2])))
                        s3.append(scale_pair(Int32(mS3[e, i0 + r, v // 2])))

                for i in cutlass.range(off, off + num):  # every (expert, token) pair of this expert
                    t = mTok[i]
                    h1 = cute.make_rmem_tensor((RPW,), Float32)
                    h3 = cute.make_rmem_tensor((RPW,), Float32)
                    for r in cutlass.range_constexpr(RPW):
                        h1[r] = Float32(0.0)
                        h3[r] = Float32(0.0)
                    for j in cutlass.range_constexpr(NV):
                        v = lane + 32 * j
                        zq = []
                        for q in cutlass.range_constexpr(4):
                            zq.append(gF[(None, (t, (Z0 + 16 * v) // 4 + q))].load())
                        for r in cutlass.range_constexpr(RPW):
                            n = r * NV + j
                            for half in cutlass.range_constexpr(2):
                                c1 = decode(w1[n][half], s1[n])
                                c3 = decode(w3[n][half], s3[n])
                                for k in cutlass.range_constexpr(8):
                                    zk = zq[half * 2 + k // 4][k % 4]
                                    h1[r] = h1[r] + c1[k] * zk
                                    h3[r] = h3[r] + c3[k] * zk
                    for r in cutlass.range_constexpr(RPW):
                        g = cute.arch.warp_reduction_sum(h1[r])
                        u = cute.arch.warp_reduction_sum(h3[r])
                        if lane == 0:
                            mA[i, i0 + r] = _situ(g, u, BETA, BETA_LIN).to(BFloat16)

    @cute.jit
    def up_host(mF: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mA: cute.Tensor,
                mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor, stream):
        M = mF.shape[0]
        up_kernel(mF, mW1, mS1, mW3, mS3, mMeta, mAct, mList, mTok, mA, mAsh, mLat, mSsq).launch(
            grid=(I // RB, cute.min(M * TOPK, E) + 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=PDL)

    args = expert_up_args(sh)
    return up_host, args


def expert_up_args(sh: MoEShape) -> tuple:
    """Compile-time stand-ins of moe_up's arguments (the direct and the pipelined kernel take the same):
    front output, W1 codes/scales, W3 codes/scales, meta, active experts, (offset, count) lists, token ids,
    a, a_shared, latent partials, Σ r², stream."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Uint8

    I, S = sh.inter, sh.shared
    fake = cute.runtime.make_fake_compact_tensor
    m = cute.sym_int()
    w = fake(Int32, (E, I, L // 8), stride_order=(2, 1, 0), assumed_align=16)
    s = fake(Uint8, (E, I, L // 32), stride_order=(2, 1, 0), assumed_align=16)
    return (
        fake(Float32, (m, sh.ncat), stride_order=(1, 0), assumed_align=16),
        w, s, w, s,
        fake(Int32, (4,), assumed_align=16),
        fake(Int32, (E,), assumed_align=16),
        fake(Int32, (E, 2), stride_order=(1, 0), assumed_align=16),
        fake(Int32, (cute.sym_int(),), assumed_align=16),
        fake(BFloat16, (cute.sym_int(), I), stride_order=(1, 0), assumed_align=16),
        fake(BFloat16, (m, S), stride_order=(1, 0), assumed_align=16),
        fake(Float32, (sh.tp, m, L), stride_order=(2, 1, 0), assumed_align=16),
        fake(Float32, (m,), assumed_align=16),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )


# the names of expert_down_args' stand-ins, in order (the stream last, unnamed)
DOWN_ARG_NAMES = ("a", "w2", "s2", "meta", "act", "list", "tok", "we", "lat", "coef", "cnt", "r", "a_shared", "wd",
                  "sh", "norm", "ssq")


def expert_down_args(sh: MoEShape, row_blocks: int) -> tuple:
    """Compile-time stand-ins of moe_down's arguments (direct and pipelined alike): a, W2 codes/scales, meta,
    active experts, lists, token ids, routing weights, latent partials, all-reduce coefficients, the
    `row_blocks` completion counters, r, a_shared, shared down weight, shared partials, norm weight, Σ r²,
    stream."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Uint8

    I, S, TP = sh.inter, sh.shared, sh.tp
    fake = cute.runtime.make_fake_compact_tensor
    m = cute.sym_int()
    return (
        fake(BFloat16, (cute.sym_int(), I), stride_order=(1, 0), assumed_align=16),
        fake(Int32, (E, L, I // 8), stride_order=(2, 1, 0), assumed_align=16),
        fake(Uint8, (E, L, I // 32), stride_order=(2, 1, 0), assumed_align=16),
        fake(Int32, (4,), assumed_align=16),
        fake(Int32, (E,), assumed_align=16),
        fake(Int32, (E, 2), stride_order=(1, 0), assumed_align=16),
        fake(Int32, (cute.sym_int(),), assumed_align=16),
        fake(Float32, (E, m), stride_order=(1, 0), assumed_align=16),
        fake(Float32, (TP, m, L), stride_order=(2, 1, 0), assumed_align=16),
        fake(Float32, (TP,), assumed_align=16),
        fake(Int32, (row_blocks,), assumed_align=16),
        fake(BFloat16, (m, L), stride_order=(1, 0), assumed_align=16),
        fake(BFloat16, (m, S), stride_order=(1, 0), assumed_align=16),
        fake(BFloat16, (D, S), stride_order=(1, 0), assumed_align=16),
        fake(BFloat16, (TP, m, D), stride_order=(2, 1, 0), assumed_align=16),
        fake(BFloat16, (1, L), stride_order=(1, 0), assumed_align=16),
        fake(Float32, (m,), assumed_align=16),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )


# --------------------------------------------------------------------------- 3. experts down + shared down


def down_token_capacity(key: MoEDownKey) -> int:
    """Tokens per step moe_down can hold: its per-CTA fp32 accumulator is [tokens, latent rows per CTA]
    in at most 48 KB of shared memory."""
    return min(MAX_M, ACC_WORDS // (key.warps * key.rows_per_warp))


def build_down(key: MoEDownKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, const_expr

    sh = key.shape
    I, S, TP = sh.inter, sh.shared, sh.tp
    WARPS, RPW, UE, ES = key.warps, key.rows_per_warp, key.experts_ahead, key.expert_splits
    PDL = key.pdl
    THREADS = 32 * WARPS
    G = 32 // RPW  # lanes per latent row
    NVD = (I // 16) // G  # 16-code vectors per lane
    RB = WARPS * RPW  # latent rows per CTA
    NB = L // RB  # routed row blocks (each split over ES CTAs along y)
    SH_VEC = 3  # 8-element bf16 vectors per lane of a shared-down row
    GS = S // (8 * SH_VEC)  # lanes per shared-down row
    RPWS = 32 // GS
    RBS = WARPS * RPWS
    ACC_M = down_token_capacity(key)
    assert (I // 16) % G == 0 and L % RB == 0 and S % (8 * SH_VEC) == 0 and 32 % GS == 0 and D % RBS == 0
    decode = decode_word()

    @cute.kernel
    def down_kernel(mA: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor, mMeta: cute.Tensor, mAct: cute.Tensor,
                    mList: cute.Tensor, mTok: cute.Tensor, mWe: cute.Tensor, mLat: cute.Tensor, mCoef: cute.Tensor, mCnt: cute.Tensor,
                    mR: cute.Tensor, mAsh: cute.Tensor, mWd: cute.Tensor, mSh: cute.Tensor, mNorm: cute.Tensor,
                    mSsq: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, by, _ = cute.arch.block_idx()
        M = mLat.shape[1]
        if const_expr(PDL):  # the tail reads nothing of this launch before its own wait
            cute.arch.griddepcontrol_launch_dependents()
        smem = cutlass.utils.SmemAllocator()
        acc = smem.allocate_tensor(Float32, cute.make_layout((ACC_M, RB), stride=(RB, 1)), byte_alignment=16)
        flag = smem.allocate_tensor(Int32, cute.make_layout((2,)), byte_alignment=16)
        if bx < NB:
            for idx in cutlass.range(tid, M * RB, THREADS):
                acc[idx // RB, idx % RB] = Float32(0.0)
            cute.arch.barrier()
            grp = lane // G
            gl = lane - grp * G
            rloc = warp * RPW + grp
            row = bx * RB + rloc
            gW2 = cute.zipped_divide(mW2, (1, 1, 2))
            gA = cute.zipped_divide(mA, (1, 8))
            nact = mMeta[0]
            for jb in cutlass.range(by * UE, nact, ES * UE):
                ws = []
                ss = []
                es = []
                offs = []
                nums = []
                for u in cutlass.range_constexpr(UE):
                    jj = cutlass.min(jb + u, nact - 1)
                    e = mAct[jj]
                    es.append(e)
                    offs.append(mList[jj, 0])
                    nums.append(mList[jj, 1])
                    for j in cutlass.range_constexpr(NVD):
                        v = gl + G * j
                        q2 = gW2[(None, (e, row, v))].load()
                        ws.append([q2[0], q2[1]])
                        ss.append(scale_pair(Int32(mS2[e, row, v // 2])))
                if const_expr(PDL):  # W2 codes are in flight; a (moe_up's output) is read after this
                    cute.arch.griddepcontrol_wait()
                for u in cutlass.range_constexpr(UE):
                    if jb + u < nact:
                        e = es[u]

                        for i in cutlass.range(offs[u], offs[u] + nums[u]):  # every token routed to e
                            t = mTok[i]
                            p = Float32(0.0)
                            for j in cutlass.range_constexpr(NVD):
                                v = gl + G * j
                                n = u * NVD + j
                                for half in cutlass.range_constexpr(2):
                                    av = gA[(None, (i, 2 * v + half))].load().to(Float32)
                                    cw = decode(ws[n][half], ss[n])
                                    for k in cutlass.range_constexpr(8):
                                        p = p + cw[k] * av[k]
                            for off in cutlass.range_constexpr(G.bit_length() - 1):
                                p = p + cute.arch.shuffle_sync_bfly(p, offset=G >> (off + 1))
                            if gl == 0:
                                acc[t, rloc] = acc[t, rloc] + p * mWe[e, t]
            if const_expr(PDL):  # (a CTA without experts) the partial moe_up zeroed is added to after this
                cute.arch.griddepcontrol_wait()
            cute.arch.barrier()
            for idx in cutlass.range(tid, M * RB, THREADS):  # this CTA's share of the rank's latent partial
                t = idx // RB
                rl = idx - t * RB
                cute.arch.red(mLat.iterator + (t * L + bx * RB + rl), acc[t, rl], op="add", dtype=Float32,
                              sem="relaxed", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            if tid == 0:
                old = cute.arch.atomic_add(mCnt.iterator + bx, Int32(1), sem="acq_rel", scope="gpu")
                flag[0] = Int32(old == ES - 1)
            cute.arch.barrier()
            if flag[0] != 0:  # the last of the row block's CTAs: one-shot all-reduce read of the slice
                cute.arch.fence_acq_rel_gpu()
                for idx in cutlass.range(tid, M * RB, THREADS):
                    t = idx // RB
                    rl = idx - t * RB
                    tot = mCoef[0] * mLat[0, t, bx * RB + rl]
                    for p_ in cutlass.range_constexpr(1, TP):
                        tot = tot + mCoef[p_] * mLat[p_, t, bx * RB + rl]
                    mR[t, bx * RB + rl] = (tot * mNorm[0, bx * RB + rl].to(Float32)).to(BFloat16)  # RMSNorm's weight
                    acc[t, rl] = tot * tot
                cute.arch.barrier()
                rms_sumsq()(acc, mSsq, M, RB, WARPS)  # Σ r² of the slice into the token's sum (the tail's rsqrt)
                if tid == 0:
                    mCnt[bx] = Int32(0)  # re-arm for the next step
        elif by == 0:  # shared experts' down projection: this rank's partial
            grp = lane // GS
            gl = lane - grp * GS
            n = (bx - NB) * RBS + warp * RPWS + grp
            gWd = cute.zipped_divide(mWd, (1, 8))
            gAs = cute.zipped_divide(mAsh, (1, 8))
            wv = []
            for j in cutlass.range_constexpr(SH_VEC):
                wv.append(gWd[(None, (n, gl + GS * j))].load().to(Float32))
            if const_expr(PDL):  # a_sh comes from moe_up
                cute.arch.griddepcontrol_wait()
            for t in cutlass.range(M):
                p = Float32(0.0)
                for j in cutlass.range_constexpr(SH_VEC):
                    av = gAs[(None, (t, gl + GS * j))].load().to(Float32)
                    p = p + (wv[j] * av).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                for off in cutlass.range_constexpr(GS.bit_length() - 1):
                    p = p + cute.arch.shuffle_sync_bfly(p, offset=GS >> (off + 1))
                if gl == 0:
                    mSh[0, t, n] = p.to(BFloat16)

    @cute.jit
    def down_host(mA: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor, mMeta: cute.Tensor, mAct: cute.Tensor,
                  mList: cute.Tensor, mTok: cute.Tensor, mWe: cute.Tensor, mLat: cute.Tensor, mCoef: cute.Tensor, mCnt: cute.Tensor,
                  mR: cute.Tensor, mAsh: cute.Tensor, mWd: cute.Tensor, mSh: cute.Tensor, mNorm: cute.Tensor,
                  mSsq: cute.Tensor, stream):
        down_kernel(mA, mW2, mS2, mMeta, mAct, mList, mTok, mWe, mLat, mCoef, mCnt, mR, mAsh, mWd, mSh, mNorm, mSsq).launch(
            grid=(NB + D // RBS, ES, 1), block=(THREADS, 1, 1), smem=4 * ACC_M * RB + 64, stream=stream,
            use_pdl=PDL)

    args = expert_down_args(sh, NB)
    return down_host, args


# --------------------------------------------------------------------------- 4. RMSNorm · up + shared all-reduce


def build_tail(key: MoETailKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, const_expr

    sh = key.shape
    N, K, MT, TP = D, L, key.m_tile, sh.tp
    MMA = key.mma
    if MMA:
        assert MT in MMA_TILES, f"the tensor-core tail takes m_tile in {MMA_TILES}"
        R, WARPS, U = mma_tiling(MT, True, key.mma_rows, key.mma_warps)
    else:
        R, WARPS, U = default_tiling(N, K, MT)
    assert N % R == 0 and K % (32 * WARPS) == 0, f"the tail's {N} rows x {K} in CTAs of {R} rows, {WARPS} warps"
    RM = R * MT
    THREADS = 32 * WARPS
    # the shared all-reduce reads issued with the GEMV's loads when each thread owns at most one output (TP
    # registers); the 64-token tensor-core tail (16 outputs a thread) reads them in its epilogue
    EARLY = RM <= THREADS
    EPS, PDL = sh.eps, key.pdl

    @cute.kernel
    def tail_kernel(mW: cute.Tensor, mX: cute.Tensor, mSsq: cute.Tensor, mSh: cute.Tensor, mCoef: cute.Tensor,
                    mO: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        row0 = bx * R
        m0 = by * MT
        M = mX.shape[0]
        smem = cutlass.utils.SmemAllocator()
        buf = smem.allocate_tensor(Float32, cute.make_layout((WARPS, RM), stride=(RM, 1)), byte_alignment=16)
        # the shared all-reduce read is issued with the GEMV's loads, so its latency is hidden (every thread
        # loads, at clamped indices; the owners of an output use them after the GEMV; EARLY). With PDL it reads
        # moe_down's output, so it goes right after the wait, behind the first W_up loads.
        tc = cutlass.min(tid, RM - 1)
        rc, mic = tile_output(tc, R, MT, MMA)
        mc = cutlass.min(m0 + mic, M - 1)
        cf = []
        for p_ in cutlass.range_constexpr(TP):
            cf.append(mCoef[p_])

        def shared_reads():
            return [mSh[p_, mc, row0 + rc] for p_ in range(TP)]

        def partials(wait, after_wait):
            if const_expr(MMA):
                return gemv_partials_mma()(mW, mX, buf, row0, m0, K, MT, R, WARPS, U, wait, after_wait, True)
            return gemv_partials()(mW, mX, mX, buf, row0, m0, K, MT, R, WARPS, U, False, False, wait, after_wait)

        shv = None
        if const_expr(PDL):
            shv = partials(True, shared_reads if EARLY else None)
        else:
            if const_expr(EARLY):
                shv = shared_reads()
            partials(False, None)
        for j in cutlass.range_constexpr(-(-RM // THREADS)):
            e = tid + j * THREADS
            if e < RM:
                r, mi = tile_output(e, R, MT, MMA)
                s = warp_sum()(buf, e, WARPS)
                if m0 + mi < M:
                    s = s * cute.math.rsqrt(mSsq[m0 + mi] * Float32(1.0 / K) + Float32(EPS))
                    for p_ in cutlass.range_constexpr(TP):
                        sv = shv[p_] if const_expr(EARLY) else mSh[p_, m0 + mi, row0 + r]
                        s = s + cf[p_] * sv.to(Float32)
                    mO[m0 + mi, row0 + r] = s.to(BFloat16)

    @cute.jit
    def tail_host(mW: cute.Tensor, mX: cute.Tensor, mSsq: cute.Tensor, mSh: cute.Tensor, mCoef: cute.Tensor,
                  mO: cute.Tensor, stream):
        M = mX.shape[0]
        tail_kernel(mW, mX, mSsq, mSh, mCoef, mO).launch(
            grid=(N // R, cute.ceil_div(M, MT), 1), block=(THREADS, 1, 1), smem=4 * WARPS * RM + 64,
            stream=stream, use_pdl=PDL)

    fake = cute.runtime.make_fake_compact_tensor
    m = cute.sym_int()
    args = (
        fake(BFloat16, (N, K), stride_order=(1, 0), assumed_align=16),
        fake(BFloat16, (m, K), stride_order=(1, 0), assumed_align=16),
        fake(Float32, (m,), assumed_align=16),
        fake(BFloat16, (TP, m, N), stride_order=(2, 1, 0), assumed_align=16),
        fake(Float32, (TP,), assumed_align=16),
        fake(BFloat16, (m, N), stride_order=(1, 0), assumed_align=16),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    return tail_host, args


# --------------------------------------------------------------------------- registry

M_TILES = (1, 2, 4, 8)  # the front and tail GEMVs' token tiles: the smallest that holds the step (since run 49)
M8_TILES = (1, 8)  # 'mtfit0': m_tile 8 from 2 tokens on (before run 49; run 48 measured both)


# the front and tail GEMVs on tensor cores (`MoEFrontKey.mma`, `MoETailKey.mma`) from MMA_MIN_TOKENS tokens: m_tile 8
# up to 8 tokens, 64 above (the front at 8 while it routes in its last router CTA); 'mma0' keeps the CUDA-core
# GEMVs. Run 73 timed the tensor-core GEMV alone within 1% of torch.mm or below at 8 tokens (the CUDA-core one at
# m_tile 8: 1.2-1.35x) and 6x faster than the CUDA-core one at 64 tokens
MMA_TILES = (8, 64)
MMA_MIN_TOKENS = 5
# the 'mrowsR[wW]' tilings built ahead of time at TP8, (rows, warps; 0: 4): slower than the default in run 78 (H100),
# built for the record
MMA_ROWS_BUILT = ((64, 0), (64, 8))


def pick_m_tile(m: int, tiles: tuple[int, ...] = M_TILES) -> int:
    """The front and tail GEMVs' m_tile for m tokens: the smallest of `tiles` >= m, else the largest."""
    return next((t for t in tiles if t >= m), tiles[-1])


def _tensor_cores(m: int, options: dict) -> bool:
    """Whether the front and tail GEMVs of an m-token step run on tensor cores (`MMA_MIN_TOKENS`, 'mma0')."""
    return m >= MMA_MIN_TOKENS and options.get("tensor_cores", True)


def _mma_rows(options: dict, mma: bool, m_tile: int) -> tuple[int, int]:
    """(rows, warps) of the 'mrowsR[wW]' tiling for a front or tail GEMV on tensor cores at m_tile 64, else (0, 0):
    the default tiling."""
    return options.get("mma_rows", (0, 0)) if mma and m_tile == MMA_TILES[-1] else (0, 0)


def tail_key_for(shape: MoEShape, m: int, pdl: bool, options: dict | None = None, arch: str = "sm_90a") -> "MoETailKey":
    """The plain tail GEMV's key for a step of m tokens (`split_front_options`' 'mma0' and 'mtfit0' apply): on
    tensor cores from MMA_MIN_TOKENS tokens (m_tile 8, or 64 above 8 tokens), else at the front's m_tile."""
    o = options or {}
    if _tensor_cores(m, o):
        mt = MMA_TILES[0] if m <= MMA_TILES[0] else MMA_TILES[-1]
        rows, warps = _mma_rows(o, True, mt)
        return MoETailKey(shape, m_tile=mt, pdl=pdl, mma=True, mma_rows=rows, mma_warps=warps, arch=arch)
    mt = pick_m_tile(m, M_TILES if o.get("m_tile_fit", True) else M8_TILES)
    return MoETailKey(shape, m_tile=mt, pdl=pdl, arch=arch)


def front_key_for(shape: MoEShape, m: int, separate_routing: bool, options: dict | None = None,
                  arch: str = "sm_90a", route_flag: bool = False, shared_rows: bool = True,
                  shared_keep: int = 0) -> tuple:
    """The front kernel's key for a step of m tokens with the routing options `options` (`split_front_options`),
    and the tags of the options that changed it from the default (for the variant name): the plain GEMV
    (`MoEFrontKey`) at the smallest m_tile of M_TILES that holds the step ('mtfit0': of M8_TILES). One token with
    the routing in the front kernel, options: 'fring', the persistent ring GEMV (`moe_front_ring.MoEFrontRingKey`;
    runs 50-51: slower; 'fringRxS' with R rows per slot and S slots); 'skeys', the routing keys in shared memory and FRONT_SKEYS_CTAS CTAs per SM (run 49:
    slower); 'foccN', N CTAs per SM; 'fpdl', the plain front as a programmatic dependent (`MoEFrontKey.pdl`).
    route_flag: the routing CTA sets meta[ROUTED_FLAG] for moe_up's 'uflag' (the plain front only; refused with
    separate routing or the ring front).
    shared_rows: False for moe_up's 'shup', which streams the shared experts' gate/up rows itself (the plain front
    only); shared_keep ('shfrontK', with it): the first K shared columns' gate and up rows stay in the front.
    From MMA_MIN_TOKENS tokens the GEMV runs on tensor cores (`MoEFrontKey.mma`; 'mma0': not) at m_tile 8, or 64
    above 8 tokens with the routing as its own launch; 'cand0', 'uflag' and 'shup' keep the CUDA-core front."""
    o = options or {}
    mt = pick_m_tile(m, M_TILES if o.get("m_tile_fit", True) else M8_TILES)
    m8 = mt != pick_m_tile(m)
    cand = o.get("candidates", True)
    # tensor cores from MMA_MIN_TOKENS tokens ('mma0': not), built for the default routing only: the routing
    # ablations ('cand0', 'uflag') and moe_up's shared rows ('shup') keep the CUDA-core front, which has them
    mma = _tensor_cores(m, o) and shared_rows and (separate_routing or (cand and not route_flag))
    if mma:  # m_tile 64 above 8 tokens when the routing is its own launch; 8 while the front routes
        mt = MMA_TILES[0] if m <= MMA_TILES[0] or not separate_routing else MMA_TILES[-1]
    one = mt == 1 and not separate_routing  # the routing front at one token: the ring and occupancy options apply
    sk = one and o.get("smem_keys", False)
    occ_default = FRONT_SKEYS_CTAS if sk else 0
    occ = o.get("min_ctas", occ_default) if one else 0
    ring = one and o.get("front_ring", False) and "smem_keys" not in o and "min_ctas" not in o
    geometry = o.get("front_ring_geometry")
    ring_key = None
    if ring:
        from .moe_front_ring import front_ring_key
        ring_key = front_ring_key(shape, geometry, candidates=cand, arch=arch)
    ring_tag = "fring" + (ring_key.geometry_tag if ring_key is not None and geometry else "")
    pdl = one and not ring and o.get("front_pdl", False)
    tags = [tag for tag, on in (("cand0", not cand), (ring_tag, ring), ("skeys", sk), (f"focc{occ}", occ != occ_default),
                                ("mtfit0", m8), ("fpdl", pdl),
                                ("mma0", m >= MMA_MIN_TOKENS and not o.get("tensor_cores", True))) if on]
    if route_flag and (separate_routing or ring):
        raise ValueError("uflag: the routing flag is set by the plain front kernel's routing; it cannot go with the "
                         "routing as its own launch or the ring front (fring)")
    if not shared_rows and (ring or pdl):
        raise ValueError("shup: moe_up streams the shared gate/up rows and reads x before its wait, which needs the "
                         "plain front launched in stream order; it cannot go with fring or fpdl")
    if ring:
        return ring_key, tags
    rows, warps = _mma_rows(o, mma, mt)
    if rows:
        tags.append(f"mrows{rows}" + (f"w{warps}" if warps else ""))
    key = MoEFrontKey(shape, m_tile=mt, route=not separate_routing, min_ctas=occ,
                      candidates=cand or separate_routing, smem_keys=sk, pdl=pdl, route_flag=route_flag,
                      shared_rows=shared_rows, shared_keep=shared_keep, mma=mma, mma_rows=rows, mma_warps=warps,
                      arch=arch)  # no routing: the default key
    return key, tags


def shapes_for_tp(tp: int) -> MoEShape:
    from ..config import KimiK3Config, ShardSpec

    sh = ShardSpec(tp=tp, cfg=KimiK3Config())
    cfg = sh.cfg
    return MoEShape(inter=sh.expert_intermediate_local, shared=sh.shared_intermediate, tp=tp, beta=cfg.situ_beta,
                    beta_lin=cfg.situ_linear_beta, eps=cfg.rms_norm_eps, scaling=cfg.routed_scaling_factor)


# launch-shape variants compiled ahead of time at TP8 for the on-GPU tuning run
# (`kimi-decode moe --executors fused@w4r1-w4r8e2s8,...`; see parse_variant)
TUNE_UP = ((4, 1), (8, 1), (8, 2))
TUNE_DOWN = ((4, 4, 2, 8), (4, 8, 4, 4), (4, 8, 2, 8), (8, 4, 4, 4), (4, 16, 2, 4))
# the direct kernels' launch shapes built by default (their GPU test's); the rest of TUNE_UP / TUNE_DOWN by
# `bundle --tuning` (since the wide kernels took the steps above 8 tokens, the direct ones are a comparison point)
TUNE_UP_BUILT = ((8, 1),)
TUNE_DOWN_BUILT = ((4, 8, 2, 8),)


def parse_variant(text: str) -> tuple[dict, dict]:
    """'w4r1-w4r8e2s8' -> (MoEUpKey fields, MoEDownKey fields): up warps/rows per warp, then down
    warps/rows per warp/experts ahead/expert splits."""
    import re

    m = re.fullmatch(r"w(\d+)r(\d+)-w(\d+)r(\d+)e(\d+)s(\d+)", text)
    if not m:
        raise ValueError(f"fused MoE variant must look like w4r2-w4r4e4s4 (up warps, rows per warp; down warps, "
                         f"rows per warp, experts ahead, expert splits), got {text!r}")
    v = [int(g) for g in m.groups()]
    return (dict(warps=v[0], rows_per_warp=v[1]),
            dict(warps=v[2], rows_per_warp=v[3], experts_ahead=v[4], expert_splits=v[5]))


def variant_name(up: "MoEUpKey", down: "MoEDownKey") -> str:
    return (f"w{up.warps}r{up.rows_per_warp}-w{down.warps}r{down.rows_per_warp}e{down.experts_ahead}"
            f"s{down.expert_splits}")


def aot_keys_for(kind: str):
    def keys(arch: str):
        out = []
        for tp in (8, 16):
            s = shapes_for_tp(tp)
            if kind == "front":  # every m_tile, routing in the front kernel or not; at TP8 the options (the
                # one-token ring front, 'fring', is moe_front_ring's)
                opts = [{}] + ([{"candidates": False}, {"smem_keys": True}, {"m_tile_fit": False}] if tp == 8 else [])
                for o in opts:
                    for m in (1, 2, 3, 8):
                        for sep in (False, True):
                            key = front_key_for(s, m, sep, o, arch)[0]
                            if isinstance(key, MoEFrontKey) and key not in out:
                                out.append(key)
                # the tensor-core front: 8 tokens routing in it or not, 64 (routing as its own launch); and the
                # CUDA-core one at m_tile 8 for 'mma0'
                for m, sep in ((8, False), (8, True), (64, True)):
                    for o in ({}, {"tensor_cores": False}):
                        key = front_key_for(s, m, sep, o, arch)[0]
                        if key not in out:
                            out.append(key)
                if tp == 8:  # 'mrowsR[wW]' at 64 tokens
                    out += [front_key_for(s, 64, True, {"mma_rows": rw}, arch)[0] for rw in MMA_ROWS_BUILT]
                if tp == 8:  # 'uflag' at every m_tile, 'fpdl' at one token, and both
                    for m in (1, 2, 3, 8):
                        out.append(front_key_for(s, m, False, {}, arch, route_flag=True)[0])
                    out += [front_key_for(s, 1, False, {"front_pdl": True}, arch, route_flag=f)[0] for f in (False, True)]
                    # 'shup' (moe_up streams the shared gate/up rows): one and two tokens
                    out += [front_key_for(s, m, False, {}, arch, shared_rows=False)[0] for m in (1, 2)]
                    # 'shfrontK' (the front keeps a share of the shared rows): the K of the built variants
                    from .moe_pipe import built_shared_fronts
                    out += [front_key_for(s, m, False, {}, arch, shared_rows=False, shared_keep=k)[0]
                            for k in built_shared_fronts() for m in (1, 2)]
            elif kind == "route":
                out += [MoERouteKey(s, arch=arch), MoERouteKey(s, pdl=False, arch=arch)]
                if tp == 8:
                    out += [MoERouteKey(s, candidates=False, pdl=p, arch=arch) for p in (True, False)]
                    out += [MoERouteKey(s, spread=False, pdl=p, arch=arch) for p in (True, False)]
            elif kind == "up":
                out += [MoEUpKey(s, arch=arch), MoEUpKey(s, pdl=False, arch=arch)]
                if tp == 8:
                    out += _tuned_keys("up", arch, TUNE_UP_BUILT)
            elif kind == "down":
                out += [MoEDownKey(s, arch=arch), MoEDownKey(s, pdl=False, arch=arch)]
                if tp == 8:
                    out += _tuned_keys("down", arch, TUNE_DOWN_BUILT)
            else:
                out += [MoETailKey(s, m_tile=mt, pdl=p, arch=arch) for mt in M_TILES for p in (True, False)]
                out += [MoETailKey(s, m_tile=mt, pdl=p, mma=True, arch=arch) for mt in MMA_TILES for p in (True, False)]
                if tp == 8:
                    out += [tail_key_for(s, 64, p, {"mma_rows": rw}, arch) for rw in MMA_ROWS_BUILT for p in (True, False)]
        return out
    return keys


def _tuned_keys(kind: str, arch: str, shapes) -> list:
    """The direct kernels' TP8 keys at the given launch shapes (TUNE_UP / TUNE_DOWN entries), with and without PDL."""
    s = shapes_for_tp(8)
    if kind == "up":
        return [MoEUpKey(s, warps=w, rows_per_warp=r, pdl=p, arch=arch) for w, r in shapes for p in (True, False)]
    return [MoEDownKey(s, warps=w, rows_per_warp=r, experts_ahead=e, expert_splits=x, pdl=p, arch=arch)
            for w, r, e, x in shapes for p in (True, False)]


def _tuning_only(kind: str, built, shapes):
    return lambda arch: _tuned_keys(kind, arch, [v for v in shapes if v not in built])


FRONT = kc.register(kc.KernelSpec(name="moe_front", module=__name__, key_type=MoEFrontKey, build=build_front,
                                  aot_keys=aot_keys_for("front"), ptx_checks=("ld.global.v4", "atom")))
ROUTE = kc.register(kc.KernelSpec(name="moe_route", module=__name__, key_type=MoERouteKey, build=build_route,
                                  aot_keys=aot_keys_for("route"), ptx_checks=("atom",)))
UP = kc.register(kc.KernelSpec(name="moe_up", module=__name__, key_type=MoEUpKey, build=build_up,
                               aot_keys=aot_keys_for("up"), ptx_checks=("mul.rn.bf16x2",),
                               tuning_keys=_tuning_only("up", TUNE_UP_BUILT, TUNE_UP)))
DOWN = kc.register(kc.KernelSpec(name="moe_down", module=__name__, key_type=MoEDownKey, build=build_down,
                                 aot_keys=aot_keys_for("down"), ptx_checks=("mul.rn.bf16x2",),
                                 tuning_keys=_tuning_only("down", TUNE_DOWN_BUILT, TUNE_DOWN)))
TAIL = kc.register(kc.KernelSpec(name="moe_tail", module=__name__, key_type=MoETailKey, build=build_tail,
                                 aot_keys=aot_keys_for("tail"), ptx_checks=("ld.global.v4",)))


def check_scales(*scales: torch.Tensor) -> None:
    """The in-register decode needs E8M0 scales <= 128 (|w| <= 12); refuse weights outside that."""
    for s in scales:
        mx = int(s.max())
        if mx > MAX_E8M0:
            raise ValueError(f"MXFP4 scale byte {mx} > {MAX_E8M0}: weights of magnitude above 12 are outside "
                             "what the fused MoE decode supports")


__all__ = ["MoEShape", "MoEFrontKey", "MoERouteKey", "MoEUpKey", "MoEDownKey", "MoETailKey", "shapes_for_tp", "pick_m_tile",
           "check_scales", "MAX_M", "TOPK", "CHUNK", "VEC"]
