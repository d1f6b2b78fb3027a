"""How fast one SM runs `mma.sync.m16n8k16` bf16 (the pipelined expert kernels' tensor-core op), alone or with
the MXFP4 pair decode in front of each mma, for a given number of warps and independent accumulator chains.

The pipelined moe_up takes about 2300 cycles per item (16 mma per warp on 14 warps, run 20–23) whatever its
warp count or decode version (`docs/fused_moe.md`); this kernel measures the same instruction mix without the
ring, the barriers or the reduction. One CTA per SM; every warp runs `outer` rounds of `depth` × `chains` mmas
(`chains` independent accumulators, each `depth` deep per round), between two reads of %clock64 and
%globaltimer. `mma_rate.run_mma_rate` turns the cycles into cycles per mma per SM sub-partition.
"""

from dataclasses import dataclass

from .. import compile as kc

MMA_RATE_SMS = 132  # one CTA per SM of the H200
MMA_RATE_DEPTH = 8  # mmas per chain per round (a super-block's chain in the expert kernels)
MMA_RATE_OUTER = 64  # rounds between the two clock reads (mma_rate.run_mma_rate passes them in the seed vector)


@dataclass(frozen=True)
class MmaRateKey:
    warps: int = 16  # warps per CTA
    chains: int = 2  # independent accumulator chains per warp (moe_up: 2 super-blocks per warp, 1 with upw28)
    decode: bool = False  # decode a code word into the A operand before each mma (`mxfp4_decode.PAIR_CUTS[2]`)
    arch: str = "sm_90a"

    def __post_init__(self):
        if not (1 <= self.warps <= 32 and self.warps % 4 == 0):
            raise ValueError(f"warps must be a multiple of 4 in 4..32 (one CTA of at most 1024 threads), "
                             f"got {self.warps}")
        if self.chains not in (1, 2, 4, 8):
            raise ValueError(f"chains must be 1, 2, 4 or 8, got {self.chains}")

    @property
    def mmas_per_warp(self) -> int:
        return MMA_RATE_OUTER * MMA_RATE_DEPTH * self.chains


def build_mma_rate(key: MmaRateKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, const_expr

    from .mxfp4_decode import decode_pairs
    from .ptx_ops import mma_bf16, timestamps

    W, CH, DEC = key.warps, key.chains, key.decode
    G, DEPTH, OUTER = MMA_RATE_SMS, MMA_RATE_DEPTH, MMA_RATE_OUTER
    mma, stamp = mma_bf16(), timestamps()

    @cute.kernel
    def rate_kernel(mOut: cute.Tensor, mSeed: cute.Tensor):
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, _, _ = cute.arch.block_idx()
        s = mSeed[lane]  # operands from memory: nothing to fold at compile time
        sc = mSeed[(lane + 1) % 32]
        outer = mSeed[32]  # rounds, at run time (a constant trip count would be unrolled)
        b = [s + Int32(4), s + Int32(5)]
        sink = Float32(0.0)
        cute.arch.barrier()
        ns0, c0 = stamp()
        for it in cutlass.range(outer):
            # per round and chain different A operands: otherwise the chains (and the rounds) are common
            # subexpressions the compiler computes once
            q = s + it
            accs = [[Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)] for _ in range(CH)]
            for d in cutlass.range_constexpr(DEPTH):
                for c in cutlass.range_constexpr(CH):
                    if const_expr(DEC):  # one code word per mma, as in the expert kernels (4 pairs = the A operand)
                        p = decode_pairs(2)(q + Int32(7 * c + d), sc)
                        accs[c] = mma([p[0], p[1], p[2], p[3]], b, accs[c])
                    else:
                        accs[c] = mma([q + Int32(7 * c), q + Int32(7 * c + 1), q + Int32(7 * c + 2),
                                       q + Int32(7 * c + 3)], b, accs[c])
            for c in cutlass.range_constexpr(CH):
                sink = sink + accs[c][0]
        ns1, c1 = stamp()
        if lane == 0:
            mOut[bx, warp, 0] = c1 - c0
            mOut[bx, warp, 1] = ns1 - ns0
            mOut[bx, warp, 2] = Int64(sink == Float32(1.25))  # keeps the mmas live

    @cute.jit
    def rate_host(mOut: cute.Tensor, mSeed: cute.Tensor, stream):
        rate_kernel(mOut, mSeed).launch(grid=(G, 1, 1), block=(32 * W, 1, 1), stream=stream)

    fake = cute.runtime.make_fake_compact_tensor
    args = (fake(Int64, (G, W, 3), stride_order=(2, 1, 0), assumed_align=16),
            fake(Int32, (33,), assumed_align=16),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
    return rate_host, args


MMA_RATE_WARPS = (4, 8, 16, 32)
MMA_RATE_CHAINS = (1, 2)  # 4 chains spill (ptxas unrolls the rounds 4 times)


def rate_keys(arch: str):
    """The configurations built ahead of time: every warp count with 1 or 2 chains, with and without the decode,
    except 32 warps × 2 chains with the decode (64 registers a thread: it spills)."""
    return [MmaRateKey(w, c, d, arch=arch) for d in (False, True) for w in MMA_RATE_WARPS for c in MMA_RATE_CHAINS
            if not (d and c * w > 32)]


def smoke_keys(arch: str):
    """The two configurations of the GPU test, in the default bundle; the whole set (`rate_keys`, measured on the
    H200 in run 26, `mma_rate_h200`) is built by `kimi-decode bundle --tuning`, which keeps the default bundle
    within the device call's carry limit."""
    return [MmaRateKey(8, 1, arch=arch), MmaRateKey(8, 2, True, arch=arch)]


MMA_RATE = kc.register(kc.KernelSpec(name="mma_rate", module=__name__, key_type=MmaRateKey, build=build_mma_rate,
                                     aot_keys=smoke_keys, tuning_keys=rate_keys,
                                     ptx_checks=("mma.sync", "%clock64")))

__all__ = ["MmaRateKey", "rate_keys", "MMA_RATE_SMS", "MMA_RATE_DEPTH", "MMA_RATE_OUTER", "MMA_RATE_WARPS",
           "MMA_RATE_CHAINS"]
