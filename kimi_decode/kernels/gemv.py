"""Decode GEMV, `kimi_k3_layer.md` §2 "Linears" (bf16 × bf16, fp32 accumulate; router fp32 out); replaces a cuBLAS GEMM launch (+ the sigmoid-gate multiply / residual add launch when fused).

    out[m, n] = epi( Σ_k x[m, k] · W[n, k] )           W: [N, K] bf16, x: [M, K] bf16, M = 1..64
    epi(a)    = a · σ(gate[m, n])   if gate       (sigmoid output gate, e.g. KDA/MLA g_out)
              + residual[m, n]      if residual
    stored bf16, or fp32 with `out_fp32` (the MoE router logits).

Memory-bound at decode batch. A CTA owns `rows` weight rows; its `warps`
warps split K (warp w reads 256-wide chunks w, w+warps, ...), each lane
loading 8 consecutive bf16 per chunk (128-bit `ld.global.v4`). K is static, so
the chunk loop unrolls; `unroll` chunks of every row (and of x) are loaded
before any arithmetic, which keeps rows·unroll·512 B in flight per warp. Each
x vector is converted once and used for all `rows` rows. Partial sums meet in
shared memory; one thread per (row, m) applies the epilogue and stores.
M is a symbolic size processed in compile-time tiles of `m_tile` (grid.y walks
the tiles), so for M > m_tile the weights are read ceil(M/m_tile) times: the
bandwidth-optimal range is M <= 8; M = 9..64 is correct but slower than cuBLAS
(a tensor-core path is future work; see docs/toolchain.md).
"""


from dataclasses import dataclass

import torch

from .. import compile as kc

VEC = 8  # bf16 per 128-bit load
CHUNK = 32 * VEC  # elements of one row a warp reads per step
MAX_M = 64
M_TILES = (1, 2, 4, 8)
AOT_M_TILES = (1, 8)
# the tensor-core GEMV (`GemvKey.mma`): tokens in n8 tiles of mma.sync m16n8k16, weight rows in m16 tiles
MMA_M_TILES = (8, 16, 32, 64)
MMA_K_BLOCK = 32  # K a warp consumes per step: a 16-byte load of each of its rows and of each token's x


def default_tiling(n: int, k: int, m_tile: int) -> tuple[int, int, int]:
    """(rows per CTA, warps per CTA, unroll) for an [n, k] weight and m_tile.

    From the H200 sweeps (data/measured/kernels_gemv_tuning*.csv, kernels_gemv*.csv):
    M = 1: one row per CTA, 8 chunks in flight per warp, 4 warps splitting K
           (2 when K/256 is not a multiple of 4: K = 3584 ran 12.4 µs vs 13.2);
    M = 8: 8 rows per CTA up to K = 7168 (each x vector serves 8 rows), 4 rows
           beyond (8×12288×7168: 66 µs with 4 rows, 245 µs with 8).
    """
    chunks = k // CHUNK
    if m_tile == 1:
        rows, unroll = 1, 8
        warps = 4 if chunks % 4 == 0 or chunks % 2 else 2
    else:
        rows, unroll, warps = (8 if k <= 7168 else 4), 1, 4
    while n % rows:
        rows //= 2
    return rows, warps, unroll


