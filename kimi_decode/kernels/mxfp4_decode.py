"""In-register MXFP4 decode for the fused MoE kernels (`kimi_k3_layer.md` §6.2), SM90.

One 32-bit word holds 8 E2M1 codes (code k in bits 4k..4k+3: the even element in
the low nibble of each byte). Pairs of codes (k, k+4) sit 16 bits apart, so one
shift and one mask place both codes' sign / exponent / mantissa bits where a
bf16 pair has them: magnitude bits to bf16 bits 6..8 and the sign to bit 15.
That bf16 is the E2M1 value times 2^-126 (codes 0 and 1 become bf16 subnormals,
which `mul.rn.bf16x2` keeps exact), so one packed multiply by 2^(s-1) (the E8M0
scale 2^(s-127) times 2^126) yields the exact dequantised pair. The two halves
then become fp32 by a shift and a mask. Per code: about 2 integer ops and half a
packed multiply, against 6–8 for a nibble-by-nibble decode.

The scale trick needs 2^(s-1) to be a normal bf16: s <= 128 (|w| <= 12). The
fused MoE executor checks this before any launch.
"""


MAX_E8M0 = 128  # largest E8M0 scale byte the decode accepts (2^(s-1) must fit bf16)

_DECODE = None


def _asm_words(asm, n_out, args, loc, ip):
    """(traced) inline PTX `asm` over the Int32 `args` ($n_out ..) with n_out b32 results ($0 ..), as Int32. Marked
    as having side effects so that the compiler keeps each decode next to its use: hoisted out of a token loop,
    all of a CTA's decoded weights (8 fp32 per word) would be live at once and spill."""
    from cutlass import Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    res = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * n_out),
                          [Int32(a).ir_value(loc=loc, ip=ip) for a in args], asm,
                          ",".join(["=r"] * n_out + ["r"] * len(args)), has_side_effects=True, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Int32(llvm.extractvalue(T.i32(), res, [k], loc=loc, ip=ip)) for k in range(n_out)]


def decode_word():
    """`@dsl_user_op` decode(q, scale_pair) -> [8 × Float32]: the 8 codes of q times the scale.

    q: Int32 word of 8 E2M1 codes; scale_pair: Int32 holding bf16x2 (2^(s-1), 2^(s-1)) from
    `scale_pair(s)`. Result element k is code k (bits 4k..4k+3) dequantised.
    """
    global _DECODE
    if _DECODE is None:
        _DECODE = _make_decode()
    return _DECODE


def _make_decode():
    from cutlass import Float32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    # outputs $0..$7 = codes 0..7 (as b32 bit patterns of fp32); inputs $8 = q, $9 = scale pair
    body = []
    for step, (lo, hi) in enumerate(((3, 7), (2, 6), (1, 5), (0, 4))):
        src = "q" if step == 0 else f"q{step}"
        if step > 0:
            prev = "q" if step == 1 else f"q{step - 1}"
            body.append(f"shl.b32 {src}, {prev}, 4;")
        body += [
            f"and.b32 sg, {src}, 0x80008000;",
            f"shr.b32 mg, {src}, 6;",
            "and.b32 mg, mg, 0x01C001C0;",
            "or.b32 pr, mg, sg;",
            "mul.rn.bf16x2 pr, pr, sc;",
            f"shl.b32 ${lo}, pr, 16;",
            f"and.b32 ${hi}, pr, 0xFFFF0000;",
        ]
    asm = ("{\n.reg .b32 q, q1, q2, q3, sg, mg, pr, sc;\nmov.b32 q, $8;\nmov.b32 sc, $9;\n"
           + "\n".join(body) + "\n}")

    @dsl_user_op
    def decode(q, scale_pair, *, loc=None, ip=None):
        return [Float32(llvm.bitcast(T.f32(), w.ir_value(loc=loc, ip=ip), loc=loc, ip=ip))
                for w in _asm_words(asm, 8, (q, scale_pair), loc, ip)]

    return decode


_PAIRS = {}

