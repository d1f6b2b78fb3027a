"""The MoE tail at one token as a persistent GEMV that streams W_up through a bulk-copy ring (`moe_tail_ring`).

Same result as `moe.build_tail` at m_tile 1 (`kimi_k3_layer.md` §6.3, the last launch of the MoE half):

    out[n] = (Σ_k W_up[n, k] · r[k]) · rsqrt(Σ r² / L + eps) + Σ_p coef[p] · sh[p, n]     (bf16 out)

with r = the reduced latent times the RMSNorm weight (bf16, written by moe_down), Σ r² per token (moe_down), and
the shared experts' all-reduce read over `tp` buffers.

Why a second tail: the plain GEMV gives each row its own CTA (7 KB of loads), and under moe_down's 217 KB of shared
memory only a few of them fit beside it, so at one token the tail streams W_up (51.4 MB at TP8) at the GEMV's 83%
of the copy bandwidth (run 46: 14.5 µs against 12.1) and little of it is in flight before moe_down ends. Here one
CTA per SM owns every G-th block of `rows_per_stage` consecutive rows (contiguous bytes: one bulk copy per block).
A producer lane fills `stages` ring slots as soon as the CTA starts, before `griddepcontrol.wait` (W_up does not
depend on moe_down), so each SM holds up to 200 KB of W_up (about half of it over 132 SMs) by the time r is ready;
then it refills each slot as the consumer warps release it (an `empty` mbarrier per slot, one arrival per warp).
Each consumer warp takes one row of a slot: its lanes hold r (fp32, 112 values a lane) in registers, read the row
from shared memory in 16-byte chunks, and one warp sum gives the dot product.

One token only: `FusedMoE` uses it for single-token steps (the `m_tile` 1 tail), the plain GEMV otherwise.
"""

from dataclasses import dataclass
from typing import ClassVar

from .. import compile as kc
from .moe import D, L, MoEShape, shapes_for_tp
from .moe_pipe import H200_SMS

SMEM_MAX = 227 * 1024  # usable shared memory per CTA on the H200
SM_SMEM = 233472  # shared memory per SM on sm_90 (228 KB)
CTA_RESERVED_SMEM = 1024  # what the system keeps of it for each resident CTA
SM_REGISTERS = 65536


class RingGeometry:
    """What the ring keys share (`MoETailRingKey` here, `moe_front_ring.MoEFrontRingKey`, `ring_rate.RingRateKey`): slots of
    `rows_per_stage` weight rows of ROW_ELEMS bf16 (one row per consumer warp, one bulk copy per slot), `stages`
    slots, and the checks on that geometry, made before any build."""
    ROW_ELEMS: ClassVar[int]

    @property
    def stage_bytes(self) -> int:
        return self.rows_per_stage * self.ROW_ELEMS * 2

    def check_geometry(self, row_counts: dict[str, int], smem_bytes: int) -> None:
        """Refuse a slot that does not divide each of `row_counts` (what: rows), a consumer warp count outside
        1..16, and a ring that needs more shared memory than a CTA has."""
        for what, n in row_counts.items():
            if n % self.rows_per_stage:
                raise ValueError(f"rows_per_stage={self.rows_per_stage} must divide {what} ({n} rows)")
        if not 1 <= self.rows_per_stage <= 16:
            raise ValueError("rows_per_stage is the consumer warp count: 1..16")
        if smem_bytes > SMEM_MAX:
            raise ValueError(f"{self.stages} slots of {self.rows_per_stage} rows need {smem_bytes} B of shared "
                             f"memory, over {SMEM_MAX}: they do not fit a CTA")
        if self.ctas not in (H200_SMS, 2 * H200_SMS):
            raise ValueError(f"ctas must be {H200_SMS} (one per SM) or {2 * H200_SMS} (two), got {self.ctas}")
        if self.ctas_per_sm * (smem_bytes + CTA_RESERVED_SMEM) > SM_SMEM:
            raise ValueError(f"{self.ctas_per_sm} CTAs per SM of {smem_bytes} B of shared memory each do not fit "
                             f"the SM's {SM_SMEM} B")

    @property
    def ctas_per_sm(self) -> int:
        return self.ctas // H200_SMS

    @property
    def geometry_tag(self) -> str:
        """RxS (rows per slot x slots), with cN where N CTAs share an SM: the variant names' form."""
        return f"{self.rows_per_stage}x{self.stages}" + (f"c{self.ctas_per_sm}" if self.ctas_per_sm != 1 else "")