@dataclass(frozen=True)
class GemvKey:
    n: int
    k: int
    m_tile: int = 1
    gate: bool = False
    residual: bool = False
    out_fp32: bool = False
    rows: int = 0  # weight rows per CTA (0: default_tiling)
    warps: int = 0  # warps per CTA, splitting K (0: default_tiling)
    unroll: int = 0  # chunks loaded ahead per row (0: default_tiling)
    # tensor cores instead of CUDA-core FMAs (`gemv_partials_mma`): m_tile in MMA_M_TILES, rows a multiple of 16,
    # K a multiple of 32 per warp; the weights are still read once per m_tile tokens
    mma: bool = False
    # (with mma) the K loop as a runtime loop that keeps `unroll` blocks of loads in flight in a register ring,
    # refilled after each block's mma: ptxas cannot sink those loads to their use as it does in the unrolled form
    # (run 72: about two blocks in flight whatever the unroll)
    mma_loop: bool = False
    arch: str = "sm_90a"

    def __post_init__(self):
        if self.k % VEC:
            raise ValueError(f"K={self.k} must be a multiple of {VEC} (128-bit loads)")
        if self.mma_loop and not self.mma:
            raise ValueError("mma_loop is an option of the tensor-core GEMV (mma=True)")
        if self.mma:
            self._check_mma()
            return
        if self.m_tile not in M_TILES:
            raise ValueError(f"m_tile={self.m_tile} not in {M_TILES}")
        rows, warps, unroll = default_tiling(self.n, self.k, self.m_tile)
        for name, value in (("rows", rows), ("warps", warps), ("unroll", unroll)):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, value)
        if self.n % self.rows:
            raise ValueError(f"N={self.n} must be a multiple of rows={self.rows}")
        if self.rows * self.m_tile > 32 * self.warps:
            raise ValueError("rows * m_tile must not exceed the CTA's threads")

    def _check_mma(self):
        if self.m_tile not in MMA_M_TILES:
            raise ValueError(f"the tensor-core GEMV takes m_tile in {MMA_M_TILES}, got {self.m_tile}")
        if self.out_fp32 or self.gate or self.residual:
            raise ValueError("the tensor-core GEMV has no epilogue options (gate, residual, out_fp32) yet")
        rows, warps, unroll = mma_tiling(self.m_tile, self.mma_loop)
        for name, value in (("rows", rows), ("warps", warps), ("unroll", unroll)):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, value)
        if self.rows % 16:
            raise ValueError(f"rows={self.rows} must be a multiple of 16 (mma.sync m16 tiles)")
        if self.n % self.rows:
            raise ValueError(f"N={self.n} must be a multiple of rows={self.rows}")
        if self.k % (MMA_K_BLOCK * self.warps):
            raise ValueError(f"K={self.k} must be a multiple of {MMA_K_BLOCK} x warps={self.warps} "
                             f"(each warp takes whole {MMA_K_BLOCK}-wide blocks of K)")


def mma_tiling(m_tile: int, loop: bool = False, rows: int = 0, warps: int = 0) -> tuple[int, int, int]:
    """(rows, warps, unroll) of the tensor-core GEMV: 16 rows (two m16 tiles from 32 tokens on, so that each
    token's x, read from L2 by every CTA, serves twice the rows), 4 warps splitting K, and 4 steps of loads in
    flight (2 from 32 tokens on, where each step holds 4·m_tile/8 words of x a lane). With `loop`
    (`GemvKey.mma_loop`) up to 16 tokens: 8 warps and 8 blocks in flight a warp (64 KB of weights a CTA), since
    run 72 put the unrolled form's loss at small N on the bytes in flight (one CTA an SM at 8 × 7168 × 2112);
    run 73 measured it within 1% of torch.mm or below at 8 tokens on five of six decode shapes. rows / warps (the
    front and tail at 64 tokens, 'mrowsR[wW]'): R rows a CTA split over W warps (4 by default), x's L2 reads per
    weight byte divided by R / 32."""
    if rows:  # ('mrowsR[wW]', 64 tokens) R rows a CTA: x, read from L2 by every CTA, serves R rows; one block in flight
        if rows % 16 or not m_tile > 16:
            raise ValueError(f"mma rows: a multiple of 16 at an m_tile above 16; got {rows} rows at m_tile {m_tile}")
        return (rows, warps or 4, 1 if rows >= 64 else 2)
    if loop and m_tile <= 16:
        return (16, 8, 8)
    return (16, 4, 4) if m_tile <= 16 else (32, 4, 2)


_PARTIALS = None


