"""Single PTX instructions the CuTe DSL kernels need as traced calls (inline asm, SM90).

    bulk_g2s(dst, src, nbytes, mbar, hint=None)
                                       cp.async.bulk global -> shared, completing `nbytes` of the
                                       transaction count of the mbarrier at shared address `mbar`
    bulk_prefetch_l2(src, nbytes, hint=None)
                                       cp.async.bulk.prefetch.L2: bring `nbytes` (a multiple of 16) at global
                                       address `src` into L2 without waiting or using a register or shared
                                       memory (a later launch's bytes, fetched while this one is not
                                       bandwidth-bound)
                                       Both with `hint` (fixed at trace time, one of L2_HINTS: "evict_first",
                                       "evict_last", ...) give the bytes they bring that L2 eviction priority
                                       (.L2::cache_hint with a createpolicy.fractional policy over all of them)
    mma_bf16(a, b, c) -> d             mma.sync m16n8k16, bf16 A (4 regs) × bf16 B (2 regs) + fp32 C (4)
    mma_f16(a, b, c) -> d              mma.sync m16n8k16, f16 A (4 regs) × f16 B (2 regs) + fp32 C (4)
    e4m3x2_to_f16x2(x) -> (lo, hi)     the 4 E4M3 bytes of x as two f16 pairs: bytes (0, 1) and (2, 3) (cvt, exact)
    pack_f16x2(lo, hi) -> Int32        two fp32 rounded to an f16 pair (lo in the low half)
    as_f32(bits) -> Float32            an Int32's bits read as fp32 (f32_bits: the reverse)
    pack_bf16x2(lo, hi) -> Int32       two fp32 rounded to a bf16 pair (lo in the low half)
    bf16x2_to_f32(w) -> (lo, hi)       the two bf16 of a word as fp32
    bf16x2_to_f32_here(w) -> (lo, hi)  the same as volatile asm: unpacked where it stands, not hoisted out of loops
    ld_v4_f32(addr) -> [4 Float32]     ld.relaxed.gpu.global.v4.f32 (16-byte aligned; volatile: stays in order
                                       with fences)
    red_add_v4_f32(addr, a, b, c, d)   red.relaxed.gpu.global.add.v4.f32 (sm_90): four fp32 added in one request
    mbar_spin_wait(mbar, phase)        poll mbarrier.test_wait.parity until the phase completes (no suspend)
    mbar_inval(mbar)                   mbarrier.inval: retire an mbarrier whose bytes are then used for other data
    timestamps() -> (ns, clk)          %globaltimer (ns, common to all SMs) and %clock64 (this SM's cycles),
                                       read where the call stands (volatile), for kernel timelines

Fragment layouts of mma.sync m16n8k16 (lane = 4·g + c): A a0a1 = row g, k 2c..2c+1; a2a3 = row g+8,
k 2c..2c+1; a4a5 = row g, k 2c+8..2c+9; a6a7 = row g+8, k 2c+8..2c+9. B b0b1 = k 2c..2c+1, column g;
b2b3 = k 2c+8..2c+9, column g. C/D c0c1 = row g, columns 2c..2c+1; c2c3 = row g+8, same columns.
"""


_OPS = {}
L2_HINTS = ("evict_first", "evict_last", "evict_normal", "evict_unchanged")  # createpolicy.fractional's priorities


