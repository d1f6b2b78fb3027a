"""The MoE front at one token as a persistent GEMV that streams its weights through a bulk-copy ring (`moe_front_ring`).

Same result as `moe.build_front` at m_tile 1 with routing (`kimi_k3_layer.md` §6.3, launch 1 of the MoE half): one
GEMV of x against [router ; latent down ; shared gate/up] (fp32 out), and the routing of the token from the router
logits into the expert-major tables (`moe.route_tokens`).

Why: the plain GEMV gives each weight row its own CTA, and at one token the front kernel streams its 86 MB at
about 82% of the copy bandwidth (run 49: 24.9 µs against 20.2). The one-token tail streamed through a bulk-copy
ring (`moe_tail_ring`) reached 94% (12.8 µs for 51.4 MB), so the front does the same: one CTA per SM owns every
G-th block of `rows_per_stage` consecutive rows (one bulk copy each), a producer lane keeps `stages` slots in
flight, and each consumer warp takes one row of a slot against x, staged once in shared memory as bf16 pairs.

Routing: rows 0 .. E-1 are the router's. After storing a router row's logit, the consumer lane arrives on an
mbarrier of its CTA (no fence on the streaming path; run 50 fenced and counted per row there, which did not
explain its slowness: run 51 without it was no faster); the CTA's four routing warps wait for its router rows, fence, and add their number to the step's
router-row counter (`mMeta[1]`, acq_rel at gpu scope); the CTA that completes the count routes the token on the
routing warps' named barrier while its other warps go on streaming, and re-arms the counter for the next step.

One token only: `FusedMoE(variant='fring')` uses it for single-token steps with the routing in the front kernel.
Measured slower than the plain front (runs 50 and 51: 28.5 and 30.2 µs in the batch-1 graph against 25.0 and
25.5, the step 67.0 and 70.1 µs against 60.1 and 60.6), so it is an option, not the default (docs/fused_moe.md).
"""

from dataclasses import dataclass
from typing import ClassVar

from .. import compile as kc
from .moe import D, E, MoEShape, _routing_fakes, route_smem, route_smem_bytes, route_tokens, shapes_for_tp
from .moe_pipe import H200_SMS
from .moe_tail_ring import SMEM_MAX, RingGeometry, init_ring_barriers, ring_row_dot, ring_smem, stream_row_blocks

ROUTE_WARPS = 4  # the routing warps of every CTA (one token: warp 0 of them routes, all four build the tables)
ROUTE_BARRIER = 2  # their named barrier (1: the consumer warps')


@dataclass(frozen=True)
class MoEFrontRingKey(RingGeometry):
    shape: MoEShape
    rows_per_stage: int = 4  # weight rows per ring slot: one per consumer warp (one bulk copy of 4 · 14 KB)
    stages: int = 3  # ring slots: 3 · 56 KB = 168 KB
    ctas: int = H200_SMS  # persistent CTAs (one per SM)
    candidates: bool = True  # routing by candidates (as moe.MoEFrontKey.candidates)
    arch: str = "sm_90a"

    ROW_ELEMS: ClassVar[int] = D  # a row of [router ; latent down ; shared gate/up]

    def __post_init__(self):
        self.check_geometry({"the router": E, "the front": self.shape.ncat}, front_ring_smem_bytes(self))


def front_ring_smem_bytes(key: MoEFrontRingKey) -> int:
    """The ring, two mbarriers per slot, the routing's wake-up mbarrier and flag, x, and the routing's tables."""
    return key.stages * key.stage_bytes + 16 * key.stages + 64 + D * 2 + route_smem_bytes(ROUTE_WARPS) + 256


