"""The MoE half's expert kernels as persistent, bulk-copy pipelined CTAs (`kernels/moe.py` has the rest).

Launches 2 and 3 of the fused MoE half (`docs/fused_moe.md`) read the active experts' MXFP4 bytes:
23 MB (gate/up) and 12 MB (down) at TP8 batch 1. The first versions (`moe.MoEUpKey`, `moe.MoEDownKey`)
gave every (expert, row block) its own CTA: each loads its codes into registers, waits, computes and
exits, and the grid runs in two or three waves whose loads do not overlap the previous wave's
arithmetic (17.8 and 24.4 µs inside the H200 graph against a 5.5 and 5.4 µs floor).

Here one CTA per SM walks a list of work items (expert × row block). One thread streams each item's
contiguous bytes (codes and scales) into a ring of `stages` shared-memory slots with `cp.async.bulk`,
completing an mbarrier per slot; the compute warps work from the slot, then the slot is refilled with
the item `stages` ahead (by an extra warp that does no arithmetic, in the default builds). So each SM keeps up to `stages` items of bytes in flight, independent of
registers, and the arithmetic of one item overlaps the loads of the next ones.

moe_up (MoEUpPipeKey): an item is 8 intermediate rows of one active expert. Its W1 and W3 rows form the
16 rows of an mma.sync m16n8k16 A operand (rows 0..7 gate, 8..15 up), decoded from MXFP4 straight into
bf16 pairs (`mxfp4_decode.decode_pairs`); up to 8 of the expert's tokens are the B columns (z in
bf16). The warps split K (each a set of 128-code super-blocks) and meet in shared memory; the thread
holding (gate, up) of a (row, token) applies SiTU. K is permuted inside every 32-code block so that one
decoded word feeds the mma directly (the same permutation is applied to z): thread c of a quad holds
words 4c..4c+3 of a 16-word super-block (one ld.shared.v4, one scale byte), and mma (b, s) of the
super-block takes codes (s, s+4) and (s+2, s+6) of word 4c+b.
"""

import dataclasses
import functools
from dataclasses import dataclass

from .. import compile as kc
from .moe import D, DONE_FLAG, E, L, PASS_COUNT, ROUTED_FLAG, TOPK, MoEShape, _situ, DOWN_ARG_NAMES, expert_down_args, expert_up_args, rms_sumsq, shapes_for_tp, shared_situ_and_zeroing

# moe_up's compute warp counts: warp w takes super-blocks w, w + warps, ... of a row's 28 (16: warps 0..11 take two,
# 12..15 one, so that each sub-partition, warps w = s mod 4, has 7; with 14 two sub-partitions have 8 and two 6)
UP_WARPS = (7, 14, 16, 28)
RB_UP = 8  # intermediate rows per moe_up item: the mma's A rows 0..7 (W1) and 8..15 (W3)
SB = 128  # codes per super-block (16 words of a row)
H200_SMS = 132
FLUSH_WARPS = 4  # moe_down's flush warps ('fwarp'): a row block's all-reduce read at 8 tokens in one or two round trips
PIPE_MAX_M = 8  # tokens per step of the pipelined kernels (activations and tables live in shared memory);
# more tokens take the direct kernels of kernels/moe.py
PF_CHUNK = 32768  # bytes per L2 prefetch instruction (cp.async.bulk.prefetch.L2)
TRACE_SLOTS = 32  # checkpoints per CTA in a traced build (TRACE_UP / TRACE_DOWN name them)
TRACE_ITEMS = 10  # items whose slot arrival and completion a traced build records
TRACE_UP = ("start", "wait_done", "ring_issued", "staged") + tuple(
    f"item{n}_{w}" for n in range(TRACE_ITEMS) for w in ("arrived", "done"))
TRACE_DOWN = ("start", "ring_issued", "wait_done", "staged") + tuple(
    f"item{n}_{w}" for n in range(TRACE_ITEMS) for w in ("arrived", "done")) + (
    "flush_start", "flush_counted", "allreduce_done", "flusher_end")
# moe_up's traced build also records, for its first WARP_TRACE_ITEMS items, when each compute warp got past the
# slot's mbarrier ('waited') and when it had stored its K partials ('computed'), and when the reducing warp
# (the epilogue warp, or the last compute warp without one) began and ended the item's reduction; these sit
# after the TRACE_SLOTS CTA checkpoints, two per (item, warp), the reducer as warp WARP_TRACE_EPI
WARP_TRACE_ITEMS = 4
WARP_TRACE_EPI = 31  # above every compute warp count (UP_WARPS)
TRACE_BUF = TRACE_SLOTS + WARP_TRACE_ITEMS * 32 * 2  # int64 slots per CTA and clock in the timeline buffer


def warp_trace_slot(n, warp, k):
    """Slot of per-warp checkpoint k (0 waited / began, 1 computed / ended) of item n and warp `warp`."""
    return TRACE_SLOTS + (n * 32 + warp) * 2 + k


def warp_trace_name(slot: int) -> str:
    """The checkpoint name of a per-warp slot (`warp_trace_slot`), e.g. 'item1_w3_computed', 'item0_epi_ended'."""
    n, rest = divmod(slot - TRACE_SLOTS, 64)
    warp, k = divmod(rest, 2)
    if warp == WARP_TRACE_EPI:
        return f"item{n}_epi_{('began', 'ended')[k]}"
    return f"item{n}_w{warp}_{('waited', 'computed')[k]}"
PF_MAX_ACTIVE = 32  # moe_up prefetches the active experts' W2 only up to this many (about 23 MB at TP8);
# more would not stay in the L2 (50 MB on the H100, 60 on the H200) next to moe_up's own bytes


@dataclass(frozen=True)
class MoEUpPipeKey:
    shape: MoEShape
    warps: int = 14  # warps splitting K: L / 128 = 28 super-blocks per row, 28 / warps each
    stages: int = 4  # ring slots (30464 B each at TP8); 6 with one token's activations measured slower (run 14)
    ctas: int = H200_SMS  # persistent CTAs (one per SM)
    pdl: bool = True
    # bring moe_down's bytes into L2 while this launch runs: the shared experts' down projection (before the
    # wait) and, up to PF_MAX_ACTIVE active experts, their W2. Off: measured slower (run 15, docs/fused_moe.md)
    prefetch_down: bool = False
    trace: bool = False  # record per-CTA checkpoints (TRACE_UP) into the timeline buffer (kimi-decode moe --trace)
    # ring slots requested before z is staged; the others after. The staging loads queue behind whatever bulk
    # data is already on its way to the SM: with all 4 slots first (run 13) staging took about 3 µs (run 16)
    early_slots: int = 0  # 1 in run 17's kernels (without the merged prologue, which stages z in the ring)
    # 'pro': the prologue in one round trip. Thread 0 bulk-copies the routing tables and the tokens' z rows
    # (fp32, into the still idle ring) on one mbarrier right after the wait; all threads then convert z to bf16
    # pairs and the whole ring is requested (no slot early: early_slots must be 0). Without it the tables, z and
    # the first slot take three dependent round trips (3.2 µs at batch 1, run 17's trace)
    prologue: bool = True  # run 19: staged 1.4 µs after the wait instead of 3.2
    # 'epi': one more warp that does no arithmetic: after each item's barrier it refills the slot and reduces
    # the compute warps' K partials (double-buffered) into SiTU, while the compute warps go on to the next item
    # (one CTA barrier per item instead of two; the refill and the reduction leave the compute warps' path)
    epilogue_warp: bool = True
    # how each code word is cut into bf16 pairs (`mxfp4_decode.PAIR_CUTS`): 2 takes one of the three integer-ALU
    # ops per pair to the FMA pipe (ncu: the decode's ALU ops and their math-pipe stalls hold most samples, run
    # 22). Run 23: batch 1 70.4 µs against 71.7 (within the spread), batch 8 232.8 against 234.8. 3 cuts each pair
    # with two logic ops and one integer multiply (`mxfp4_decode.SPREAD`). Run 26: an item 2030 cycles against
    # 2150 (moe_down's expert items 1950 against 2220), batch 8 223.0 µs against 225.6, batch 1 within the spread
    decode: int = 3
    # 'pad': each row of a ring slot starts 64 B after the previous one ends (one bulk copy per row instead of
    # one per 8 rows). Unpadded, the 8 rows lie 1792 B apart, on the same banks: the two rows a quarter warp
    # reads conflict, and 45% of moe_up's shared-memory load wavefronts were replays (run 22). Run 23: batch 8
    # 230.4 µs against 234.8, batch 1 unchanged
    pad_rows: bool = True
    # 'zlast' (with 'pro'): z is staged in the ring's last slots (one at up to 2 tokens), so that the slots before
    # them can be requested as soon as the prologue's round trip brings the routing tables, while z is converted
    # and the shared experts' SiTU finishes. Without it the whole ring is requested after the CTA barrier that
    # ends the staging, and the first item's slot arrives one round trip later (about 1 µs at batch 1, run 24's
    # trace: staged 8.9 µs, item 0's slot 9.9 µs)
    z_last: bool = False
    # 'bal' (14 compute warps and the epilogue warp): the super-blocks are split in halves (2 of the 4 words a lane
    # holds) and dealt so that the four sub-partitions (warps w = s mod 4) do equal work: UP_BALANCED_HALVES. With
    # two super-blocks per warp, sub-partitions 0 and 1 (four compute warps each) have 8 and finish about 550
    # cycles after sub-partition 3 (three warps, 6), sub-partition 2 has 6 and the epilogue warp (run 27's
    # per-warp timeline). Measured slower (run 28: batch 8 234.2 µs against 224.9, batch 1 within the spread): a
    # half costs about 180 cycles on a sub-partition against about 120 as half of a whole super-block
    balance: bool = False
    # 'f16' (with the merged prologue, whole super-blocks): each code word is placed as 8 E4M3 values (2 shifts and 4
    # masks, `mxfp4_decode.decode_e4m3`), turned into f16 pairs by cvt (F2FP) and fed to f16 mma.sync m16n8k16; z is
    # staged in f16 times a per-token power of two (its largest |z| in [2^14, 2^15)), 11 significant bits against
    # bf16's 8. The quad of lanes holding a row's 32 k of a group's two chained mma holds one 32-code scale group,
    # so the E8M0 scale is applied once per group and row by FFMA after the mma instead of by 4 packed multiplies per
    # word. sm_90a has no fp8 mma.sync: ptxas makes the same F2FP + f16 HMMA of an m16n8k32 e4m3 mma, and that
    # build (runs 30 and 32, removed) gave wrong, run-to-run varying results (docs/fused_moe.md)
    fp16: bool = False
    # 'zswz' (bf16 path): z's staged rows 4 words longer and their 4-word chunks swizzled (`z_chunk`), so that a
    # quarter warp's 16-byte B loads (4 chunks 16 words apart, and at 5-8 tokens two rows) hit 32 distinct banks:
    # unswizzled, chunks 4c + bb of c = 0, 2 and of c = 1, 3 share banks (2-way), 4-way with two rows
    z_swizzle: bool = False
    # 'fence' (on; fence0 drops it): fence.proxy.async before the bulk copies that refill a ring slot the compute
    # warps have read (and, with 'pro', before the ring's requests after z was read out of it). ptxas makes it
    # MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S, and the membar waits for the issuing thread's own global stores: the
    # epilogue warp's a rows of the previous item, thread 0's share of the shared SiTU and the zeroing. The
    # slot's generic reads are complete before the CTA barrier that precedes every refill (their values are in
    # registers), so a bulk write cannot overtake them: without the fence the refill goes out at once
    proxy_fence: bool = True
    # 'spin': the compute warps wait for an item's slot by polling mbarrier.test_wait instead of the DSL's
    # try_wait loop, which ptxas pairs with NANOSLEEP.SYNCS: the timelines of runs 35-39 show about 470 cycles
    # between an item's barrier and the next slot's wait passing, at batch 1 and 8 alike, in a path of some 40
    # instructions; if that is the sleeping warps' wake-up, polling removes it
    spin_wait: bool = False
    # 'upmaxN' (with 'upstN'): tokens a step may have (z rows staged in shared memory, a table entry each); fewer
    # than PIPE_MAX_M leaves room for more ring slots. Run 40's timeline: an item waits about 455 cycles for its
    # slot although it was requested three items earlier, as if each SM received its ring at about 20 GB/s with 3
    # slots in flight; a fourth in flight tests that
    max_tokens: int = PIPE_MAX_M
    # (with MoEDownPipeKey.flag_wait) at its end each CTA adds 1 to meta[DONE_FLAG] (release), so that moe_down can
    # start on a counter instead of on this grid's completion. 1 ('dflag'): every thread fences (fence.acq_rel.gpu)
    # before the CTA barrier (run 61: the CTAs left 0.6-1.8 µs later, moe_down started later, the step 1.7 µs slower
    # on the H100); 2 ('dflagt'): the CTA barrier, then thread 0 alone fences and adds, as a grid-wide barrier does
    # (the barrier orders the other threads' stores before thread 0's release, which is cumulative). 0: off
    done_flag: int = 0
    # 'uflagN' (with 'zlast' and moe_down's route_reset; the front sets meta[ROUTED_FLAG] once its routing tables
    # are written): thread 0 polls that flag (acquire) at the CTA's start, before griddepcontrol.wait, reads the
    # active-expert count and its first items' experts with plain loads and requests up to N ring slots (not those
    # z takes) at once, instead of after the prologue's round trip that follows the wait (run 64's timeline: the
    # ring requested 1.0 µs after the wait and its first slot landing 1.9 µs later, item 0 2.9 µs after the wait).
    # 0: off
    route_early: int = 0
    # (set by MoEExpertsPipeKey, 'merge') moe_up as the first phase of the merged expert kernel, whose CTAs have this
    # many threads (moe_down's); its buffers carved from one block that moe_down's phase then reuses. 0: its own launch
    merged_threads: int = 0
    # 'l2h': the ring's bulk copies of W1/W3 and their scales carry an L2 evict_first policy (bytes read once per
    # step), so that what the step brings into L2 for later (moe_down's prefetch of the tail's W_up rows, evict_last)
    # is not the first to go. False: the default policy
    l2_hints: bool = False
    # 'shup' (one token; upmax2: two; the front without the shared rows, `moe.MoEFrontKey.shared_rows`): moe_up
    # streams the shared experts' gate/up rows itself, one gate and one up row (bf16, K = D) an item, through its
    # ring ahead of the expert items. They read only x and weights, so each CTA requests its first slots and x
    # (staged once) before griddepcontrol.wait; the compute warps split the row's K and sum on CUDA cores, the
    # epilogue warp finishes the sum and writes a_shared. The front GEMV loses 22 MB (at TP8) that moe_up, bound by
    # its items' instruction issue at about two thirds of the copy bandwidth, streams beside its expert items and
    # through its start (the wait, the routing tables, z). z is staged by plain loads (the ring is busy)
    shared_up: bool = False
    # ('shupiN', with shared_up) each CTA's own items in an interleaved order: N shared items first (they cover the
    # wait, the tables and z), then an expert item and a shared item by turns, so that the shared rows stream while
    # the expert items' decode keeps the warps busy; the rest of whichever list is longer at the end. 0 ('shup'): the
    # shared items first, dealt round-robin over the CTAs as one list with the expert items after them (run 70)
    shared_lead: int = 0
    # ('shfrontK', with shared_up) the front GEMV keeps the gate and up rows of the first K shared columns
    # (`moe.MoEFrontKey.shared_keep`), whose SiTU moe_up's prologue computes from the front's output as without
    # 'shup'; moe_up streams the other S - K as its shared items. Run 70 put the shared rows' bytes in moe_up at
    # about its own rate: only the share that its spare bandwidth absorbs beside the expert items is free. 0: none
    shared_front: int = 0
    arch: str = "sm_90a"

    @property
    def balanced(self) -> bool:
        """Whether the build deals half super-blocks ('bal'); refused where it does not apply."""
        if self.balance and not (self.warps == len(UP_BALANCED_HALVES) and self.epilogue_warp):
            raise ValueError(f"balance deals half super-blocks over {len(UP_BALANCED_HALVES)} compute warps and the "
                             f"epilogue warp: not with warps={self.warps}, epilogue_warp={self.epilogue_warp}")
        return self.balance

    @property
    def row_pad(self) -> int:
        """Words of padding after each ring row: 'f16' reads one word per lane (rows 4 banks apart), the bf16 path a
        quarter warp's 16-byte loads (UP_ROW_PAD)."""
        if not self.pad_rows:
            return 0
        return UP_ROW_PAD_F16 if self.fp16 else UP_ROW_PAD

    @property
    def z_row_words(self) -> int:
        """Words from one token's staged z row to the next: L/2 (bf16 pairs, or with 'f16' f16 pairs) and the
        padding of 'f16' (F16_Z_PAD) or 'zswz' (Z_SWIZZLE_PAD)."""
        return L // 2 + (F16_Z_PAD if self.fp16 else Z_SWIZZLE_PAD if self.z_swizzle else 0)


# 'bal': half super-blocks per compute warp (14 warps): sub-partitions 0 and 1 take 15 halves, 2 (which also runs the
# epilogue warp) 12, 3 14: of a row's 56 halves, warp w takes the UP_BALANCED_HALVES[w] after those of warps < w
UP_BALANCED_HALVES = (4, 4, 4, 5, 4, 4, 4, 5, 4, 4, 4, 4, 3, 3)

SHUP_MAX_M = 2  # 'shup': tokens its builds take (x staged in shared memory beside the ring; partials per lane)
SHARED_FRONT_STEP = 8  # 'shfrontK': K in steps of the front GEMV's rows per CTA (8 at m_tile 2 and above)


def shared_order_item(n, ns, ne, bx, lead, ctas, nshi, imin=min, imax=max, flag=int, zero=0):
    """('shupiN') CTA bx's n-th item (0 <= n < ns + ne) in the interleaved order, as a virtual item index: its k-th
    shared item (bx + k·ctas) is bx + k·ctas, its k-th expert item is nshi + bx + k·ctas. ns, ne: the CTA's shared and
    expert item counts. `lead` shared items first, then (expert, shared) by turns, then the rest of the longer list.
    Branch-free integer arithmetic (0/1 flags select), so that the kernel traces the same function on its Int32
    values (imin, imax, flag: cutlass.min, cutlass.max, Int32) that the CPU tests run on Python ints."""
    P = imin(flag(lead), ns)
    a = imax(imin(ne, ns - P), zero)  # alternating (expert, shared) pairs
    m = n - P
    t_lead = flag(n < P)
    t_alt = flag(m < 2 * a)
    half = m >> 1
    rest = m - 2 * a
    is_sh = t_lead + (1 - t_lead) * (t_alt * (m & 1) + (1 - t_alt) * flag(ne <= a))
    k_sh = t_lead * n + (1 - t_lead) * (P + t_alt * half + (1 - t_alt) * (a + rest))
    k_e = t_alt * half + (1 - t_alt) * (a + rest)
    k = is_sh * k_sh + (1 - is_sh) * k_e
    return bx + k * ctas + (1 - is_sh) * nshi


UP_ROW_PAD = 16  # words of padding after each ring row ('pad'): row g's quad c lands on bank group 4g + c mod 8
UP_ROW_PAD_F16 = 4  # with 'f16' lane (g, c) reads one word of row g: rows 452 words apart put it on bank 4g + c
Z_SWIZZLE_PAD = 4  # 'zswz': words after each staged z row (bf16 path): the second row of a quarter warp 4 banks on
F16_Z_PAD = 16  # words after each token's f16 z row ('f16'): a quarter warp's 16-byte loads of two rows on 32 banks
# 'f16': the codes of a word each B register of a group's two mma holds (mma 1: b0, b1; mma 2: b0, b1), matching the A
# halves: mma 1 takes bytes 0, 1 of decode_e4m3's even and odd registers, mma 2 bytes 2, 3 (tests/test_mxfp4.py)
F16_B_PAIRS = ((0, 2), (1, 3), (4, 6), (5, 7))


_RING_INIT = None


def _hint(on: bool, hint: str):
    """the L2 priority an 'l2h' copy or prefetch carries (`ptx_ops.L2_HINTS`), or None (the default policy)"""
    return hint if on else None