# How each of the 4 bf16 pairs of a word is cut out (`decode_pairs`), as (sign source, magnitude source) with a
# source written (right shift, then left shift) of the word q; the pair is (mag & 0x01C001C0) | (sign & 0x80008000).
# v1: one shift of q per pair puts code k's sign at bit 15 (and code k+4's at 31), the magnitudes follow 6 bits
#     lower: per pair a left shift, a right shift and two logic ops (three on the integer ALU pipe, one
#     IMAD.SHL): the ALU pipe bounds the pipelined expert kernels.
# v2: the magnitudes of codes 2, 3, 6, 7 come from q >> 8 (one right shift per word), every other shift is a
#     left shift (IMAD.SHL, the FMA pipe): per pair two ALU ops instead of three.
PAIR_CUTS = {
    1: tuple(((0, 12 - 4 * k), (4 * k - 6, 0) if k >= 2 else (0, 6 - 4 * k)) for k in range(4)),
    2: tuple(((0, 12 - 4 * k), (8 if k >= 2 else 0, 6 - 4 * (k % 2))) for k in range(4)),
}
MAG_MASK, SIGN_MASK = 0x01C001C0, 0x80008000
# v3: no shift pair per pair. The pair's two nibbles are masked out of q (codes 2, 3, 6, 7 out of q >> 8, the one
#     right shift per word), then one integer multiply by 2^a + 2^b writes the nibbles to two places at once (the
#     two copies do not overlap, so the multiply carries nothing), and a second mask keeps the magnitude of one copy
#     and the sign of the other: per pair two logic ops (ALU pipe) and one IMAD (FMA pipe), instead of v2's two
#     logic ops and about two shifts. SPREAD[k % 2] = (nibble mask, multiplier) of pairs k and k + 2.
SPREAD = {0: (0x000F000F, (1 << 6) + (1 << 12)), 1: (0x00F000F0, (1 << 2) + (1 << 8))}
VERSIONS = (1, 2, 3)


def emulate_pairs(q: int, version: int = 1) -> list[int]:
    """The bit operations of `decode_pairs` on a Python int (before the scale multiply): 4 bf16x2 words,
    each the codes (k, k+4) times 2^-126 (used by the CPU tests)."""
    if version not in VERSIONS:
        raise ValueError(f"decode version must be one of {VERSIONS}, got {version!r}")
    q &= 0xFFFFFFFF
    out = []
    if version == 3:
        for k in range(4):
            mask, mult = SPREAD[k % 2]
            t = ((q >> 8) if k >= 2 else q) & mask
            out.append(((t * mult) & 0xFFFFFFFF) & (MAG_MASK | SIGN_MASK))
        return out
    for (sr, sl), (mr, ml) in PAIR_CUTS[version]:
        sign = ((q >> sr) << sl) & 0xFFFFFFFF
        mag = ((q >> mr) << ml) & 0xFFFFFFFF
        out.append((mag & MAG_MASK) | (sign & SIGN_MASK))
    return out


def decode_pairs(version: int = 1):
    """`@dsl_user_op` decode_pairs(q, scale_pair) -> [4 × Int32]: the 8 codes of q dequantised as bf16
    pairs, pair k = (code k in the low half, code k + 4 in the high half): the A operand of a bf16
    mma.sync straight from the decode (same arithmetic as `decode_word`, without the fp32 split).
    `version` picks how the pairs are cut out (`PAIR_CUTS`, `SPREAD`); all give the same bits."""
    if version not in VERSIONS:
        raise ValueError(f"decode version must be one of {VERSIONS}, got {version!r}")
    if version not in _PAIRS:
        _PAIRS[version] = _make_pairs(version)
    return _PAIRS[version]