def build_front_ring(key: MoEFrontRingKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from .ptx_ops import bf16x2_to_f32

    sh = key.shape
    N, SCALING = sh.ncat, sh.scaling
    RS, ST, G = key.rows_per_stage, key.stages, key.ctas
    NB = N // RS  # row blocks
    NRB = E // RS  # the router's row blocks (the first ones)
    SB = key.stage_bytes
    WORDS = D // 2  # Int32 words (bf16 pairs) of a row
    NCH = WORDS // 4 // 32  # 16-byte chunks a lane reads per row
    assert WORDS % 128 == 0
    CONS = 32 * RS  # consumer threads (warps 0 .. RS-1), then the producer warp, then the routing warps
    RT0 = CONS + 32
    THREADS = RT0 + 32 * ROUTE_WARPS
    unpack = bf16x2_to_f32()

    @cute.kernel
    def front_ring_kernel(mW: cute.Tensor, mX: cute.Tensor, mO: cute.Tensor, mBias: cute.Tensor, mMeta: cute.Tensor,
                          mIds: cute.Tensor, mWts: cute.Tensor, mWe: cute.Tensor, mAct: cute.Tensor,
                          mList: cute.Tensor, mTok: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        ring, full, empty = ring_smem(smem, ST, RS, WORDS)
        rdone = smem.allocate_tensor(Int64, cute.make_layout((1,)), byte_alignment=8)
        flag = smem.allocate_tensor(Int32, cute.make_layout((2,)), byte_alignment=16)
        xs = smem.allocate_tensor(Int32, cute.make_layout((WORDS,)), byte_alignment=16)
        cnt, lst, wtot, kys = route_smem(smem, ROUTE_WARPS)
        cute.arch.griddepcontrol_launch_dependents()  # moe_up may be scheduled into the SMs this launch frees
        nitems = (NB - bx + G - 1) // G  # row blocks bx, bx + G, ...
        nrouter = RS * cutlass.max((NRB - bx + G - 1) // G, Int32(0))  # router rows among them
        if tid == 0:
            init_ring_barriers(full, empty, ST, RS)
            cute.arch.mbarrier_init(rdone.iterator, cutlass.max(nrouter, Int32(1)))
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        if warp == RS:  # the producer
            if lane == 0:
                stream_row_blocks()(mW, ring, full, empty, bx, nitems, G, ST, SB)
        elif warp < RS:  # the consumers: one row of each slot per warp
            # x (bf16 pairs) into shared memory once: in registers it would take 112 a lane, and spill
            xw = cute.make_tensor(cute.recast_ptr(mX.iterator, dtype=Int32), cute.make_layout((WORDS,)))
            gX = cute.zipped_divide(xw, (4,))
            sX = cute.zipped_divide(xs, (4,))
            for c in cutlass.range(tid, WORDS // 4, CONS):
                sX[(None, c)].store(gX[(None, c)].load())
            cute.arch.barrier(barrier_id=1, number_of_threads=CONS)
            gR = cute.zipped_divide(ring, (1, 1, 4))
            for n in cutlass.range(nitems):
                slot = n % ST
                cute.arch.mbarrier_wait(full.iterator + slot, (n // ST) % 2)
                tot = ring_row_dot(gR, slot, warp, lane, NCH, unpack, lambda i: sX[(None, lane + 32 * i)].load(),
                                   lambda xc, i, q: unpack(xc[q]))
                cute.arch.sync_warp()  # every lane has read the slot
                if lane == 0:
                    cute.arch.mbarrier_arrive(empty.iterator + slot)
                    blk = bx + n * G
                    mO[0, blk * RS + warp] = tot
                    if blk < NRB:  # a router row: tell this CTA's routing warps (no fence on this path)
                        cute.arch.mbarrier_arrive(rdone.iterator)
        else:  # the routing warps: count this CTA's router rows into the step's counter, route if they complete it
            if nrouter > 0:
                cute.arch.mbarrier_wait(rdone.iterator, 0)  # this CTA's router logits are stored
                cute.arch.fence_acq_rel_gpu()
                if tid == RT0:
                    old = cute.arch.atomic_add(mMeta.iterator + 1, nrouter, sem="acq_rel", scope="gpu")
                    flag[0] = Int32(old + nrouter == E)
                cute.arch.barrier(barrier_id=ROUTE_BARRIER, number_of_threads=32 * ROUTE_WARPS)
                if flag[0] != 0:  # every logit of the step is written
                    cute.arch.fence_acq_rel_gpu()
                    route_tokens()(mO, mBias, mMeta, mIds, mWts, mWe, mAct, mList, mTok, cnt, lst, wtot, kys,
                                   ROUTE_WARPS, SCALING, key.candidates, False, RT0, ROUTE_BARRIER)
                    if tid == RT0:
                        mMeta[1] = Int32(0)  # re-arm the counter for the next step

    @cute.jit
    def front_ring_host(mW: cute.Tensor, mX: cute.Tensor, mO: cute.Tensor, mBias: cute.Tensor, mMeta: cute.Tensor,
                        mIds: cute.Tensor, mWts: cute.Tensor, mWe: cute.Tensor, mAct: cute.Tensor,
                        mList: cute.Tensor, mTok: cute.Tensor, stream):
        front_ring_kernel(mW, mX, mO, mBias, mMeta, mIds, mWts, mWe, mAct, mList, mTok).launch(
            grid=(G, 1, 1), block=(THREADS, 1, 1), smem=front_ring_smem_bytes(key), stream=stream)

    fake = cute.runtime.make_fake_compact_tensor
    m = cute.sym_int()
    from cutlass import BFloat16
    args = (
        fake(BFloat16, (N, D), stride_order=(1, 0), assumed_align=16),
        fake(BFloat16, (m, D), stride_order=(1, 0), assumed_align=16),
        fake(Float32, (m, N), stride_order=(1, 0), assumed_align=16),
        *_routing_fakes(m),
    )
    return front_ring_host, args


# ring geometries (rows per slot, slots) compiled ahead of time at TP8 besides the default 4 x 3 ('fringRxS'):
# the same 168 KB in six slots of two rows, and seven slots (196 KB). The profile of 4 x 3 (H100, this project's
# profiles/fused-moe.fring) shows its consumer warps waiting on full slots at 15% issue activity: a slot can be
# read only once all 56 KB of it have arrived, so smaller slots should keep them busier.
# (run 56: both slower). With a third entry, CTAs per SM ('fringRxScN'): 2 x 3 at two CTAs per SM, each with its
# own producer lane and x, the same 168 KB of slots per SM.
RING_GEOMETRIES = ((2, 6), (2, 7), (2, 3, 2))


def front_ring_key(shape: MoEShape, geometry: tuple | None = None, candidates: bool = True,
                   arch: str = "sm_90a") -> MoEFrontRingKey:
    """The ring front key of a 'fringRxS[cN]' geometry (rows per slot, slots[, CTAs per SM]); None: 4 x 3."""
    if geometry is None:
        return MoEFrontRingKey(shape, candidates=candidates, arch=arch)
    r, st, c = (*geometry, 1)[:3]
    return MoEFrontRingKey(shape, rows_per_stage=r, stages=st, ctas=H200_SMS * c, candidates=candidates, arch=arch)


def _aot_keys(arch: str):
    keys = [MoEFrontRingKey(shapes_for_tp(tp), arch=arch) for tp in (8, 16)]
    return keys + [front_ring_key(shapes_for_tp(8), g, arch=arch) for g in RING_GEOMETRIES]


FRONT_RING = kc.register(kc.KernelSpec(name="moe_front_ring", module=__name__, key_type=MoEFrontRingKey,
                                       build=build_front_ring, aot_keys=_aot_keys,
                                       ptx_checks=("cp.async.bulk", "mbarrier", "atom")))

__all__ = ["MoEFrontRingKey", "front_ring_smem_bytes", "SMEM_MAX", "FRONT_RING", "RING_GEOMETRIES", "front_ring_key"]