def gemv_partials():
    """The `@cute.jit` building block of every GEMV-shaped kernel, inlined where a kernel calls it:

        pre = gemv_partials()(mW, mX, mS, buf, row0, m0, K, MT, R, WARPS, U, scale, ssq, wait, after_wait)

    computes the CTA's dot products W[row0 + r] · x[m0 + mi] (r < R, mi < MT). Each warp's partial
    sums are reduced over its lanes and left in shared memory: buf[warp, r * MT + mi]; with `ssq`,
    buf[warp, R * MT + mi] holds the warp's part of Σ_k x[m0 + mi, k]². With `scale`, x is multiplied
    elementwise by mS ([1, K] bf16, an RMSNorm weight) as it is loaded (mS is ignored otherwise). With
    `wait` (a kernel launched as a programmatic dependent), the first group of weight loads is issued
    before `griddepcontrol.wait` and x (the previous launch's output) is read after it; `after_wait`
    (a traced Python callable, or None) is called right after the wait, so the loads it issues fly with
    the GEMV's, and its result is returned. Ends with a CTA barrier; the caller sums buf over warps (one
    thread per entry).
    """
    global _PARTIALS
    if _PARTIALS is None:
        _PARTIALS = _make_partials()
    return _PARTIALS


_WARP_SUM = None


def warp_sum():
    """`@cute.jit` warp_sum()(buf, col, WARPS): Σ_w buf[w, col], the cross-warp total of a partial left by
    `gemv_partials` (called by the one thread that owns column `col`)."""
    global _WARP_SUM
    if _WARP_SUM is None:
        import cutlass
        import cutlass.cute as cute
        from cutlass import Constexpr

        @cute.jit
        def total(buf: cute.Tensor, col, WARPS: Constexpr):
            s = buf[0, col]
            for wi in cutlass.range_constexpr(1, WARPS):
                s = s + buf[wi, col]
            return s

        _WARP_SUM = total
    return _WARP_SUM