def _ops():
    if _OPS:
        return _OPS
    from cutlass import Float32, Int32, Int64
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    def asm(result, args, text, constraints, loc, ip):
        return llvm.inline_asm(result, args, text, constraints, has_side_effects=result is None,
                               is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)

    def with_policy(text, hint):
        """`text` (one bulk instruction ending in its operands and ';'), plain or with an L2 eviction priority"""
        if hint is None:
            return text
        if hint not in L2_HINTS:
            raise ValueError(f"L2 eviction hint must be one of {L2_HINTS}; got {hint!r}")
        op, operands = text.split(" ", 1)
        return (f"{{\n.reg .b64 pol;\ncreatepolicy.fractional.L2::{hint}.b64 pol, 1.0;\n"
                f"{op}.L2::cache_hint {operands[:-1]}, pol;\n}}")

    @dsl_user_op
    def bulk_g2s(dst, src, nbytes, mbar, hint=None, *, loc=None, ip=None):
        asm(None, [Int32(dst).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip),
                   Int32(nbytes).ir_value(loc=loc, ip=ip), Int32(mbar).ir_value(loc=loc, ip=ip)],
            with_policy("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
                        hint), "r,l,r,r", loc, ip)

    @dsl_user_op
    def bulk_prefetch_l2(src, nbytes, hint=None, *, loc=None, ip=None):
        asm(None, [Int64(src).ir_value(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
            with_policy("cp.async.bulk.prefetch.L2.global [$0], $1;", hint), "l,r", loc, ip)

    def make_mma(ab):
        text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 {{$0,$1,$2,$3}}, {{$4,$5,$6,$7}}, {{$8,$9}}, "
                "{$10,$11,$12,$13};")

        @dsl_user_op
        def mma(a, b, c, *, loc=None, ip=None):
            ins = ([Int32(x).ir_value(loc=loc, ip=ip) for x in a] + [Int32(x).ir_value(loc=loc, ip=ip) for x in b]
                   + [Float32(x).ir_value(loc=loc, ip=ip) for x in c])
            res = asm(llvm.StructType.get_literal([T.f32()] * 4), ins, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc, ip)
            return [Float32(llvm.extractvalue(T.f32(), res, [k], loc=loc, ip=ip)) for k in range(4)]

        return mma

    mma_bf16, mma_f16 = make_mma("bf16"), make_mma("f16")

    @dsl_user_op
    def e4m3x2_to_f16x2(x, *, loc=None, ip=None):
        res = asm(llvm.StructType.get_literal([T.i32()] * 2), [Int32(x).ir_value(loc=loc, ip=ip)],
                  "{\n.reg .b16 l, h;\nmov.b32 {l, h}, $2;\ncvt.rn.f16x2.e4m3x2 $0, l;\ncvt.rn.f16x2.e4m3x2 $1, h;\n}",
                  "=r,=r,r", loc, ip)
        return tuple(Int32(llvm.extractvalue(T.i32(), res, [k], loc=loc, ip=ip)) for k in range(2))

    @dsl_user_op
    def f32_bits(x, *, loc=None, ip=None):
        return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))

    @dsl_user_op
    def as_f32(bits, *, loc=None, ip=None):
        return Float32(llvm.bitcast(T.f32(), Int32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))

    def make_pack(kind):
        text = f"cvt.rn.{kind}.f32 $0, $1, $2;"

        @dsl_user_op
        def pack(lo, hi, *, loc=None, ip=None):
            res = asm(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
                      text, "=r,f,f", loc, ip)
            return Int32(res)

        return pack

    pack_bf16x2, pack_f16x2 = make_pack("bf16x2"), make_pack("f16x2")

    @dsl_user_op
    def bf16x2_to_f32(w, *, loc=None, ip=None):
        """Int32 holding a bf16 pair -> (low as fp32, high as fp32)"""
        w = Int32(w)
        lo = w << 16
        hi = w & Int32(-65536)
        return (Float32(llvm.bitcast(T.f32(), lo.ir_value(loc=loc, ip=ip), loc=loc, ip=ip)),
                Float32(llvm.bitcast(T.f32(), hi.ir_value(loc=loc, ip=ip), loc=loc, ip=ip)))

    @dsl_user_op
    def ld_v4_f32(addr, *, loc=None, ip=None):
        """four consecutive fp32 from global memory (16-byte aligned) in one relaxed gpu-scope load, which stays
        in program order with the fences around it"""
        res = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * 4), [Int64(addr).ir_value(loc=loc, ip=ip)],
                              "ld.relaxed.gpu.global.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l",
                              has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                              loc=loc, ip=ip)
        return [Float32(llvm.extractvalue(T.f32(), res, [k], loc=loc, ip=ip)) for k in range(4)]

    @dsl_user_op
    def red_add_v4_f32(addr, a, b, c, d, *, loc=None, ip=None):
        """four fp32 added into consecutive global words (16-byte aligned) in one relaxed gpu-scope reduction"""
        asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)] + [Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)],
            "red.relaxed.gpu.global.add.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f", loc, ip)

    @dsl_user_op
    def mbar_spin_wait(mbar, phase, *, loc=None, ip=None):
        """wait for phase `phase` of the mbarrier at shared address `mbar` by polling mbarrier.test_wait (no
        suspend, unlike try_wait's loop, which ptxas pairs with NANOSLEEP.SYNCS)"""
        asm(None, [Int32(mbar).ir_value(loc=loc, ip=ip), Int32(phase).ir_value(loc=loc, ip=ip)],
            "{\n.reg .pred p;\nSPIN_WAIT:\nmbarrier.test_wait.parity.shared::cta.b64 p, [$0], $1;\n@!p bra SPIN_WAIT;\n}",
            "r,r", loc, ip)

    @dsl_user_op
    def mbar_inval(mbar, *, loc=None, ip=None):
        """invalidate the mbarrier at shared address `mbar`, so that its bytes may be used for something else"""
        asm(None, [Int32(mbar).ir_value(loc=loc, ip=ip)], "mbarrier.inval.shared::cta.b64 [$0];", "r", loc, ip)

    @dsl_user_op
    def timestamps(*, loc=None, ip=None):
        res = llvm.inline_asm(llvm.StructType.get_literal([T.i64(), T.i64()]), [],
                              "mov.u64 $0, %globaltimer; mov.u64 $1, %clock64;", "=l,=l", has_side_effects=True,
                              is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
        return tuple(Int64(llvm.extractvalue(T.i64(), res, [k], loc=loc, ip=ip)) for k in range(2))

    @dsl_user_op
    def bf16x2_to_f32_here(w, *, loc=None, ip=None):
        """bf16x2_to_f32 as volatile inline asm: unpacked where the call stands, never hoisted out of a loop
        (keeps a loop-invariant packed operand packed in registers)"""
        res = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * 2), [Int32(w).ir_value(loc=loc, ip=ip)],
                              "shl.b32 $0, $2, 16;\n\tand.b32 $1, $2, 0xFFFF0000;", "=f,=f,r",
                              has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                              loc=loc, ip=ip)
        return tuple(Float32(llvm.extractvalue(T.f32(), res, [k], loc=loc, ip=ip)) for k in range(2))

    _OPS.update(bulk_g2s=bulk_g2s, bulk_prefetch_l2=bulk_prefetch_l2, mma_bf16=mma_bf16, mma_f16=mma_f16,
                e4m3x2_to_f16x2=e4m3x2_to_f16x2, pack_bf16x2=pack_bf16x2, pack_f16x2=pack_f16x2,
                bf16x2_to_f32=bf16x2_to_f32, as_f32=as_f32, f32_bits=f32_bits, timestamps=timestamps,
                ld_v4_f32=ld_v4_f32, red_add_v4_f32=red_add_v4_f32, mbar_spin_wait=mbar_spin_wait,
                bf16x2_to_f32_here=bf16x2_to_f32_here, mbar_inval=mbar_inval)
    return _OPS


def _accessor(name):
    def get():
        return _ops()[name]
    get.__name__ = get.__qualname__ = name
    get.__doc__ = f"The traced op `{name}` (see the module docstring); built on first use."
    return get


(bulk_g2s, bulk_prefetch_l2, mma_bf16, mma_f16, e4m3x2_to_f16x2, pack_bf16x2, pack_f16x2, bf16x2_to_f32, as_f32,
 f32_bits, timestamps, ld_v4_f32, red_add_v4_f32, mbar_spin_wait, bf16x2_to_f32_here, mbar_inval) = (
    _accessor(n) for n in (
        "bulk_g2s", "bulk_prefetch_l2", "mma_bf16", "mma_f16", "e4m3x2_to_f16x2", "pack_bf16x2", "pack_f16x2",
        "bf16x2_to_f32", "as_f32", "f32_bits", "timestamps", "ld_v4_f32", "red_add_v4_f32", "mbar_spin_wait",
        "bf16x2_to_f32_here", "mbar_inval"))