def ring_init():
    """`@cute.jit` ring_init()(bars, ST): thread 0 arms the ring's ST mbarriers (one arrival each: the thread
    that issues a slot's bulk copies), then a CTA barrier."""
    global _RING_INIT
    if _RING_INIT is None:
        import cutlass
        import cutlass.cute as cute
        from cutlass import Constexpr

        @cute.jit
        def init(bars: cute.Tensor, ST: Constexpr):
            tid, _, _ = cute.arch.thread_idx()
            if tid == 0:
                for s in cutlass.range_constexpr(ST):
                    cute.arch.mbarrier_init(bars.iterator + s, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.barrier()

        _RING_INIT = init
    return _RING_INIT


class SmemCarve:
    """(traced inline; the merged expert kernel, `MoEExpertsPipeKey`) tensors carved out of one raw shared-memory
    block at offsets fixed at trace time, so that moe_up's phase and moe_down's phase lay their buffers over the
    same bytes (SmemAllocator gives every allocation its own). `end` is the bytes used so far."""

    def __init__(self, raw, limit: int):
        self.base, self.limit, self.end = raw.iterator.toint(), limit, 0

    def allocate_tensor(self, dtype, layout, byte_alignment: int = 16):
        import cutlass.cute as cute

        self.end = -(-self.end // byte_alignment) * byte_alignment
        ptr = cute.make_ptr(dtype, self.base + self.end, cute.AddressSpace.smem, assumed_align=byte_alignment)
        self.end += cute.cosize(layout) * dtype.width // 8
        assert self.end <= self.limit, f"the merged kernel's phases need {self.end} B of shared memory, {self.limit} given"
        return cute.make_tensor(ptr, layout)


def carve_tables(smem, max_tokens: int):
    """(traced inline) meta and the routing tables (active experts, their (offset, count), the grouped token ids), the
    first buffers of both phases of the merged kernel, at the same offsets: moe_down's phase reads what moe_up's
    prologue staged. Returns (s_meta, s_act, s_list, s_tok)."""
    import cutlass.cute as cute
    from cutlass import Int32

    s_meta = smem.allocate_tensor(Int32, cute.make_layout((4,)), byte_alignment=16)
    s_act = smem.allocate_tensor(Int32, cute.make_layout((E,)), byte_alignment=16)
    s_list = smem.allocate_tensor(Int32, cute.make_layout((E, 2), stride=(2, 1)), byte_alignment=16)
    s_tok = smem.allocate_tensor(Int32, cute.make_layout((TOPK * max_tokens,)), byte_alignment=16)
    return s_meta, s_act, s_list, s_tok


def stamp(mTrace, bx, c):
    """(traced inline, one thread) record checkpoint c of CTA bx: mTrace[bx, 0, c] = %globaltimer (ns),
    mTrace[bx, 1, c] = %clock64. The last slot (TRACE_SLOTS - 1) is the CTA's end."""
    from .ptx_ops import timestamps

    ns, clk = timestamps()()
    mTrace[bx, 0, c] = ns
    mTrace[bx, 1, c] = clk


def trace_arg():
    """Compile-time stand-in of the pipelined kernels' timeline buffer: Int64 [CTAs, 2, TRACE_BUF] (written
    only by builds with trace=True)."""
    import cutlass.cute as cute
    from cutlass import Int64

    return cute.runtime.make_fake_compact_tensor(Int64, (H200_SMS, 2, TRACE_BUF), stride_order=(2, 1, 0),
                                                 assumed_align=16)


def store_f16_order(dst, row, o, v, scale):
    """(traced inline; 'f16') Store 8 consecutive fp32 values v (codes 8o .. 8o + 7 of a K row) times `scale` as the
    f16 pairs of a group's two mma's B operands: words 4o .. 4o + 3 of dst[row] = codes F16_B_PAIRS."""
    from .ptx_ops import pack_f16x2

    pack = pack_f16x2()
    for q, (a, b) in enumerate(F16_B_PAIRS):
        dst[row, 4 * o + q] = pack(v[a] * scale, v[b] * scale)


def z_chunk(j, swizzle=False):
    """(traced inline) Where 4-word chunk j of a staged activation row lies: j itself, or with 'zswz' j with bit 1
    flipped when bit 3 is set, so that the chunks a quad reads (4c + bb, c = 0..3: 16 words apart, two bank groups)
    lie in four."""
    return j ^ (((j >> 3) & 1) << 1) if swizzle else j


def store_b_order(dst, row, o, v, swizzle=False):
    """(traced inline) Store 8 consecutive fp32 values v (codes 8o .. 8o + 7 of a K row) as the bf16 pairs an
    mma.sync B operand takes in the permuted K order: words 4o .. 4o + 3 of dst[row] = (0,4) (2,6) (1,5) (3,7)
    (chunk o moved by `z_chunk` with `swizzle`)."""
    from .ptx_ops import pack_bf16x2

    pack = pack_bf16x2()
    o = z_chunk(o, swizzle)
    for w, (a, b) in enumerate(((0, 4), (2, 6), (1, 5), (3, 7))):
        dst[row, 4 * o + w] = pack(v[a], v[b])


_TABLES = None


def stage_routing_tables():
    """`@cute.jit` stage_routing_tables()(mAct, mList, mTok, s_act, s_list, s_tok, nact, M, THREADS): copy the
    routing's expert-major tables (active experts, their (offset, count), the grouped token ids) into shared
    memory, all threads of the CTA; the caller synchronises."""
    global _TABLES
    if _TABLES is None:
        import cutlass
        import cutlass.cute as cute
        from cutlass import Constexpr

        @cute.jit
        def stage(mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, s_act: cute.Tensor,
                  s_list: cute.Tensor, s_tok: cute.Tensor, nact, M, THREADS: Constexpr):
            tid, _, _ = cute.arch.thread_idx()
            for idx in cutlass.range(tid, nact, THREADS):
                s_act[idx] = mAct[idx]
                s_list[idx, 0] = mList[idx, 0]
                s_list[idx, 1] = mList[idx, 1]
            for idx in cutlass.range(tid, M * TOPK, THREADS):
                s_tok[idx] = mTok[idx]

        _TABLES = stage
    return _TABLES


def bulk_routing_tables(mMeta, mAct, mList, mTok, s_meta, s_act, s_list, s_tok, M, bar):
    """(one thread, traced inline; the 'pro' prologues) bulk-copy meta and the routing tables (active experts,
    their (offset, count) lists, the M tokens' grouped ids) into shared memory, completing on mbarrier address
    `bar`; returns the bytes they bring, for the caller's expect_tx."""
    from .ptx_ops import bulk_g2s

    bulk = bulk_g2s()
    bulk(s_meta.iterator.toint(), mMeta.iterator.toint(), 16, bar)
    bulk(s_act.iterator.toint(), mAct.iterator.toint(), E * 4, bar)
    bulk(s_list.iterator.toint(), mList.iterator.toint(), E * 8, bar)
    bulk(s_tok.iterator.toint(), mTok.iterator.toint(), M * (TOPK * 4), bar)


def routing_table_bytes(M, per_token: int = 0):
    """Bytes `bulk_routing_tables` brings for M tokens, plus `per_token` more bytes per token that the caller
    copies on the same mbarrier."""
    return 16 + E * 12 + M * (TOPK * 4 + per_token)


def superblock_mma(acc, wa, wb, sa, sb, sB, col, v0, decode=1, bbs=(0, 4), swizzle=False):
    """(traced inline) One lane's share of a 128-code super-block: acc += A·B over 8 mma.sync m16n8k16, A rows
    g and g+8 from the 4 code words wa, wb (scale pairs sa, sb) decoded to bf16 pairs, B from the staged
    activations sB (pairs in the mma's B order) of column `col`, 8-code groups v0..v0+3. `bbs`: the words
    (of 4) this call takes (a K split inside the super-block); `decode`: the pair decode's version; `swizzle`: the
    activations were staged with `z_chunk`'s swizzle."""
    from .mxfp4_decode import decode_pairs
    from .ptx_ops import mma_bf16

    pairs, mma = decode_pairs(decode), mma_bf16()
    for bb in range(*bbs):
        b = sB[(None, (col, z_chunk(v0 + bb, swizzle)))].load()
        pa = pairs(wa[bb], sa)
        pb = pairs(wb[bb], sb)
        for s in range(2):
            acc = mma([pa[s], pb[s], pa[s + 2], pb[s + 2]], [b[2 * s], b[2 * s + 1]], acc)
    return acc


SMEM_BUDGET = 227 * 1024 - 2048  # dynamic shared memory a CTA may take on the H200, less static and slack


def _up_stage_bytes(shape: MoEShape, pad_words: int = 0) -> int:
    return RB_UP * (L // 8 + pad_words) * 4 * 2 + RB_UP * (L // 32) * 2


def _up_fixed_bytes(key: MoEUpPipeKey) -> int:
    n = key.max_tokens
    tables = 4 * (3 * E + TOPK * n)
    z = n * key.z_row_words * 4 + (n * 8 if key.fp16 else 0)  # 'f16': the per-token scales
    return z + tables + key.warps * 32 * 4 * 4 + 512


def up_pipe_smem_bytes(key: MoEUpPipeKey) -> int:
    extra = (64 if key.prologue else 0) + (key.warps * 32 * 4 * 4 if key.epilogue_warp else 0)
    if key.shared_up:  # 'shup': x (bf16) and its mbarrier
        extra += key.max_tokens * D * 2 + 16
    return key.stages * (_up_stage_bytes(key.shape, key.row_pad) + 8) + _up_fixed_bytes(key) + extra


def build_up_pipe(key: MoEUpPipeKey):
    """(host function, compile-time arguments) of moe_up's own launch."""
    return _build_up(key)[:2]


def _build_up(key: MoEUpPipeKey):
    """(host function, compile-time arguments, `up_main`): up_main(<up_kernel's tensors>, raw) is the kernel's body as
    a `@cute.jit` function, which the merged expert kernel inlines as its first phase (raw: the shared-memory block
    its buffers are carved from; unused in moe_up's own launch)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Int64, Uint8, const_expr

    from .mxfp4_decode import scale_pair
    from .ptx_ops import bulk_g2s, bulk_prefetch_l2, mbar_inval, mbar_spin_wait

    sh = key.shape
    I = sh.inter
    spin, inval = mbar_spin_wait(), mbar_inval()
    WARPS, ST, G, PDL = key.warps, key.stages, key.ctas, key.pdl
    MXT = key.max_tokens
    assert 1 <= MXT <= PIPE_MAX_M
    EPI, PRO, FENCE = key.epilogue_warp, key.prologue, key.proxy_fence
    MERGED = key.merged_threads > 0  # the merged kernel's first phase: its CTAs have moe_down's threads
    THREADS = key.merged_threads if MERGED else 32 * (WARPS + int(EPI))  # the epilogue warp, if any, is warp WARPS
    assert not MERGED or THREADS >= 32 * (WARPS + int(EPI))
    NSB = L // SB
    assert I % RB_UP == 0 and WARPS in UP_WARPS and NSB % 4 == 0
    SBW = -(-NSB // WARPS)  # super-blocks of the busiest warp; the last round only for warps with sb < NSB
    BAL = key.balanced
    if BAL:
        assert WARPS == len(UP_BALANCED_HALVES) and EPI and sum(UP_BALANCED_HALVES) == 2 * NSB
        HSTART = tuple(sum(UP_BALANCED_HALVES[:w]) for w in range(WARPS))
        HMIN, HMAX = min(UP_BALANCED_HALVES), max(UP_BALANCED_HALVES)
    WROW = L // 8  # int32 words (8 codes each) per row
    SROW = L // 32  # scale bytes per row
    NRB = I // RB_UP
    W_BYTES = RB_UP * WROW * 4
    PAD = key.pad_rows
    F16 = key.fp16
    ZSW = key.z_swizzle
    assert not (ZSW and (F16 or not PRO)), "zswz swizzles the bf16 path's z, staged by the merged prologue"
    assert not F16 or (PRO and not BAL and NSB % WARPS == 0), \
        "f16 stages z in the merged prologue and gives every compute warp the same number of whole super-blocks"
    PADW = key.row_pad
    WROWP = WROW + PADW  # words from one ring row to the next
    WS_BYTES = RB_UP * WROWP * 4  # a slot's W1 (or W3) rows in shared memory
    S_BYTES = RB_UP * SROW
    STAGE_BYTES = 2 * W_BYTES + 2 * S_BYTES
    assert W_BYTES % 16 == 0 and S_BYTES % 16 == 0
    Z0, BETA, BETA_LIN = sh.z0, sh.beta, sh.beta_lin
    bulk, pf = bulk_g2s(), bulk_prefetch_l2()
    bulk_ring = functools.partial(bulk, hint=_hint(key.l2_hints, "evict_first"))  # z and the tables: plain
    PF = key.prefetch_down
    TR = key.trace
    EARLY = key.early_slots
    assert 0 <= EARLY <= ST
    NB = 2 if EPI else 1  # buffers of the K partials
    DFLAG = key.done_flag
    assert DFLAG in (0, 1, 2)
    ZL = key.z_last
    SLOT_W = 2 * WS_BYTES  # bytes of a slot's W1 and W3 rows: z (fp32) fills whole slots from the ring's end
    assert PRO or not ZL, "z_last stages z in the ring: it needs the merged prologue"
    RE = key.route_early
    assert 0 <= RE < ST and (RE == 0 or ZL), "uflag requests ring slots before z is staged: it needs zlast"
    assert not (RE and key.done_flag), "uflag and dflag share a word of meta (moe.ROUTED_FLAG): not both"
    for m_ in range(1, MXT + 1):  # the last slot's last row has no padding after it: z must end before it
        assert -(-m_ * L * 4 // SLOT_W) * SLOT_W - PADW * 4 >= m_ * L * 4
    if PRO:
        assert EARLY == 0, "the merged prologue stages z in the ring: no slot may be requested before it"
        assert ST * 2 * W_BYTES >= MXT * L * 4, "the ring must hold PIPE_MAX_M tokens' fp32 z"
    F_ROW = sh.ncat * 4  # bytes per token row of the front kernel's output
    assert F_ROW % 16 == 0 and (Z0 * 4) % 16 == 0 and (L * 4) % 16 == 0
    W2_BYTES, S2_BYTES, SD_BYTES = L * I // 2, L * I // 32, D * sh.shared * 2  # one expert's W2, its scales; shared down
    PF_W, PF_S = -(-W2_BYTES // PF_CHUNK), -(-S2_BYTES // PF_CHUNK)
    PF_E = PF_W + PF_S  # prefetch chunks per active expert
    PF_SD = -(-SD_BYTES // PF_CHUNK)
    assert W2_BYTES % 16 == 0 and S2_BYTES % 16 == 0 and SD_BYTES % 16 == 0
    SHUP = key.shared_up
    KEEP = key.shared_front  # ('shfrontK') shared columns the front computed: their SiTU in the prologue
    assert KEEP == 0 or (SHUP and 0 < KEEP < sh.shared), "shared_front: a share of the shared rows of 'shup'"
    NSHI = sh.shared - KEEP if SHUP else 0  # 'shup': shared items (one gate and one up row each: column KEEP + item)
    LEAD = key.shared_lead
    assert LEAD == 0 or (SHUP and LEAD >= 1), "shared_lead orders the shared items of 'shup'"
    SH_BYTES = D * 2  # one shared gate (or up) row, bf16
    WS_WORDS = RB_UP * WROWP  # a slot's W1 (or W3) part in words: a shared item's gate (or up) row
    if SHUP:
        assert PRO and EPI and not (ZL or RE or F16 or BAL or PF or MERGED or DFLAG or EARLY), \
            "shup: the merged prologue and the epilogue warp; not with zlast, uflag, f16, bal, pf, merge or dflag"
        assert 1 <= MXT <= SHUP_MAX_M and SH_BYTES <= WS_BYTES and NSB % WARPS == 0
        assert D // 8 == 64 * WARPS, "shup: two 16-byte chunks of a shared row per lane of each compute warp"

    def issue(item, slot, mAct, mW1, mS1, mW3, mS3, bars, w_base, s_base):
        """(one thread, traced inline) stream item's W1/W3 rows and scales into ring slot `slot`"""
        j = item // NRB
        row = mAct[j] * I + (item - j * NRB) * RB_UP
        bar = bars.iterator + slot
        cute.arch.mbarrier_arrive_and_expect_tx(bar, STAGE_BYTES)
        b = bar.toint()
        dw = w_base + slot * (2 * WS_BYTES)
        ds = s_base + slot * (2 * S_BYTES)
        if PAD:  # a bulk copy per row, each row to its padded place
            for r in range(RB_UP):
                bulk_ring(dw + r * (WROWP * 4), mW1.iterator.toint() + Int64(row + r) * (WROW * 4), WROW * 4, b)
                bulk_ring(dw + WS_BYTES + r * (WROWP * 4), mW3.iterator.toint() + Int64(row + r) * (WROW * 4),
                          WROW * 4, b)
        else:
            bulk_ring(dw, mW1.iterator.toint() + Int64(row) * (WROW * 4), W_BYTES, b)
            bulk_ring(dw + W_BYTES, mW3.iterator.toint() + Int64(row) * (WROW * 4), W_BYTES, b)
        bulk_ring(ds, mS1.iterator.toint() + Int64(row) * SROW, S_BYTES, b)
        bulk_ring(ds + S_BYTES, mS3.iterator.toint() + Int64(row) * SROW, S_BYTES, b)

    def issue_shared(item, slot, mWsh, bars, w_base):
        """(one thread, traced inline; 'shup') stream shared item `item`'s gate row and up row (bf16) into ring slot
        `slot`, where an expert item's W1 and W3 rows go"""
        bar = bars.iterator + slot
        cute.arch.mbarrier_arrive_and_expect_tx(bar, 2 * SH_BYTES)
        b = bar.toint()
        dw = w_base + slot * (2 * WS_BYTES)
        bulk_ring(dw, mWsh.iterator.toint() + Int64(item + KEEP) * SH_BYTES, SH_BYTES, b)
        bulk_ring(dw + WS_BYTES, mWsh.iterator.toint() + Int64(item + KEEP + sh.shared) * SH_BYTES, SH_BYTES, b)

    def shup_virtual(n, ns, ne, bx):
        """(traced inline; 'shupiN') `shared_order_item` on the kernel's Int32 values"""
        return shared_order_item(n, ns, ne, bx, LEAD, G, NSHI, cutlass.min, cutlass.max, Int32, Int32(0))

    @cute.jit
    def stage_z_plain(mF: cute.Tensor, sz: cute.Tensor, tid: Int32):
        """(all threads, inlined) every token's z from the front's fp32 output by plain loads into shared memory as
        bf16 pairs in the mma's B order (without the merged prologue, and with 'shup', whose ring is busy)"""
        M = mF.shape[0]
        gF = cute.zipped_divide(mF, (1, 4))
        for idx in cutlass.range(tid, M * (L // 8), THREADS):
            t = idx // (L // 8)
            o = idx - t * (L // 8)
            z0 = gF[(None, (t, Z0 // 4 + 2 * o))].load()
            z1 = gF[(None, (t, Z0 // 4 + 2 * o + 1))].load()
            store_b_order(sz, t, o, [z0[k] for k in range(4)] + [z1[k] for k in range(4)])

    @cute.jit
    def issue_virtual(v: Int32, slot, mAct: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor,
                      mS3: cute.Tensor, mWsh: cute.Tensor, bars: cute.Tensor, w_base, s_base):
        """(one thread; 'shup') request virtual item v into ring slot `slot`: shared item v below NSHI, expert item
        v - NSHI above"""
        if v < NSHI:
            issue_shared(v, slot, mWsh, bars, w_base)
        else:
            issue(v - NSHI, slot, mAct, mW1, mS1, mW3, mS3, bars, w_base, s_base)

    @cute.jit
    def stage_prologue_shup(mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor,
                            mF: cute.Tensor, s_meta: cute.Tensor, s_act: cute.Tensor, s_list: cute.Tensor,
                            s_tok: cute.Tensor, sz: cute.Tensor, pbar: cute.Tensor, mAsh: cute.Tensor,
                            mLat: cute.Tensor, mSsq: cute.Tensor, bx: Int32, tid: Int32):
        """(all threads, inlined; 'shup', after the wait) thread 0 bulk-copies meta and the routing tables on one
        mbarrier; meanwhile the zeroing and every token's z (plain loads of the front's fp32 output: the ring is
        streaming the shared items) to bf16 pairs in the mma's B order. Returns the number of active experts."""
        M = mF.shape[0]
        pb = pbar.iterator
        if tid == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(pb, routing_table_bytes(M))
            bulk_routing_tables(mMeta, mAct, mList, mTok, s_meta, s_act, s_list, s_tok, M, pb.toint())
        # the zeroing, and ('shfrontK') the SiTU of the columns whose rows the front kept
        shared_situ_and_zeroing()(mF, mAsh, mLat, mSsq, bx * THREADS + tid, G * THREADS, sh, False, KEEP)
        stage_z_plain(mF, sz, tid)
        cute.arch.mbarrier_wait(pb, 0)
        return s_meta[0]

    @cute.jit
    def slot_wait(bars: cute.Tensor, slot: Int32, n: Int32, mTrace: cute.Tensor, bx: Int32, tid: Int32, lane: Int32,
                  warp: Int32):
        """(a compute warp) wait for item n's ring slot; the timeline build stamps the arrival (thread 0) and the
        warp's pass (its lane 0)"""
        if const_expr(key.spin_wait):
            spin((bars.iterator + slot).toint(), (n // ST) % 2)
        else:
            cute.arch.mbarrier_wait(bars.iterator + slot, (n // ST) % 2)
        if const_expr(TR):
            if tid == 0 and n < TRACE_ITEMS:
                stamp(mTrace, bx, 4 + 2 * n)
            if lane == 0 and n < WARP_TRACE_ITEMS:
                stamp(mTrace, bx, warp_trace_slot(n, warp, 0))

    @cute.jit
    def shared_partials(gR: cute.Tensor, gX: cute.Tensor, red: cute.Tensor, slot: Int32, buf: Int32, warp: Int32,
                        lane: Int32):
        """(a compute warp; 'shup') the warp's K share of a shared item's gate and up rows against each token's x:
        two 16-byte chunks of each row per lane (chunks 64·warp + lane and + 32), bf16 pairs split to fp32 by a shift
        and a mask; the lane's partials (gate of tokens 0..MXT-1, then up) into red[buf, warp, lane, :]"""
        from .ptx_ops import as_f32

        asf = as_f32()
        acc = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
        for h in cutlass.range_constexpr(2):
            q = warp * 64 + 32 * h + lane
            gw = gR[(None, (slot, 0, q))].load()
            uw = gR[(None, (slot, 1, q))].load()
            for tt in cutlass.range_constexpr(MXT):
                xw = gX[(None, (tt, q))].load()
                for k in cutlass.range_constexpr(4):
                    xl, xh = asf(xw[k] << 16), asf(xw[k] & Int32(-65536))
                    acc[tt] = acc[tt] + asf(gw[k] << 16) * xl + asf(gw[k] & Int32(-65536)) * xh
                    acc[MXT + tt] = acc[MXT + tt] + asf(uw[k] << 16) * xl + asf(uw[k] & Int32(-65536)) * xh
        for r in cutlass.range_constexpr(4):
            red[buf, warp, lane, r] = acc[r]

    @cute.jit
    def shared_epilogue(red: cute.Tensor, buf: Int32, lane: Int32, item: Int32, mAsh: cute.Tensor, M: Int32):
        """(the epilogue warp; 'shup') the compute warps' partials summed, then over the lanes: lane t < M writes
        token t's a_shared[KEEP + item] = SiTU(gate, up)"""
        tot = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
        for w_ in cutlass.range_constexpr(WARPS):
            for r in cutlass.range_constexpr(2 * MXT):
                tot[r] = tot[r] + red[buf, w_, lane, r]
        for r in cutlass.range_constexpr(2 * MXT):
            for o_ in cutlass.range_constexpr(5):
                tot[r] = tot[r] + cute.arch.shuffle_sync_bfly(tot[r], offset=16 >> o_)
        if lane < M:
            gate, up_ = tot[0], tot[MXT]
            if const_expr(MXT == 2):
                gate = cutlass.select_(lane == 1, tot[1], gate)
                up_ = cutlass.select_(lane == 1, tot[3], up_)
            mAsh[lane, item + KEEP] = _situ(gate, up_, BETA, BETA_LIN).to(BFloat16)

    def store_partials(red, buf, warp, lane, accs):
        """(a compute warp, traced inline) its K partials of an item: the sum of its accumulators, into red[buf]"""
        for r in range(4):
            v = accs[0][r]
            for q in range(1, len(accs)):
                v = v + accs[q][r]
            red[buf, warp, lane, r] = v

    @cute.jit
    def expert_partials(gW: cute.Tensor, ring_s: cute.Tensor, gZ: cute.Tensor, red: cute.Tensor, slot: Int32,
                        buf: Int32, warp: Int32, lane: Int32, g: Int32, c: Int32, t: Int32):
        """(a compute warp) an expert item's K partials (B column: token t): one accumulator per super-block, which
        makes independent mma chains; the last round only for the warps with a super-block left (sb < NSB)"""
        accs = []
        for q in cutlass.range_constexpr(SBW):
            acc = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
            sb = warp + WARPS * q
            if const_expr(WARPS * (q + 1) <= NSB):  # every warp has this round's super-block
                accs.append(up_superblock(acc, gW, ring_s, gZ, slot, g, c, sb, t))
            else:  # only the first NSB - WARPS * q warps
                if sb < NSB:
                    acc = up_superblock(acc, gW, ring_s, gZ, slot, g, c, sb, t)
                accs.append(acc)
        store_partials(red, buf, warp, lane, accs)

    @cute.jit
    def expert_epilogue(red: cute.Tensor, buf: Int32, lane: Int32, g: Int32, c: Int32, off: Int32, num: Int32,
                        i0: Int32, mA: cute.Tensor, s_zsc: cute.Tensor, s_tok: cute.Tensor):
        """(the reducing warp) an expert item's partials summed over the compute warps into SiTU -> a rows
        off + 2c, off + 2c + 1 (the item's tokens), column i0 + g ('f16': times each token's 2^k first)"""
        tot = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
        for w_ in cutlass.range_constexpr(WARPS):
            for r in cutlass.range_constexpr(4):
                tot[r] = tot[r] + red[buf, w_, lane, r]
        for x_ in cutlass.range_constexpr(2):  # (gate, up) of the item's tokens 2c and 2c + 1
            tk = 2 * c + x_
            if tk < num:
                gate, up_ = tot[x_], tot[2 + x_]
                if const_expr(F16):  # times the token's 2^k
                    sc = s_zsc[MXT + s_tok[off + tk]]
                    gate, up_ = gate * sc, up_ * sc
                mA[off + tk, i0 + g] = _situ(gate, up_, BETA, BETA_LIN).to(BFloat16)

    @cute.jit
    def stage_prologue_up(mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor,
                          mF: cute.Tensor, s_meta: cute.Tensor, s_act: cute.Tensor, s_list: cute.Tensor,
                          s_tok: cute.Tensor, ring_w: cute.Tensor, sz: cute.Tensor, pbar: cute.Tensor,
                          mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor, bx: Int32, tid: Int32,
                          mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor, bars: cute.Tensor,
                          w_base, s_base, nz, s_zsc: cute.Tensor, e0):
        """(all threads, inlined; 'pro') thread 0 bulk-copies meta, the routing tables and every token's z row
        (fp32, into the idle ring: its first slots, or with 'zlast' its last `nz`) on one mbarrier; meanwhile the
        shared experts' SiTU and the zeroing; with 'zlast' thread 0 then requests the slots before z's; then z
        to bf16 pairs in the mma's B order ('uflag': slots below e0 were requested before the wait). Returns the
        number of active experts."""
        M = mF.shape[0]
        pb = pbar.iterator
        zbase = ring_w.iterator + (ST - nz) * (2 * RB_UP * WROWP) if ZL else ring_w.iterator
        if tid == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(pb, routing_table_bytes(M, per_token=L * 4))
            b = pb.toint()
            bulk_routing_tables(mMeta, mAct, mList, mTok, s_meta, s_act, s_list, s_tok, M, b)
            for t in cutlass.range(M):
                bulk(zbase.toint() + t * (L * 4), mF.iterator.toint() + Int64(t) * F_ROW + Z0 * 4,
                     L * 4, b)
        shared_situ_and_zeroing()(mF, mAsh, mLat, mSsq, bx * THREADS + tid, G * THREADS, sh)
        cute.arch.mbarrier_wait(pb, 0)
        if const_expr(ZL):
            if tid == 0:  # the slots z does not use: untouched since the kernel began, no proxy fence needed
                for s in cutlass.range(e0, ST - nz):
                    if bx + s * G < s_meta[0] * NRB:
                        issue(bx + s * G, s, s_act, mW1, mS1, mW3, mS3, bars, w_base, s_base)
        zf = cute.make_tensor(cute.recast_ptr(zbase, dtype=Float32),
                              cute.make_layout((MXT, L), stride=(L, 1)))
        gS = cute.zipped_divide(zf, (1, 4))
        if const_expr(F16):
            z_scales_f16(gS, s_zsc, M, tid)
        for idx in cutlass.range(tid, M * (L // 8), THREADS):
            t = idx // (L // 8)
            o = idx - t * (L // 8)
            z0 = gS[(None, (t, 2 * o))].load()
            z1 = gS[(None, (t, 2 * o + 1))].load()
            v = [z0[k] for k in range(4)] + [z1[k] for k in range(4)]
            if const_expr(F16):
                store_f16_order(sz, t, o, v, s_zsc[t])
            else:
                store_b_order(sz, t, o, v, ZSW)
        return s_meta[0]

    @cute.jit
    def z_scales_f16(gS: cute.Tensor, s_zsc: cute.Tensor, M: Int32, tid: Int32):
        """(all threads, traced inline; 'f16') warp t < M finds token t's largest |z| and the power of two 2^k that
        puts it in [2^14, 2^15): s_zsc[t] = 2^-k, s_zsc[MXT + t] = 2^k; then a CTA barrier."""
        from .ptx_ops import as_f32, f32_bits

        w_, ln = tid // 32, tid % 32
        if w_ < M:
            mx = Float32(0.0)
            for j in cutlass.range_constexpr(L // 128):
                v = gS[(None, (w_, 32 * j + ln))].load()
                for k in cutlass.range_constexpr(4):
                    mx = cute.arch.fmax(mx, cute.arch.fmax(v[k], -v[k]))
            for o_ in cutlass.range_constexpr(5):
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=16 >> o_))
            if ln == 0:
                e = cutlass.max(cutlass.min(f32_bits()(mx) >> 23, Int32(254)), Int32(15))  # biased exponent of |z|max
                s_zsc[w_] = as_f32()((Int32(268) - e) << 23)
                s_zsc[MXT + w_] = as_f32()((e - Int32(14)) << 23)
        cute.arch.barrier()

    def f16_superblock(acc, ring_w, ring_s32, gB, slot, g, c, sb, t):
        """(traced inline; 'f16') a lane's share of super-block sb of the slot's W1 and W3 rows g: per 32-code group
        one word of each row (the quad's 4 lanes hold the group), placed as E4M3 (`decode_e4m3`), unpacked to f16
        pairs, two chained mma m16n8k16 with B column t, the result scaled per row by the group's 2^(s - 121)."""
        from .mxfp4_decode import E4M3_SCALE_SHIFT, decode_e4m3
        from .ptx_ops import as_f32, e4m3x2_to_f16x2, mma_f16

        dec, mma, asf, unpack = decode_e4m3(), mma_f16(), as_f32(), e4m3x2_to_f16x2()
        bias = E4M3_SCALE_SHIFT * 0x01010101  # every scale byte + 6: no carry (bytes <= MAX_E8M0)
        s1 = Int32(ring_s32[slot, 0, g, sb]) + bias
        s3 = Int32(ring_s32[slot, 1, g, sb]) + bias
        for grp in range(4):
            w = 16 * sb + 4 * grp + c
            e1, o1 = dec(ring_w[slot, 0, g, w])
            e3, o3 = dec(ring_w[slot, 1, g, w])
            f1 = asf(((s1 >> (8 * grp)) & 0xFF) << 23)
            f3 = asf(((s3 >> (8 * grp)) & 0xFF) << 23)
            b = gB[(None, (t, w))].load()
            u = [unpack(x) for x in (e1, e3, o1, o3)]  # each: (bytes 0, 1) and (bytes 2, 3) as f16 pairs
            d = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
            d = mma([u[0][0], u[1][0], u[2][0], u[3][0]], [b[0], b[1]], d)
            d = mma([u[0][1], u[1][1], u[2][1], u[3][1]], [b[2], b[3]], d)
            acc = [acc[0] + d[0] * f1, acc[1] + d[1] * f1, acc[2] + d[2] * f3, acc[3] + d[3] * f3]
        return acc

    def up_operands(gW, ring_s, slot, g, c, sb):
        """(traced inline) a lane's 4 code words of super-block sb in the slot's W1 and W3 rows g, and their scale
        pairs."""
        a1 = gW[(None, (slot, 0, g, 4 * sb + c))].load()
        a3 = gW[(None, (slot, 1, g, 4 * sb + c))].load()
        return (a1, a3, scale_pair(Int32(ring_s[slot, 0, g, 4 * sb + c])),
                scale_pair(Int32(ring_s[slot, 1, g, 4 * sb + c])))

    def up_superblock(acc, gW, ring_s, gZ, slot, g, c, sb, t):
        """(traced inline) a lane's share of super-block sb of the slot's W1 and W3 rows g (A rows g, g + 8)."""
        a1, a3, sc1, sc3 = up_operands(gW, ring_s, slot, g, c, sb)
        return superblock_mma(acc, a1, a3, sc1, sc3, gZ, t, 16 * sb + 4 * c, key.decode, swizzle=ZSW)

    def up_half(acc, gW, ring_s, gZ, slot, g, c, h, t):
        """(traced inline; 'bal') a lane's share of half super-block h (words 2·(h mod 2), +1 of the lane's four in
        super-block h // 2) of the slot's W1 and W3 rows g."""
        sb = h // 2
        hi = (h - 2 * sb) == 1
        a1, a3, sc1, sc3 = up_operands(gW, ring_s, slot, g, c, sb)
        w1 = [Int32(cutlass.select_(hi, a1[2 + k], a1[k])) for k in range(2)]
        w3 = [Int32(cutlass.select_(hi, a3[2 + k], a3[k])) for k in range(2)]
        return superblock_mma(acc, w1, w3, sc1, sc3, gZ, t, 16 * sb + 4 * c + 2 * (h - 2 * sb), key.decode, (0, 2),
                              swizzle=ZSW)

    if MERGED:
        assert PRO and DFLAG == 2 and not (PF or RE or F16), \
            "the merged kernel's moe_up phase: the merged prologue and dflagt's count, no pf, uflag or f16"

    @cute.jit
    def up_main(mF: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mA: cute.Tensor,
                mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor,
                mWd: cute.Tensor, mTrace: cute.Tensor, raw: cute.Tensor, mX: cute.Tensor, mWsh: cute.Tensor):
        # (mX, mWsh: x and the shared gate/up rows, read by 'shup' builds only; stand-ins otherwise)
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, _, _ = cute.arch.block_idx()
        if const_expr(TR):
            if tid == 0:
                stamp(mTrace, bx, 0)
        M = mF.shape[0]
        if const_expr(MERGED):  # the tables first, where moe_down's phase finds them
            smem = SmemCarve(raw, up_pipe_smem_bytes(key))
            s_meta, s_act, s_list, s_tok = carve_tables(smem, MXT)
        else:
            smem = cutlass.utils.SmemAllocator()
        ring_w = smem.allocate_tensor(Int32, cute.make_layout((ST, 2, RB_UP, WROW), stride=(2 * RB_UP * WROWP, RB_UP * WROWP, WROWP, 1)),
                                      byte_alignment=128)
        ring_s = smem.allocate_tensor(Uint8, cute.make_layout((ST, 2, RB_UP, SROW), stride=(2 * RB_UP * SROW, RB_UP * SROW, SROW, 1)),
                                      byte_alignment=128)
        # z of every token as bf16 pairs in the mma's B order (per 8 codes (0,4) (2,6) (1,5) (3,7)), or with 'f16' as
        # f16 pairs in its two mma's (F16_B_PAIRS)
        sz = smem.allocate_tensor(Int32, cute.make_layout((MXT, L // 2), stride=(key.z_row_words, 1)),
                                  byte_alignment=16)
        if const_expr(F16):  # the tokens' power-of-two scales, and the scale bytes 4 at a time
            s_zsc = smem.allocate_tensor(Float32, cute.make_layout((2 * MXT,)), byte_alignment=16)
            ring_s32 = cute.make_tensor(cute.recast_ptr(ring_s.iterator, dtype=Int32), cute.make_layout(
                (ST, 2, RB_UP, SROW // 4), stride=(2 * RB_UP * SROW // 4, RB_UP * SROW // 4, SROW // 4, 1)))
        else:
            s_zsc = sz  # a stand-in argument: only the f16 staging reads or writes per-token scales
        if const_expr(not MERGED):
            s_act = smem.allocate_tensor(Int32, cute.make_layout((E,)), byte_alignment=16)
            s_list = smem.allocate_tensor(Int32, cute.make_layout((E, 2), stride=(2, 1)), byte_alignment=16)
            s_tok = smem.allocate_tensor(Int32, cute.make_layout((TOPK * MXT,)), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout((NB, WARPS, 32, 4), stride=(WARPS * 128, 128, 4, 1)),
                                   byte_alignment=16)
        bars = smem.allocate_tensor(Int64, cute.make_layout((ST,)), byte_alignment=8)
        w_base = ring_w.iterator.toint()
        s_base = ring_s.iterator.toint()
        if const_expr(SHUP):  # x (bf16 pairs) and its mbarrier
            sx = smem.allocate_tensor(Int32, cute.make_layout((MXT, D // 2), stride=(D // 2, 1)), byte_alignment=16)
            xbar = smem.allocate_tensor(Int64, cute.make_layout((1,)), byte_alignment=8)
        if const_expr(PRO):
            pbar = smem.allocate_tensor(Int64, cute.make_layout((1,)), byte_alignment=8)
            if const_expr(not MERGED):
                s_meta = smem.allocate_tensor(Int32, cute.make_layout((4,)), byte_alignment=16)
            if tid == 0:  # nothing here reads the previous launch: before the wait
                cute.arch.mbarrier_init(pbar.iterator, 1)
                if const_expr(SHUP):
                    cute.arch.mbarrier_init(xbar.iterator, 1)
            ring_init()(bars, ST)
        if const_expr(SHUP):  # x and the shared rows do not depend on the front: before the wait
            if tid == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(xbar.iterator, M * SH_BYTES)
                for t_ in cutlass.range(M):
                    bulk(sx.iterator.toint() + t_ * SH_BYTES, mX.iterator.toint() + Int64(t_) * SH_BYTES, SH_BYTES,
                         xbar.iterator.toint())
                for s_ in cutlass.range_constexpr(min(ST, LEAD) if LEAD else ST):  # ('shupiN': its lead only)
                    if bx + s_ * G < NSHI:
                        issue_shared(bx + s_ * G, s_, mWsh, bars, w_base)
        if const_expr(PF):  # the shared experts' down projection does not depend on the routing
            if tid == 32:
                for k in cutlass.range(bx, PF_SD, G):
                    pf(mWd.iterator.toint() + Int64(k) * PF_CHUNK, cutlass.min(PF_CHUNK, SD_BYTES - k * PF_CHUNK))
        # slots z takes ('zlast': from the ring's end; they are requested after the staging, the others before)
        nz = (M * (L * 4) + SLOT_W - 1) // SLOT_W if ZL else ST
        e0 = Int32(0)  # ring slots requested before the wait ('uflag')
        if const_expr(RE > 0):
            e0 = cutlass.min(Int32(RE), ST - nz)
            if tid == 0:  # the front's routing tables are written once its flag is set (release / acquire)
                routed = Int32(0)
                while routed == 0:
                    routed = cute.arch.load(mMeta.iterator + ROUTED_FLAG, Int32, sem="acquire", scope="gpu")
                nit = mMeta[0] * NRB
                for s in cutlass.range(e0):
                    if bx + s * G < nit:
                        issue(bx + s * G, s, mAct, mW1, mS1, mW3, mS3, bars, w_base, s_base)
        if const_expr(PDL):  # everything else reads the routing tables
            cute.arch.griddepcontrol_wait()
            if const_expr(not MERGED):  # (merged: the tail may start only once every CTA is resident, moe_down's trigger)
                cute.arch.griddepcontrol_launch_dependents()
        if const_expr(TR):
            if tid == 0:
                stamp(mTrace, bx, 1)
        if const_expr(SHUP):
            nact = stage_prologue_shup(mMeta, mAct, mList, mTok, mF, s_meta, s_act, s_list, s_tok, sz, pbar, mAsh,
                                       mLat, mSsq, bx, tid)
        elif const_expr(PRO):
            nact = stage_prologue_up(mMeta, mAct, mList, mTok, mF, s_meta, s_act, s_list, s_tok, ring_w, sz, pbar,
                                     mAsh, mLat, mSsq, bx, tid, mW1, mS1, mW3, mS3, bars, w_base, s_base, nz, s_zsc,
                                     e0)
        else:
            nact = mMeta[0]
            # the routing tables, once, into shared memory: no global round trip on an item's critical path
            stage_routing_tables()(mAct, mList, mTok, s_act, s_list, s_tok, nact, M, THREADS)
            ring_init()(bars, ST)
        nitems = nact * NRB + NSHI  # ('shup': the shared items first)
        if const_expr(LEAD):  # ('shupiN') this CTA's shared and expert items, walked in the interleaved order
            ns_ = (NSHI - bx + G - 1) // G
            ne_ = (nact * NRB - bx + G - 1) // G
            nloc = ns_ + ne_
        if tid == 0:
            for s in cutlass.range_constexpr(EARLY):
                if bx + s * G < nitems:
                    issue(bx + s * G, s, s_act, mW1, mS1, mW3, mS3, bars, w_base, s_base)
            if const_expr(TR):
                stamp(mTrace, bx, 2)
        if const_expr(PF):  # the active experts' W2 codes and scales, behind any ring slots requested early
            if tid == 32:
                npf = nact * PF_E if nact <= PF_MAX_ACTIVE else 0
                for k in cutlass.range(bx, npf, G):
                    j = k // PF_E
                    r = k - j * PF_E
                    e = Int64(s_act[j])
                    if r < PF_W:
                        pf(mW2.iterator.toint() + e * W2_BYTES + r * PF_CHUNK, cutlass.min(PF_CHUNK, W2_BYTES - r * PF_CHUNK))
                    else:
                        o = (r - PF_W) * PF_CHUNK
                        pf(mS2.iterator.toint() + e * S2_BYTES + o, cutlass.min(PF_CHUNK, S2_BYTES - o))
        gZ = cute.zipped_divide(sz, (1, 4))
        if const_expr(not PRO):
            # while the first items fly: z into shared memory (bf16, B order), the shared experts' SiTU, and
            # zeroing this rank's latent accumulator
            stage_z_plain(mF, sz, tid)
            shared_situ_and_zeroing()(mF, mAsh, mLat, mSsq, bx * THREADS + tid, G * THREADS, sh)
        cute.arch.barrier()
        if tid == 0:  # the rest of the ring, now that z is in
            if const_expr(PRO and FENCE and not SHUP):  # the ring held z: generic-proxy reads before the bulk writes
                cute.arch.fence_view_async_shared()
            if const_expr(LEAD):  # the first slots not requested before the wait
                for s in cutlass.range_constexpr(ST):
                    todo = Int32(s < nloc)
                    if const_expr(s < LEAD):  # requested before the wait if it was a shared item
                        todo = todo * Int32(bx + s * G >= NSHI)
                    if todo > 0:
                        issue_virtual(shup_virtual(Int32(s), ns_, ne_, bx), s, s_act, mW1, mS1, mW3, mS3, mWsh, bars,
                                      w_base, s_base)
            elif const_expr(SHUP):  # the first slots' expert items (the shared ones went out before the wait)
                for s in cutlass.range_constexpr(ST):
                    if bx + s * G >= NSHI and bx + s * G < nitems:
                        issue(bx + s * G - NSHI, s, s_act, mW1, mS1, mW3, mS3, bars, w_base, s_base)
            elif const_expr(ZL):
                for s in cutlass.range(ST - nz, ST):
                    if bx + s * G < nitems:
                        issue(bx + s * G, s, s_act, mW1, mS1, mW3, mS3, bars, w_base, s_base)
            else:
                for s in cutlass.range_constexpr(EARLY, ST):
                    if bx + s * G < nitems:
                        issue(bx + s * G, s, s_act, mW1, mS1, mW3, mS3, bars, w_base, s_base)
            if const_expr(TR):
                stamp(mTrace, bx, 3)

        g = lane // 4
        c = lane - 4 * g
        gW = cute.zipped_divide(ring_w, (1, 1, 1, 4))
        if const_expr(BAL):  # this warp's run of half super-blocks
            h0, nh = Int32(0), Int32(0)
            for w_ in cutlass.range_constexpr(WARPS):
                h0 = Int32(cutlass.select_(warp == w_, Int32(HSTART[w_]), h0))
                nh = Int32(cutlass.select_(warp == w_, Int32(UP_BALANCED_HALVES[w_]), nh))
        if const_expr(SHUP):  # the slots as two rows of 16-byte chunks each, and x the same way
            gR = cute.zipped_divide(cute.make_tensor(ring_w.iterator, cute.make_layout(
                (ST, 2, WS_WORDS), stride=(2 * WS_WORDS, WS_WORDS, 1))), (1, 1, 4))
            gX = cute.zipped_divide(sx, (1, 4))
            cute.arch.mbarrier_wait(xbar.iterator, 0)
        n = Int32(0)
        if const_expr(LEAD):  # ('shupiN') local positions, each turned into its virtual item
            lo_, hi_, step_ = Int32(0), nloc, 1
        else:
            lo_, hi_, step_ = bx, nitems, G
        for it_ in cutlass.range(lo_, hi_, step_):
            item = it_
            if const_expr(LEAD):
                item = shup_virtual(n, ns_, ne_, bx)
            slot = n % ST
            ie = item
            if const_expr(SHUP):  # the expert item (a shared item reads expert item 0's tables, unused)
                ie = cutlass.max(item - NSHI, Int32(0))
            j = ie // NRB
            i0 = (ie - j * NRB) * RB_UP
            off = s_list[j, 0]
            num = s_list[j, 1]  # <= M <= 8: one mma column per token
            buf = n % NB
            if warp < WARPS:  # the compute warps (all of them without an epilogue warp)
                t = s_tok[off + cutlass.min(g, num - 1)]  # this lane's B column (token); clamped
                if const_expr(SHUP):  # the wait (a loop) in each branch: ptxas then keeps the branch instead of
                    # predicating both items' code into one stream that every item issues (run 71's SASS: a shared
                    # item issued the expert item's decode and mma, predicated off)
                    if item < NSHI:
                        slot_wait(bars, slot, n, mTrace, bx, tid, lane, warp)
                        shared_partials(gR, gX, red, slot, buf, warp, lane)
                    else:
                        slot_wait(bars, slot, n, mTrace, bx, tid, lane, warp)
                        expert_partials(gW, ring_s, gZ, red, slot, buf, warp, lane, g, c, t)
                else:
                    slot_wait(bars, slot, n, mTrace, bx, tid, lane, warp)
                    if const_expr(F16):  # one accumulator: the group's mma are chained, then scaled
                        acc = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
                        for q in cutlass.range_constexpr(NSB // WARPS):
                            acc = f16_superblock(acc, ring_w, ring_s32, gZ, slot, g, c, warp + WARPS * q, t)
                        store_partials(red, buf, warp, lane, [acc])
                    elif const_expr(BAL):  # halves alternate between two accumulators: two independent mma chains
                        acc0 = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
                        acc1 = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
                        for u in cutlass.range_constexpr(HMAX):
                            if const_expr(u < HMIN):
                                if const_expr(u % 2 == 0):
                                    acc0 = up_half(acc0, gW, ring_s, gZ, slot, g, c, h0 + u, t)
                                else:
                                    acc1 = up_half(acc1, gW, ring_s, gZ, slot, g, c, h0 + u, t)
                            else:
                                if u < nh:
                                    if const_expr(u % 2 == 0):
                                        acc0 = up_half(acc0, gW, ring_s, gZ, slot, g, c, h0 + u, t)
                                    else:
                                        acc1 = up_half(acc1, gW, ring_s, gZ, slot, g, c, h0 + u, t)
                        store_partials(red, buf, warp, lane, [acc0, acc1])
                    else:
                        expert_partials(gW, ring_s, gZ, red, slot, buf, warp, lane, g, c, t)
                if const_expr(TR):
                    if lane == 0 and n < WARP_TRACE_ITEMS:
                        stamp(mTrace, bx, warp_trace_slot(n, warp, 1))
            cute.arch.barrier()
            if const_expr(EPI and TR):
                if tid == 0 and n < TRACE_ITEMS:
                    stamp(mTrace, bx, 5 + 2 * n)
            # every warp is done with the slot: refill it with the item ST rounds ahead (thread 0, or the
            # epilogue warp's first lane)
            if tid == (32 * WARPS if EPI else 0):
                if const_expr(LEAD):
                    if n + ST < nloc:
                        if const_expr(FENCE):
                            cute.arch.fence_view_async_shared()
                        issue_virtual(shup_virtual(n + ST, ns_, ne_, bx), slot, s_act, mW1, mS1, mW3, mS3, mWsh,
                                      bars, w_base, s_base)
                elif item + ST * G < nitems:
                    if const_expr(FENCE):
                        cute.arch.fence_view_async_shared()
                    if const_expr(SHUP):
                        issue_virtual(item + ST * G, slot, s_act, mW1, mS1, mW3, mS3, mWsh, bars, w_base, s_base)
                    else:
                        issue(item + ST * G, slot, s_act, mW1, mS1, mW3, mS3, bars, w_base, s_base)
            if warp == (WARPS if EPI else WARPS - 1):
                if const_expr(TR):
                    if lane == 0 and n < WARP_TRACE_ITEMS:
                        stamp(mTrace, bx, warp_trace_slot(n, WARP_TRACE_EPI, 0))
                if const_expr(SHUP):
                    if item < NSHI:
                        shared_epilogue(red, buf, lane, item, mAsh, M)
                    else:
                        expert_epilogue(red, buf, lane, g, c, off, num, i0, mA, s_zsc, s_tok)
                else:
                    expert_epilogue(red, buf, lane, g, c, off, num, i0, mA, s_zsc, s_tok)
                if const_expr(TR):
                    if lane == 0 and n < WARP_TRACE_ITEMS:
                        stamp(mTrace, bx, warp_trace_slot(n, WARP_TRACE_EPI, 1))
            if const_expr(not EPI):  # the partials' one buffer is free again
                cute.arch.barrier()
                if const_expr(TR):
                    if tid == 0 and n < TRACE_ITEMS:
                        stamp(mTrace, bx, 5 + 2 * n)
            n = n + 1
        if const_expr(TR):  # with the epilogue warp, its last reduction may still be running
            if tid == 0:
                stamp(mTrace, bx, TRACE_SLOTS - 1)
        if const_expr(DFLAG):  # every thread's a rows, shared SiTU and zeroing are out: count this CTA done
            if const_expr(DFLAG == 1):
                cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            if tid == 0:
                if const_expr(DFLAG == 2):
                    cute.arch.fence_acq_rel_gpu()
                cute.arch.atomic_add(mMeta.iterator + DONE_FLAG, Int32(1), sem="release", scope="gpu")
                if const_expr(MERGED):  # moe_down's phase lays its buffers over these mbarriers: retire them
                    for s_ in cutlass.range_constexpr(ST):
                        inval((bars.iterator + s_).toint())
                    inval(pbar.iterator.toint())

    @cute.kernel
    def up_kernel(mF: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                  mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mA: cute.Tensor,
                  mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor,
                  mWd: cute.Tensor, mTrace: cute.Tensor):
        up_main(mF, mW1, mS1, mW3, mS3, mMeta, mAct, mList, mTok, mA, mAsh, mLat, mSsq, mW2, mS2, mWd, mTrace,
                mMeta, mF, mF)  # (raw, mX, mWsh: stand-ins; only the merged kernel carves, only 'shup' reads x)

    @cute.jit
    def up_host(mF: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mA: cute.Tensor,
                mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor,
                mWd: cute.Tensor, mTrace: cute.Tensor, stream):
        up_kernel(mF, mW1, mS1, mW3, mS3, mMeta, mAct, mList, mTok, mA, mAsh, mLat, mSsq, mW2, mS2, mWd, mTrace).launch(
            grid=(G, 1, 1), block=(THREADS, 1, 1), smem=up_pipe_smem_bytes(key), stream=stream, use_pdl=PDL)

    @cute.kernel
    def shup_kernel(mF: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                    mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mA: cute.Tensor,
                    mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor,
                    mWd: cute.Tensor, mTrace: cute.Tensor, mX: cute.Tensor, mWsh: cute.Tensor):
        up_main(mF, mW1, mS1, mW3, mS3, mMeta, mAct, mList, mTok, mA, mAsh, mLat, mSsq, mW2, mS2, mWd, mTrace,
                mMeta, mX, mWsh)

    @cute.jit
    def shup_host(mF: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                  mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mA: cute.Tensor,
                  mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor,
                  mWd: cute.Tensor, mTrace: cute.Tensor, mX: cute.Tensor, mWsh: cute.Tensor, stream):
        shup_kernel(mF, mW1, mS1, mW3, mS3, mMeta, mAct, mList, mTok, mA, mAsh, mLat, mSsq, mW2, mS2, mWd, mTrace, mX,
                    mWsh).launch(grid=(G, 1, 1), block=(THREADS, 1, 1), smem=up_pipe_smem_bytes(key), stream=stream,
                                 use_pdl=PDL)

    if SHUP:  # x and the shared gate/up rows after the timeline buffer
        return shup_host, up_pipe_args(sh, shared_up=True), up_main
    return up_host, up_pipe_args(sh), up_main


def up_pipe_args(sh: MoEShape, shared_up: bool = False) -> tuple:
    """Compile-time stand-ins of the pipelined moe_up's arguments: the direct kernel's (`moe.expert_up_args`),
    then moe_down's weights it may prefetch into L2 (W2 codes, W2 scales, shared down), the timeline buffer
    (`trace_arg`), with shared_up ('shup') x [tokens, D] and the shared gate/up rows [2 S, D] (bf16), then the
    stream."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Int32, Uint8

    fake = cute.runtime.make_fake_compact_tensor
    *head, stream = expert_up_args(sh)
    I = sh.inter
    shup = (fake(BFloat16, (cute.sym_int(), D), stride_order=(1, 0), assumed_align=16),
            fake(BFloat16, (2 * sh.shared, D), stride_order=(1, 0), assumed_align=16)) if shared_up else ()
    return (*head, fake(Int32, (E, L, I // 8), stride_order=(2, 1, 0), assumed_align=16),
            fake(Uint8, (E, L, I // 32), stride_order=(2, 1, 0), assumed_align=16),
            fake(BFloat16, (D, sh.shared), stride_order=(1, 0), assumed_align=16), trace_arg(), *shup, stream)


# --------------------------------------------------------------------------- moe_down


@dataclass(frozen=True)
class MoEDownPipeKey:
    """moe_down with a ring. An expert item is 16 · `warps` latent rows of one active expert's W2: row group w
    owns rows 16w..16w+15 as an mma.sync A operand (decoded to bf16 pairs as in moe_up) over K = I, taken by
    `ksplit` warps that split K and meet in shared memory; the expert's tokens (a, bf16, from shared memory) are
    the B columns; w · a·W2ᵀ is added into the CTA's fp32
    sum of its row block. A shared item is `rows_per_item` rows of the shared experts' down projection (bf16,
    CUDA cores). Expert items are ordered (row block, expert); each CTA takes a run of them (`balanced`: an equal
    share of the expert items and of the shared items; otherwise one contiguous run of both), so it sums one row
    block over consecutive experts in shared memory and adds the sum into the rank's latent partial (red.add)
    once per row block; the CTA that completes a row block's expert count (an atomic counter) does its one-shot
    all-reduce read and stores r (bf16)."""

    shape: MoEShape
    warps: int = 8
    stages: int = 3  # ring slots (26112 B each at TP8); 7 with one token's activations measured slower (run 14)
    ctas: int = H200_SMS
    pdl: bool = True
    # the last rows of the tail's W_up brought into L2 while this launch runs (the tail's first rows are loaded
    # by its own CTAs under PDL). 0: measured slower with it (run 15)
    prefetch_tail_rows: int = 0
    trace: bool = False  # record per-CTA checkpoints (TRACE_DOWN) into the timeline buffer
    # ring slots requested before the wait for moe_up (the rest after a is staged; see MoEUpPipeKey.early_slots)
    early_slots: int = 1
    # each CTA takes an equal share of the expert items and of the shared items (False: one contiguous run of
    # both, which at batch 1 left the expert items, about 5x the arithmetic of a shared one, to half the CTAs)
    balanced: bool = True
    # 'pro': the routing tables (before the wait) and then a and a_shared (after it) each come in one bulk copy
    # on an mbarrier, a then permuted in place into the mma's B order; without it the tables take two dependent
    # round trips and staging a one round trip per 16-byte load of each thread (3.3 µs at batch 1, run 17)
    prologue: bool = True
    # 'prod': one more warp that does no arithmetic and refills each item's slot after the item's barrier,
    # instead of thread 0 of the first compute warp
    producer_warp: bool = True
    # 'swap': the balanced split deals the shared items in reverse CTA order. Meant to keep the CTAs with an
    # extra expert item from also getting an extra shared item; with floor splits of equal counts it barely does
    # (at batch 1, 448 expert and 448 shared items: 48 CTAs carry both extras instead of 52) and it measured no
    # difference (run 20). Pairing them properly would give the shared extras to the CTAs without an expert one
    swap_shared: bool = True
    # 'pair' (balanced split): the R_e = ne mod G CTAs with one expert item more than the others are CTAs 0..R_e - 1,
    # and the shared items' extras go to the CTAs after them (R_e, R_e + 1, ... wrapping), so that no CTA takes both
    # extras while another takes neither. Run 27's timeline at batch 1 (448 items of each kind): the CTAs that ended
    # moe_down last held 4 expert and 4 shared items (8 items; the others 6 or 7) and also did a row block's
    # all-reduce read. Replaces 'swap' when on. Batch 1 faster in each of four runs (30, 32, 33, 34: 0.1 to 0.9 µs,
    # each within its run's spread), batch 8 from 4.5 µs faster to 0.6 slower; the default since run 35
    pair_extras: bool = True
    # 'late': let the tail's CTAs be scheduled (griddepcontrol.launch_dependents) only once a is staged, not
    # at this launch's start. The tail's CTAs that fit beside this one (about ten per SM) each load their
    # W_up row before their wait: a burst of about 10 MB that the a staging and the first ring slots queue
    # behind (staging took 2.4-2.9 µs after the wait in runs 20 and 21, 1.1 µs with it in run 22). The step
    # itself moved within the run-to-run spread (batch 1: 1.3 µs faster in run 22, 0.8 µs slower in run 23)
    late_trigger: bool = True
    # 'aflush': the producer warp flushes a finished row block (red.add of the CTA's sum, the fence, the
    # counter's atomic) while the compute warps go on with the next item; the row block's all-reduce read,
    # if this CTA completed it, follows the next item. Before, every thread waited for the fence and the atomic's
    # round trip (about 1 µs per row block in run 20's trace). Needs the producer warp. Measured slower (run 22:
    # the next item's barrier waits for the producer warp's fence and atomic)
    async_flush: bool = False
    # 'lazy' (without aflush): at a row block's end every thread still adds its share of the CTA's sum into the
    # latent partial (red.add) and empties acc, but the fence, the counter's atomic and, if this CTA completed the
    # row block, its all-reduce read wait until after the next item (or the CTA's last one): by then the red.adds
    # have landed and the fence no longer waits a round trip. Run 27's timeline at batch 1: flush_start to
    # flush_counted about 1.0 µs between a CTA's expert and shared items
    lazy_flush: bool = False
    decode: int = 3  # see MoEUpPipeKey.decode
    # compute warps per row group: 2 splits each expert item's K (I) between two warps that meet in shared
    # memory (16 · warps rows per item as before, twice the compute warps: 8 warps per SM left the decode's
    # latency uncovered). Run 23: batch 1 70.4 µs against 71.7, batch 8 233.5 against 234.8 (within the spread)
    ksplit: int = 2
    proxy_fence: bool = True  # see MoEUpPipeKey.proxy_fence (here only before the producer's refills)
    spin_wait: bool = False  # see MoEUpPipeKey.spin_wait (moe_down's compute warps' slot waits)
    # 'fwarp': FLUSH_WARPS more warps that flush the CTA's finished row-block sums (red.add into the latent partial,
    # the fence, the counter's atomic) and, if this CTA completed a row block, do its all-reduce read, Σ r² and
    # re-arm, while the compute and producer warps go on with the next items on their own named barrier; the
    # row-block sum is double-buffered. Without it all warps do the flush in line: the CTAs that completed a row
    # block between their items ended moe_down up to 5 µs after the others (runs 27 and 37). One flush warp (run
    # 36) read the all-reduce too slowly; four (run 38): batch 1 66.6 µs against 68.6, batch 8 221.4 against
    # 226.9. The default since run 39 ('run35' keeps the kernels before; lazy and aflush imply fwarp0)
    flush_warp: bool = True
    # 'downmaxN': tokens a step may have (their a rows, routing weights and row-block sums live in shared memory).
    # At one token ('downmax1', implied by the fused front option 'cotail') moe_down needs about 113 KB instead of
    # 217 KB, which leaves room on each SM for a tail CTA that streams W_up while moe_down still runs
    max_tokens: int = PIPE_MAX_M
    # 'dflag': thread 0 waits for moe_up's CTAs (as many as this launch's) on the counter meta[DONE_FLAG] (acquire,
    # polled) instead of griddepcontrol.wait, which returns only once the whole moe_up grid has completed and its
    # memory is flushed: in run 46's timeline 0.8-1.3 µs after moe_up's last CTA ended. The last CTA past the
    # counter (meta[PASS_COUNT]) re-arms both for the next step. Needs moe_up's done_flag and the same CTA count
    flag_wait: bool = False
    # 'sfirst': each CTA runs its shared items before its expert items. The shared items need only a_shared, which
    # this kernel computes itself (the SiTU of the front's fp32 gate/up pre-activations, as moe_up does) and the
    # shared down projection: so they run before the wait for moe_up, while the front is long complete, and the
    # wait and a's staging come at the first expert item. In run 61's timeline a CTA spent about 3 µs from its
    # start to its first item (wait, staging) while its shared items take about 0.64 µs each. Measured slower (run
    # 63, H200: 63.2 µs against 61.0 at batch 1): the whole ring requested at once lands its first slot about 3.4 µs
    # after the CTA starts, so the shared items gain nothing and a's staging falls on the expert items' path.
    # 2 ('sfirst2'): one ring slot first and the rest once a_shared is computed (as without sfirst), and a's bulk
    # copy issued by the first flush warp (idle until the first row block ends) as soon as its wait returns, so
    # that a lands while the shared items run (run 66, H100: slower, 76.4 µs against 74.7 at batch 1: the shared
    # items, last by default, are where a CTA's row-block flushes and all-reduce reads hide). 0: off
    shared_first: int = 0
    # ('uflag') thread 0 of CTA 0 clears meta[ROUTED_FLAG] after the wait for moe_up (whose CTAs polled it): the next
    # step's front sets it again once its routing is written
    route_reset: bool = False
    # (set by MoEExpertsPipeKey, 'merge') moe_down as the second phase of the merged expert kernel: its buffers carved
    # over moe_up's, the routing tables left where moe_up's prologue staged them, and the wait for moe_up's CTAs on
    # 'dflag''s counter (flag_wait). False: its own launch
    merged: bool = False
    # 'l2h': the ring's bulk copies of W2, its scales and the shared down rows carry an L2 evict_first policy, and the
    # prefetch of the tail's W_up rows (tailN) evict_last: between this launch's start and the tail's last rounds
    # about 60 MB (moe_down's 23, the tail's first rows) stream through the L2 (60 MB on the H200, 50 on the H100),
    # which under a plain least-recently-used order would evict the prefetched rows before the tail reads them
    l2_hints: bool = False
    arch: str = "sm_90a"

    @property
    def rows_per_item(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        """Threads of a CTA: the compute warps, the producer warp and the flush warps, if any."""
        return 32 * (self.warps * self.ksplit + int(self.producer_warp) + (FLUSH_WARPS if self.flush_warp else 0))


def paired_split(bx: int, ne: int, nsh: int, g: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """CTA bx's runs of expert items and of shared items, [lo, hi) each, in the 'pair' split (the kernel computes
    the same on the device): the ne mod g expert extras to CTAs 0.., the nsh mod g shared extras to the CTAs after
    them, wrapping."""
    q_e, r_e = divmod(ne, g)
    lo_e = bx * q_e + min(bx, r_e)
    j = (bx - r_e) % g
    q_s, r_s = divmod(nsh, g)
    lo_s = j * q_s + min(j, r_s)
    return (lo_e, lo_e + q_e + int(bx < r_e)), (lo_s, lo_s + q_s + int(j < r_s))


def row_block_flushes(lo_e: int, hi_e: int, nact: int) -> list[tuple[int, int]]:
    """(row block, this CTA's expert items of it) for each row block a CTA with expert run [lo_e, hi_e) flushes, in
    order: what moe_down's flush warp ('fwarp') computes on the device (items are ordered (row block, expert))."""
    if hi_e <= lo_e:
        return []
    nfl = (hi_e - 1) // nact - lo_e // nact + 1
    return [(rb, min(hi_e, (rb + 1) * nact) - max(lo_e, rb * nact))
            for rb in range(lo_e // nact, lo_e // nact + nfl)]


def down_pipe_capacity(key: MoEDownPipeKey) -> int:
    return key.max_tokens


def _down_pipe_sizes(key: MoEDownPipeKey):
    I, S = key.shape.inter, key.shape.shared
    RBD = key.rows_per_item
    w_bytes = RBD * I // 2
    s_bytes = RBD * I // 32
    rsh = 1 << ((w_bytes // (2 * S)).bit_length() - 1)  # shared-down rows per shared item (a power of 2)
    assert w_bytes % 16 == 0 and s_bytes % 16 == 0 and rsh >= 1
    return RBD, w_bytes, s_bytes, rsh


def _down_fixed_bytes(key) -> int:
    I, S, n = key.shape.inter, key.shape.shared, key.max_tokens
    acts = 2 * TOPK * n * I + 2 * n * S
    tables = 4 * (3 * E + 2 * TOPK * n)
    sums = 4 * n * key.rows_per_item * (2 if key.async_flush or key.lazy_flush or key.flush_warp else 1)  # the async flush's all-reduce has its own
    parts = key.ksplit * key.warps * 32 * 4 * 4 if key.ksplit > 1 else 0  # the K halves' partial sums
    return sums + parts + acts + tables + 640


def down_pipe_smem_bytes(key: MoEDownPipeKey) -> int:
    _, w_bytes, s_bytes, _ = _down_pipe_sizes(key)
    return key.stages * (w_bytes + s_bytes + 8) + _down_fixed_bytes(key) + (64 if key.prologue else 0)


def build_down_pipe(key: MoEDownPipeKey):
    """(host function, compile-time arguments) of moe_down's own launch."""
    return _build_down(key)[:2]


def _build_down(key: MoEDownPipeKey):
    """(host function, compile-time arguments, `down_main`): down_main(<down_kernel's tensors>, raw), the kernel's body,
    which the merged expert kernel inlines as its second phase (see `_build_up`)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Constexpr, Float32, Int32, Int64, Uint8, const_expr

    from .moe import D
    from .mxfp4_decode import scale_pair
    from .ptx_ops import bf16x2_to_f32, bulk_g2s, bulk_prefetch_l2, ld_v4_f32, mbar_spin_wait, red_add_v4_f32

    sh = key.shape
    I, S, TP = sh.inter, sh.shared, sh.tp
    ld4, red4, spin = ld_v4_f32(), red_add_v4_f32(), mbar_spin_wait()
    PT = key.prefetch_tail_rows
    TR = key.trace
    BAL = key.balanced
    EARLY = key.early_slots
    assert 0 <= EARLY <= key.stages
    assert 0 <= PT <= D
    PT_BYTES = PT * L * 2
    PT_N = -(-PT_BYTES // PF_CHUNK)
    pf = functools.partial(bulk_prefetch_l2(), hint=_hint(key.l2_hints, "evict_last"))
    RG, KS, ST, G, PDL = key.warps, key.ksplit, key.stages, key.ctas, key.pdl
    WARPS = RG * KS  # compute warps: RG row groups of 16 rows, each split KS ways along K
    MXT = key.max_tokens
    assert 1 <= MXT <= PIPE_MAX_M
    # fewer tokens ('downmaxN'): the largest shared-memory carveout, so that a tail CTA fits beside this one
    carveout = dict(preferred_smem_carveout=100) if MXT < PIPE_MAX_M else {}
    PRO, PROD, SWAP, LATE, AFL = key.prologue, key.producer_warp, key.swap_shared, key.late_trigger, key.async_flush
    FENCE, FW = key.proxy_fence, key.flush_warp
    LAZY = key.lazy_flush and not AFL
    FLAGW = key.flag_wait
    SF = key.shared_first
    assert SF in (0, 1, 2)
    assert not SF or (PRO and FW and not FLAGW), "sfirst needs the merged prologue and the flush warps, not dflag"
    assert not key.route_reset or not (SF or FLAGW), "uflag's reset follows moe_down's wait: not with sfirst or dflag"
    SH0, BETA, BETA_LIN = sh.sh0, sh.beta, sh.beta_lin
    PAIR = key.pair_extras and BAL
    assert PROD or not AFL, "the async flush runs on the producer warp"
    assert not (FW and (AFL or key.lazy_flush)), "the flush warp replaces aflush and lazy"
    MAIN = 32 * (WARPS + int(PROD))  # the compute warps and the producer warp, if any (warp WARPS)
    FWARP = WARPS + int(PROD)  # the first flush warp ('fwarp'), if any
    FW_THREADS = 32 * FLUSH_WARPS  # ('fwarp') the flush warps: warps FWARP ..
    THREADS = MAIN + (FW_THREADS if FW else 0)
    assert THREADS == key.threads
    MERGED = key.merged
    assert not MERGED or (FLAGW and PRO and (LATE or not PDL) and not (SF or key.route_reset)), \
        "the merged kernel's moe_down phase: dflag's wait, the merged prologue, the late trigger; no sfirst or uflag"
    REFILL = 32 * WARPS if PROD else 0  # the thread that refills the ring
    # rms_sumsq strides its tokens over the compute warps; the producer warp (index WARPS) would repeat token
    # WARPS if a step could hold more tokens than there are compute warps
    assert not PROD or WARPS >= MXT, "the producer warp needs at least max_tokens compute warps"
    RBD, W_BYTES, S_BYTES, RSH = _down_pipe_sizes(key)
    ACC_W = 2 * RBD if FW else RBD  # the row-block sum, double-buffered for the flush warp
    FW_PEERS = min(TP, 8)  # ranks whose 4-word loads a flush thread has in flight at once in an all-reduce
    # (token, 4 rows) pairs it reads per round: ptxas (80 registers) does not overlap a second pair's loads with
    # the first's arithmetic, and below 5 tokens a second pair would be a clamped duplicate, so one
    FW_PAIRS = 1
    assert not FW or RBD == 128, "the flush warp gives each lane 4 rows of a row block"
    WROW = I // 8  # words per W2 row
    SROW = I // 32
    NSBD = I // SB  # 128-code super-blocks per W2 row
    assert (4 * NSBD) % KS == 0, "the K split goes by code words of a super-block"
    KU = 4 * NSBD // KS  # code words (of a lane's super-block quads) per K part
    # K part h: (super-block, first word, end word) runs of words h·KU .. (h+1)·KU
    KPARTS = [[(u // 4, u % 4, min(4, u % 4 + (h + 1) * KU - u)) for u in range(h * KU, (h + 1) * KU)
               if u == h * KU or u % 4 == 0] for h in range(KS)]
    NBD = L // RBD
    SH_WORDS = S // 2  # words per shared-down row
    SH_VEC = 3  # 8-bf16 vectors per lane of a shared row
    GS = S // (8 * SH_VEC)
    RPWS = 32 // GS
    NSH = D // RSH
    assert I % SB == 0 and L % RBD == 0 and S % (8 * SH_VEC) == 0 and 32 % GS == 0 and D % RSH == 0
    SHW = min(WARPS, RSH // RPWS)  # compute warps that take a shared item's rows (all but at TP16 with downk2)
    assert RSH % (SHW * RPWS) == 0
    SHQ = RSH // (SHW * RPWS)  # shared rows per lane group
    bulk, unpack = bulk_g2s(), bf16x2_to_f32()
    bulk_ring = functools.partial(bulk, hint=_hint(key.l2_hints, "evict_first"))  # a and the tables: plain

    @cute.jit
    def issue(k: Int32, slot: Int32, ne: Int32, nact: Int32, mAct: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor,
              mWd: cute.Tensor, bars: cute.Tensor, w_base: Int32, s_base: Int32):
        """(one thread, inlined) stream item k (expert items first, then shared) into slot `slot`"""
        bar = bars.iterator + slot
        b = bar.toint()
        dw = w_base + slot * W_BYTES
        if k < ne:
            rb = k // nact
            row = mAct[k - rb * nact] * L + rb * RBD
            cute.arch.mbarrier_arrive_and_expect_tx(bar, W_BYTES + S_BYTES)
            bulk_ring(dw, mW2.iterator.toint() + Int64(row) * (WROW * 4), W_BYTES, b)
            bulk_ring(s_base + slot * S_BYTES, mS2.iterator.toint() + Int64(row) * SROW, S_BYTES, b)
        else:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, RSH * 2 * S)
            bulk_ring(dw, mWd.iterator.toint() + Int64(k - ne) * (RSH * 2 * S), RSH * 2 * S, b)

    @cute.jit
    def bulk_tables(mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor,
                    s_meta: cute.Tensor, s_act: cute.Tensor, s_list: cute.Tensor, s_tok: cute.Tensor,
                    pbar: cute.Tensor, M: Int32, tid: Int32):
        """(all threads, inlined; 'pro') meta and the routing tables into shared memory in one bulk round trip
        (phase 0 of pbar). Returns the number of active experts."""
        pb = pbar.iterator
        if tid == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(pb, routing_table_bytes(M))
            bulk_routing_tables(mMeta, mAct, mList, mTok, s_meta, s_act, s_list, s_tok, M, pb.toint())
        cute.arch.mbarrier_wait(pb, 0)
        return s_meta[0]

    @cute.jit
    def issue_acts(mA: cute.Tensor, mAsh: cute.Tensor, s_a: cute.Tensor, s_ash: cute.Tensor, pbar: cute.Tensor,
                   M: Int32, ASH: Constexpr = True):
        """(one thread, inlined) a (and, with ASH, a_shared) bulk-copied into shared memory on pbar's second
        mbarrier, the copy `bulk_acts` waits for."""
        pb = pbar.iterator + 1
        cute.arch.mbarrier_arrive_and_expect_tx(pb, M * (TOPK * I * 2 + (S * 2 if ASH else 0)))
        bulk(s_a.iterator.toint(), mA.iterator.toint(), M * (TOPK * I * 2), pb.toint())
        if const_expr(ASH):  # ('sfirst' computes a_shared itself)
            bulk(s_ash.iterator.toint(), mAsh.iterator.toint(), M * (S * 2), pb.toint())

    @cute.jit
    def bulk_acts(mA: cute.Tensor, mAsh: cute.Tensor, s_a: cute.Tensor, s_ash: cute.Tensor, pbar: cute.Tensor,
                  M: Int32, tid: Int32, NTH: Constexpr = THREADS, ASH: Constexpr = True, ISSUE: Constexpr = True):
        """(all threads, inlined; 'pro') a (every (expert, token) pair's row) and a_shared into shared memory in
        one bulk round trip (phase 0 of pbar's second mbarrier: the tables' is not re-armed, since a thread
        re-arming it could complete its next phase before a slower thread had seen the first, and no CTA barrier
        lies between), then a permuted in place, 16 bytes per thread at a time, into the mma's B order: per 8
        values (0,4) (2,6) (1,5) (3,7) as bf16 pairs (bit-exact, no conversion)."""
        pb = pbar.iterator + 1
        if const_expr(ISSUE):  # (without ISSUE another thread has issued a's copy on this mbarrier)
            if tid == 0:
                issue_acts(mA, mAsh, s_a, s_ash, pbar, M, ASH)
        cute.arch.mbarrier_wait(pb, 0)
        sA4 = cute.zipped_divide(s_a, (1, 4))
        lo16, hi16 = Int32(0xFFFF), Int32(-65536)
        for idx in cutlass.range(tid, M * TOPK * (I // 8), NTH):
            i = idx // (I // 8)
            o = idx - i * (I // 8)
            w = sA4[(None, (i, o))].load()  # bf16 pairs (v0,v1) (v2,v3) (v4,v5) (v6,v7)
            s_a[i, 4 * o] = (w[0] & lo16) | (w[2] << 16)
            s_a[i, 4 * o + 1] = (w[1] & lo16) | (w[3] << 16)
            s_a[i, 4 * o + 2] = ((w[0] >> 16) & lo16) | (w[2] & hi16)
            s_a[i, 4 * o + 3] = ((w[1] >> 16) & lo16) | (w[3] & hi16)

    def expert_rows(gW, ring_s, sA, slot, r0, c, pi, part):
        """(traced inline) a lane's mma sums over its K part (runs of code words of its super-blocks) for rows
        r0 and r0 + 8 of the item in `slot` against B column pi"""
        accs = []
        for q, b0, b1 in part:
            cq = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
            wa = gW[(None, (slot, r0, 4 * q + c))].load()
            wb = gW[(None, (slot, r0 + 8, 4 * q + c))].load()
            sa = scale_pair(Int32(ring_s[slot, r0, 4 * q + c]))
            sb_ = scale_pair(Int32(ring_s[slot, r0 + 8, 4 * q + c]))
            accs.append(superblock_mma(cq, wa, wb, sa, sb_, sA, pi, 16 * q + 4 * c, key.decode, (b0, b1)))
        tot = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
        for a_ in accs:
            for r in range(4):
                tot[r] = tot[r] + a_[r]
        return tot

    @cute.jit
    def add_rows(acc: cute.Tensor, t0: Float32, t1: Float32, t2: Float32, t3: Float32, s_tok: cute.Tensor,
                 s_we: cute.Tensor, off: Int32, num: Int32, c: Int32, r0: Int32, ab):
        """(inlined) the lane's two tokens' routing-weighted sums (t0, t1 of row r0; t2, t3 of row r0 + 8) into
        the CTA's row block sum"""
        tot = [t0, t1, t2, t3]
        for x_ in cutlass.range_constexpr(2):
            n_ = 2 * c + x_
            if n_ < num:
                t = s_tok[off + n_]
                w = s_we[off + n_]
                acc[t, ab + r0] = acc[t, ab + r0] + tot[x_] * w
                acc[t, ab + r0 + 8] = acc[t, ab + r0 + 8] + tot[2 + x_] * w

    @cute.jit
    def flush_rows(rb: Int32, mine: Int32, nact: Int32, acc: cute.Tensor, flag: cute.Tensor, mLat: cute.Tensor,
                   mCnt: cute.Tensor, M: Int32, lane: Int32, bx: Int32, mTrace: cute.Tensor):
        """(the producer warp, inlined; 'aflush') add the CTA's sum of row block rb into the rank's latent
        partial and empty acc (then bar.arrive on barrier 1: the compute warps may write acc again), then the
        fence and the counter's atomic; lane 0 stores whether this CTA completed the row block in flag[rb % 2]"""
        if const_expr(TR):
            if lane == 0:
                stamp(mTrace, bx, 4 + 2 * TRACE_ITEMS)
        for idx in cutlass.range(lane, M * RBD, 32):
            t = idx // RBD
            rl = idx - t * RBD
            cute.arch.red(mLat.iterator + (t * L + rb * RBD + rl), acc[t, rl], op="add", dtype=Float32,
                          sem="relaxed", scope="gpu")
            acc[t, rl] = Float32(0.0)
        cute.arch.barrier_arrive(barrier_id=1, number_of_threads=THREADS)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        if lane == 0:
            old = cute.arch.atomic_add(mCnt.iterator + rb, mine, sem="acq_rel", scope="gpu")
            flag[rb % 2] = Int32(old + mine == nact)
            if const_expr(TR):
                stamp(mTrace, bx, 5 + 2 * TRACE_ITEMS)

    @cute.jit
    def allreduce_rows(rb: Int32, sq: cute.Tensor, mLat: cute.Tensor, mCoef: cute.Tensor, mR: cute.Tensor,
                       mNorm: cute.Tensor, mSsq: cute.Tensor, mCnt: cute.Tensor, M: Int32, tid: Int32, bx: Int32,
                       mTrace: cute.Tensor, zero: Constexpr):
        """(all threads, inlined) every expert of row block rb is in: the one-shot all-reduce read of it (own
        partial + the peers'), r ⊙ w_norm stored (bf16), its Σ r² (left in the scratch sq, [M, RBD], zeroed
        afterwards with `zero`) into the tokens' sums; re-arms the row block's counter for the next step"""
        cute.arch.fence_acq_rel_gpu()
        for idx in cutlass.range(tid, M * RBD, THREADS):
            t = idx // RBD
            rl = idx - t * RBD
            tot_ = mCoef[0] * mLat[0, t, rb * RBD + rl]
            for p_ in cutlass.range_constexpr(1, TP):
                tot_ = tot_ + mCoef[p_] * mLat[p_, t, rb * RBD + rl]
            mR[t, rb * RBD + rl] = (tot_ * mNorm[0, rb * RBD + rl].to(Float32)).to(BFloat16)
            sq[t, rl] = tot_ * tot_
        cute.arch.barrier()
        rms_sumsq()(sq, mSsq, M, RBD, WARPS)
        cute.arch.barrier()  # sq is free for a later row block
        if const_expr(zero):
            for idx in cutlass.range(tid, M * RBD, THREADS):
                sq[idx // RBD, idx % RBD] = Float32(0.0)
        if tid == 0:
            mCnt[rb] = Int32(0)  # re-arm for the next step
            if const_expr(TR):
                stamp(mTrace, bx, 6 + 2 * TRACE_ITEMS)

    @cute.jit
    def complete_row_block(rb: Int32, mine: Int32, nact: Int32, flag: cute.Tensor, sq: cute.Tensor,
                           mLat: cute.Tensor, mCoef: cute.Tensor, mR: cute.Tensor, mNorm: cute.Tensor,
                           mSsq: cute.Tensor, mCnt: cute.Tensor, M: Int32, tid: Int32, bx: Int32, mTrace: cute.Tensor,
                           zero: Constexpr):
        """(all threads, inlined) the end of row block rb's flush once its red.adds are out (right after them, or
        with 'lazy' an item later): the fence, the counter's atomic of this CTA's `mine` expert items and, if this
        CTA completed the row block, its all-reduce read with `sq` as scratch (`allreduce_rows`' `zero`)"""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        if tid == 0:
            old = cute.arch.atomic_add(mCnt.iterator + rb, mine, sem="acq_rel", scope="gpu")
            flag[0] = Int32(old + mine == nact)
            if const_expr(TR):
                stamp(mTrace, bx, 5 + 2 * TRACE_ITEMS)
        cute.arch.barrier()
        if flag[0] != 0:  # every expert of the row block is in: one-shot all-reduce read of it
            allreduce_rows(rb, sq, mLat, mCoef, mR, mNorm, mSsq, mCnt, M, tid, bx, mTrace, zero)
        cute.arch.barrier()

    @cute.jit
    def flusher(lo_e: Int32, hi_e: Int32, nact: Int32, acc: cute.Tensor, fflag: cute.Tensor, mLat: cute.Tensor,
                mCoef: cute.Tensor, mCnt: cute.Tensor, mR: cute.Tensor, mNorm: cute.Tensor, mSsq: cute.Tensor,
                M: Int32, f: Int32, bx: Int32, mTrace: cute.Tensor):
        """(the flush warps, thread f of FW_THREADS, inlined; 'fwarp') for each row block of the CTA's expert run
        [lo_e, hi_e), in order: wait until the other warps hand it over (named barrier 4 + s % 2: they arrive,
        these warps sync), add the acc half s % 2 into the rank's latent partial (a 4-word red.add per (token, 4
        rows)) and empty it, give the half back (barrier 6 + s % 2, except after the last row block, whose half
        nobody reuses), then the fence and, on thread 0, the counter's atomic of the CTA's expert items of the row
        block; if that completed the row block: its one-shot all-reduce read (own partial + the peers', a 4-word
        load per (token, 4 rows) and rank, FW_PAIRS of them in flight a thread), r ⊙ w_norm stored (bf16), Σ r²
        per token into mSsq (one warp holds one token's 128 rows), and the counter re-armed. The hand-over
        barriers alternate by parity so that an arrival for row block s + 1 can never fall into row block s's
        generation; barrier 8 is the flush warps' own."""
        lane = f % 32
        nfl = Int32(0)
        if hi_e > lo_e:
            nfl = (hi_e - 1) // nact - lo_e // nact + 1
        coef = [mCoef[p_] for p_ in range(TP)]
        lat = mLat.iterator.toint()
        for s_ in cutlass.range(nfl):
            rb = lo_e // nact + s_
            ab = (s_ % 2) * RBD
            mine = cutlass.min(hi_e, (rb + 1) * nact) - cutlass.max(lo_e, rb * nact)
            if s_ % 2 == 0:
                cute.arch.barrier(barrier_id=4, number_of_threads=MAIN + FW_THREADS)
            else:
                cute.arch.barrier(barrier_id=5, number_of_threads=MAIN + FW_THREADS)
            if const_expr(TR):
                if f == 0:
                    stamp(mTrace, bx, 4 + 2 * TRACE_ITEMS)
            for idx in cutlass.range(f, M * 32, FW_THREADS):  # (token, 4 rows) pairs: RBD == 128
                t = idx // 32
                rl = ab + 4 * (idx - 32 * t)
                red4(lat + Int64(t * L + rb * RBD + rl - ab) * 4, acc[t, rl], acc[t, rl + 1], acc[t, rl + 2],
                     acc[t, rl + 3])
                for e_ in cutlass.range_constexpr(4):
                    acc[t, rl + e_] = Float32(0.0)
            if s_ + 1 < nfl:
                if s_ % 2 == 0:
                    cute.arch.barrier_arrive(barrier_id=6, number_of_threads=MAIN + FW_THREADS)
                else:
                    cute.arch.barrier_arrive(barrier_id=7, number_of_threads=MAIN + FW_THREADS)
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=8, number_of_threads=FW_THREADS)
            if f == 0:
                old = cute.arch.atomic_add(mCnt.iterator + rb, mine, sem="acq_rel", scope="gpu")
                fflag[0] = Int32(old + mine == nact)
                if const_expr(TR):
                    stamp(mTrace, bx, 5 + 2 * TRACE_ITEMS)
            cute.arch.barrier(barrier_id=8, number_of_threads=FW_THREADS)
            if fflag[0] != 0:  # every expert of the row block is in: its one-shot all-reduce read
                cute.arch.fence_acq_rel_gpu()
                for c0 in cutlass.range(f, M * 32, FW_THREADS * FW_PAIRS):
                    ts = [cutlass.min((c0 + FW_THREADS * u) // 32, M - 1) for u in range(FW_PAIRS)]  # clamped
                    row = rb * RBD + 4 * lane
                    tots = [[Float32(0.0)] * 4 for u in range(FW_PAIRS)]
                    for pc in cutlass.range_constexpr(0, TP, FW_PEERS):  # FW_PEERS ranks' loads in flight at once
                        parts = [[ld4(lat + Int64((p_ * M + ts[u]) * L + row) * 4) for p_ in range(pc, pc + FW_PEERS)]
                                 for u in range(FW_PAIRS)]
                        for u in cutlass.range_constexpr(FW_PAIRS):
                            for e_ in cutlass.range_constexpr(4):
                                for j_ in cutlass.range_constexpr(FW_PEERS):
                                    tots[u][e_] = tots[u][e_] + coef[pc + j_] * parts[u][j_][e_]
                    for u in cutlass.range_constexpr(FW_PAIRS):
                        ok = c0 + FW_THREADS * u < M * 32  # the same for the whole warp (one token)
                        sq_ = Float32(0.0)
                        for e_ in cutlass.range_constexpr(4):
                            tot_ = tots[u][e_]
                            sq_ = sq_ + tot_ * tot_
                            if ok:
                                mR[ts[u], row + e_] = (tot_ * mNorm[0, row + e_].to(Float32)).to(BFloat16)
                        sq_ = cute.arch.warp_reduction_sum(sq_)
                        if lane == 0 and ok:
                            cute.arch.red(mSsq.iterator + ts[u], sq_, op="add", dtype=Float32, sem="relaxed",
                                          scope="gpu")
                if f == 0:
                    mCnt[rb] = Int32(0)  # re-arm for the next step
                    if const_expr(TR):
                        stamp(mTrace, bx, 6 + 2 * TRACE_ITEMS)
            cute.arch.barrier(barrier_id=8, number_of_threads=FW_THREADS)  # fflag is free for the next row block
        if const_expr(TR):
            if f == 0:
                stamp(mTrace, bx, 7 + 2 * TRACE_ITEMS)

    @cute.jit
    def down_main(mA: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor, mMeta: cute.Tensor, mAct: cute.Tensor,
                  mList: cute.Tensor, mTok: cute.Tensor, mWe: cute.Tensor, mLat: cute.Tensor, mCoef: cute.Tensor,
                  mCnt: cute.Tensor, mR: cute.Tensor, mAsh: cute.Tensor, mWd: cute.Tensor, mSh: cute.Tensor,
                  mNorm: cute.Tensor, mSsq: cute.Tensor, mWup: cute.Tensor, mF: cute.Tensor, mTrace: cute.Tensor,
                  raw: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, _, _ = cute.arch.block_idx()
        if const_expr(TR):
            if tid == 0:
                stamp(mTrace, bx, 0)
        M = mLat.shape[1]
        if const_expr(PDL and not LATE):  # the tail reads nothing of this launch before its own wait
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(MERGED):  # over moe_up's phase's buffers; the routing tables as moe_up's prologue staged them
            smem = SmemCarve(raw, down_pipe_smem_bytes(key))
            s_meta, s_act, s_list, s_tok = carve_tables(smem, MXT)
        else:
            smem = cutlass.utils.SmemAllocator()
        ring_w = smem.allocate_tensor(Int32, cute.make_layout((ST, RBD, WROW), stride=(RBD * WROW, WROW, 1)),
                                      byte_alignment=128)
        ring_s = smem.allocate_tensor(Uint8, cute.make_layout((ST, RBD, SROW), stride=(RBD * SROW, SROW, 1)),
                                      byte_alignment=128)
        acc = smem.allocate_tensor(Float32, cute.make_layout((MXT, ACC_W), stride=(ACC_W, 1)), byte_alignment=16)
        # moe_up's outputs and the routing tables, once, in shared memory: an item's arithmetic waits on no
        # global round trip. a is kept as bf16 pairs in the mma's B order (per 8 codes: (0,4) (2,6) (1,5) (3,7))
        s_a = smem.allocate_tensor(Int32, cute.make_layout((TOPK * MXT, I // 2), stride=(I // 2, 1)),
                                   byte_alignment=16)
        s_ash = smem.allocate_tensor(BFloat16, cute.make_layout((MXT, S), stride=(S, 1)), byte_alignment=16)
        if const_expr(not MERGED):
            s_act = smem.allocate_tensor(Int32, cute.make_layout((E,)), byte_alignment=16)
            s_list = smem.allocate_tensor(Int32, cute.make_layout((E, 2), stride=(2, 1)), byte_alignment=16)
            s_tok = smem.allocate_tensor(Int32, cute.make_layout((TOPK * MXT,)), byte_alignment=16)
        s_we = smem.allocate_tensor(Float32, cute.make_layout((TOPK * MXT,)), byte_alignment=16)
        bars = smem.allocate_tensor(cutlass.Int64, cute.make_layout((ST,)), byte_alignment=8)
        flag = smem.allocate_tensor(Int32, cute.make_layout((2,)), byte_alignment=16)
        if const_expr(AFL or LAZY):  # the all-reduce's r² (acc may hold the next row block's sum by then)
            sq = smem.allocate_tensor(Float32, cute.make_layout((MXT, RBD), stride=(RBD, 1)), byte_alignment=16)
        if const_expr(KS > 1):  # each K part's sums of an item (mma accumulator layout)
            kpart = smem.allocate_tensor(Float32, cute.make_layout((KS, RG, 32, 4), stride=(RG * 128, 128, 4, 1)),
                                         byte_alignment=16)
        if const_expr(PRO):
            # the prologue's two round trips (routing tables; a and a_shared), one mbarrier each
            pbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((2,)), byte_alignment=8)
            if const_expr(not MERGED):
                s_meta = smem.allocate_tensor(Int32, cute.make_layout((4,)), byte_alignment=16)
            if tid == 0:
                cute.arch.mbarrier_init(pbar.iterator, 1)
                cute.arch.mbarrier_init(pbar.iterator + 1, 1)
            ring_init()(bars, ST)
            if const_expr(MERGED):  # staged by moe_up's prologue (the merged kernel's CTA barriers lie between)
                nact = s_meta[0]
            else:  # the routing tables come from moe_front / moe_route: complete before this launch
                nact = bulk_tables(mMeta, mAct, mList, mTok, s_meta, s_act, s_list, s_tok, pbar, M, tid)
        else:
            nact = mMeta[0]  # the routing tables come from moe_front / moe_route: complete before this launch
        ne = NBD * nact
        # this CTA's items: a run of expert items [lo_e, hi_e) then a run of shared items [lo_s, hi_s)
        if const_expr(BAL):  # every CTA an equal share of each kind (expert items cost far more arithmetic)
            if const_expr(PAIR):
                q_e = ne // G
                r_e = ne - q_e * G
                lo_e = bx * q_e + cutlass.min(bx, r_e)
                hi_e = lo_e + q_e + Int32(bx < r_e)
                j_s = bx - r_e
                j_s = j_s + Int32(j_s < 0) * G
                lo_s = j_s * (NSH // G) + cutlass.min(j_s, Int32(NSH % G))
                hi_s = lo_s + NSH // G + Int32(j_s < NSH % G)
            else:
                lo_e = (bx * ne) // G
                hi_e = ((bx + 1) * ne) // G
                bs = G - 1 - bx if SWAP else bx
                lo_s = (bs * NSH) // G
                hi_s = ((bs + 1) * NSH) // G
        else:  # one contiguous run of (expert items, then shared items)
            lo = (bx * (ne + NSH)) // G
            hi = ((bx + 1) * (ne + NSH)) // G
            lo_e = cutlass.min(lo, ne)
            hi_e = cutlass.min(hi, ne)
            lo_s = cutlass.max(lo, ne) - ne
            hi_s = cutlass.max(hi, ne) - ne
        n_e = hi_e - lo_e
        n_items = n_e + hi_s - lo_s

        # the CTA's i-th item as a global item index is b0 + i + (i >= cut) * jmp: expert items first (from lo_e,
        # then the shared ones from ne + lo_s), or ('sfirst') shared items first; written out at its four uses: a
        # helper closing over Int32 is refused by the DSL (closure capture) and a module-level one recursed in its
        # preprocessor
        if const_expr(SF):
            b0, cut, jmp = ne + lo_s, hi_s - lo_s, lo_e - ne - hi_s
        else:
            b0, cut, jmp = lo_e, n_e, ne + lo_s - hi_e
        if const_expr(not PRO):
            stage_routing_tables()(mAct, mList, mTok, s_act, s_list, s_tok, nact, M, THREADS)
            cute.arch.barrier()
        for idx in cutlass.range(tid, nact, THREADS):  # routing weight of every (expert, token) pair
            e = s_act[idx]
            off = s_list[idx, 0]
            num = s_list[idx, 1]
            wq = [mWe[e, s_tok[off + cutlass.min(q, num - 1)]] for q in range(MXT)]  # loads in flight together
            for q in cutlass.range_constexpr(MXT):
                if q < num:
                    s_we[off + q] = wq[q]
        if const_expr(not PRO):
            ring_init()(bars, ST)
        w_base = ring_w.iterator.toint()
        s_base = ring_s.iterator.toint()
        if tid == 0:  # ('sfirst': the whole ring: no slot waits for moe_up)
            for s in cutlass.range_constexpr(ST if SF == 1 else EARLY):
                if s < n_items:
                    issue(b0 + s + Int32(s >= cut) * jmp, s, ne, nact, s_act, mW2, mS2, mWd, bars, w_base, s_base)
            if const_expr(TR):
                stamp(mTrace, bx, 1)
        if const_expr(PT > 0):  # the tail's last W_up rows into L2
            if tid == 32:
                base = mWup.iterator.toint() + Int64((D - PT) * L * 2)
                for k in cutlass.range(bx, PT_N, G):
                    pf(base + Int64(k) * PF_CHUNK, cutlass.min(PF_CHUNK, PT_BYTES - k * PF_CHUNK))
        for idx in cutlass.range(tid, MXT * ACC_W, THREADS):
            acc[idx // ACC_W, idx % ACC_W] = Float32(0.0)
        if const_expr(FLAGW):  # ('dflag') moe_up's CTAs counted done, instead of its grid's completion
            if tid == 0:
                done = Int32(0)
                while done < G:
                    done = cute.arch.load(mMeta.iterator + DONE_FLAG, Int32, sem="acquire", scope="gpu")
                cute.arch.fence_proxy("async.global")  # a and a_sh, written by generic stores, read by bulk copies
            if const_expr(not PRO):  # every thread reads a with generic loads
                cute.arch.barrier()
        elif const_expr(PDL and not SF):  # a, a_sh and the zeroed latent partial come from moe_up
            cute.arch.griddepcontrol_wait()
        if const_expr(key.route_reset):  # ('uflag') moe_up is complete: no CTA polls the routing flag any more
            if bx == 0 and tid == 0:
                mMeta[ROUTED_FLAG] = Int32(0)
        if const_expr(TR and not SF):
            if tid == 0:
                stamp(mTrace, bx, 2)
        sAs = cute.zipped_divide(s_ash, (1, 8))
        if const_expr(SF):  # a_shared from the front's pre-activations (complete before this launch), no wait
            for idx in cutlass.range(tid, M * S, THREADS):
                t = idx // S
                cc = idx - t * S
                s_ash[t, cc] = _situ(mF[t, SH0 + cc], mF[t, SH0 + S + cc], BETA, BETA_LIN).to(BFloat16)
        elif const_expr(PRO):
            bulk_acts(mA, mAsh, s_a, s_ash, pbar, M, tid)
        else:
            gA = cute.zipped_divide(mA, (1, 8))
            gAs = cute.zipped_divide(mAsh, (1, 8))
            for idx in cutlass.range(tid, M * TOPK * (I // 8), THREADS):
                i = idx // (I // 8)
                o = idx - i * (I // 8)
                v = gA[(None, (i, o))].load().to(Float32)  # a[i, 8o .. 8o + 7] (exact in fp32)
                store_b_order(s_a, i, o, [v[k] for k in range(8)])
            for idx in cutlass.range(tid, M * (S // 8), THREADS):
                t = idx // (S // 8)
                sAs[(None, (t, idx - t * (S // 8)))].store(gAs[(None, (t, idx - t * (S // 8)))].load())
        cute.arch.barrier()
        if tid == 0:  # the rest of the ring, now that a is in
            for s in cutlass.range_constexpr(ST if SF == 1 else EARLY, ST):
                if s < n_items:
                    issue(b0 + s + Int32(s >= cut) * jmp, s, ne, nact, s_act, mW2, mS2, mWd, bars, w_base, s_base)
            if const_expr(TR):
                stamp(mTrace, bx, 3)
        if const_expr(PDL and LATE and not SF):  # a and the ring's requests are out: the tail's W_up may start now
            cute.arch.griddepcontrol_launch_dependents()
        g = lane // 4
        c = lane - 4 * g
        gW = cute.zipped_divide(ring_w, (1, 1, 4))
        sA = cute.zipped_divide(s_a, (1, 4))
        gW4 = cute.zipped_divide(cute.make_tensor(ring_w.iterator, cute.make_layout((ST, RBD * WROW), stride=(RBD * WROW, 1))),
                                 (1, 4))
        apend = Int32(0)  # (aflush) the producer warp is emptying acc: compute warps sync on barrier 1 first
        pend = Int32(-1)  # (lazy) the row block whose red.adds are out and whose fence and count are pending
        pmine = Int32(0)  # (lazy) its expert items in this CTA
        chk = Int32(-1)  # (aflush) the row block whose completion flag is read after the next CTA barrier
        nsw = Int32(0)  # (fwarp) row blocks handed to the flush warp so far; acc half nsw % 2 takes the sums
        n_loop = n_items * Int32(warp < FWARP) if FW else n_items  # (fwarp) the flush warp walks no items
        if const_expr(SF == 2 and PDL):  # the first flush warp: a's bulk copy as soon as moe_up is complete
            if tid == MAIN:
                if n_e > 0:
                    cute.arch.griddepcontrol_wait()
                    if const_expr(TR):
                        stamp(mTrace, bx, 2)
                    issue_acts(mA, mAsh, s_a, s_ash, pbar, M, False)
        for i in cutlass.range(n_loop):
            k = b0 + i + Int32(i >= cut) * jmp
            ie = i  # the item's place in the CTA's run of expert items
            if const_expr(SF):
                ie = i - cut
                if i == cut:  # the first expert item: now moe_up's a (the compute and producer warps)
                    if const_expr(PDL and SF == 1):
                        cute.arch.griddepcontrol_wait()
                        if const_expr(TR):
                            if tid == 0:
                                stamp(mTrace, bx, 2)
                    # ('sfirst2': the first flush warp has issued a's copy; without PDL, thread 0 issues it here)
                    bulk_acts(mA, mAsh, s_a, s_ash, pbar, M, tid, MAIN, False, not (SF == 2 and PDL))
                    cute.arch.barrier(barrier_id=3, number_of_threads=MAIN)
                    if const_expr(PDL and LATE):
                        cute.arch.griddepcontrol_launch_dependents()
            slot = i % ST
            if k < ne:
                rb = k // nact
                jj = k - rb * nact
                off = s_list[jj, 0]
                num = s_list[jj, 1]
                pi = off + cutlass.min(g, num - 1)  # this lane's B column: a pair of the expert; clamped
                r0 = 16 * (warp % RG if KS > 1 else warp) + g
                ab = (nsw % 2) * RBD if FW else 0  # the acc half this row block's sums go to
                if warp < WARPS:
                    if const_expr(key.spin_wait):
                        spin((bars.iterator + slot).toint(), (i // ST) % 2)
                    else:
                        cute.arch.mbarrier_wait(bars.iterator + slot, (i // ST) % 2)
                    if const_expr(TR):
                        if tid == 0 and i < TRACE_ITEMS:
                            stamp(mTrace, bx, 4 + 2 * i)
                    if const_expr(KS == 1):
                        tot = expert_rows(gW, ring_s, sA, slot, r0, c, pi, KPARTS[0])
                    else:  # each K part into shared memory, then the row group's first warp sums them
                        for h in cutlass.range_constexpr(KS):
                            if warp // RG == h:
                                th = expert_rows(gW, ring_s, sA, slot, r0, c, pi, KPARTS[h])
                                for r in cutlass.range_constexpr(4):
                                    kpart[h, warp - h * RG, lane, r] = th[r]
                        cute.arch.barrier(barrier_id=2, number_of_threads=32 * WARPS)
                        tot = [kpart[0, warp % RG, lane, r] for r in range(4)]
                        for h in cutlass.range_constexpr(1, KS):
                            for r in cutlass.range_constexpr(4):
                                tot[r] = tot[r] + kpart[h, warp % RG, lane, r]
                    if const_expr(AFL):
                        if apend != 0:  # the producer warp has emptied acc (its bar.arrive on barrier 1)
                            cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
                    if const_expr(KS == 1):
                        add_rows(acc, tot[0], tot[1], tot[2], tot[3], s_tok, s_we, off, num, c, r0, ab)
                    else:
                        if warp < RG:  # the row group's first warp adds its rows into the CTA's sum
                            add_rows(acc, tot[0], tot[1], tot[2], tot[3], s_tok, s_we, off, num, c, r0, ab)
                if const_expr(FW):  # the slot is free; the row block's sum may be complete
                    cute.arch.barrier(barrier_id=3, number_of_threads=MAIN)
                else:
                    cute.arch.barrier()
                if const_expr(TR):
                    if tid == 0 and i < TRACE_ITEMS:
                        stamp(mTrace, bx, 5 + 2 * i)
                if tid == REFILL:
                    if i + ST < n_items:
                        if const_expr(FENCE):
                            cute.arch.fence_view_async_shared()
                        issue(b0 + i + ST + Int32(i + ST >= cut) * jmp, slot, ne, nact, s_act, mW2, mS2, mWd, bars, w_base, s_base)
                if const_expr(AFL):
                    apend = Int32(0)  # the compute warps synced on barrier 1 above if it was pending
                    if chk >= 0:  # the previous row block's flag, stored before this item's barrier
                        if flag[chk % 2] != 0:
                            allreduce_rows(chk, sq, mLat, mCoef, mR, mNorm, mSsq, mCnt, M, tid, bx, mTrace, False)
                        chk = Int32(-1)
                    if ie + 1 == n_e or (k + 1) // nact != rb:  # this CTA's last item of the row block
                        if warp == WARPS:  # the producer warp, while the compute warps go on
                            flush_rows(rb, k + 1 - cutlass.max(lo_e, rb * nact), nact, acc, flag, mLat, mCnt, M,
                                       lane, bx, mTrace)
                        apend = Int32(1)
                        chk = rb
                if const_expr(LAZY):  # the previous row block's fence and count, an item after its red.adds
                    if pend >= 0:
                        complete_row_block(pend, pmine, nact, flag, sq, mLat, mCoef, mR, mNorm, mSsq, mCnt, M, tid,
                                           bx, mTrace, False)
                        pend = Int32(-1)
                if const_expr(FW):  # hand a finished row block to the flush warp (barriers by parity, see flusher)
                    if ie + 1 == n_e or (k + 1) // nact != rb:
                        if nsw % 2 == 0:
                            cute.arch.barrier_arrive(barrier_id=4, number_of_threads=MAIN + FW_THREADS)
                        else:
                            cute.arch.barrier_arrive(barrier_id=5, number_of_threads=MAIN + FW_THREADS)
                        if nsw > 0:  # the other half, flushed a row block ago, must be empty again
                            if nsw % 2 == 0:
                                cute.arch.barrier(barrier_id=7, number_of_threads=MAIN + FW_THREADS)
                            else:
                                cute.arch.barrier(barrier_id=6, number_of_threads=MAIN + FW_THREADS)
                        nsw = nsw + 1
                if const_expr(not AFL and not FW):  # every thread adds its share of the row block's sum at once
                    if ie + 1 == n_e or (k + 1) // nact != rb:  # this CTA's last item of the row block
                        if const_expr(TR):
                            if tid == 0:
                                stamp(mTrace, bx, 4 + 2 * TRACE_ITEMS)
                        for idx in cutlass.range(tid, M * RBD, THREADS):
                            t = idx // RBD
                            rl = idx - t * RBD
                            cute.arch.red(mLat.iterator + (t * L + rb * RBD + rl), acc[t, rl], op="add",
                                          dtype=Float32, sem="relaxed", scope="gpu")
                            acc[t, rl] = Float32(0.0)
                        if const_expr(LAZY):  # the fence and the count after the next item
                            cute.arch.barrier()  # acc is empty for the next row block
                            pend = rb
                            pmine = k + 1 - cutlass.max(lo_e, rb * nact)
                        else:  # the fence, the count and perhaps the all-reduce now, acc (empty) as scratch
                            complete_row_block(rb, k + 1 - cutlass.max(lo_e, rb * nact), nact, flag, acc, mLat, mCoef,
                                               mR, mNorm, mSsq, mCnt, M, tid, bx, mTrace, True)
            else:  # shared experts' down projection, rows n0 .. n0 + RSH: this rank's partial
                n0 = (k - ne) * RSH
                sgrp = lane // GS
                sgl = lane - sgrp * GS
                if warp < SHW:
                    if const_expr(key.spin_wait):
                        spin((bars.iterator + slot).toint(), (i // ST) % 2)
                    else:
                        cute.arch.mbarrier_wait(bars.iterator + slot, (i // ST) % 2)
                    if const_expr(TR):
                        if tid == 0 and i < TRACE_ITEMS:
                            stamp(mTrace, bx, 4 + 2 * i)
                    for q in cutlass.range_constexpr(SHQ):
                        rr = (q * SHW + warp) * RPWS + sgrp
                        wv = []
                        for j in cutlass.range_constexpr(SH_VEC):
                            # the slot holds RSH rows of 2·S bytes back to back: row rr starts at word rr·S/2
                            q4 = gW4[(None, (slot, (rr * SH_WORDS) // 4 + sgl + GS * j))].load()
                            f = []
                            for u in cutlass.range_constexpr(4):
                                lo_, hi_ = unpack(q4[u])
                                f += [lo_, hi_]
                            wv.append(f)
                        for t in cutlass.range(M):
                            p = Float32(0.0)
                            for j in cutlass.range_constexpr(SH_VEC):
                                av = sAs[(None, (t, sgl + GS * j))].load().to(Float32)
                                for kk in cutlass.range_constexpr(8):
                                    p = p + wv[j][kk] * av[kk]
                            for o in cutlass.range_constexpr(GS.bit_length() - 1):
                                p = p + cute.arch.shuffle_sync_bfly(p, offset=GS >> (o + 1))
                            if sgl == 0:
                                mSh[0, t, n0 + rr] = p.to(BFloat16)
                if const_expr(FW):
                    cute.arch.barrier(barrier_id=3, number_of_threads=MAIN)
                else:
                    cute.arch.barrier()
                if const_expr(TR):
                    if tid == 0 and i < TRACE_ITEMS:
                        stamp(mTrace, bx, 5 + 2 * i)
                if tid == REFILL:
                    if i + ST < n_items:
                        if const_expr(FENCE):
                            cute.arch.fence_view_async_shared()
                        issue(b0 + i + ST + Int32(i + ST >= cut) * jmp, slot, ne, nact, s_act, mW2, mS2, mWd, bars, w_base, s_base)
                if const_expr(AFL):
                    if chk >= 0:  # the last row block's flag, stored before this item's barrier
                        if flag[chk % 2] != 0:
                            allreduce_rows(chk, sq, mLat, mCoef, mR, mNorm, mSsq, mCnt, M, tid, bx, mTrace, False)
                        chk = Int32(-1)
                if const_expr(LAZY):
                    if pend >= 0:
                        complete_row_block(pend, pmine, nact, flag, sq, mLat, mCoef, mR, mNorm, mSsq, mCnt, M, tid,
                                           bx, mTrace, False)
                        pend = Int32(-1)
        if const_expr(LAZY):  # a row block that ended with the CTA's last item
            if pend >= 0:
                complete_row_block(pend, pmine, nact, flag, sq, mLat, mCoef, mR, mNorm, mSsq, mCnt, M, tid, bx, mTrace,
                                   False)
        if const_expr(AFL):
            if apend != 0:  # balance the producer's last bar.arrive on barrier 1
                if warp < WARPS:
                    cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
            cute.arch.barrier()  # a flush after the last item: its flag is stored
            if chk >= 0:
                if flag[chk % 2] != 0:
                    allreduce_rows(chk, sq, mLat, mCoef, mR, mNorm, mSsq, mCnt, M, tid, bx, mTrace, False)
        if const_expr(SF and PDL):  # a CTA without expert items (or the flush warps) has not waited yet
            if warp >= FWARP or n_e == 0:
                cute.arch.griddepcontrol_wait()
        if const_expr(FW):
            if warp >= FWARP:
                flusher(lo_e, hi_e, nact, acc, flag, mLat, mCoef, mCnt, mR, mNorm, mSsq, M, tid - MAIN, bx, mTrace)
        if const_expr(TR):
            if tid == 0:
                stamp(mTrace, bx, TRACE_SLOTS - 1)
        if const_expr(FLAGW):  # the last CTA past the counter re-arms it (the next moe_up runs after the tail)
            if tid == 0:
                passed = cute.arch.atomic_add(mMeta.iterator + PASS_COUNT, Int32(1), sem="relaxed", scope="gpu")
                if passed == G - 1:
                    mMeta[DONE_FLAG] = Int32(0)
                    mMeta[PASS_COUNT] = Int32(0)

    @cute.kernel
    def down_kernel(mA: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor, mMeta: cute.Tensor, mAct: cute.Tensor,
                    mList: cute.Tensor, mTok: cute.Tensor, mWe: cute.Tensor, mLat: cute.Tensor, mCoef: cute.Tensor,
                    mCnt: cute.Tensor, mR: cute.Tensor, mAsh: cute.Tensor, mWd: cute.Tensor, mSh: cute.Tensor,
                    mNorm: cute.Tensor, mSsq: cute.Tensor, mWup: cute.Tensor, mF: cute.Tensor, mTrace: cute.Tensor):
        down_main(mA, mW2, mS2, mMeta, mAct, mList, mTok, mWe, mLat, mCoef, mCnt, mR, mAsh, mWd, mSh, mNorm, mSsq,
                  mWup, mF, mTrace, mMeta)  # (raw: a stand-in, only the merged kernel carves)

    @cute.jit
    def down_host(mA: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor, mMeta: cute.Tensor, mAct: cute.Tensor,
                  mList: cute.Tensor, mTok: cute.Tensor, mWe: cute.Tensor, mLat: cute.Tensor, mCoef: cute.Tensor,
                  mCnt: cute.Tensor, mR: cute.Tensor, mAsh: cute.Tensor, mWd: cute.Tensor, mSh: cute.Tensor, mNorm: cute.Tensor,
                  mSsq: cute.Tensor, mWup: cute.Tensor, mF: cute.Tensor, mTrace: cute.Tensor, stream):
        down_kernel(mA, mW2, mS2, mMeta, mAct, mList, mTok, mWe, mLat, mCoef, mCnt, mR, mAsh, mWd, mSh, mNorm, mSsq,
                    mWup, mF, mTrace).launch(grid=(G, 1, 1), block=(THREADS, 1, 1), smem=down_pipe_smem_bytes(key), stream=stream,
                                 use_pdl=PDL, **carveout)

    return down_host, down_pipe_args(sh, NBD), down_main


# the names of down_pipe_args' stand-ins, in order (the stream last, unnamed)
DOWN_PIPE_ARG_NAMES = DOWN_ARG_NAMES + ("w_up", "front_out", "trace")


def down_pipe_args(sh: MoEShape, row_blocks: int) -> tuple:
    """Compile-time stand-ins of the pipelined moe_down's arguments: the direct kernel's
    (`moe.expert_down_args`), then the tail's W_up (whose last rows it may prefetch into L2), the front kernel's
    fp32 output (whose shared gate/up pre-activations 'sfirst' reads), the timeline buffer (`trace_arg`), then
    the stream."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32

    fake = cute.runtime.make_fake_compact_tensor
    *head, stream = expert_down_args(sh, row_blocks)
    return (*head, fake(BFloat16, (D, L), stride_order=(1, 0), assumed_align=16),
            fake(Float32, (cute.sym_int(), sh.ncat), stride_order=(1, 0), assumed_align=16), trace_arg(), stream)


# --------------------------------------------------------------------------- registry


# earlier package defaults, kept for comparison, spelled as pipe_variant_name writes them
RUN20 = "dec1-pad0-pair0-late0-downk1-fwarp0"  # the run-20 kernels (the defaults from run 20 to run 23)
RUN17 = "pro0-epi0-dec1-pad0-prod0-swap0-pair0-late0-downk1-fwarp0"  # the run-17 kernels (the defaults before run 19)
RUN24 = "dec2-pair0-fwarp0"  # the run-24 kernels (the defaults from run 24 to run 26)
RUN27 = "pair0-fwarp0"  # the run-27 kernels (the defaults from run 27 to run 34)
RUN35 = "fwarp0"  # the run-35 kernels (the defaults from run 35 to run 38)
# the variants compiled ahead of time at TP8 for on-GPU comparisons (`kimi-decode moe --executors fused@...`): the
# run-20 and run-17 kernels, each later option turned off alone, the async flush (measured slower, run 22) and
# moe_up with 28 compute warps (no faster, run 23), the run-24 kernels (the shift pair decode) and moe_up's z in its
# last ring slots (zlast, no faster, run 26), moe_up with 16 compute warps (slower, run 27) and its half super-blocks
# dealt for equal sub-partitions (bal, slower, run 28), the run-27 kernels, and the options of runs 30-34 (f16, lazy,
# zswz: docs/fused_moe.md), moe_down for one token (downmax1, the cotail's), the finished-CTA counter instead of
# moe_up's grid completion (dflag, dflagt; runs 61-64, no faster) and moe_down's shared items before its wait
# (sfirst; run 63, slower), and moe_up's first ring slots requested on the front's routing flag before its wait
# (uflag1, uflag3). Others (pf1, tailN, contig, upearlyN, downearlyN, ...) need the
# compiler on the GPU host
# --------------------------------------------------------------------------- moe_up and moe_down in one launch


@dataclass(frozen=True)
class MoEExpertsPipeKey:
    """'merge': the pipelined moe_up and moe_down as two phases of one persistent launch (one CTA per SM, moe_down's
    warps). Each CTA walks its gate/up items, counts itself done on meta[DONE_FLAG] ('dflagt': a CTA barrier, then
    thread 0's gpu-scope fence and release add), retires its mbarriers, requests its first moe_down ring slots (they
    read only weights and the routing tables, which stay in shared memory where moe_up's prologue put them), polls the
    counter until every CTA has counted (acquire) and goes on with moe_down's items; moe_down's buffers lie over
    moe_up's (`SmemCarve`). Between the two launches this replaces lay a CTA's exit, the next CTA's start, the grid's
    completion and flush, and moe_down's first ring slot landing about 3 µs after its CTA started (run 66's
    timelines). A timeline build (trace) records each phase's checkpoints as the two kernels' builds do (moe_down's
'start' is its phase's). The counter needs every CTA resident at once: one per SM, `ctas` SMs at least (FusedMoE refuses
    smaller devices). Built from `up` and `down` with `merged_threads` / `merged` set here."""
    up: MoEUpPipeKey
    down: MoEDownPipeKey

    def __post_init__(self):
        if not (self.up.done_flag == 2 and self.down.flag_wait and self.down.merged):
            raise ValueError("the merged expert kernel counts moe_up's CTAs done on dflagt's counter: up.done_flag=2, "
                             "down.flag_wait and down.merged")
        if (self.up.shape, self.up.ctas, self.up.pdl, self.up.max_tokens, self.up.trace, self.up.arch) != \
                (self.down.shape, self.down.ctas, self.down.pdl, self.down.max_tokens, self.down.trace, self.down.arch):
            raise ValueError("the merged expert kernel's phases must agree in shape, CTAs, PDL, tokens, trace and arch")
        if self.up.merged_threads not in (0, self.down.threads):
            raise ValueError(f"moe_up's phase runs with moe_down's {self.down.threads} threads")

    @property
    def shape(self) -> MoEShape:
        return self.down.shape

    @property
    def arch(self) -> str:
        return self.down.arch

    @property
    def up_phase(self) -> MoEUpPipeKey:
        """The up key the merged kernel builds: `up` with moe_down's thread count."""
        return dataclasses.replace(self.up, merged_threads=self.down.threads)


def experts_pipe_smem_bytes(key: MoEExpertsPipeKey) -> int:
    """The shared-memory block both phases carve their buffers from (the larger of the two)."""
    return max(up_pipe_smem_bytes(key.up_phase), down_pipe_smem_bytes(key.down))


def build_experts_pipe(key: MoEExpertsPipeKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Uint8

    up, down = key.up_phase, key.down
    _, up_args, up_main = _build_up(up)
    _, down_args, down_main = _build_down(down)
    NB = experts_pipe_smem_bytes(key)
    THREADS, G, PDL = down.threads, down.ctas, down.pdl

    @cute.kernel
    def experts_kernel(mF: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                       mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mA: cute.Tensor,
                       mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor,
                       mWd: cute.Tensor, mTrU: cute.Tensor, mWe: cute.Tensor, mCoef: cute.Tensor, mCnt: cute.Tensor,
                       mR: cute.Tensor, mSh: cute.Tensor, mNorm: cute.Tensor, mWup: cute.Tensor, mTrD: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        raw = cutlass.utils.SmemAllocator().allocate_tensor(Uint8, cute.make_layout((NB,)), byte_alignment=128)
        up_main(mF, mW1, mS1, mW3, mS3, mMeta, mAct, mList, mTok, mA, mAsh, mLat, mSsq, mW2, mS2, mWd, mTrU, raw, mF, mF)
        # every thread past the first phase (its last shared-memory reads, the retired mbarriers): the second phase's
        # bulk copies may now write over what the first phase's threads read and wrote
        cute.arch.barrier()
        if tid == 0:
            cute.arch.fence_view_async_shared()
        down_main(mA, mW2, mS2, mMeta, mAct, mList, mTok, mWe, mLat, mCoef, mCnt, mR, mAsh, mWd, mSh, mNorm, mSsq,
                  mWup, mF, mTrD, raw)

    @cute.jit
    def experts_host(mF: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                     mMeta: cute.Tensor, mAct: cute.Tensor, mList: cute.Tensor, mTok: cute.Tensor, mA: cute.Tensor,
                     mAsh: cute.Tensor, mLat: cute.Tensor, mSsq: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor,
                     mWd: cute.Tensor, mTrU: cute.Tensor, mWe: cute.Tensor, mCoef: cute.Tensor, mCnt: cute.Tensor,
                     mR: cute.Tensor, mSh: cute.Tensor, mNorm: cute.Tensor, mWup: cute.Tensor, mTrD: cute.Tensor,
                     stream):
        experts_kernel(mF, mW1, mS1, mW3, mS3, mMeta, mAct, mList, mTok, mA, mAsh, mLat, mSsq, mW2, mS2, mWd, mTrU,
                       mWe, mCoef, mCnt, mR, mSh, mNorm, mWup, mTrD).launch(
            grid=(G, 1, 1), block=(THREADS, 1, 1), smem=NB + 256, stream=stream, use_pdl=PDL)

    # moe_up's arguments, then those of moe_down's it lacks: we, coef, cnt, r, sh, norm, W_up, its timeline buffer
    return experts_host, (*up_args[:-1], *(down_args[DOWN_PIPE_ARG_NAMES.index(n)] for n in MERGED_DOWN_ARGS),
                          up_args[-1])


# moe_down's arguments the merged kernel takes after moe_up's (the others are moe_up's too, or unused)
MERGED_DOWN_ARGS = ("we", "coef", "cnt", "r", "sh", "norm", "w_up", "trace")
# the merged kernel's variants built ahead of time (TP8, with and without PDL): downearly3 requests all of moe_down's
# ring slots as soon as a CTA's gate/up items are done, before the counter's wait
MERGE_VARIANTS = ("merge", "merge-downearly3", "merge-tail3584-l2h")
# its other prefetch forms, timed on an H100 in run 69 (`moe_run69_b1_h100_tp8`: 1.6-2.0 us slower than the default, as
# the three above), built only by `kimi-decode bundle --tuning` to keep the default bundle within the device carry
MERGE_HISTORY_VARIANTS = ("merge-tail2048", "merge-tail3584", "merge-tail2048-l2h")


AOT_VARIANTS = ("downmax1", "zlast", "upw16", "f16", "run35", "dflag", "dflagt", "sfirst", "sfirst2", "uflag1", "uflag3",
                "tail2048", "l2h", "tail2048-l2h", "tail3584-l2h", "shup", "shupi2", "shupi3", "shupi4", "upmax2-shupi2",
                "shupi2-tail2048-l2h", "shupi3-tail2048-l2h", "shupi2-shfront256", "shupi2-shfront384",
                "shupi2-shfront512")


def built_shared_fronts() -> list[int]:
    """The K of the 'shfrontK' variants among AOT_VARIANTS: the front keys built for them (`moe.aot_keys_for`)."""
    return sorted({parse_pipe_variant(v)[0].get("shared_front", 0) for v in AOT_VARIANTS} - {0})


# the options of runs 17-41, each measured no faster and superseded by the defaults of run 35 (their rows are in
# data/measured/history and the run tables of docs/fused_moe.md): built only by `kimi-decode bundle --tuning`, which
# keeps the default bundle within the device call's carry limit (run 70's `upmax2-shup` and `shup-l2h` with them)
HISTORY_VARIANTS = ("run20", "run17", "pro0", "epi0", "prod0", "swap0", "late0", "aflush", "dec1", "pad0", "downk1",
                    "upw28", "run24", "bal", "lazy", "zswz", "run27", "fence0", "spin", "upst5-upmax4", "upmax2-shup",
                    "shup-l2h")
# variants with a timeline build besides the defaults: since run 49 only the previous defaults (the timelines of
# the others were measured in runs 24-41 and are kept in data/measured/moe_trace_*; re-running them needs the
# compiler on the GPU host), which keeps the offline bundle within the device tool's 64 MiB
# uflag1: its ring start (dflag's, dflagt's, sfirst's, sfirst2's: runs 61-66); shupi2: whether its shared items' bytes
# arrive while the expert items compute
TRACE_VARIANTS = ("run35", "uflag1", "shupi2")


# the on/off options of parse_pipe_variant: token -> (kernel, key field)
_SWITCHES = {"pf": ("up", "prefetch_down"), "epi": ("up", "epilogue_warp"), "pad": ("up", "pad_rows"),
             "zlast": ("up", "z_last"), "bal": ("up", "balance"), "prod": ("down", "producer_warp"),
             "swap": ("down", "swap_shared"), "late": ("down", "late_trigger"), "aflush": ("down", "async_flush"),
             "pair": ("down", "pair_extras"), "lazy": ("down", "lazy_flush"), "fwarp": ("down", "flush_warp")}


def parse_pipe_variant(text: str) -> tuple[dict, dict]:
    """A '-'-joined list of options of the pipelined kernels -> (MoEUpPipeKey fields, MoEDownPipeKey fields).
    Options (X1 or bare X turns an option on, X0 off; defaults in brackets):
    pro (both kernels' prologues in one bulk round trip each) [on], epi (moe_up's epilogue warp) [on], prod
    (moe_down's producer warp) [on], swap (moe_down deals its shared items in reverse CTA order; without pair) [on], pair (moe_down
    deals the shared items' extras to the CTAs without an expert extra; replaces swap) [on], lazy (moe_down's
    flush fence, count and all-reduce an item after the row block's red.adds) [off], fwarp (moe_down's extra warps
    flush finished row blocks and do their all-reduce reads while the other warps go on; lazy and aflush imply
    fwarp0) [on], spin (both kernels' compute warps poll their slots' mbarriers; upspin / downspin one
    kernel's) [off], upstN (moe_up's ring slots) [4], upmaxN (the most tokens moe_up stages, 1..8; fewer leave room for
    slots) [8], downmaxN (the most tokens moe_down stages, 1..8; at 1 it leaves room for a tail CTA beside it) [8], fence (both kernels' proxy fence before a ring refill; upfence0 / downfence0 one kernel's) [on], late
    (moe_down lets the tail's CTAs be scheduled only once its a is staged) [on], aflush (moe_down's producer
    warp flushes finished row blocks while the compute warps go on) [off], decN (both kernels' pair decode,
    `mxfp4_decode.VERSIONS`) [3], upwN (moe_up's compute warps, 7, 14, 16 or 28) [14], downkN (moe_down's
    compute warps per row group, splitting K) [2], pad (moe_up's ring rows padded against bank conflicts) [on],
    zlast (moe_up stages z in its ring's last slots and requests the others from the prologue) [off], bal (moe_up
    deals half super-blocks so that its four sub-partitions do equal work, UP_BALANCED_HALVES; 14 compute warps
    and the epilogue warp only) [off], f16 (moe_up's codes placed as E4M3, unpacked to f16 for f16 mma.sync, z in
    f16, the scales applied per 32-code group after the mma; needs pro, not with bal) [off], zswz (moe_up's staged z
    rows padded and their chunks swizzled against bank conflicts; not with f16) [off],
    pf (moe_up prefetches moe_down's bytes into L2) [off], dflag / dflagt (moe_up's CTAs count themselves done on a
    counter that moe_down polls instead of griddepcontrol.wait; every thread fences / thread 0 alone) [off], sfirst
    (moe_down computes a_shared from the front's output and runs its shared items before waiting for moe_up;
    sfirst2 with one early ring slot and a's copy issued by a flush warp) [off], uflagN (the front sets a routing
    flag once its tables are written; moe_up polls it before its wait and requests N ring slots (its z in the last,
    as zlast), moe_down clears it) [uflag0], merge (moe_up and moe_down as the two phases of one launch, met on
    dflagt's counter: `MoEExpertsPipeKey`) [off], tailN (moe_down prefetches the tail's last N W_up
    rows) [0], l2h (L2 priorities: both rings' weight copies evict_first, the tailN prefetch evict_last) [off], shup
    (moe_up streams the shared experts' gate/up rows ahead of its expert items, the front GEMV stops before them; one
    token, upmax2 two) [off], shupiN (shup with each CTA's shared and expert items interleaved, N shared items first)
    [off], shfrontK (with shup or shupiN: the front keeps the first K shared columns' gate/up rows, moe_up streams
    the rest) [0], contig (moe_down's items as one contiguous run per CTA instead of balanced runs), upearlyN /
    downearlyN (ring slots requested before the staging) [0 / 1; upearlyN > 0 needs pro0, and pro0 alone
    means upearly1, as in run 17]; uppro0 / downpro0 one kernel's prologue only; run24 = RUN24 (the defaults of
    runs 24-26), run27 = RUN27 (the defaults of runs 27-34), run35 = RUN35 (the defaults of runs 35-38), run20 = RUN20 (the defaults of runs 20-23), run17 =
    RUN17 (run 17's kernels), each expanded
    where it stands, so that 'run17-swap1' is run
    17's kernels with the swap.
    E.g. 'pf1-tail2048', 'run17', 'pro0-contig-upearly4-downearly3' (run 13's kernels)."""
    import re

    up, down = {}, {}
    toks = text.split("-") if text else ["?"]
    for alias, spelled in (("run17", RUN17), ("run20", RUN20), ("run24", RUN24), ("run27", RUN27), ("run35", RUN35)):
        if alias in toks:  # expanded in place, so that options after it change it
            i = toks.index(alias)
            toks = toks[:i] + spelled.split("-") + toks[i + 1:]
    for tok in toks:
        if (m := re.fullmatch(r"([a-z]+?)([01]?)", tok)) and m.group(1) in _SWITCHES:  # X, X1 on; X0 off
            side, field = _SWITCHES[m.group(1)]
            (up if side == "up" else down)[field] = m.group(2) != "0"
        elif (m := re.fullmatch(r"tail(\d+)", tok)) and int(m.group(1)) <= D:
            down["prefetch_tail_rows"] = int(m.group(1))
        elif m := re.fullmatch(r"sfirst([012]?)", tok):
            down["shared_first"] = int(m.group(1) or 1)
        elif m := re.fullmatch(r"uflag(\d)", tok):  # the routing flag: N ring slots before moe_up's wait
            up["route_early"] = int(m.group(1))
            down["route_reset"] = int(m.group(1)) > 0
            if int(m.group(1)):  # z in the ring's last slot (uflag0 leaves zlast as it is)
                up["z_last"] = True
        elif tok == "merge":  # moe_up and moe_down in one launch, the phases met on dflagt's counter
            up["done_flag"] = 2
            down["flag_wait"] = down["merged"] = True
        elif m := re.fullmatch(r"dflag([01t]?)", tok):
            up["done_flag"] = {"0": 0, "t": 2}.get(m.group(1), 1)
            down["flag_wait"] = m.group(1) != "0"
        elif tok == "l2h":  # L2 priorities: the rings' weights evict_first, the tail's prefetch evict_last
            up["l2_hints"] = down["l2_hints"] = True
        elif tok == "f16":
            up["fp16"] = True
        elif tok == "shup":  # moe_up streams the shared gate/up rows (the front stops before them)
            up["shared_up"] = True
        elif m := re.fullmatch(r"shupi(\d)", tok):  # the same, each CTA's shared and expert items interleaved
            up["shared_up"], up["shared_lead"] = True, int(m.group(1))
            if not up["shared_lead"]:
                raise ValueError(f"shupiN leads with N >= 1 shared items (shup: all of them first); got {text!r}")
        elif m := re.fullmatch(r"shfront(\d+)", tok):  # the front keeps the first K shared columns' gate/up rows
            up["shared_front"] = int(m.group(1))
            if up["shared_front"] % SHARED_FRONT_STEP or not 0 < up["shared_front"]:
                raise ValueError(f"shfrontK keeps K > 0 shared columns in the front, K a multiple of "
                                 f"{SHARED_FRONT_STEP} (whole CTAs of its GEMV); got {text!r}")
        elif tok == "zswz":
            up["z_swizzle"] = True
        elif tok == "contig":
            down["balanced"] = False
        elif m := re.fullmatch(r"(up|down)early(\d)", tok):
            (up if m.group(1) == "up" else down)["early_slots"] = int(m.group(2))
        elif m := re.fullmatch(r"upst(\d)", tok):
            up["stages"] = int(m.group(1))
        elif (m := re.fullmatch(r"(up|down)max(\d)", tok)) and 1 <= int(m.group(2)) <= PIPE_MAX_M:
            (up if m.group(1) == "up" else down)["max_tokens"] = int(m.group(2))
        elif m := re.fullmatch(r"(up|down)?spin([01]?)", tok):
            for side in ((up, down) if not m.group(1) else (up,) if m.group(1) == "up" else (down,)):
                side["spin_wait"] = m.group(2) != "0"
        elif m := re.fullmatch(r"(up|down)?fence([01]?)", tok):
            for side in ((up, down) if not m.group(1) else (up,) if m.group(1) == "up" else (down,)):
                side["proxy_fence"] = m.group(2) != "0"
        elif m := re.fullmatch(r"(up|down)?pro([01]?)", tok):
            for side in ((up, down) if not m.group(1) else (up,) if m.group(1) == "up" else (down,)):
                side["prologue"] = m.group(2) != "0"
        elif m := re.fullmatch(r"dec([123])", tok):
            up["decode"] = down["decode"] = int(m.group(1))
        elif (m := re.fullmatch(r"upw(\d+)", tok)) and int(m.group(1)) in UP_WARPS:
            up["warps"] = int(m.group(1))
        elif m := re.fullmatch(r"downk([12])", tok):
            down["ksplit"] = int(m.group(1))
        else:
            raise ValueError(f"pipelined-kernel variant must be '-'-joined options among pro0/pro1 (one-round-trip "
                             f"prologues), epi0/epi1 (moe_up's epilogue warp), prod0/prod1 (moe_down's producer "
                             f"warp), swap0/swap1 (moe_down's shared items dealt in reverse), pair0/pair1 (moe_down's extras "
                             f"on different CTAs), lazy0/lazy1 (moe_down's deferred flush), late0/late1 "
                             f"(moe_down lets the tail start only after its staging), aflush0/aflush1 (moe_down's "
                             f"producer warp flushes row blocks), fwarp (moe_down's flush warp), fence0/upfence0/"
                             f"downfence0 (no proxy fence before ring refills), spin/upspin/downspin (polled slot waits), upstN/upmaxN/downmaxN (moe_up's ring slots / tokens, moe_down's tokens), dec1/dec2/dec3 (the pair decode), upwN (moe_up's "
                             f"compute warps, N in {UP_WARPS}), downk1/downk2 (moe_down's K split), pad0/pad1 "
                             f"(moe_up's padded ring rows), zlast0/zlast1 (moe_up stages z in its ring's last "
                             f"slots and requests the others first), bal0/bal1 (moe_up deals half super-blocks that "
                             f"even out its sub-partitions), dflag/dflagt (moe_down starts on a counter of finished moe_up CTAs), merge (moe_up and moe_down in one launch), sfirst/sfirst2 (moe_down's shared items before its wait), f16 (moe_up on f16 mma), zswz (moe_up's swizzled z), pf0/pf1 (moe_up "
                             f"prefetches moe_down's bytes), tailN (moe_down prefetches the tail's last 0..{D} rows), l2h (L2 "
                             f"priorities: the rings evict_first, the tail's prefetch evict_last), shup (moe_up streams the shared "
                             f"gate/up rows), shfrontK (with shup: the front keeps the first K shared columns' rows), "
                             f"contig (moe_down's items in one contiguous run per CTA), upearlyN/downearlyN (ring "
                             f"slots requested before the staging), run17, run20, run24, run27; e.g. pf1-tail2048 or run17; got {text!r}")
    if down.get("async_flush") or down.get("lazy_flush"):  # the in-line flushes: alternatives to the flush warps
        if down.get("flush_warp"):
            raise ValueError(f"fwarp (moe_down's flush warps) replaces aflush and lazy: it cannot go with either; "
                             f"got {text!r}")
        down["flush_warp"] = False
    if down.get("async_flush", MoEDownPipeKey.async_flush) and not down.get("producer_warp", MoEDownPipeKey.producer_warp):
        raise ValueError(f"aflush runs on moe_down's producer warp: it cannot go with prod0; got {text!r}")
    if up.get("balance") and (up.get("warps", MoEUpPipeKey.warps) != len(UP_BALANCED_HALVES)
                              or not up.get("epilogue_warp", MoEUpPipeKey.epilogue_warp)):
        raise ValueError(f"bal deals moe_up's half super-blocks over {len(UP_BALANCED_HALVES)} compute warps and the "
                         f"epilogue warp: it cannot go with upwN or epi0; got {text!r}")
    if up.get("fp16") and (up.get("balance") or not up.get("prologue", MoEUpPipeKey.prologue)):
        raise ValueError(f"f16 stages z in moe_up's merged prologue and takes whole super-blocks: it cannot go with "
                         f"pro0 or bal; got {text!r}")
    if up.get("z_swizzle") and (up.get("fp16") or not up.get("prologue", MoEUpPipeKey.prologue)):
        raise ValueError(f"zswz swizzles the bf16 path's z, which the merged prologue stages: it cannot go with f16 or "
                         f"pro0; got {text!r}")
    if up.get("z_last", MoEUpPipeKey.z_last) and not up.get("prologue", MoEUpPipeKey.prologue):
        raise ValueError(f"zlast places z in moe_up's ring, which only the merged prologue does: it cannot go "
                         f"with pro0; got {text!r}")
    if up.get("shared_front") and not up.get("shared_up"):
        raise ValueError(f"shfrontK shares the shared gate/up rows between the front and moe_up's 'shup' or "
                         f"'shupiN': it needs one of them; got {text!r}")
    if up.get("shared_up"):
        up.setdefault("max_tokens", 1)
        clash = [name for name, on in (("zlast", up.get("z_last")), ("uflag", up.get("route_early")),
                                       ("f16", up.get("fp16")), ("bal", up.get("balance")),
                                       ("pf", up.get("prefetch_down")), ("merge/dflag", up.get("done_flag")),
                                       ("pro0", not up.get("prologue", True)), ("epi0", not up.get("epilogue_warp", True)),
                                       ("sfirst", down.get("shared_first")),
                                       ("upwN", up.get("warps", MoEUpPipeKey.warps) != MoEUpPipeKey.warps)) if on]
        if clash:
            raise ValueError(f"shup streams the shared gate/up rows through moe_up's ring from its start: it cannot go "
                             f"with {', '.join(clash)}; got {text!r}")
        if not 1 <= up["max_tokens"] <= SHUP_MAX_M:
            raise ValueError(f"shup stages x beside moe_up's ring for 1..{SHUP_MAX_M} tokens (upmax1, upmax2); "
                             f"got {text!r}")
    if up.get("prologue", MoEUpPipeKey.prologue):
        if up.get("early_slots", 0) != 0:
            raise ValueError(f"the merged prologue stages z in moe_up's ring, so no ring slot can be requested "
                             f"before it: upearlyN needs pro0; got {text!r}")
    else:
        up.setdefault("early_slots", 1)  # run 17's ring start
    return up, down


def pipe_variant_name(up: MoEUpPipeKey, down: "MoEDownPipeKey | None") -> str:
    """The options of `parse_pipe_variant` that differ from the defaults ('default' if none)."""
    parts = []
    down_pro = down.prologue if isinstance(down, MoEDownPipeKey) else up.prologue
    if not up.prologue:
        parts.append("pro0" if not down_pro else "uppro0")
    if not up.epilogue_warp:
        parts.append("epi0")
    if up.warps != MoEUpPipeKey.warps:
        parts.append(f"upw{up.warps}")
    if up.decode != MoEUpPipeKey.decode:
        parts.append(f"dec{up.decode}")
    if up.pad_rows != MoEUpPipeKey.pad_rows:
        parts.append("pad" if up.pad_rows else "pad0")
    if up.z_last != MoEUpPipeKey.z_last and not up.route_early:  # uflag implies zlast
        parts.append("zlast" if up.z_last else "zlast0")
    if up.balance:
        parts.append("bal")
    if up.fp16:
        parts.append("f16")
    if up.z_swizzle:
        parts.append("zswz")
    if up.early_slots != (0 if up.prologue else 1):
        parts.append(f"upearly{up.early_slots}")
    if up.prefetch_down:
        parts.append("pf1")
    if isinstance(down, MoEDownPipeKey) and down.merged:
        parts.append("merge")
    elif up.done_flag:
        parts.append({1: "dflag", 2: "dflagt"}[up.done_flag])
    if up.route_early:
        parts.append(f"uflag{up.route_early}")
    down_fence = down.proxy_fence if isinstance(down, MoEDownPipeKey) else up.proxy_fence
    if not up.proxy_fence:
        parts.append("fence0" if not down_fence else "upfence0")
    if up.stages != MoEUpPipeKey.stages:
        parts.append(f"upst{up.stages}")
    if up.max_tokens != (1 if up.shared_up else MoEUpPipeKey.max_tokens):
        parts.append(f"upmax{up.max_tokens}")
    if up.shared_up:
        parts.append(f"shupi{up.shared_lead}" if up.shared_lead else "shup")
        if up.shared_front:
            parts.append(f"shfront{up.shared_front}")
    down_spin = down.spin_wait if isinstance(down, MoEDownPipeKey) else up.spin_wait
    if up.spin_wait:
        parts.append("spin" if down_spin else "upspin")
    if isinstance(down, MoEDownPipeKey):
        if up.prologue and not down.prologue:  # the two kernels' prologues set apart
            parts.append("downpro0")
        if down.prefetch_tail_rows:
            parts.append(f"tail{down.prefetch_tail_rows}")
        if not down.balanced:
            parts.append("contig")
        if down.early_slots != MoEDownPipeKey.early_slots:
            parts.append(f"downearly{down.early_slots}")
        if not down.producer_warp:
            parts.append("prod0")
        if not down.swap_shared:
            parts.append("swap0")
        if down.pair_extras != MoEDownPipeKey.pair_extras:
            parts.append("pair" if down.pair_extras else "pair0")
        if down.lazy_flush:
            parts.append("lazy")
        if down.late_trigger != MoEDownPipeKey.late_trigger:
            parts.append("late" if down.late_trigger else "late0")
        if down.async_flush != MoEDownPipeKey.async_flush:
            parts.append("aflush" if down.async_flush else "aflush0")
        if down.ksplit != MoEDownPipeKey.ksplit:
            parts.append(f"downk{down.ksplit}")
        if up.proxy_fence and not down.proxy_fence:
            parts.append("downfence0")
        if down.spin_wait and not up.spin_wait:
            parts.append("downspin")
        if down.flush_warp != MoEDownPipeKey.flush_warp and not (down.lazy_flush or down.async_flush):
            parts.append("fwarp" if down.flush_warp else "fwarp0")
        if down.max_tokens != MoEDownPipeKey.max_tokens:
            parts.append(f"downmax{down.max_tokens}")
        if down.shared_first:
            parts.append({1: "sfirst", 2: "sfirst2"}[down.shared_first])
    if up.l2_hints or (isinstance(down, MoEDownPipeKey) and down.l2_hints):
        parts.append("l2h")
    name = "-".join(parts) or "default"
    return {RUN17: "run17", RUN20: "run20", RUN24: "run24", RUN27: "run27", RUN35: "run35"}.get(name, name)


def _history_keys(kind: str):
    def keys(arch: str):
        s = shapes_for_tp(8)
        make = MoEUpPipeKey if kind == "up" else MoEDownPipeKey
        return [make(s, pdl=p, arch=arch, **parse_pipe_variant(v)[0 if kind == "up" else 1])
                for v in HISTORY_VARIANTS for p in (True, False)]
    return keys


def _aot_keys(kind: str):
    def keys(arch: str):
        out = []
        for tp in (8, 16):
            s = shapes_for_tp(tp)
            make = MoEUpPipeKey if kind == "up" else MoEDownPipeKey
            out += [make(s, arch=arch), make(s, pdl=False, arch=arch)]  # PDL at one token, not above (PDL_MAX_TOKENS)
            if tp == 8:
                out += [make(s, trace=True, pdl=p, arch=arch) for p in (True, False)]  # the timeline builds (moe --trace)
                for v in AOT_VARIANTS:  # with PDL (one token) and without (more: fused_moe.PDL_MAX_TOKENS)
                    kw = parse_pipe_variant(v)[0 if kind == "up" else 1]
                    for p in (True, False):
                        key = make(s, pdl=p, arch=arch, **kw)
                        if key not in out:
                            out.append(key)
                for v in TRACE_VARIANTS:  # their timelines (kimi-decode moe --trace --executors fused@run20)
                    kw = parse_pipe_variant(v)[0 if kind == "up" else 1]
                    for p in (True, False):
                        key = make(s, trace=True, pdl=p, arch=arch, **kw)
                        if key not in out:
                            out.append(key)
        return out
    return keys


UP_PIPE = kc.register(kc.KernelSpec(name="moe_up_pipe", module=__name__, key_type=MoEUpPipeKey, build=build_up_pipe,
                                    aot_keys=_aot_keys("up"), tuning_keys=_history_keys("up"),
                                    ptx_checks=("cp.async.bulk", "mma.sync", "mul.rn.bf16x2")))
DOWN_PIPE = kc.register(kc.KernelSpec(name="moe_down_pipe", module=__name__, key_type=MoEDownPipeKey,
                                      build=build_down_pipe, aot_keys=_aot_keys("down"), tuning_keys=_history_keys("down"),
                                      ptx_checks=("cp.async.bulk", "mma.sync", "mul.rn.bf16x2", "red.")))


def _merged_aot_keys(arch: str, variants=MERGE_VARIANTS):
    s = shapes_for_tp(8)
    out = []
    for v in variants:
        up_kw, down_kw = parse_pipe_variant(v)
        for p in (True, False):
            out.append(MoEExpertsPipeKey(MoEUpPipeKey(s, pdl=p, arch=arch, **up_kw),
                                         MoEDownPipeKey(s, pdl=p, arch=arch, **down_kw)))
            if v == "merge":  # its timeline build (kimi-decode moe --trace --executors fused@merge)
                out.append(MoEExpertsPipeKey(MoEUpPipeKey(s, pdl=p, arch=arch, trace=True, **up_kw),
                                             MoEDownPipeKey(s, pdl=p, arch=arch, trace=True, **down_kw)))
    return out


EXPERTS_PIPE = kc.register(kc.KernelSpec(
    name="moe_experts_pipe", module=__name__, key_type=MoEExpertsPipeKey, build=build_experts_pipe,
    aot_keys=_merged_aot_keys, tuning_keys=lambda arch: _merged_aot_keys(arch, MERGE_HISTORY_VARIANTS), ptx_checks=("cp.async.bulk", "mma.sync", "mbarrier.inval", "atom.global.release.add",
                                           "ld.acquire.gpu", "red.relaxed.gpu.global.add")))

__all__ = ["MoEUpPipeKey", "MoEDownPipeKey", "MoEExpertsPipeKey", "experts_pipe_smem_bytes", "down_pipe_capacity", "up_pipe_smem_bytes", "down_pipe_smem_bytes",
           "parse_pipe_variant", "pipe_variant_name", "paired_split"]