def _make_partials():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Constexpr, Float32, const_expr

    @cute.jit
    def partials(mW: cute.Tensor, mX: cute.Tensor, mS: cute.Tensor, buf: cute.Tensor, row0, m0,
                 K: Constexpr, MT: Constexpr, R: Constexpr, WARPS: Constexpr, U: Constexpr,
                 scale: Constexpr, ssq: Constexpr, wait: Constexpr, after_wait: Constexpr = None):
        FULL = K // CHUNK
        TAIL = (K % CHUNK) // VEC
        PER_WARP = -(-FULL // WARPS)
        GROUPS = -(-PER_WARP // U)
        RM = R * MT
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        M = mX.shape[0]
        gW = cute.zipped_divide(mW, (1, VEC))  # ((1, VEC), (N, K / VEC))
        gX = cute.zipped_divide(mX, (1, VEC))
        gS = cute.zipped_divide(mS, (1, VEC))
        assert not wait or GROUPS > 0, "wait needs at least one full chunk per warp"
        pre = None
        acc = cute.make_rmem_tensor((RM + MT,), Float32)
        for i in cutlass.range_constexpr(RM + MT):
            acc[i] = Float32(0.0)
        xrow = []
        for mi in cutlass.range_constexpr(MT):
            xrow.append(cutlass.min(m0 + mi, M - 1))  # rows past M compute garbage that is never stored
        for g in cutlass.range_constexpr(GROUPS):
            ws = []
            xs = []
            ss = []
            live = []
            kvs = []
            for u in cutlass.range_constexpr(U):
                step = g * U + u
                if const_expr(step < PER_WARP):
                    c = warp + step * WARPS
                    if const_expr((step + 1) * WARPS > FULL):  # some warps run past FULL on this step
                        live.append(Float32(c < FULL))
                        c = cutlass.min(c, FULL - 1)
                    else:
                        live.append(None)
                    kv = c * 32 + lane
                    kvs.append(kv)
                    wr = []
                    for r in cutlass.range_constexpr(R):
                        wr.append(gW[(None, (row0 + r, kv))].load())
                    ws.append(wr)
            if const_expr(wait and g == 0):
                cute.arch.griddepcontrol_wait()
                if const_expr(after_wait is not None):
                    pre = after_wait()
            for u in cutlass.range_constexpr(len(kvs)):
                kv = kvs[u]
                xr = []
                for mi in cutlass.range_constexpr(MT):
                    xr.append(gX[(None, (xrow[mi], kv))].load())
                xs.append(xr)
                if const_expr(scale):
                    ss.append(gS[(None, (0, kv))].load())
                else:
                    ss.append(None)
            for u in cutlass.range_constexpr(len(ws)):
                for mi in cutlass.range_constexpr(MT):
                    x = xs[u][mi].to(Float32)
                    if const_expr(live[u] is not None):
                        x = x * live[u]
                    if const_expr(ssq):
                        acc[RM + mi] = acc[RM + mi] + (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    if const_expr(scale):
                        x = x * ss[u].to(Float32)
                    for r in cutlass.range_constexpr(R):
                        w = ws[u][r].to(Float32)
                        acc[r * MT + mi] = acc[r * MT + mi] + (w * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        if const_expr(TAIL > 0):
            if warp == 0 and lane < TAIL:
                kv = FULL * 32 + lane
                for mi in cutlass.range_constexpr(MT):
                    x = gX[(None, (xrow[mi], kv))].load().to(Float32)
                    if const_expr(ssq):
                        acc[RM + mi] = acc[RM + mi] + (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    if const_expr(scale):
                        x = x * gS[(None, (0, kv))].load().to(Float32)
                    for r in cutlass.range_constexpr(R):
                        w = gW[(None, (row0 + r, kv))].load().to(Float32)
                        acc[r * MT + mi] = acc[r * MT + mi] + (w * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        NRED = RM + MT if const_expr(ssq) else RM
        for i in cutlass.range_constexpr(NRED):
            s = cute.arch.warp_reduction_sum(acc[i])
            if lane == 0:
                buf[warp, i] = s
        cute.arch.barrier()
        return pre

    return partials


_PARTIALS_MMA = None


def gemv_partials_mma():
    """The tensor-core form of `gemv_partials` (`@cute.jit`, inlined where called):

        pre = gemv_partials_mma()(mW, mX, buf, row0, m0, K, MT, R, WARPS, U, wait, after_wait, LOOP)

    leaves the partials token-major, buf[warp, mi * R + r] = Σ over the warp's part of K of W[row0 + r] ·
    x[m0 + mi] (so that the threads of an epilogue store consecutive rows of one token's output), with the same
    `wait` / `after_wait` contract, and ends with a CTA barrier. Warp w takes the 32-wide blocks
    w, w + WARPS, ... of K; at each block a lane (g = lane / 4, c = lane % 4) loads 16 bytes of each of its rows
    (row 16t + g and 16t + g + 8 of each m16 tile t) and of token g of each n8 tile, at K offset 8c. The sum over
    K is free of order as long as A and B agree, so those four words are the lane's A and B fragments as they
    are (`ptx_ops`: a0a1 a2a3 a4a5 a6a7 = words 0 and 1 of rows g, g + 8 for the first mma.sync m16n8k16, words
    2 and 3 for the second; b0b1 b2b3 = words 0, 1 and 2, 3 of token g): no shuffle, no conversion, and x needs
    no staging. MT must be a multiple of 8 and R of 16; K a multiple of 32·WARPS (`GemvKey` checks). Unrolled
    (LOOP False), ptxas sinks each block's loads to its mma (about two blocks in flight, run 72); with LOOP the K
    loop is a runtime loop over a ring of U blocks in registers, refilled after each block's mma (`mma_loop`)."""
    global _PARTIALS_MMA
    if _PARTIALS_MMA is None:
        _PARTIALS_MMA = _make_partials_mma()
    return _PARTIALS_MMA


def _make_partials_mma():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Constexpr, Float32, Int32, const_expr

    from .ptx_ops import mma_bf16

    @cute.jit
    def partials(mW: cute.Tensor, mX: cute.Tensor, buf: cute.Tensor, row0, m0, K: Constexpr, MT: Constexpr,
                 R: Constexpr, WARPS: Constexpr, U: Constexpr, wait: Constexpr, after_wait: Constexpr = None,
                 LOOP: Constexpr = False):
        mma = mma_bf16()
        NB = K // MMA_K_BLOCK
        PER_WARP = NB // WARPS
        GROUPS = -(-PER_WARP // U)
        RT = R // 16
        NT = MT // 8
        WORDS = K // 2
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        g = lane // 4
        c = lane - 4 * g
        M = mX.shape[0]
        N = mW.shape[0]
        w32 = cute.make_tensor(cute.recast_ptr(mW.iterator, dtype=Int32),
                               cute.make_layout((N, WORDS), stride=(WORDS, 1)))
        x32 = cute.make_tensor(cute.recast_ptr(mX.iterator, dtype=Int32),
                               cute.make_layout((M, WORDS), stride=(WORDS, 1)))
        gW = cute.zipped_divide(w32, (1, 4))  # ((1, 4), (N, K / 8)): 16 bytes of a row
        gX = cute.zipped_divide(x32, (1, 4))
        assert not wait or GROUPS > 0, "wait needs at least one block of K per warp"
        pre = None
        acc = cute.make_rmem_tensor((RT * NT * 4,), Float32)
        for i in cutlass.range_constexpr(RT * NT * 4):
            acc[i] = Float32(0.0)
        rows = []
        for t in cutlass.range_constexpr(RT):
            rows.append(row0 + 16 * t + g)
            rows.append(row0 + 16 * t + g + 8)
        toks = []
        for t in cutlass.range_constexpr(NT):
            toks.append(cutlass.min(m0 + 8 * t + g, M - 1))  # tokens past M compute garbage that is never stored

        def block_mma(wv, xv):
            """the block's two mma.sync per (m16, n8) tile: wv[r] the 4 words of row r, xv[t] of token tile t"""
            for h in cutlass.range_constexpr(2):  # words (0, 1), then (2, 3)
                for rt in cutlass.range_constexpr(RT):
                    lo, hi = wv[2 * rt], wv[2 * rt + 1]
                    a = [lo[2 * h], hi[2 * h], lo[2 * h + 1], hi[2 * h + 1]]
                    for t in cutlass.range_constexpr(NT):
                        b = [xv[t][2 * h], xv[t][2 * h + 1]]
                        o = (rt * NT + t) * 4
                        d = mma(a, b, [acc[o], acc[o + 1], acc[o + 2], acc[o + 3]])
                        for q in cutlass.range_constexpr(4):
                            acc[o + q] = d[q]

        if const_expr(LOOP):
            # a ring of U blocks in registers (static slots): the prologue fills it, each block's mma is followed
            # by the load of the block U further on, so U blocks are in flight across the loop's back edge
            WS = 2 * RT * 4
            XS = NT * 4
            wring = cute.make_rmem_tensor((U * WS,), Int32)
            xring = cute.make_rmem_tensor((U * XS,), Int32)

            def load_w(slot, step):
                kv = (warp + step * WARPS) * 4 + c
                for r in cutlass.range_constexpr(2 * RT):
                    v = gW[(None, (rows[r], kv))].load()
                    for q in cutlass.range_constexpr(4):
                        wring[slot * WS + r * 4 + q] = v[q]

            def load_x(slot, step):
                kv = (warp + step * WARPS) * 4 + c
                for t in cutlass.range_constexpr(NT):
                    v = gX[(None, (toks[t], kv))].load()
                    for q in cutlass.range_constexpr(4):
                        xring[slot * XS + t * 4 + q] = v[q]

            def use(slot):
                wv = [[wring[slot * WS + r * 4 + q] for q in range(4)] for r in range(2 * RT)]
                xv = [[xring[slot * XS + t * 4 + q] for q in range(4)] for t in range(NT)]
                block_mma(wv, xv)

            FIRST = min(U, PER_WARP)
            for u in cutlass.range_constexpr(FIRST):
                load_w(u, u)
            if const_expr(wait):
                cute.arch.griddepcontrol_wait()
                if const_expr(after_wait is not None):
                    pre = after_wait()
            for u in cutlass.range_constexpr(FIRST):
                load_x(u, u)
            for it in cutlass.range(PER_WARP // U, unroll=1):  # (no helpers in here: the DSL stages no closures)
                for u in cutlass.range_constexpr(U):
                    for h in cutlass.range_constexpr(2):
                        for rt in cutlass.range_constexpr(RT):
                            wl = u * WS + 2 * rt * 4
                            wh = wl + 4
                            a = [wring[wl + 2 * h], wring[wh + 2 * h], wring[wl + 2 * h + 1], wring[wh + 2 * h + 1]]
                            for t in cutlass.range_constexpr(NT):
                                xb = u * XS + t * 4
                                b = [xring[xb + 2 * h], xring[xb + 2 * h + 1]]
                                o = (rt * NT + t) * 4
                                d = mma(a, b, [acc[o], acc[o + 1], acc[o + 2], acc[o + 3]])
                                for q in cutlass.range_constexpr(4):
                                    acc[o + q] = d[q]
                    nxt = (it + 1) * U + u
                    if nxt < PER_WARP:
                        kv = (warp + nxt * WARPS) * 4 + c
                        for r in cutlass.range_constexpr(2 * RT):
                            v = gW[(None, (rows[r], kv))].load()
                            for q in cutlass.range_constexpr(4):
                                wring[u * WS + r * 4 + q] = v[q]
                        for t in cutlass.range_constexpr(NT):
                            v = gX[(None, (toks[t], kv))].load()
                            for q in cutlass.range_constexpr(4):
                                xring[u * XS + t * 4 + q] = v[q]
            for u in cutlass.range_constexpr(PER_WARP % U):  # the blocks the last full round loaded
                use(u)
        for gi in cutlass.range_constexpr(0 if LOOP else GROUPS):
            ws = []
            kvs = []
            for u in cutlass.range_constexpr(U):
                step = gi * U + u
                if const_expr(step < PER_WARP):
                    kv = (warp + step * WARPS) * 4 + c  # in 16-byte units along K
                    kvs.append(kv)
                    wr = []
                    for r in cutlass.range_constexpr(2 * RT):
                        wr.append(gW[(None, (rows[r], kv))].load())
                    ws.append(wr)
            if const_expr(wait and gi == 0):
                cute.arch.griddepcontrol_wait()
                if const_expr(after_wait is not None):
                    pre = after_wait()
            xs = []
            for u in cutlass.range_constexpr(len(kvs)):
                xr = []
                for t in cutlass.range_constexpr(NT):
                    xr.append(gX[(None, (toks[t], kvs[u]))].load())
                xs.append(xr)
            for u in cutlass.range_constexpr(len(kvs)):
                block_mma(ws[u], xs[u])
        # c0 c1: row g, tokens 2c, 2c + 1 of the n8 tile; c2 c3: row g + 8, the same tokens
        for rt in cutlass.range_constexpr(RT):
            for t in cutlass.range_constexpr(NT):
                o = (rt * NT + t) * 4
                for q in cutlass.range_constexpr(4):
                    r = 16 * rt + g + 8 * (q // 2)
                    mi = 8 * t + 2 * c + (q % 2)
                    buf[warp, mi * R + r] = acc[o + q]
        cute.arch.barrier()
        return pre

    return partials


def build(key: GemvKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, const_expr

    N, K, MT = key.n, key.k, key.m_tile
    R, WARPS, U = key.rows, key.warps, key.unroll
    OUT = Float32 if key.out_fp32 else BFloat16
    GATE, RES = key.gate, key.residual
    RM = R * MT
    MMA = key.mma
    THREADS = 32 * WARPS

    @cute.kernel
    def gemv_kernel(mW: cute.Tensor, mX: cute.Tensor, mO: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        row0 = bx * R
        m0 = by * MT
        M = mX.shape[0]
        smem = cutlass.utils.SmemAllocator()
        buf = smem.allocate_tensor(Float32, cute.make_layout((WARPS, RM), stride=(RM, 1)), byte_alignment=16)
        if const_expr(MMA):
            gemv_partials_mma()(mW, mX, buf, row0, m0, K, MT, R, WARPS, U, False, None, key.mma_loop)
        else:
            gemv_partials()(mW, mX, mX, buf, row0, m0, K, MT, R, WARPS, U, False, False, False)
        for j in cutlass.range_constexpr(-(-RM // THREADS)):  # one thread per (row, token) of the tile
            e = tid + j * THREADS
            if e < RM:
                if const_expr(MMA):  # token-major partials: consecutive threads, consecutive rows of a token
                    mi = e // R
                    r = e - mi * R
                else:
                    r = e // MT
                    mi = e - r * MT
                s = warp_sum()(buf, e, WARPS)
                if m0 + mi < M:
                    if const_expr(GATE):
                        gt = mG[m0 + mi, row0 + r].to(Float32)
                        s = s / (Float32(1.0) + cute.math.exp(-gt, fastmath=True))
                    if const_expr(RES):
                        s = s + mR[m0 + mi, row0 + r].to(Float32)
                    mO[m0 + mi, row0 + r] = s.to(OUT)

    @cute.jit
    def gemv_host(mW: cute.Tensor, mX: cute.Tensor, mO: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor, stream):
        M = mX.shape[0]
        gemv_kernel(mW, mX, mO, mG, mR).launch(
            grid=(N // R, cute.ceil_div(M, MT), 1), block=(THREADS, 1, 1), smem=4 * WARPS * RM + 64, stream=stream
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


TEST_SHAPE = (7160, 200)  # (K, N): a partial last chunk and uneven K split, for the GPU tests
# (K, N) for the tensor-core GEMV's GPU tests: 26 blocks of K a warp at 4 warps and 13 at 8, so that the last group
# of loads (the unrolled form's, unroll 4) and the last round of the ring (the loop's, 8) are partial
TEST_SHAPE_MMA = (3328, 224)
MMA_AOT_M_TILES = (8, 64)
MMA_SHAPES_64 = [(7168, 12288)]  # (K, N) of the 64-token tensor-core builds
MMA_UNROLLED_SHAPES = [(7168, 2112), (7168, 12288)]  # (K, N) of the unrolled form's 8-token builds

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
    """Plain GEMVs at every decode shape, plus one shape per fused epilogue; m_tile 1 (M = 1) and 8."""
    keys = []
    for mt in AOT_M_TILES:
        keys += [GemvKey(n=n, k=k, m_tile=mt, arch=arch) for k, n in DECODE_SHAPES]
        keys.append(GemvKey(n=7168, k=12288, m_tile=mt, residual=True, arch=arch))
        keys.append(GemvKey(n=3584, k=7168, m_tile=mt, gate=True, arch=arch))
        keys.append(GemvKey(n=896, k=7168, m_tile=mt, out_fp32=True, arch=arch))  # router: 896 experts
        keys.append(GemvKey(n=TEST_SHAPE[1], k=TEST_SHAPE[0], m_tile=mt, arch=arch))
    # the tensor-core GEMV (plain: no epilogue options yet; the offline bundle must fit the device call): the loop
    # form at 8 tokens at every decode shape and at 64 at MMA_SHAPES_64; the unrolled form of run 72 (185 KB of code
    # a build at 64 tokens and K = 7168) at 8 tokens at MMA_UNROLLED_SHAPES, for a comparison in the same run
    keys += [GemvKey(n=n, k=k, m_tile=8, mma=True, mma_loop=True, arch=arch)
             for k, n in DECODE_SHAPES + [TEST_SHAPE_MMA]]
    keys += [GemvKey(n=n, k=k, m_tile=64, mma=True, mma_loop=True, arch=arch)
             for k, n in MMA_SHAPES_64 + [TEST_SHAPE_MMA]]
    keys += [GemvKey(n=n, k=k, m_tile=8, mma=True, arch=arch) for k, n in MMA_UNROLLED_SHAPES + [TEST_SHAPE_MMA]]
    keys.append(GemvKey(n=TEST_SHAPE_MMA[1], k=TEST_SHAPE_MMA[0], m_tile=64, mma=True, arch=arch))
    return keys


def mma_built(k: int, n: int, m_tile: int, loop: bool, arch: str = "sm_90a") -> bool:
    """Whether the tensor-core GEMV of this shape and form is among the kernels built ahead of time."""
    return GemvKey(n=n, k=k, m_tile=m_tile, mma=True, mma_loop=loop, arch=arch) in aot_keys(arch)


TUNING_SHAPES = [(7168, 2112), (7168, 12288)]  # (K, N)


def tuning_keys(arch: str) -> list[GemvKey]:
    """Other tilings of decode shapes, for `scripts/bench_kernels.py --only tuning`."""
    keys = []
    for rows, warps, unroll in [(1, 4, 8), (1, 2, 8), (2, 2, 8), (2, 4, 8)]:  # K = 3584: 14 chunks
        keys.append(GemvKey(n=6144, k=3584, m_tile=1, rows=rows, warps=warps, unroll=unroll, arch=arch))
    for k, n in TUNING_SHAPES:
        for rows, warps, unroll in [(1, 4, 8), (2, 4, 4), (2, 4, 8), (4, 4, 4), (2, 8, 4), (4, 8, 4)]:
            keys.append(GemvKey(n=n, k=k, m_tile=1, rows=rows, warps=warps, unroll=unroll, arch=arch))
        for rows, warps, unroll in [(2, 4, 1), (4, 4, 1), (4, 4, 2), (8, 4, 1), (4, 8, 1), (8, 8, 1)]:
            keys.append(GemvKey(n=n, k=k, m_tile=8, rows=rows, warps=warps, unroll=unroll, arch=arch))
    return keys


SPEC = kc.register(
    kc.KernelSpec(
        name="gemv",
        module=__name__,
        key_type=GemvKey,
        build=build,
        aot_keys=aot_keys,
        ptx_checks=("ld.global.v4",),
        tuning_keys=tuning_keys,
    )
)


def pick_m_tile(m: int, mma: bool = False) -> int:
    """m_tile for batch m among the tiles built ahead of time: CUDA cores 1 at M = 1, else 8; tensor cores
    (`mma`) 8 up to M = 8, else 64."""
    tiles = MMA_AOT_M_TILES if mma else AOT_M_TILES
    return next(t for t in tiles if t >= m or t == tiles[-1])


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


def check_operands(kernel: str, x: torch.Tensor, weight: torch.Tensor, m_min: int, m_max: int,
                   hint: str = "") -> tuple[int, int, int, torch.device]:
    """(M, K, N, device) of x [M, K] and weight [N, K], both bf16, contiguous, 16-byte aligned and on one CUDA
    device, with m_min <= M <= m_max; raises before any launch otherwise (`kernel` names the kernel in the message,
    `hint` what to use outside its range). The GEMV's and the GEMM's entry points share it."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("x and weight must be torch tensors")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    if not m_min <= M <= m_max:
        raise ValueError(f"{kernel} takes M={m_min}..{m_max} tokens: batch M={M} outside the supported "
                         f"{m_min}..{m_max}{hint}")
    if x.device.type != "cuda":
        raise ValueError(f"{kernel} runs on a CUDA device, got x on {x.device}")
    _check("weight", weight, (N, K), torch.bfloat16, x.device)
    _check("x", x, (M, K), torch.bfloat16, x.device)
    return M, K, N, x.device


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_fp32: bool = False,
    out: torch.Tensor | None = None,
    mma: bool = False,
    mma_loop: bool = False,
    arch: str | None = None,
) -> torch.Tensor:
    """out = epi(x @ weight.T) for x [M, K] bf16 (M = 1..64), weight [N, K] bf16, on one CUDA device.

    gate, residual: optional [M, N] bf16 (out = (x@Wᵀ)·σ(gate) + residual);
    out_fp32: fp32 output (router). `out` may be given (NaN-poisoned in tests).
    mma: on tensor cores (`GemvKey.mma`; no gate, residual or fp32 output; N a multiple of 16, of 32 above
    8 tokens; K a multiple of 128), which reads the weights once per 64 tokens instead of once per 8.
    mma_loop: with mma, its K loop as a runtime loop over a ring of blocks in registers (`GemvKey.mma_loop`; K a
    multiple of 256 up to 8 tokens).
    """
    M, K, N, dev = check_operands("gemv", x, weight, 1, MAX_M)
    if gate is not None:
        _check("gate", gate, (M, N), torch.bfloat16, dev)
    if residual is not None:
        _check("residual", residual, (M, N), torch.bfloat16, dev)
    out_dtype = torch.float32 if out_fp32 else torch.bfloat16
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=dev)
    else:
        _check("out", out, (M, N), out_dtype, dev)
    key = GemvKey(  # raises ValueError for a shape or option outside the chosen kernel, before any launch
        n=N,
        k=K,
        m_tile=pick_m_tile(M, mma),
        gate=gate is not None,
        residual=residual is not None,
        out_fp32=out_fp32,
        mma=mma,
        mma_loop=mma_loop,
        arch=kc.resolve_arch(arch),
    )
    fn = kc.load(key)
    fn(weight, x, out, gate if gate is not None else x, residual if residual is not None else x)
    return out