def _make_pairs(version: int):
    from cutlass.cutlass_dsl import dsl_user_op

    body = []
    if version in (2, 3):
        body.append("shr.b32 qr, q, 8;")
    if version == 3:
        for k in range(4):
            mask, mult = SPREAD[k % 2]
            body += [f"and.b32 t, {'qr' if k >= 2 else 'q'}, {mask:#010x};", f"mul.lo.u32 t, t, {mult};",
                     f"and.b32 pr, t, {MAG_MASK | SIGN_MASK:#010x};", f"mul.rn.bf16x2 ${k}, pr, sc;"]
    for k, ((sr, sl), (mr, ml)) in enumerate(PAIR_CUTS.get(version, ())):
        assert sr == 0  # every sign source is q shifted left
        body.append(f"shl.b32 t, q, {sl};" if sl else "mov.b32 t, q;")
        body.append("and.b32 sg, t, 0x80008000;")
        if version == 2:
            body.append(f"shl.b32 mg, {'qr' if mr else 'q'}, {ml};")
        else:  # v1: the magnitude source is the sign source shifted right by 6
            body.append("shr.b32 mg, t, 6;")
        body += ["and.b32 mg, mg, 0x01C001C0;", "or.b32 pr, mg, sg;", f"mul.rn.bf16x2 ${k}, pr, sc;"]
    regs = "q, qr, t, sg, mg, pr, sc" if version in (2, 3) else "q, t, sg, mg, pr, sc"
    asm = ("{\n.reg .b32 " + regs + ";\nmov.b32 q, $4;\nmov.b32 sc, $5;\n" + "\n".join(body) + "\n}")

    @dsl_user_op
    def pairs(q, scale_pair, *, loc=None, ip=None):
        return _asm_words(asm, 4, (q, scale_pair), loc, ip)

    return pairs


def scale_pair(s):
    """bf16x2 (2^(s-1), 2^(s-1)) as an Int32 from an E8M0 byte s (traced; s <= MAX_E8M0)."""
    from cutlass import Int32

    b = (Int32(s) + Int32(126)) << 7
    return b | (b << 16)


# E2M1 -> E4M3 by placing bits ('f16', moe_up's option): code (s, e1, e0, m) becomes the byte s·128 + (e1 e0 m)·4,
# an E4M3 whose exponent field is (0 0 e1 e0) and mantissa (m 0 0). Normal codes 2^(e-1)(1 + m/2) and the subnormal
# m/2 both become their value times 2^-6 (E4M3's bias is 7, E2M1's 1; E4M3's subnormal step is 2^-9), so the pair of
# registers holds the exact codes up to one power of two that the scale takes back (`E4M3_SCALE_SHIFT`). The even
# codes of a word sit in the low nibbles of its bytes, the odd ones in the high nibbles: per word two shifts and
# four masks give 4 + 4 codes; cvt makes them exact f16 pairs (E4M3 is a subset of f16).
E4M3_SCALE_SHIFT = 6  # the decoded codes are the E2M1 values times 2^-6: the fp32 scale is 2^(s - 127 + 6)
E4M3_MAG, E4M3_SIGN = 0x1C1C1C1C, 0x80808080


def emulate_e4m3(q: int) -> tuple[int, int]:
    """The bit operations of `decode_e4m3` on a Python int: (even, odd), each 4 E4M3 bytes (byte i = code 2i, or
    2i + 1), each the E2M1 code times 2^-6 (used by the CPU tests)."""
    q &= 0xFFFFFFFF
    even = (((q << 2) & E4M3_MAG) | ((q << 4) & E4M3_SIGN)) & 0xFFFFFFFF
    odd = ((q >> 2) & E4M3_MAG) | (q & E4M3_SIGN)
    return even, odd


_E4M3 = None


def decode_e4m3():
    """`@dsl_user_op` decode_e4m3(q) -> (even, odd): the 8 E2M1 codes of word q as E4M3 (times 2^-6), codes
    0, 2, 4, 6 in the bytes of `even` and 1, 3, 5, 7 in those of `odd` (byte 0 first); 'f16' unpacks each register
    into two f16 pairs (`ptx_ops.e4m3x2_to_f16x2`) for the A operand of f16 mma.sync."""
    global _E4M3
    if _E4M3 is None:
        from cutlass.cutlass_dsl import dsl_user_op

        asm = ("{\n.reg .b32 q, t, u;\nmov.b32 q, $2;\n"
               f"shl.b32 t, q, 2;\nand.b32 t, t, {E4M3_MAG:#010x};\nshl.b32 u, q, 4;\n"
               f"and.b32 u, u, {E4M3_SIGN:#010x};\nor.b32 $0, t, u;\n"
               f"shr.b32 t, q, 2;\nand.b32 t, t, {E4M3_MAG:#010x};\nand.b32 u, q, {E4M3_SIGN:#010x};\n"
               "or.b32 $1, t, u;\n}")

        @dsl_user_op
        def decode(q, *, loc=None, ip=None):
            return tuple(_asm_words(asm, 2, (q,), loc, ip))

        _E4M3 = decode
    return _E4M3
