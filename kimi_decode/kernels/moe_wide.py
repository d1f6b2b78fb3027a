"""The MoE half's expert kernels above 8 tokens: persistent bulk-copy rings on tensor cores over chunks of tokens.

The pipelined expert kernels (`moe_pipe.py`) stage every (expert, token) pair's activations in shared memory
once per CTA, which holds 8 tokens (128 pairs of a rows, 96 KB at TP8). Above that the step took the direct
kernels (`moe.MoEUpKey`, `moe.MoEDownKey`: a CTA per expert row block, CUDA cores, every code decoded again for
each token), which ran at a fifth to a third of the copy bandwidth (604 and 666 µs at batch 64 on an H100, run 74).

Here both kernels walk items of one **chunk** (up to 8 of one expert's tokens: the mma's 8 B columns) through a
ring of `stages` slots, one persistent CTA per SM, as moe_pipe's do. Each CTA builds the chunk table from the
routing tables in its prologue (one warp's scan over the active experts, `chunk_table`); an expert with more than
8 tokens has one chunk per 8 and its rows are read once per chunk (at batch 64 × 1 token an active expert has
about 1.7 tokens).

moe_up (`MoEUpWideKey`): an item is (chunk, 8 intermediate rows), in chunk order: 8 rows of W1 and 8 of W3 as the
16 rows of an mma.sync m16n8k16 A operand decoded from MXFP4 straight to bf16 pairs, 14 warps splitting K. The
chunk's z (8 tokens × 7 KB) is too large for the slots: a CTA stages it in shared memory (bf16, the mma's B order)
when its items reach a new chunk, about 5 times a CTA at batch 64. `decoupled`: the producer warp, which streams
the ring, also sums the warps' K parts and applies SiTU (double-buffered, on named barriers), so the compute warps
go on to the next item. Each CTA also does its share of the shared experts' SiTU and of zeroing the latent partial
and Σ r² (as the direct moe_up).

moe_down (`MoEDownWideKey`): an expert item is (256 latent rows of W2, one chunk): the chunk's a rows (contiguous
in `a`, which is grouped by expert) come into the same slot as the item's codes and scales by one more bulk copy,
and are permuted into the mma's B order in registers. Items are ordered (row block, chunk); 16 row groups of 16
rows, one warp each with all of K (at TP8 since run 78, at TP16 since run 79; `wdownr128`: 128 rows,
8 row groups × 2 halves of K that meet in shared memory, as in run 77). Each (row, token) sum
times the routing weight goes into the rank's fp32 latent partial by red.add (no per-CTA row-block sum, so only
the routing tables grow with the tokens); at the CTA's last item of a row block it fences and adds its item count
to the row block's counter, and the CTA that completes it does the one-shot all-reduce read (own partial + the
peers'), stores r ⊙ w_norm and adds Σ r² per token, as moe_pipe's moe_down. A shared item is 16 rows of the shared
experts' down projection (bf16) against up to 16 tokens' a_shared (two mma column tiles from one A fragment; 8
with 'wdownsh8'), both in the slot, K split over the 16 warps;
shared items come after a CTA's expert items. `decoupled`: the compute warps hand each slot back on a named
barrier of its own and go on; the producer waits on it before the refill.

Both take the token ids and routing weights a chunk needs from global memory (L2), not from staged tables, and
the direct kernels' arguments (moe_down: moe_pipe's, `moe_pipe.down_pipe_args`): the executor calls either the
same way. Options (`parse_wide_options`): wsync, wstN, wupstN, wdownstN, wdownc16, wupc16, wdownr128, wdownpf, wzpar,
wdownsh8.
"""

from dataclasses import dataclass

from .. import compile as kc
from .moe import D, E, L, MAX_M, TOPK, MoEShape, shapes_for_tp
from .moe_pipe import H200_SMS, PIPE_MAX_M, SB, SMEM_BUDGET, down_pipe_args, ring_init

WIDE_MIN_TOKENS = PIPE_MAX_M + 1  # the step sizes these kernels are for (they are correct from one token)
CHUNK = 8  # an expert's tokens per item: the mma's n (moe_down: `chunk`, 8 or 16 as two column tiles)
SH_TOKENS = 16  # tokens per moe_down shared item by default (two mma column tiles; 'wdownsh8': one, before run 81)
SHARED_TOKENS = (8, 16)  # the shared items' token counts moe_down is built for
SH_ROWS = 16  # shared-down rows per shared item: one mma row tile
RBW = 128  # latent rows per moe_down expert item ('wdownr128'): 8 row groups of 16, two warps each splitting K
WARPS = 16  # moe_down's compute warps; warp WARPS is the producer
DOWN_ROWS = (128, 256)  # moe_down's latent rows per expert item (256, the default: 16 row groups, one warp each, all of K)
DOWN_STAGES = {256: 2, 128: 3}  # moe_down's ring slots by rows per item (the default's two slots hold 64 KB each)
MAX_CHUNKS = E + TOPK * MAX_M // CHUNK  # chunks a step can have: one per active expert plus one per 8 more pairs


def max_chunks(chunk: int = CHUNK) -> int:
    """Chunks of up to `chunk` tokens a step can have: one per active expert plus one per `chunk` more pairs."""
    return E + TOPK * MAX_M // chunk
INFO_SHIFT = 5  # the chunk table's second word: expert id << INFO_SHIFT | the chunk's token count (up to 16)
INFO_MASK = (1 << INFO_SHIFT) - 1


@dataclass(frozen=True)
class MoEDownWideKey:
    """moe_down for steps of more than `moe_pipe.PIPE_MAX_M` tokens (module docstring)."""

    shape: MoEShape
    stages: int = DOWN_STAGES[256]  # ring slots
    ctas: int = H200_SMS
    pdl: bool = False  # (fused_moe.PDL_MAX_TOKENS: PDL only at one token)
    decode: int = 3  # the pair decode's version (mxfp4_decode.VERSIONS)
    # the compute warps hand each slot back on a named barrier of its own (bar.arrive: they go on to the next item)
    # and the producer warp waits on it before the refill; the mma sums that meet in shared memory are
    # double-buffered. False ('wsync'): a CTA barrier after every item
    decoupled: bool = True
    # an expert's tokens per item ('wdownc16'): 8 (one mma column tile) or 16 (two tiles from one decode of the item's
    # codes: an expert with 9-16 tokens reads its rows once instead of twice)
    chunk: int = CHUNK
    # latent rows per expert item: 256 (the default since runs 78-79), each 16 rows by one warp with all of K,
    # which adds its sums into the latent partial itself (no meeting, no barrier of the compute warps in an expert
    # item), in 2 ring slots; or 128 ('wdownr128', 3 slots, the kernel of run 77), each 16 rows taken by two warps
    # that split K and meet in shared memory
    rows: int = 256
    # True ('wdownpf'): a lane's token ids and routing weights for the CTA's next expert item read during this one
    # (ids before the mma, weights after it), meant to take the two dependent L2 reads off the item's path; False
    # ('wdownpf0'): read at the item's start. It costs on an H100: run 78, 128-row items 281 µs at batch 64 with it
    # against 243 without; run 79, 256-row items, the step 565.6 µs with it against 549.0 (17 tokens 300.9 against
    # 293.1); run 80 at TP16: 429.0 µs without it against 435.9
    prefetch_ids: bool = False
    # tokens per shared item: 16 (the default since run 81: two mma column tiles against one A fragment, the shared
    # down rows, 24.6 KB an item at TP8, read once per 16 tokens: 1792 shared items at batch 64 instead of 3584) or 8
    # ('wdownsh8', one tile). Run 80 (H100): batch 64 535.8 µs against 547.1, 512 tokens 2150 against 2243, TP16 at
    # batch 64 418.0 against 429.0; 17 tokens within the spread
    shared_tokens: int = SH_TOKENS
    arch: str = "sm_90a"

    @property
    def rows_per_item(self) -> int:
        """Latent rows per completion counter (the executor sizes its counters by it)."""
        return self.rows

    @property
    def ksplit(self) -> int:
        return WARPS * 16 // self.rows

    @property
    def threads(self) -> int:
        return 32 * (WARPS + 1)


