"""How fast a persistent bulk-copy ring streams weights on this GPU, with and without its consumers' arithmetic
(`kimi-decode ring-rate`, runner `kimi_decode.ring_rate`).

The one-token tail ring (`moe_tail_ring`) wins in the MoE half's graph because it fills its slots before
`griddepcontrol.wait`, while moe_down runs; measured alone under Nsight Compute it streams W_up more slowly
than the plain GEMV (H100, run 55: 22.4 µs for 51.5 MB, 2.3 TB/s against a 2.99 TB/s copy), and the ring front
(`moe_front_ring`), which has nothing to overlap, is slower than the plain front in every geometry tried
(runs 50-56). This kernel is that ring and nothing else: one producer lane per CTA streams `stages` slots of
`slot_kb` KB (one bulk copy each, blocks bx, bx + G, ... of a flat weight buffer) and 4 consumer warps release
each slot, either at once (`work` 0: the ring's own rate) or after the tail ring's row loop over their quarter
of it (`work` 1: 16-byte shared-memory loads, bf16 unpack and two fp32 chains, `moe_tail_ring.ring_row_dot`, against
one x value; each warp stores its sum). Arguments: the weights (bf16, flat), the sums (fp32 [blocks, 4]) and
(blocks, work, x) as int32.
`ctas` CTAs in all: 132 is one per SM, 264 two.
"""

from dataclasses import dataclass

from .. import compile as kc
from .moe_pipe import H200_SMS
from .moe_tail_ring import RingGeometry, init_ring_barriers, ring_row_dot, ring_smem, stream_row_blocks

RING_RATE_WARPS = 4  # consumer warps per CTA (each takes a quarter of a slot, as one W_up row of the tail ring)


@dataclass(frozen=True)
class RingRateKey(RingGeometry):
    slot_kb: int = 28  # KB per slot (one bulk copy): the tail ring's 4 rows of 7 KB
    stages: int = 7  # slots per CTA
    ctas: int = H200_SMS  # persistent CTAs in the grid
    arch: str = "sm_90a"

    def __post_init__(self):
        if self.slot_kb < 2 or self.slot_kb % 2:
            raise ValueError(f"slot_kb must be an even number of KB (4 consumer warps × 16 bytes × 32 lanes "
                             f"divide it), got {self.slot_kb}")
        if not 2 <= self.stages <= 16:
            raise ValueError(f"stages must be 2..16, got {self.stages}")
        self.check_geometry({}, ring_rate_smem_bytes(self))

    @property
    def rows_per_stage(self) -> int:  # a slot's "rows" are the consumer warps' quarters
        return RING_RATE_WARPS

    @property
    def ROW_ELEMS(self) -> int:  # noqa: N802  (RingGeometry's name)
        return self.slot_kb * 1024 // RING_RATE_WARPS // 2

    @property
    def slot_bytes(self) -> int:
        return self.stage_bytes

    @property
    def kb_in_flight_per_sm(self) -> int:
        return self.slot_kb * self.stages * self.ctas_per_sm


def ring_rate_smem_bytes(key: RingRateKey) -> int:
    return key.stages * (key.slot_bytes + 16) + 128


def build_ring_rate(key: RingRateKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from .ptx_ops import bf16x2_to_f32

    ST, G, SB, C = key.stages, key.ctas, key.slot_bytes, RING_RATE_WARPS
    WORDS = SB // 4 // C  # Int32 words of a consumer warp's quarter of a slot
    NCH = WORDS // 4 // 32  # 16-byte chunks a lane reads per slot
    assert NCH * 4 * 32 == WORDS
    THREADS = 32 * C + 32
    unpack = bf16x2_to_f32()

    @cute.kernel
    def ring_rate_kernel(mW: cute.Tensor, mOut: cute.Tensor, mArg: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        ring, full, empty = ring_smem(smem, ST, C, WORDS)
        nblocks = mArg[0]
        work = mArg[1]
        nitems = (nblocks - bx + G - 1) // G  # blocks bx, bx + G, ...
        if tid == 0:
            init_ring_barriers(full, empty, ST, C)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        if warp == C:
            if lane == 0:
                stream_row_blocks()(mW, ring, full, empty, bx, nitems, G, ST, SB)
        else:
            scale = mArg[2].to(Float32)  # the x of the row loop: one value, from memory
            gR = cute.zipped_divide(ring, (1, 1, 4))
            for n in cutlass.range(nitems):
                slot = n % ST
                cute.arch.mbarrier_wait(full.iterator + slot, (n // ST) % 2)
                if work != 0:
                    tot = ring_row_dot(gR, slot, warp, lane, NCH, unpack, lambda i: None,
                                       lambda _, i, q: (scale, scale))
                    cute.arch.sync_warp()
                    if lane == 0:
                        mOut[bx + n * G, warp] = tot
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.mbarrier_arrive(empty.iterator + slot)

    @cute.jit
    def ring_rate_host(mW: cute.Tensor, mOut: cute.Tensor, mArg: cute.Tensor, stream):
        ring_rate_kernel(mW, mOut, mArg).launch(grid=(G, 1, 1), block=(THREADS, 1, 1),
                                                smem=ring_rate_smem_bytes(key), stream=stream)

    fake = cute.runtime.make_fake_compact_tensor
    from cutlass import BFloat16
    m, nb = cute.sym_int(), cute.sym_int()
    args = (fake(BFloat16, (m,), assumed_align=16),
            fake(Float32, (nb, C), stride_order=(1, 0), assumed_align=16),
            fake(Int32, (3,), assumed_align=16),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
    return ring_rate_host, args


# built ahead of time: the tail ring's geometry (28 KB x 7) and the ring front's (56 KB x 3); the same bytes in
# flight in smaller slots (14 KB x 14, 8 KB x 24 would need 24 mbarrier pairs: 8 KB x 16); less in flight
# (28 KB x 2 / x 4, 56 KB x 2); and two CTAs per SM (28 KB x 3, 14 KB x 7: 168 and 196 KB per SM)
RING_RATE_GEOMETRIES = ((28, 7, 1), (56, 3, 1), (14, 14, 1), (8, 16, 1), (28, 2, 1), (28, 4, 1), (56, 2, 1),
                        (28, 3, 2), (14, 7, 2))


def rate_keys(arch: str):
    return [RingRateKey(kb, st, H200_SMS * per_sm, arch=arch) for kb, st, per_sm in RING_RATE_GEOMETRIES]


def smoke_keys(arch: str):
    """The two geometries of the GPU test, in the default bundle; the whole set (`rate_keys`, measured on the H100
    in run 58 and the H200 in run 64: `ring_rate_h100`, `ring_rate_h200`) is built by `kimi-decode bundle --tuning`."""
    return [RingRateKey(28, 7, arch=arch), RingRateKey(28, 3, 2 * H200_SMS, arch=arch)]


RING_RATE = kc.register(kc.KernelSpec(name="ring_rate", module=__name__, key_type=RingRateKey,
                                      build=build_ring_rate, aot_keys=smoke_keys, tuning_keys=rate_keys,
                                      ptx_checks=("cp.async.bulk", "mbarrier")))

__all__ = ["RingRateKey", "ring_rate_smem_bytes", "rate_keys", "RING_RATE", "RING_RATE_GEOMETRIES",
           "RING_RATE_WARPS"]