@dataclass(frozen=True)
class MoETailRingKey(RingGeometry):
    shape: MoEShape
    rows_per_stage: int = 4  # W_up rows per ring slot: one per consumer warp (one bulk copy of 4 · 7 KB)
    stages: int = 7  # ring slots: 7 · 28 KB = 196 KB
    ctas: int = H200_SMS  # persistent CTAs (one per SM)
    pdl: bool = True
    # r held in registers as bf16 pairs (56 words a lane, unpacked in the row loop) instead of fp32 (112): few
    # enough registers for the tail CTA to sit beside moe_down's on every SM ('cotail', COTAIL_TAIL)
    r_packed: bool = False
    # ('fpdl') griddepcontrol.launch_dependents at the CTA's start: the next launch (the next layer's front, built
    # as a programmatic dependent) may be scheduled beside this one and load its weights while W_up streams
    trigger: bool = False
    arch: str = "sm_90a"

    ROW_ELEMS: ClassVar[int] = L  # a W_up row

    def __post_init__(self):
        self.check_geometry({"W_up": D}, tail_ring_smem_bytes(self))

    @property
    def max_items(self) -> int:
        """Row blocks a CTA owns at most."""
        return -(-(D // self.rows_per_stage) // self.ctas)


def tail_ring_smem_bytes(key: MoETailRingKey) -> int:
    """The ring, its two mbarriers per slot, and the shared all-reduce term of each of the CTA's rows."""
    return key.stages * key.stage_bytes + 16 * key.stages + 4 * key.max_items * key.rows_per_stage + 256


# 'cotail' (one token): the tail ring that fits beside moe_down at one token (`MoEDownPipeKey(max_tokens=1)`,
# about 113 KB of shared memory and 672 threads of 80 registers): 2 rows per slot and 8 slots (about 115 KB),
# 3 warps with r packed. moe_down lets the tail's CTAs be scheduled once its a is staged ('late'), so each SM's
# producer lane requests its 8 slots (15 MB of W_up over 132 SMs) while moe_down still runs, instead of after it
# ends. Both launches ask for the largest shared-memory carveout, so that the first one leaves the room.
COTAIL_GEOMETRY = dict(rows_per_stage=2, stages=8, r_packed=True)


def cotail_key(shape: MoEShape, pdl: bool = True, arch: str = "sm_90a") -> MoETailRingKey:
    return MoETailRingKey(shape, pdl=pdl, arch=arch, **COTAIL_GEOMETRY)


_STREAM = None


def stream_row_blocks():
    """`@cute.jit` stream_row_blocks()(mW, ring, full, empty, bx, nitems, G, ST, SB): (one thread, inlined) the ring's
    producer. Item n of CTA bx is the block of weight rows bx + n · G (SB contiguous bytes from mW's start: one
    bulk copy into slot n mod ST, completing full[slot]); from the second round on it first waits until every
    consumer warp has released the slot (empty[slot], one arrival per warp)."""
    global _STREAM
    if _STREAM is None:
        import cutlass
        import cutlass.cute as cute
        from cutlass import Constexpr, Int64

        from .ptx_ops import bulk_g2s

        bulk = bulk_g2s()

        @cute.jit
        def stream(mW: cute.Tensor, ring: cute.Tensor, full: cute.Tensor, empty: cute.Tensor, bx, nitems,
                   G: Constexpr, ST: Constexpr, SB: Constexpr):
            w0 = mW.iterator.toint()
            r0 = ring.iterator.toint()
            for n in cutlass.range(nitems):
                slot = n % ST
                if n >= ST:  # the slot's previous block has been read by every consumer warp
                    cute.arch.mbarrier_wait(empty.iterator + slot, (n // ST - 1) % 2)
                cute.arch.mbarrier_arrive_and_expect_tx(full.iterator + slot, SB)
                bulk(r0 + slot * SB, w0 + Int64(bx + n * G) * SB, SB, (full.iterator + slot).toint())

        _STREAM = stream
    return _STREAM


def ring_smem(smem, stages: int, rows: int, words: int):
    """(traced where it is called) a ring's shared memory from `smem` (a `cutlass.utils.SmemAllocator`): `stages`
    slots of `rows` rows of `words` int32 (128-byte aligned, the target of one bulk copy each), and a full and an
    empty mbarrier per slot. Returns (ring, full, empty)."""
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    ring = smem.allocate_tensor(Int32, cute.make_layout((stages, rows, words), stride=(rows * words, words, 1)),
                                byte_alignment=128)
    full = smem.allocate_tensor(Int64, cute.make_layout((stages,)), byte_alignment=8)
    empty = smem.allocate_tensor(Int64, cute.make_layout((stages,)), byte_alignment=8)
    return ring, full, empty


def init_ring_barriers(full, empty, stages: int, consumers: int):
    """(traced, by one thread) full[s] completes on the producer's one arrival and its bytes, empty[s] on one arrival
    per consumer warp; the caller adds its own mbarriers and then `mbarrier_init_fence`."""
    import cutlass.cute as cute

    for s in range(stages):
        cute.arch.mbarrier_init(full.iterator + s, 1)
        cute.arch.mbarrier_init(empty.iterator + s, consumers)


def ring_row_dot(gR, slot, warp, lane, nch, unpack, x_chunk, x_pair):
    """(traced where it is called, inside a ring kernel) the consumer warp's dot product of its row of a full slot
    against x: chunk lane + 32 i (16 bytes, 8 bf16 weights) of the row for i < nch, unpacked by `unpack`, against
    x_pair(x_chunk(i), i, q) -> (x_lo, x_hi) for word q of the chunk (x in registers or in shared memory), in two
    fp32 chains and one warp sum. gR: the ring divided into 16-byte chunks (slot, row, chunk)."""
    import cutlass.cute as cute
    from cutlass import Float32

    acc = [Float32(0.0), Float32(0.0)]
    for i in range(nch):
        v = gR[(None, (slot, warp, lane + 32 * i))].load()
        xc = x_chunk(i)
        for q in range(4):
            lo, hi = unpack(v[q])
            x_lo, x_hi = x_pair(xc, i, q)
            acc[q % 2] = acc[q % 2] + lo * x_lo
            acc[q % 2] = acc[q % 2] + hi * x_hi
    return cute.arch.warp_reduction_sum(acc[0] + acc[1])


def build_tail_ring(key: MoETailRingKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, const_expr

    from .ptx_ops import bf16x2_to_f32, bf16x2_to_f32_here

    sh = key.shape
    TP, EPS, PDL = sh.tp, sh.eps, key.pdl
    RS, ST, G = key.rows_per_stage, key.stages, key.ctas
    NB = D // RS  # row blocks
    NI = key.max_items
    SB = key.stage_bytes
    WORDS = L // 2  # Int32 words (bf16 pairs) of a row
    NCH = WORDS // 4 // 32  # 16-byte chunks a lane reads per row
    assert WORDS % 128 == 0
    CONS = 32 * RS  # consumer threads
    THREADS = CONS + 32  # and one producer warp
    PACKED = key.r_packed
    # the co-resident tail asks for the largest shared-memory carveout (see COTAIL_GEOMETRY); its r words are
    # unpacked by volatile asm in the row loop (the plain unpack is hoisted out of it into 112 fp32 registers)
    carveout = dict(preferred_smem_carveout=100) if PACKED else {}
    unpack = bf16x2_to_f32()
    unpack_here = bf16x2_to_f32_here()

    @cute.kernel
    def tail_ring_kernel(mW: cute.Tensor, mX: cute.Tensor, mSsq: cute.Tensor, mSh: cute.Tensor, mCoef: cute.Tensor,
                         mO: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        ring, full, empty = ring_smem(smem, ST, RS, WORDS)
        shs = smem.allocate_tensor(Float32, cute.make_layout((NI * RS,)), byte_alignment=16)
        nitems = (NB - bx + G - 1) // G  # row blocks bx, bx + G, ...
        if const_expr(key.trigger):
            cute.arch.griddepcontrol_launch_dependents()
        if tid == 0:
            init_ring_barriers(full, empty, ST, RS)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        if warp == RS:  # the producer: W_up does not depend on moe_down, so the ring fills before the wait
            if lane == 0:
                stream_row_blocks()(mW, ring, full, empty, bx, nitems, G, ST, SB)
        else:
            if const_expr(PDL):  # r, Σ r² and this rank's shared partial are moe_down's
                cute.arch.griddepcontrol_wait()
            # r in registers, chunk lane + 32 i (8 values) of the row: as fp32, or as the bf16 pairs loaded
            xw = cute.make_tensor(cute.recast_ptr(mX.iterator, dtype=Int32), cute.make_layout((WORDS,)))
            gX = cute.zipped_divide(xw, (4,))
            xv = [gX[(None, lane + 32 * i)].load() for i in range(NCH)]
            xf = []
            if const_expr(not PACKED):
                for i in cutlass.range_constexpr(NCH):
                    for q in cutlass.range_constexpr(4):
                        r_lo, r_hi = unpack(xv[i][q])
                        xf.append(r_lo)
                        xf.append(r_hi)
            if const_expr(PACKED):
                r_pair = lambda _, i, q: unpack_here(xv[i][q])  # noqa: E731
            else:
                r_pair = lambda _, i, q: (xf[8 * i + 2 * q], xf[8 * i + 2 * q + 1])  # noqa: E731
            rs = cute.math.rsqrt(mSsq[0] * Float32(1.0 / L) + Float32(EPS))
            # the shared all-reduce term of each of this CTA's rows, loaded once (latency off the row loop)
            for idx in cutlass.range(tid, nitems * RS, CONS):
                n = idx // RS
                row = (bx + n * G) * RS + (idx - n * RS)
                a = Float32(0.0)
                for p_ in cutlass.range_constexpr(TP):
                    a = a + mCoef[p_] * mSh[p_, 0, row].to(Float32)
                shs[idx] = a
            cute.arch.barrier(barrier_id=1, number_of_threads=CONS)
            gR = cute.zipped_divide(ring, (1, 1, 4))
            for n in cutlass.range(nitems):
                slot = n % ST
                cute.arch.mbarrier_wait(full.iterator + slot, (n // ST) % 2)
                tot = ring_row_dot(gR, slot, warp, lane, NCH, unpack, lambda i: None, r_pair)
                cute.arch.sync_warp()  # every lane has read the slot
                if lane == 0:
                    cute.arch.mbarrier_arrive(empty.iterator + slot)
                    row = (bx + n * G) * RS + warp
                    mO[0, row] = (tot * rs + shs[n * RS + warp]).to(BFloat16)

    @cute.jit
    def tail_ring_host(mW: cute.Tensor, mX: cute.Tensor, mSsq: cute.Tensor, mSh: cute.Tensor, mCoef: cute.Tensor,
                       mO: cute.Tensor, stream):
        tail_ring_kernel(mW, mX, mSsq, mSh, mCoef, mO).launch(
            grid=(G, 1, 1), block=(THREADS, 1, 1), smem=tail_ring_smem_bytes(key), stream=stream, use_pdl=PDL,
            **carveout)

    fake = cute.runtime.make_fake_compact_tensor
    m = cute.sym_int()
    args = (
        fake(BFloat16, (D, L), stride_order=(1, 0), assumed_align=16),
        fake(BFloat16, (m, L), stride_order=(1, 0), assumed_align=16),
        fake(Float32, (m,), assumed_align=16),
        fake(BFloat16, (TP, m, D), stride_order=(2, 1, 0), assumed_align=16),
        fake(Float32, (TP,), assumed_align=16),
        fake(BFloat16, (m, D), stride_order=(1, 0), assumed_align=16),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    return tail_ring_host, args


# ring geometries (rows per slot, slots, CTAs per SM) built ahead of time at TP8 with PDL besides the default
# 4 x 7 ('tringRxS[cN]'): two CTAs per SM, each with its own producer lane (`ring_rate`'s question: is one lane
# issuing one bulk copy after each release what bounds the ring? run 58: no); and 4 x 8, the deepest ring that
# fits (224 KB of slots: more of W_up in flight before moe_down ends, which is what the ring gains in the graph)
TAIL_RING_GEOMETRIES = ((4, 3, 2), (2, 7, 2), (4, 8, 1))


def tail_ring_key(shape: MoEShape, geometry: tuple | None = None, pdl: bool = True,
                  arch: str = "sm_90a", trigger: bool = False) -> MoETailRingKey:
    """The tail ring key of a 'tringRxS[cN]' geometry (rows per slot, slots, CTAs per SM); None: the default.
    trigger: let the next launch be scheduled at the CTA's start ('fpdl')."""
    if geometry is None:
        return MoETailRingKey(shape, pdl=pdl, trigger=trigger, arch=arch)
    r, st, c = geometry
    return MoETailRingKey(shape, rows_per_stage=r, stages=st, ctas=H200_SMS * c, pdl=pdl, trigger=trigger, arch=arch)


def _aot_keys(arch: str):
    keys = [MoETailRingKey(shapes_for_tp(tp), pdl=p, arch=arch) for tp in (8, 16) for p in (True, False)]
    keys += [tail_ring_key(shapes_for_tp(8), g, arch=arch) for g in TAIL_RING_GEOMETRIES]
    keys += [tail_ring_key(shapes_for_tp(8), trigger=True, arch=arch)]  # 'fpdl'
    return keys + [cotail_key(shapes_for_tp(8), arch=arch)]  # 'cotail' at TP8, one token (PDL)


TAIL_RING = kc.register(kc.KernelSpec(name="moe_tail_ring", module=__name__, key_type=MoETailRingKey,
                                      build=build_tail_ring, aot_keys=_aot_keys,
                                      ptx_checks=("cp.async.bulk", "mbarrier")))

__all__ = ["RingGeometry", "ring_smem", "init_ring_barriers", "ring_row_dot", "MoETailRingKey", "tail_ring_smem_bytes", "stream_row_blocks", "TAIL_RING", "COTAIL_GEOMETRY", "cotail_key",
           "TAIL_RING_GEOMETRIES", "tail_ring_key"]