def slot_bytes(shape: MoEShape, chunk: int = CHUNK, rows: int = 256, shared_tokens: int = SH_TOKENS
               ) -> tuple[int, int, int]:
    """(weight, scale, activation) bytes of one ring slot: an expert item's W2 codes and scales and its chunk's a
    rows, or a shared item's bf16 rows and its tokens' a_shared rows (the larger of each)."""
    I, S = shape.inter, shape.shared
    w = max(rows * I // 2, SH_ROWS * S * 2)
    s = rows * I // 32
    a = max(chunk * I * 2, shared_tokens * S * 2)
    return w, s, a


def down_wide_smem_bytes(key: MoEDownWideKey) -> int:
    """Dynamic shared memory of one CTA (each allocation rounded up to its 128-byte alignment)."""
    w, s, a = slot_bytes(key.shape, key.chunk, key.rows, key.shared_tokens)
    parts = [key.stages * w, key.stages * s, key.stages * a,  # the ring
             # each compute warp's mma sums (of the wider of an expert item's chunk and a shared item's tokens)
             (2 if key.decoupled else 1) * 4 * WARPS * 32 * 4 * max(key.chunk, key.shared_tokens) // CHUNK,
             *tail_bytes(key.stages)]
    return sum(-(-p // 128) * 128 for p in parts)


# meta, the active experts, their (offset, count) lists, the chunk table (first pair; expert · 16 + tokens): what both
# kernels keep in shared memory. The token ids and routing weights a chunk needs are read from global memory (L2)
# when its item starts, so that nothing here grows with the tokens
TABLE_PARTS = (16, 4 * E, 8 * E, 4 * MAX_CHUNKS, 4 * MAX_CHUNKS)  # with chunks of 8 tokens (`table_parts`)


def table_parts(chunk: int = CHUNK) -> tuple[int, ...]:
    """Bytes of the tables `carve_tables` allocates for chunks of up to `chunk` tokens."""
    n = max_chunks(chunk)
    return (16, 4 * E, 8 * E, 4 * n, 4 * n)
TABLE_BYTES = 16 + 12 * E  # what the prologue's bulk copy brings: meta, active experts, lists


def tail_bytes(stages: int, chunk: int = CHUNK) -> tuple[int, ...]:
    """The tables (`table_parts`), the mbarriers (the ring's and the tables' copy) and the two-word flag that
    `carve_tables` allocates after them: what both kernels' shared memory ends with."""
    return (*table_parts(chunk), 8 * stages + 8, 16)


def carve_tables(smem, stages: int, chunk: int = CHUNK):
    """(traced inline) the tables both kernels keep in shared memory, allocated from `smem` after their ring and
    sums: (meta, active experts, their lists, the chunk table's two words, `stages` + 1 mbarriers, a two-word flag:
    [0] a row block's completion, [1] the chunk count)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    a = 128
    return (smem.allocate_tensor(Int32, cute.make_layout((4,)), byte_alignment=a),
            smem.allocate_tensor(Int32, cute.make_layout((E,)), byte_alignment=a),
            smem.allocate_tensor(Int32, cute.make_layout((E, 2), stride=(2, 1)), byte_alignment=a),
            smem.allocate_tensor(Int32, cute.make_layout((max_chunks(chunk),)), byte_alignment=a),
            smem.allocate_tensor(Int32, cute.make_layout((max_chunks(chunk),)), byte_alignment=a),
            smem.allocate_tensor(cutlass.Int64, cute.make_layout((stages + 1,)), byte_alignment=a),
            smem.allocate_tensor(Int32, cute.make_layout((2,)), byte_alignment=a))


def check_ring(name: str, stages: int, smem_bytes: int) -> None:
    """Refuse a ring depth outside 2..6 or one whose shared memory does not fit a CTA (both wide kernels)."""
    if not 2 <= stages <= 6:
        raise ValueError(f"{name} (wide) ring stages must be 2..6, got {stages}")
    if smem_bytes > SMEM_BUDGET:
        raise ValueError(f"{name} (wide) with {stages} stages needs {smem_bytes} B of shared memory, over the "
                         f"{SMEM_BUDGET} B a CTA may take")


def bulk_tables(mMeta, mAct, mList, s_meta, s_act, s_list, bar):
    """(one thread, traced inline) bulk-copy meta, the active experts and their lists into shared memory, completing
    TABLE_BYTES on the mbarrier at address `bar`"""
    from .ptx_ops import bulk_g2s

    bulk = bulk_g2s()
    bulk(s_meta.iterator.toint(), mMeta.iterator.toint(), 16, bar)
    bulk(s_act.iterator.toint(), mAct.iterator.toint(), E * 4, bar)
    bulk(s_list.iterator.toint(), mList.iterator.toint(), E * 8, bar)


def check_key(key: MoEDownWideKey) -> None:
    if key.shape.inter % SB or D % SH_ROWS:
        raise ValueError(f"moe_down (wide) needs the intermediate slice in {SB}-code super-blocks, got {key.shape.inter}")
    if key.rows not in DOWN_ROWS:
        raise ValueError(f"moe_down (wide) rows per item must be one of {DOWN_ROWS}, got {key.rows}")
    if key.chunk not in (CHUNK, 2 * CHUNK):
        raise ValueError(f"moe_down (wide) takes {CHUNK} or {2 * CHUNK} of an expert's tokens per item, got {key.chunk}")
    if key.shared_tokens not in SHARED_TOKENS:
        raise ValueError(f"moe_down (wide) takes {' or '.join(map(str, SHARED_TOKENS))} tokens per shared item, got "
                         f"{key.shared_tokens}")
    check_ring("moe_down", key.stages, down_wide_smem_bytes(key))


_CHUNKS = None


def chunk_table():
    """`@cute.jit` chunk_table()(s_act, s_list, s_cpair, s_cinfo, out, nact, lane, CH), one warp: the chunks of the
    step (up to CH tokens of one active expert each, in expert order) from the routing tables in shared memory, by a
    scan over the active experts' chunk counts 32 at a time. Chunk c: s_cpair[c] its first (expert, token) pair,
    s_cinfo[c] = expert id << INFO_SHIFT | its token count; out[1] the number of chunks (lane 0)."""
    global _CHUNKS
    if _CHUNKS is None:
        import cutlass
        import cutlass.cute as cute
        from cutlass import Constexpr, Int32

        @cute.jit
        def table(s_act: cute.Tensor, s_list: cute.Tensor, s_cpair: cute.Tensor, s_cinfo: cute.Tensor,
                  out: cute.Tensor, nact: Int32, lane: Int32, CH: Constexpr = CHUNK):
            run = Int32(0)
            for base in cutlass.range(0, nact, 32):
                j = base + lane
                num = Int32(0)
                off = Int32(0)
                e = Int32(0)
                if j < nact:
                    e = s_act[j]
                    off = s_list[j, 0]
                    num = s_list[j, 1]
                nc = (num + (CH - 1)) // CH
                inc = nc
                for d in cutlass.range_constexpr(5):  # inclusive scan of the 32 lanes' counts
                    y = cute.arch.shuffle_sync_up(inc, 1 << d)
                    if lane >= (1 << d):
                        inc = inc + y
                start = run + inc - nc
                for p in cutlass.range(nc):
                    s_cpair[start + p] = off + CH * p
                    s_cinfo[start + p] = (e << INFO_SHIFT) | cutlass.min(num - CH * p, CH)
                run = run + cute.arch.shuffle_sync(inc, 31)
            if lane == 0:
                out[1] = run

        _CHUNKS = table
    return _CHUNKS


def build_down_wide(key: MoEDownWideKey):
    """(host function, compile-time arguments) of moe_down (wide)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Constexpr, Float32, Int32, Int64, Uint8, const_expr

    from .mxfp4_decode import decode_pairs, scale_pair
    from .ptx_ops import bulk_g2s, ld_v4_f32, mma_bf16

    check_key(key)
    sh = key.shape
    I, S, TP = sh.inter, sh.shared, sh.tp
    ST, G, PDL = key.stages, key.ctas, key.pdl
    RBW, KS = key.rows, key.ksplit
    RG = RBW // 16  # row groups of 16 rows
    DEC = key.decoupled
    PF = key.prefetch_ids
    NB = 2 if DEC else 1  # buffers of the mma sums that meet in shared memory
    SLOT_BAR = 3  # (decoupled) named barriers SLOT_BAR .. SLOT_BAR + ST - 1: slot s handed back to the producer
    assert SLOT_BAR + ST <= 16
    THREADS = key.threads
    REFILL = 32 * WARPS  # the producer warp's first thread streams the ring
    CH = key.chunk
    NT = CH // CHUNK  # the mma's column tiles per expert item
    SHT = key.shared_tokens  # tokens per shared item
    NTS = SHT // CHUNK  # the mma's column tiles per shared item
    NTK = max(NT, NTS)  # column tiles of the mma sums that meet in shared memory
    W_SLOT, S_SLOT, A_SLOT = slot_bytes(sh, CH, RBW, SHT)
    W_BYTES = RBW * I // 2  # an expert item's codes
    SH_BYTES = SH_ROWS * S * 2  # a shared item's rows
    WROW, SROW = I // 8, I // 32  # code words and scale bytes per W2 row
    NBD = L // RBW  # latent row blocks
    NSB = I // SB  # super-blocks per W2 row
    KU = 4 * NSB // KS  # code words (of a lane's super-block quads) per K half
    # K half h: (super-block, first word, end word) runs of words h·KU .. (h+1)·KU
    KPARTS = [[(u // 4, u % 4, min(4, u % 4 + (h + 1) * KU - u)) for u in range(h * KU, (h + 1) * KU)
               if u == h * KU or u % 4 == 0] for h in range(KS)]
    KSTEPS = S // 16  # a shared item's k16 steps, dealt to the compute warps round robin
    KSW = -(-KSTEPS // WARPS)
    NSHB = D // SH_ROWS  # shared row blocks
    pairs, mma, bulk, ld4 = decode_pairs(key.decode), mma_bf16(), bulk_g2s(), ld_v4_f32()
    lo16, hi16 = 0xFFFF, -65536
    PEERS = min(TP, 8)  # ranks whose 4-word loads a lane of the all-reduce read has in flight at once

    def b_order(n):
        """(traced inline) 4 words of natural-order bf16 pairs (v0,v1) (v2,v3) (v4,v5) (v6,v7) -> the mma's B order
        (v0,v4) (v2,v6) (v1,v5) (v3,v7) (moe_pipe's permuted K)"""
        return [(n[0] & lo16) | (n[2] << 16), (n[1] & lo16) | (n[3] << 16),
                ((n[0] >> 16) & lo16) | (n[2] & hi16), ((n[1] >> 16) & lo16) | (n[3] & hi16)]

    def expert_rows(gW, ring_s, gA, slot, r0, c, g, part):
        """(traced inline) a lane's mma sums over its K half for rows r0 and r0 + 8 of the item in `slot`, B column g
        of each column tile j (the chunk's token 8j + g) from the slot's a rows: 4 · NT sums, tile-major"""
        tot = [Float32(0.0)] * (4 * NT)
        for q, b0, b1 in part:
            acc = [[Float32(0.0)] * 4 for _ in range(NT)]
            wa = gW[(None, (slot, r0, 4 * q + c))].load()
            wb = gW[(None, (slot, r0 + 8, 4 * q + c))].load()
            sa = scale_pair(Int32(ring_s[slot, r0, 4 * q + c]))
            sb = scale_pair(Int32(ring_s[slot, r0 + 8, 4 * q + c]))
            for bb in range(b0, b1):
                pa = pairs(wa[bb], sa)
                pb = pairs(wb[bb], sb)
                for j in range(NT):  # one decode, NT column tiles
                    b = b_order(gA[(None, (slot, CHUNK * j + g, 16 * q + 4 * c + bb))].load())
                    for s in range(2):
                        acc[j] = mma([pa[s], pb[s], pa[s + 2], pb[s + 2]], [b[2 * s], b[2 * s + 1]], acc[j])
            tot = [tot[4 * j + r] + acc[j][r] for j in range(NT) for r in range(4)]
        return tot

    @cute.jit
    def issue(k: Int32, slot: Int32, ne: Int32, nch: Int32, tt: Int32, M: Int32, s_cpair: cute.Tensor,
              s_cinfo: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor, mWd: cute.Tensor, mA: cute.Tensor,
              mAsh: cute.Tensor, bars: cute.Tensor, w_base: Int32, s_base: Int32, a_base: Int32,
              WEIGHTS: Constexpr, ACTS: Constexpr):
        """(one thread, inlined) stream item k into slot `slot`: its weights (WEIGHTS, which also sets the
        mbarrier's byte count for the whole item) and its activations (ACTS: moe_up's output, after the wait)"""
        bar = bars.iterator + slot
        b = bar.toint()
        if k < ne:  # expert item: row block rb of chunk ch's expert, the chunk's a rows
            rb = k // nch
            ch = k - rb * nch
            info = s_cinfo[ch]
            n = info & INFO_MASK
            if const_expr(WEIGHTS):
                cute.arch.mbarrier_arrive_and_expect_tx(bar, W_BYTES + RBW * SROW + n * (I * 2))
                row = (info >> INFO_SHIFT) * L + rb * RBW
                bulk(w_base + slot * W_SLOT, mW2.iterator.toint() + Int64(row) * (WROW * 4), W_BYTES, b)
                bulk(s_base + slot * S_SLOT, mS2.iterator.toint() + Int64(row) * SROW, RBW * SROW, b)
            if const_expr(ACTS):
                bulk(a_base + slot * A_SLOT, mA.iterator.toint() + Int64(s_cpair[ch]) * (I * 2), n * (I * 2), b)
        else:  # shared item: 16 shared-down rows, up to SHT tokens' a_shared
            s_ = k - ne
            rsb = s_ // tt
            t8 = s_ - rsb * tt
            nt = cutlass.min(M - SHT * t8, SHT)
            if const_expr(WEIGHTS):
                cute.arch.mbarrier_arrive_and_expect_tx(bar, SH_BYTES + nt * (S * 2))
                bulk(w_base + slot * W_SLOT, mWd.iterator.toint() + Int64(rsb) * SH_BYTES, SH_BYTES, b)
            if const_expr(ACTS):
                bulk(a_base + slot * A_SLOT, mAsh.iterator.toint() + Int64(t8) * (SHT * S * 2), nt * (S * 2), b)

    @cute.jit
    def next_ids(k: Int32, nch: Int32, c: Int32, s_cinfo: cute.Tensor, s_cpair: cute.Tensor, mTok: cute.Tensor,
                 tsr: cute.Tensor):
        """(inlined) expert item k's token ids of a lane's columns (8j + 2c + x, tile-major) into tsr; the item's
        chunk info word"""
        ch = k - (k // nch) * nch
        info = s_cinfo[ch]
        p0 = s_cpair[ch]
        for q in cutlass.range_constexpr(2 * NT):
            tsr[q] = mTok[p0 + cutlass.min(CHUNK * (q // 2) + 2 * c + (q % 2), (info & INFO_MASK) - 1)]
        return info

    @cute.jit
    def next_weights(info: Int32, mWe: cute.Tensor, tsr: cute.Tensor, wsr: cute.Tensor):
        """(inlined) the routing weights of the ids in tsr (their chunk's info word `info`) into wsr"""
        for q in cutlass.range_constexpr(2 * NT):
            wsr[q] = mWe[info >> INFO_SHIFT, tsr[q]]

    @cute.jit
    def hand_back(slot: Int32, warp: Int32):
        """(all threads, inlined) the item in `slot` is done with: a CTA barrier, or (decoupled) the compute warps
        arrive on the slot's named barrier and go on while the producer warp waits on it (its refill follows). A
        compute warp's next arrival there is for the item ST later, which needs that refill: never a generation
        early. The mma sums' buffer i % 2 is written again two items later, after every warp has passed the K
        halves' barrier of the item between, which the warps that read it reach only after reading."""
        if const_expr(DEC):
            if warp < WARPS:
                cute.arch.barrier_arrive(barrier_id=SLOT_BAR + slot, number_of_threads=32 * (WARPS + 1))
            else:
                cute.arch.barrier(barrier_id=SLOT_BAR + slot, number_of_threads=32 * (WARPS + 1))
        else:
            cute.arch.barrier()

    @cute.jit
    def complete_row_block(rb: Int32, mine: Int32, nch: Int32, flag: cute.Tensor, mLat: cute.Tensor,
                           mCoef: cute.Tensor, mR: cute.Tensor, mNorm: cute.Tensor, mSsq: cute.Tensor,
                           mCnt: cute.Tensor, M: Int32, tid: Int32, warp: Int32, lane: Int32):
        """(all threads, inlined) this CTA's red.adds into row block rb are out: the fence, its `mine` items
        counted on the row block's counter and, if that completed it (every chunk's item in), its one-shot
        all-reduce read (own partial + the peers', one token per warp at a time, 4 rows per lane), r ⊙ w_norm
        stored (bf16), Σ r² added into the token's sum, and the counter re-armed"""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        if tid == 0:
            old = cute.arch.atomic_add(mCnt.iterator + rb, mine, sem="acq_rel", scope="gpu")
            flag[0] = Int32(old + mine == nch)
        cute.arch.barrier()
        if flag[0] != 0:
            cute.arch.fence_acq_rel_gpu()
            lat = mLat.iterator.toint()
            for u in cutlass.range(warp, M * (RBW // 128), WARPS + 1):  # (token, 128 rows): 32 lanes × 4 rows
                t = u // (RBW // 128)
                row = rb * RBW + 128 * (u - t * (RBW // 128)) + 4 * lane
                tots = [Float32(0.0)] * 4
                for pc in cutlass.range_constexpr(0, TP, PEERS):  # PEERS ranks' loads in flight at once
                    parts = [ld4(lat + Int64((p_ * M + t) * L + row) * 4) for p_ in range(pc, pc + PEERS)]
                    for e_ in cutlass.range_constexpr(4):
                        for j_ in cutlass.range_constexpr(PEERS):
                            tots[e_] = tots[e_] + mCoef[pc + j_] * parts[j_][e_]
                sq = Float32(0.0)
                for e_ in cutlass.range_constexpr(4):
                    sq = sq + tots[e_] * tots[e_]
                    mR[t, row + e_] = (tots[e_] * mNorm[0, row + e_].to(Float32)).to(BFloat16)
                sq = cute.arch.warp_reduction_sum(sq)
                if lane == 0:
                    cute.arch.red(mSsq.iterator + t, sq, op="add", dtype=Float32, sem="relaxed", scope="gpu")
            if tid == 0:
                mCnt[rb] = Int32(0)  # re-arm for the next step
        cute.arch.barrier()  # flag is free for the next row block

    @cute.kernel
    def down_kernel(mA: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor, mMeta: cute.Tensor, mAct: cute.Tensor,
                    mList: cute.Tensor, mTok: cute.Tensor, mWe: cute.Tensor, mLat: cute.Tensor, mCoef: cute.Tensor,
                    mCnt: cute.Tensor, mR: cute.Tensor, mAsh: cute.Tensor, mWd: cute.Tensor, mSh: cute.Tensor,
                    mNorm: cute.Tensor, mSsq: cute.Tensor, mWup: cute.Tensor, mF: cute.Tensor, mTrace: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, _, _ = cute.arch.block_idx()
        M = mLat.shape[1]
        smem = cutlass.utils.SmemAllocator()
        ring_w = smem.allocate_tensor(Int32, cute.make_layout((ST, W_SLOT // 4), stride=(W_SLOT // 4, 1)),
                                      byte_alignment=128)
        ring_s = smem.allocate_tensor(Uint8, cute.make_layout((ST, RBW, SROW), stride=(S_SLOT, SROW, 1)),
                                      byte_alignment=128)
        ring_a = smem.allocate_tensor(Int32, cute.make_layout((ST, A_SLOT // 4), stride=(A_SLOT // 4, 1)),
                                      byte_alignment=128)
        kpart = smem.allocate_tensor(Float32, cute.make_layout((NB, WARPS, 32, 4 * NTK),
                                                               stride=(WARPS * 128 * NTK, 128 * NTK, 4 * NTK, 1)),
                                     byte_alignment=128)
        s_meta, s_act, s_list, s_cpair, s_cinfo, bars, flag = carve_tables(smem, ST)
        pbar = bars.iterator + ST  # the routing tables' bulk copy
        # views of the ring: an expert item's codes [rows, words] and a rows [8, I/2]; a shared item's bf16 rows
        # [16, S/2] and a_shared rows [SHT, S/2]
        gW = cute.zipped_divide(cute.make_tensor(ring_w.iterator, cute.make_layout(
            (ST, RBW, WROW), stride=(W_SLOT // 4, WROW, 1))), (1, 1, 4))
        gA = cute.zipped_divide(cute.make_tensor(ring_a.iterator, cute.make_layout(
            (ST, CH, I // 2), stride=(A_SLOT // 4, I // 2, 1))), (1, 1, 4))
        sWd = cute.make_tensor(ring_w.iterator, cute.make_layout((ST, SH_ROWS, S // 2), stride=(W_SLOT // 4, S // 2, 1)))
        sAs = cute.make_tensor(ring_a.iterator, cute.make_layout((ST, SHT, S // 2), stride=(A_SLOT // 4, S // 2, 1)))

        if tid == 0:
            cute.arch.mbarrier_init(pbar, 1)
        ring_init()(bars, ST)  # (thread 0's fence covers pbar too; then a CTA barrier)
        # the routing tables come from moe_route: complete before this launch
        if tid == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(pbar, TABLE_BYTES)
            bulk_tables(mMeta, mAct, mList, s_meta, s_act, s_list, pbar.toint())
        cute.arch.mbarrier_wait(pbar, 0)
        nact = s_meta[0]
        if warp == WARPS:  # the chunk table, by the producer warp
            chunk_table()(s_act, s_list, s_cpair, s_cinfo, flag, nact, lane, CH)
        cute.arch.barrier()
        nch = flag[1]
        tt = (M + (SHT - 1)) // SHT  # shared items per shared row block (token tiles)
        ne = NBD * nch
        nsh = NSHB * tt
        # this CTA's items: a run of expert items, then a run of shared items; the expert items' extras to CTAs
        # 0.., the shared ones' to the CTAs after them (moe_pipe.paired_split)
        q_e = ne // G
        r_e = ne - q_e * G
        lo_e = bx * q_e + cutlass.min(bx, r_e)
        hi_e = lo_e + q_e + Int32(bx < r_e)
        j_s = bx - r_e
        j_s = j_s + Int32(j_s < 0) * G
        q_s = nsh // G
        r_s = nsh - q_s * G
        lo_s = j_s * q_s + cutlass.min(j_s, r_s)
        hi_s = lo_s + q_s + Int32(j_s < r_s)
        n_e = hi_e - lo_e
        n_items = n_e + hi_s - lo_s
        jmp = ne + lo_s - hi_e  # the CTA's i-th item is lo_e + i + (i >= n_e) · jmp
        w_base = ring_w.iterator.toint()
        s_base = ring_s.iterator.toint()
        a_base = ring_a.iterator.toint()
        if tid == REFILL:  # the first slots' weights before the wait for moe_up
            for s in cutlass.range_constexpr(ST):
                if s < n_items:
                    issue(lo_e + s + Int32(s >= n_e) * jmp, s, ne, nch, tt, M, s_cpair, s_cinfo, mW2, mS2, mWd, mA,
                          mAsh, bars, w_base, s_base, a_base, True, False)
        if const_expr(PDL):  # a, a_shared and the zeroed latent partial come from moe_up
            cute.arch.griddepcontrol_wait()
        if tid == REFILL:
            for s in cutlass.range_constexpr(ST):
                if s < n_items:
                    issue(lo_e + s + Int32(s >= n_e) * jmp, s, ne, nch, tt, M, s_cpair, s_cinfo, mW2, mS2, mWd, mA,
                          mAsh, bars, w_base, s_base, a_base, False, True)
        if const_expr(PDL):  # the tail reads nothing of this launch before its own wait
            cute.arch.griddepcontrol_launch_dependents()
        g = lane // 4
        c = lane - 4 * g
        tsr = cute.make_rmem_tensor((2 * NT,), Int32)  # an expert item's token ids and weights (prefetch_ids: the next one's)
        wsr = cute.make_rmem_tensor((2 * NT,), Float32)
        if const_expr(PF):
            if warp < WARPS:
                if n_e > 0:
                    next_weights(next_ids(lo_e, nch, c, s_cinfo, s_cpair, mTok, tsr), mWe, tsr, wsr)
        for i in cutlass.range(n_items):
            k = lo_e + i + Int32(i >= n_e) * jmp
            slot = i % ST
            if k < ne:
                rb = k // nch
                ch = k - rb * nch
                if warp < WARPS:
                    info = s_cinfo[ch]
                    n = info & INFO_MASK
                    if const_expr(PF):  # this item's, read during the last one; the next one's ids now
                        ts = [tsr[q] for q in range(2 * NT)]
                        ws = [wsr[q] for q in range(2 * NT)]
                        if i + 1 < n_e:
                            next_ids(k + 1, nch, c, s_cinfo, s_cpair, mTok, tsr)
                    else:  # this lane's two tokens and their routing weights, read while the item computes (L2)
                        next_weights(next_ids(k, nch, c, s_cinfo, s_cpair, mTok, tsr), mWe, tsr, wsr)
                        ts = [tsr[q] for q in range(2 * NT)]
                        ws = [wsr[q] for q in range(2 * NT)]
                    cute.arch.mbarrier_wait(bars.iterator + slot, (i // ST) % 2)
                    r0 = 16 * (warp % RG) + g
                    if const_expr(KS == 1):  # all of K: this warp's rows are complete
                        tot = expert_rows(gW, ring_s, gA, slot, r0, c, g, KPARTS[0])
                    else:
                        for h in cutlass.range_constexpr(KS):
                            if warp // RG == h:
                                th = expert_rows(gW, ring_s, gA, slot, r0, c, g, KPARTS[h])
                                for r in cutlass.range_constexpr(4 * NT):
                                    kpart[i % NB, warp, lane, r] = th[r]
                        cute.arch.barrier(barrier_id=2, number_of_threads=32 * WARPS)
                        tot = [kpart[i % NB, warp % RG, lane, r] for r in range(4 * NT)]
                        for h in cutlass.range_constexpr(1, KS):
                            for r in cutlass.range_constexpr(4 * NT):
                                tot[r] = tot[r] + kpart[i % NB, warp % RG + h * RG, lane, r]
                    if const_expr(PF):  # the next item's weights, its ids in by now
                        if i + 1 < n_e:
                            next_weights(s_cinfo[(k + 1) - ((k + 1) // nch) * nch], mWe, tsr, wsr)
                    if warp < RG:  # the row group's sums times the routing weights into the latent partial
                        for j in cutlass.range_constexpr(NT):
                            for x in cutlass.range_constexpr(2):
                                if CHUNK * j + 2 * c + x < n:
                                    t = ts[2 * j + x]
                                    w = ws[2 * j + x]
                                    o = t * L + rb * RBW + r0
                                    cute.arch.red(mLat.iterator + o, tot[4 * j + x] * w, op="add", dtype=Float32,
                                                  sem="relaxed", scope="gpu")
                                    cute.arch.red(mLat.iterator + (o + 8), tot[4 * j + 2 + x] * w, op="add",
                                                  dtype=Float32, sem="relaxed", scope="gpu")
                hand_back(slot, warp)
                if tid == REFILL:
                    if i + ST < n_items:
                        cute.arch.fence_view_async_shared()
                        issue(k + ST + Int32(i + ST >= n_e) * jmp, slot, ne, nch, tt, M, s_cpair, s_cinfo, mW2, mS2,
                              mWd, mA, mAsh, bars, w_base, s_base, a_base, True, True)
                if i + 1 == n_e or (k + 1) // nch != rb:  # this CTA's last item of the row block
                    complete_row_block(rb, k + 1 - cutlass.max(lo_e, rb * nch), nch, flag, mLat, mCoef, mR, mNorm,
                                       mSsq, mCnt, M, tid, warp, lane)
            else:  # 16 rows of the shared down projection against up to SHT tokens: this rank's shared partial
                s_ = k - ne
                rsb = s_ // tt
                t8 = s_ - rsb * tt
                if warp < WARPS:
                    cute.arch.mbarrier_wait(bars.iterator + slot, (i // ST) % 2)
                    acc = [[Float32(0.0)] * 4 for _ in range(NTS)]
                    for u in cutlass.range_constexpr(KSW):
                        ks = warp + WARPS * u
                        if ks < KSTEPS:
                            wo = 8 * ks + c
                            wa = [sWd[slot, g, wo], sWd[slot, g + 8, wo], sWd[slot, g, wo + 4], sWd[slot, g + 8, wo + 4]]
                            for j in cutlass.range_constexpr(NTS):  # one A fragment, NTS token tiles
                                acc[j] = mma(wa, [sAs[slot, CHUNK * j + g, wo], sAs[slot, CHUNK * j + g, wo + 4]],
                                             acc[j])
                    for j in cutlass.range_constexpr(NTS):
                        for r in cutlass.range_constexpr(4):
                            kpart[i % NB, warp, lane, 4 * j + r] = acc[j][r]
                    cute.arch.barrier(barrier_id=2, number_of_threads=32 * WARPS)
                    if warp == 0:
                        tot = [kpart[i % NB, 0, lane, r] for r in range(4 * NTS)]
                        for w_ in cutlass.range_constexpr(1, WARPS):
                            for r in cutlass.range_constexpr(4 * NTS):
                                tot[r] = tot[r] + kpart[i % NB, w_, lane, r]
                        for j in cutlass.range_constexpr(NTS):
                            for x in cutlass.range_constexpr(2):
                                t = SHT * t8 + CHUNK * j + 2 * c + x
                                if t < M:
                                    mSh[0, t, rsb * SH_ROWS + g] = tot[4 * j + x].to(BFloat16)
                                    mSh[0, t, rsb * SH_ROWS + g + 8] = tot[4 * j + 2 + x].to(BFloat16)
                hand_back(slot, warp)
                if tid == REFILL:
                    if i + ST < n_items:
                        cute.arch.fence_view_async_shared()
                        issue(k + ST, slot, ne, nch, tt, M, s_cpair, s_cinfo, mW2, mS2, mWd, mA, mAsh, bars, w_base,
                              s_base, a_base, True, True)

    @cute.jit
    def down_host(mA: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor, mMeta: cute.Tensor, mAct: cute.Tensor,
                  mList: cute.Tensor, mTok: cute.Tensor, mWe: cute.Tensor, mLat: cute.Tensor, mCoef: cute.Tensor,
                  mCnt: cute.Tensor, mR: cute.Tensor, mAsh: cute.Tensor, mWd: cute.Tensor, mSh: cute.Tensor,
                  mNorm: cute.Tensor, mSsq: cute.Tensor, mWup: cute.Tensor, mF: cute.Tensor, mTrace: cute.Tensor,
                  stream):
        down_kernel(mA, mW2, mS2, mMeta, mAct, mList, mTok, mWe, mLat, mCoef, mCnt, mR, mAsh, mWd, mSh, mNorm, mSsq,
                    mWup, mF, mTrace).launch(grid=(G, 1, 1), block=(THREADS, 1, 1), smem=down_wide_smem_bytes(key),
                                             stream=stream, use_pdl=PDL)

    return down_host, down_pipe_args(sh, NBD)


# --------------------------------------------------------------------------- moe_up (wide)

UP_ROWS = 8  # intermediate rows per moe_up item: the mma's A rows 0..7 (W1) and 8..15 (W3), as moe_pipe's RB_UP
UP_STAGES = {8: 3, 16: 2}  # moe_up's ring slots by tokens per chunk ('wupc16': its z takes the third slot's room)
UP_WARPS = 14  # moe_up's compute warps: warp w takes super-blocks w and w + 14 of a row's 28


@dataclass(frozen=True)
class MoEUpWideKey:
    """moe_up for steps of more than `moe_pipe.PIPE_MAX_M` tokens: persistent CTAs over items (chunk, 8 intermediate
    rows) in chunk order, the W1 and W3 rows streamed through a ring as in moe_pipe; the chunk's z (up to 8 tokens,
    bf16 in the mma's B order) staged in shared memory when a CTA's items reach a new chunk. Each CTA also does its
    share of the shared experts' SiTU and of zeroing the latent partial and Σ r² (as moe.MoEUpKey)."""

    shape: MoEShape
    stages: int = UP_STAGES[CHUNK]
    ctas: int = H200_SMS
    pdl: bool = False
    decode: int = 3
    # the producer warp also sums each item's K parts and applies SiTU (double-buffered), so the compute warps go on
    # to the next item after writing their sums (bar.arrive) instead of meeting on a barrier and waiting for warp 0's
    # epilogue and a CTA barrier. False ('wsync'): as moe_down's decoupled=False
    decoupled: bool = True
    # how a CTA stages a new chunk's z: True ('wzpar') every thread loads the chunk's 8 token ids at once, then all of
    # its z words (8 rows × 8 fp32 a thread at TP8; ptxas sends them in about four groups) before the stores. False
    # (the default): a runtime loop over the chunk's tokens, each waiting for its token id and then its z words (two
    # round trips a token; at batch 64 a chunk holds about 2.5 tokens). Run 79 (H100): 'wzpar' slower by about
    # 0.33-0.37 µs an item at 17, 64 and 512 tokens (moe_up 320.8 against 265.5 µs at batch 64), not explained
    z_parallel: bool = False
    # an expert's tokens per item: 8 (one mma column tile) or 16 ('wupc16': the item's codes decoded once for two
    # column tiles, the second only in a chunk of more than 8 tokens, so that an expert with 9-16 tokens reads its
    # W1/W3 rows once instead of twice). The chunk's z (114.7 KB at 16 tokens) leaves room for 2 ring slots
    # (`UP_STAGES`)
    chunk: int = CHUNK
    arch: str = "sm_90a"

    @property
    def threads(self) -> int:
        return 32 * (UP_WARPS + 1)


def up_slot_bytes(shape: MoEShape) -> tuple[int, int]:
    """(code, scale) bytes of one moe_up ring slot: 8 rows of W1 and 8 of W3."""
    return 2 * UP_ROWS * L // 2, 2 * UP_ROWS * L // 32


def up_wide_smem_bytes(key: MoEUpWideKey) -> int:
    w, s = up_slot_bytes(key.shape)
    parts = [key.stages * w, key.stages * s,
             key.chunk * L * 2,  # the chunk's z (bf16)
             (2 if key.decoupled else 1) * 4 * (key.chunk // CHUNK) * UP_WARPS * 32 * 4,  # the warps' sums of an item
             *tail_bytes(key.stages, key.chunk)]
    return sum(-(-p // 128) * 128 for p in parts)


def check_up_key(key: MoEUpWideKey) -> None:
    if key.shape.inter % UP_ROWS or (L // SB) != 2 * UP_WARPS:
        raise ValueError(f"moe_up (wide) needs {UP_ROWS}-row blocks and {2 * UP_WARPS} super-blocks per row")
    if key.chunk not in (CHUNK, 2 * CHUNK):
        raise ValueError(f"moe_up (wide) takes {CHUNK} or {2 * CHUNK} of an expert's tokens per item, got {key.chunk}")
    if key.z_parallel and key.chunk != CHUNK:
        raise ValueError("moe_up (wide) 'wzpar' stages chunks of 8 tokens: not with 'wupc16'")
    if key.z_parallel and (L // 8) % (32 * UP_WARPS):
        raise ValueError(f"moe_up (wide) 'wzpar' gives each compute thread whole 8-value blocks of a z row: L / 8 = "
                         f"{L // 8} is not a multiple of its {32 * UP_WARPS} threads")
    check_ring("moe_up", key.stages, up_wide_smem_bytes(key))


def build_up_wide(key: MoEUpWideKey):
    """(host function, compile-time arguments) of moe_up (wide); its arguments are the direct moe_up's
    (`moe.expert_up_args`)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Boolean, Float32, Int32, Int64, Uint8, const_expr

    from .moe import _situ, expert_up_args, shared_situ_and_zeroing
    from .moe_pipe import store_b_order, superblock_mma, z_chunk
    from .mxfp4_decode import decode_pairs, scale_pair
    from .ptx_ops import bulk_g2s, mma_bf16

    check_up_key(key)
    sh = key.shape
    I = sh.inter
    ST, G, PDL = key.stages, key.ctas, key.pdl
    THREADS = key.threads
    CW = UP_WARPS * 32  # compute threads
    REFILL = CW  # the producer warp's first thread streams the ring
    W_SLOT, S_SLOT = up_slot_bytes(sh)
    ROW_BYTES, ROW_SC = L // 2, L // 32  # bytes of codes and of scales per W1 / W3 row
    WROW = L // 8
    NRB = I // UP_ROWS  # row blocks per expert
    Z0, BETA, BETA_LIN = sh.z0, sh.beta, sh.beta_lin
    DEC = key.decoupled
    NB = 2 if DEC else 1
    EPI_READY, EPI_DONE = 4, 6  # (decoupled) named barriers 4 + b: sums of buffer b written; 6 + b: read
    ZPAR = key.z_parallel
    ZCOLS = (L // 8) // CW  # (wzpar) 8-value column blocks of a z row per compute thread
    CHK = key.chunk  # tokens per chunk
    NT = CHK // CHUNK  # mma column tiles of a chunk
    bulk = bulk_g2s()

    def superblock_mma2(acc0, acc1, wa, wb, sa, sb, sB, col, v0):
        """(traced inline; 'wupc16') `superblock_mma` against two column tiles, tokens col and col + 8 of the chunk,
        from one decode of the codes: the same mma sequence for each tile as one tile alone"""
        pairs, mma = decode_pairs(key.decode), mma_bf16()
        for bb in range(4):
            b0 = sB[(None, (col, z_chunk(v0 + bb, False)))].load()
            b1 = sB[(None, (col + CHUNK, z_chunk(v0 + bb, False)))].load()
            pa = pairs(wa[bb], sa)
            pb = pairs(wb[bb], sb)
            for s in range(2):
                a = [pa[s], pb[s], pa[s + 2], pb[s + 2]]
                acc0 = mma(a, [b0[2 * s], b0[2 * s + 1]], acc0)
                acc1 = mma(a, [b1[2 * s], b1[2 * s + 1]], acc1)
        return acc0, acc1

    def item_sums(gW, ring_s, sB, slot, warp, g, c, two):
        """(traced inline) a compute warp's K part of an item: its two super-blocks of the 8 W1 and 8 W3 rows
        against the chunk's first column tile, or with `two` ('wupc16') both tiles: 4 · (2 if two else 1) sums"""
        acc, acc2 = [Float32(0.0)] * 4, [Float32(0.0)] * 4
        for u in range(2):
            q = warp + UP_WARPS * u
            wa = gW[(None, (slot, g, 4 * q + c))].load()
            wb = gW[(None, (slot, g + UP_ROWS, 4 * q + c))].load()
            sa = scale_pair(Int32(ring_s[slot, g, 4 * q + c]))
            sb = scale_pair(Int32(ring_s[slot, g + UP_ROWS, 4 * q + c]))
            if two:
                acc, acc2 = superblock_mma2(acc, acc2, wa, wb, sa, sb, sB, g, 16 * q + 4 * c)
            else:
                acc = superblock_mma(acc, wa, wb, sa, sb, sB, g, 16 * q + 4 * c, key.decode)
        return acc + acc2 if two else acc

    @cute.jit
    def issue(k: Int32, slot: Int32, s_cinfo: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor,
              mS3: cute.Tensor, bars: cute.Tensor, w_base: Int32, s_base: Int32):
        """(one thread, inlined) stream item k (chunk k // NRB, row block k % NRB) into slot `slot`: 8 rows of W1
        then 8 of W3, their scales likewise"""
        bar = bars.iterator + slot
        b = bar.toint()
        ch = k // NRB
        row = (s_cinfo[ch] >> INFO_SHIFT) * I + (k - ch * NRB) * UP_ROWS
        cute.arch.mbarrier_arrive_and_expect_tx(bar, W_SLOT + S_SLOT)
        dw = w_base + slot * W_SLOT
        ds = s_base + slot * S_SLOT
        bulk(dw, mW1.iterator.toint() + Int64(row) * ROW_BYTES, UP_ROWS * ROW_BYTES, b)
        bulk(dw + UP_ROWS * ROW_BYTES, mW3.iterator.toint() + Int64(row) * ROW_BYTES, UP_ROWS * ROW_BYTES, b)
        bulk(ds, mS1.iterator.toint() + Int64(row) * ROW_SC, UP_ROWS * ROW_SC, b)
        bulk(ds + UP_ROWS * ROW_SC, mS3.iterator.toint() + Int64(row) * ROW_SC, UP_ROWS * ROW_SC, b)

    @cute.jit
    def epilogue(kpart: cute.Tensor, b: Int32, lane: Int32, g: Int32, c: Int32, ch: Int32, rb: Int32,
                 s_cinfo: cute.Tensor, s_cpair: cute.Tensor, mA: cute.Tensor, release: Boolean = False):
        """(one warp, inlined) sum the compute warps' K parts of an item from buffer b, then (with `release`, decoupled)
        give the buffer back on EPI_DONE + b, then SiTU of gate (row g) and up (row g + 8) of the chunk's tokens 2c,
        2c + 1 into a"""
        tot = [kpart[b, 0, lane, r] for r in range(4 * NT)]
        for w_ in cutlass.range_constexpr(1, UP_WARPS):
            for r in cutlass.range_constexpr(4 * NT):
                tot[r] = tot[r] + kpart[b, w_, lane, r]
        if release:
            cute.arch.barrier_arrive(barrier_id=EPI_DONE + b, number_of_threads=CW + 32)
        num = s_cinfo[ch] & INFO_MASK
        p0 = s_cpair[ch]
        for j in cutlass.range_constexpr(NT):  # column tile j: the chunk's tokens 8j + 2c, 8j + 2c + 1
            for x in cutlass.range_constexpr(2):
                if CHUNK * j + 2 * c + x < num:
                    mA[p0 + CHUNK * j + 2 * c + x, rb * UP_ROWS + g] = _situ(tot[4 * j + x], tot[4 * j + 2 + x], BETA,
                                                                             BETA_LIN).to(BFloat16)

    @cute.kernel
    def up_kernel(mF: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                  mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mA: cute.Tensor,
                  mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        ring_w = smem.allocate_tensor(Int32, cute.make_layout((ST, 2 * UP_ROWS, WROW), stride=(W_SLOT // 4, WROW, 1)),
                                      byte_alignment=128)
        ring_s = smem.allocate_tensor(Uint8, cute.make_layout((ST, 2 * UP_ROWS, ROW_SC), stride=(S_SLOT, ROW_SC, 1)),
                                      byte_alignment=128)
        sz = smem.allocate_tensor(Int32, cute.make_layout((CHK, L // 2), stride=(L // 2, 1)), byte_alignment=128)
        kpart = smem.allocate_tensor(Float32, cute.make_layout((NB, UP_WARPS, 32, 4 * NT),
                                                               stride=(UP_WARPS * 128 * NT, 128 * NT, 4 * NT, 1)),
                                     byte_alignment=128)
        s_meta, s_act, s_list, s_cpair, s_cinfo, bars, flag = carve_tables(smem, ST, CHK)
        pbar = bars.iterator + ST
        gW = cute.zipped_divide(ring_w, (1, 1, 4))
        sB = cute.zipped_divide(sz, (1, 4))
        gF = cute.zipped_divide(mF, (1, 4))

        if tid == 0:
            cute.arch.mbarrier_init(pbar, 1)
        ring_init()(bars, ST)  # (thread 0's fence covers pbar too; then a CTA barrier)
        if const_expr(PDL):  # the routing tables and the front's output come from the launches before
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        if tid == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(pbar, TABLE_BYTES)
            bulk_tables(mMeta, mAct, mList, s_meta, s_act, s_list, pbar.toint())
        # while the tables come: this CTA's share of the shared experts' SiTU and of zeroing the latent partial and
        # Σ r² that moe_down adds into
        shared_situ_and_zeroing()(mF, mAsh, mLat, mSsq, bx * THREADS + tid, G * THREADS, sh)
        cute.arch.mbarrier_wait(pbar, 0)
        nact = s_meta[0]
        if warp == UP_WARPS:
            chunk_table()(s_act, s_list, s_cpair, s_cinfo, flag, nact, lane, CHK)
        cute.arch.barrier()
        n = NRB * flag[1]
        lo = (bx * n) // G  # this CTA's run of items, in (chunk, row block) order
        hi = ((bx + 1) * n) // G
        w_base = ring_w.iterator.toint()
        s_base = ring_s.iterator.toint()
        if tid == REFILL:
            for s in cutlass.range_constexpr(ST):
                if lo + s < hi:
                    issue(lo + s, s, s_cinfo, mW1, mS1, mW3, mS3, bars, w_base, s_base)
        g = lane // 4
        c = lane - 4 * g
        cur = Int32(-1)  # the chunk whose z is staged
        for k in cutlass.range(lo, hi):
            i = k - lo
            slot = i % ST
            ch = k // NRB
            rb = k - ch * NRB
            b = i % NB
            if warp < UP_WARPS:
                if ch != cur:  # a new chunk: its tokens' z as bf16 pairs in the mma's B order
                    if const_expr(DEC):  # every compute warp is done with the previous chunk's z
                        cute.arch.barrier(barrier_id=2, number_of_threads=CW)
                    p0 = s_cpair[ch]
                    num = s_cinfo[ch] & INFO_MASK
                    if const_expr(ZPAR):  # rows past the chunk's tokens repeat its last one (their mma columns unused)
                        toks = [mTok[p0 + cutlass.min(Int32(r), num - 1)] for r in range(CHUNK)]
                        for j in cutlass.range_constexpr(ZCOLS):
                            o = tid + CW * j
                            v = [[gF[(None, (toks[r], Z0 // 4 + 2 * o + h))].load() for h in range(2)]
                                 for r in range(CHUNK)]
                            for r in cutlass.range_constexpr(CHUNK):
                                store_b_order(sz, r, o, [v[r][h][e] for h in range(2) for e in range(4)])
                    else:
                        for idx in cutlass.range(tid, num * (L // 8), CW):
                            r = idx // (L // 8)
                            o = idx - r * (L // 8)
                            t = mTok[p0 + r]  # (8 ids, cached after the first thread's load)
                            v0 = gF[(None, (t, Z0 // 4 + 2 * o))].load()
                            v1 = gF[(None, (t, Z0 // 4 + 2 * o + 1))].load()
                            store_b_order(sz, r, o, [v0[0], v0[1], v0[2], v0[3], v1[0], v1[1], v1[2], v1[3]])
                    cute.arch.barrier(barrier_id=2, number_of_threads=CW)
                    cur = ch
                cute.arch.mbarrier_wait(bars.iterator + slot, (i // ST) % 2)
                if const_expr(NT == 1):
                    acc = item_sums(gW, ring_s, sB, slot, warp, g, c, False)
                else:  # 'wupc16': the second column tile only in a chunk of more than 8 tokens (warp-uniform)
                    acc = [Float32(0.0)] * (4 * NT)
                    if (s_cinfo[ch] & INFO_MASK) > CHUNK:
                        acc = item_sums(gW, ring_s, sB, slot, warp, g, c, True)
                    else:
                        acc = item_sums(gW, ring_s, sB, slot, warp, g, c, False) + [Float32(0.0)] * 4
                if const_expr(DEC):
                    # buffer b was last read for item i - 2 (the producer warp's arrival below); then hand over the
                    # sums, which also frees the slot. A warp's next arrival on EPI_READY + b is for item i + 2, after
                    # the producer has synced on this one (its EPI_DONE arrival for item i comes after that sync)
                    if i >= 2:
                        cute.arch.barrier(barrier_id=EPI_DONE + b, number_of_threads=CW + 32)
                    for r in cutlass.range_constexpr(4 * NT):
                        kpart[b, warp, lane, r] = acc[r]
                    cute.arch.barrier_arrive(barrier_id=EPI_READY + b, number_of_threads=CW + 32)
                else:
                    for r in cutlass.range_constexpr(4 * NT):
                        kpart[0, warp, lane, r] = acc[r]
                    cute.arch.barrier(barrier_id=2, number_of_threads=CW)
                    if warp == 0:  # gate (row g) and up (row g + 8) of tokens 2c, 2c + 1: SiTU into a
                        epilogue(kpart, 0, lane, g, c, ch, rb, s_cinfo, s_cpair, mA)
            elif const_expr(DEC):  # the producer warp: the refill, then the item's epilogue
                cute.arch.barrier(barrier_id=EPI_READY + b, number_of_threads=CW + 32)
                if tid == REFILL:
                    if k + ST < hi:
                        cute.arch.fence_view_async_shared()
                        issue(k + ST, slot, s_cinfo, mW1, mS1, mW3, mS3, bars, w_base, s_base)
                epilogue(kpart, b, lane, g, c, ch, rb, s_cinfo, s_cpair, mA, k - lo + 2 < hi - lo)
            if const_expr(not DEC):
                cute.arch.barrier()  # the slot and kpart are free
                if tid == REFILL:
                    if k + ST < hi:
                        cute.arch.fence_view_async_shared()
                        issue(k + ST, slot, s_cinfo, mW1, mS1, mW3, mS3, bars, w_base, s_base)

    @cute.jit
    def up_host(mF: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mA: cute.Tensor,
                mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor, stream):
        up_kernel(mF, mW1, mS1, mW3, mS3, mMeta, mAct, mList, mTok, mA, mAsh, mLat, mSsq).launch(
            grid=(G, 1, 1), block=(THREADS, 1, 1), smem=up_wide_smem_bytes(key), stream=stream, use_pdl=PDL)

    return up_host, expert_up_args(sh)


def parse_wide_options(text: str | None) -> tuple[dict, dict, str | None]:
    """Take the wide kernels' options out of a '-'-joined variant: (MoEUpWideKey fields, MoEDownWideKey fields, the
    rest or None). Options: wsync (both kernels without the decoupled hand-over: a CTA barrier per item), wstN (both
    kernels' ring slots), wupstN / wdownstN (one kernel's), wdownc16 / wupc16 (moe_down / moe_up takes 16 of an
    expert's tokens per item; moe_up then has 2 ring slots unless given), wdownr128 / wdownr256 (moe_down's 128-row items in 3 slots, run 77's / 256-row items in 2, the default),
    wdownpf0 / wdownpf (moe_down reads an item's token ids and weights at its start, the default / during the item
    before), wzpar / wzpar0 (moe_up stages a chunk's z with all its loads in flight / row by row, the default),
    wdownsh8 / wdownsh16 (moe_down's shared items take 8 tokens / 16, the default). They apply above
    `moe_pipe.PIPE_MAX_M` tokens."""
    import re

    up, down, rest = {}, {}, []
    for part in (text or "").split("-"):
        m = re.fullmatch(r"w(up|down)?st(\d+)", part)
        if part == "wsync":
            up["decoupled"] = down["decoupled"] = False
        elif part == "wdownc16":
            down["chunk"] = 2 * CHUNK
        elif part == "wupc16":  # with its own ring depth unless one is given
            up["chunk"], up["stages"] = 2 * CHUNK, up.get("stages", UP_STAGES[2 * CHUNK])
        elif m_sh := re.fullmatch(r"wdownsh(8|16)", part):
            down["shared_tokens"] = int(m_sh.group(1))
        elif m_z := re.fullmatch(r"wzpar([01]?)", part):
            up["z_parallel"] = m_z.group(1) != "0"
        elif m_pf := re.fullmatch(r"wdownpf([01]?)", part):
            down["prefetch_ids"] = m_pf.group(1) != "0"
        elif m_rows := re.fullmatch(r"wdownr(128|256)", part):  # with its own ring depth unless one is given
            rows = int(m_rows.group(1))
            down["rows"], down["stages"] = rows, down.get("stages", DOWN_STAGES[rows])
        elif m:
            for kw in ((up, down) if m.group(1) is None else (up,) if m.group(1) == "up" else (down,)):
                kw["stages"] = int(m.group(2))
        elif part:
            rest.append(part)
    for kw, make, check in ((up, MoEUpWideKey, check_up_key), (down, MoEDownWideKey, check_key)):
        if kw:
            check(make(shapes_for_tp(8), **kw))
    return up, down, "-".join(rest) or None


def wide_variant_name(up: MoEUpWideKey, down: MoEDownWideKey) -> str:
    """'wide', or 'wide@' and the options that differ from the defaults (parse_wide_options' spelling)."""
    parts = []
    if not up.decoupled and not down.decoupled:
        parts.append("wsync")
    down_default = DOWN_STAGES[down.rows]  # (each row count brings its ring depth, each chunk size moe_up's)
    up_default = UP_STAGES[up.chunk]
    default_rows = MoEDownWideKey.rows
    if up.stages == down.stages != up_default and down_default == DOWN_STAGES[default_rows]:
        parts.append(f"wst{up.stages}")
    else:
        if up.stages != up_default:
            parts.append(f"wupst{up.stages}")
        if down.stages != down_default:
            parts.append(f"wdownst{down.stages}")
    if up.chunk != MoEUpWideKey.chunk:
        parts.insert(0, f"wupc{up.chunk}")
    if down.chunk != MoEDownWideKey.chunk:
        parts.append(f"wdownc{down.chunk}")
    if down.shared_tokens != MoEDownWideKey.shared_tokens:
        parts.append(f"wdownsh{down.shared_tokens}")
    if up.z_parallel != MoEUpWideKey.z_parallel:
        parts.append("wzpar" if up.z_parallel else "wzpar0")
    if down.rows != default_rows:
        parts.insert(0, f"wdownr{down.rows}")
    if down.prefetch_ids != MoEDownWideKey.prefetch_ids:
        parts.append("wdownpf" if down.prefetch_ids else "wdownpf0")
    return "wide" + ("@" + "-".join(parts) if parts else "")


# run 77's default (wdownr128-wdownsh8), run 78's (wdownsh8-wdownpf), run 80's (wdownsh8) and the options measured
# against the current one; the 4-slot moe_down forms (wst4, wdownst4) fit 128-row items with 8-token shared items
# only (run 77: no faster)
AOT_WIDE_VARIANTS = ("wsync", "wupst4", "wdownc16", "wdownsh8", "wdownsh8-wdownpf", "wdownr128-wdownsh8", "wdownpf",
                     "wzpar", "wupc16", "wupc16-wdownc16")  # built at TP8 without PDL (as the steps above 8 tokens run)
# TP16's default before run 81 (run 80 timed both there), and moe_up's 16-token chunks
AOT_WIDE_VARIANTS_TP16 = ("wdownsh8-wdownpf", "wupc16")


def _aot_keys(make):
    def keys(arch: str):
        out = [make(shapes_for_tp(tp), pdl=p, arch=arch) for tp in (8, 16) for p in (False, True)]
        for tp, variants in ((8, AOT_WIDE_VARIANTS), (16, AOT_WIDE_VARIANTS_TP16)):
            for v in variants:
                kw = parse_wide_options(v)[0 if make is MoEUpWideKey else 1]
                key = make(shapes_for_tp(tp), pdl=False, arch=arch, **kw)
                if key not in out:
                    out.append(key)
        return out
    return keys


DOWN_WIDE = kc.register(kc.KernelSpec(name="moe_down_wide", module=__name__, key_type=MoEDownWideKey,
                                      build=build_down_wide, aot_keys=_aot_keys(MoEDownWideKey),
                                      ptx_checks=("cp.async.bulk", "mma.sync", "mul.rn.bf16x2", "red.", "shfl.sync.up")))

UP_WIDE = kc.register(kc.KernelSpec(name="moe_up_wide", module=__name__, key_type=MoEUpWideKey, build=build_up_wide,
                                    aot_keys=_aot_keys(MoEUpWideKey),
                                    ptx_checks=("cp.async.bulk", "mma.sync", "mul.rn.bf16x2", "shfl.sync.up")))

__all__ = ["MoEDownWideKey", "MoEUpWideKey", "up_wide_smem_bytes", "parse_wide_options", "wide_variant_name", "WIDE_MIN_TOKENS", "down_wide_smem_bytes", "slot_bytes"]
