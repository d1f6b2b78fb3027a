"""MXFP4 packing exactly as kimi_k3_layer.md §6.2."""

import pytest
import torch

from kimi_decode import mxfp4


def test_e2m1_table_and_nibble_order():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = mxfp4.e2m1_decode(codes)
    assert vals[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert vals[8:].tolist() == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    # byte = code[2i] | code[2i+1] << 4: the even element is the low nibble
    packed = torch.tensor([[0x71] + [0] * 15], dtype=torch.uint8)  # codes 1 (0.5) then 7 (6.0)
    scales = torch.tensor([[127]], dtype=torch.uint8)
    w = mxfp4.unpack(packed, scales)
    assert w.shape == (1, 32) and w[0, 0] == 0.5 and w[0, 1] == 6.0


def test_e8m0_scales():
    packed = torch.full((1, 32), 0x22, dtype=torch.uint8)  # every code 2 -> 1.0
    scales = torch.tensor([[127, 130]], dtype=torch.uint8)
    w = mxfp4.unpack(packed, scales)
    assert torch.all(w[0, :32] == 1.0) and torch.all(w[0, 32:] == 8.0)


def test_exact_round_trip_bytes():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (37, 64, 48), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (37, 64, 3), generator=g, dtype=torch.uint8)
    w = mxfp4.unpack(packed, scales)
    p2, s2 = mxfp4.pack(w, scales)
    assert torch.equal(p2, packed) and torch.equal(s2, scales)


def test_quantise_is_idempotent_and_close():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 256, generator=g)
    p, s = mxfp4.pack(w)
    q = mxfp4.unpack(p, s)
    assert torch.equal(mxfp4.unpack(*mxfp4.pack(q)), q)  # quantised values are fixed points
    # every group's scale is the smallest power of two that fits max|w| into ±6
    amax = w.abs().unflatten(-1, (-1, 32)).amax(-1)
    sv = mxfp4.scale_values(s)
    assert torch.all(amax <= 6 * sv) and torch.all(amax > 3 * sv)
    assert float((q - w).norm() / w.norm()) < 0.15


def test_round_half_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 7.0])
    vals = mxfp4.e2m1_decode(mxfp4.encode_e2m1(x))
    assert vals.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 6.0]


def test_bad_shapes_refused():
    with pytest.raises(ValueError):
        mxfp4.unpack(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(TypeError):
        mxfp4.unpack(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    assert mxfp4.packed_nbytes(384, 3584) == 384 * (1792 + 112)


def test_pair_decode_bit_cuts_give_the_e2m1_values():
    """Every way of cutting a word into bf16 pairs (`mxfp4_decode.VERSIONS`: the shift cuts of `PAIR_CUTS` and
    v3's mask-multiply-mask `SPREAD`, emulated on ints) gives codes k and k + 4 times 2^-126, for random words and
    for every single code in every position; an unknown version is refused."""
    import random
    import struct

    from kimi_decode.kernels.mxfp4_decode import VERSIONS, emulate_pairs

    def bf16(bits):  # bf16 bit pattern -> its value (as the fp32 with those top 16 bits)
        return struct.unpack("<f", struct.pack("<I", bits << 16))[0]

    table = [float(v) for v in mxfp4.e2m1_decode(torch.arange(16))]
    rng = random.Random(5)
    words = [rng.getrandbits(32) for _ in range(500)] + [c << (4 * k) for c in range(16) for k in range(8)]
    assert VERSIONS == (1, 2, 3)
    for version in VERSIONS:
        for q in words:
            for k, pr in enumerate(emulate_pairs(q, version)):
                lo, hi = bf16(pr & 0xFFFF), bf16(pr >> 16)
                assert lo == table[(q >> (4 * k)) & 15] * 2.0 ** -126, (version, hex(q), k)
                assert hi == table[(q >> (4 * k + 16)) & 15] * 2.0 ** -126, (version, hex(q), k)
    with pytest.raises(ValueError, match="decode version"):
        emulate_pairs(0, 4)


def test_e4m3_decode_places_e2m1_codes_exactly():
    """'f16' (`mxfp4_decode.decode_e4m3`, emulated on ints): byte i of the even register is code 2i and of the odd
    register code 2i + 1, each read as E4M3 the E2M1 value times 2^-6 (the shift the fp32 scale takes back), for
    random words and every code in every position."""
    import random

    from kimi_decode.kernels.mxfp4_decode import E4M3_SCALE_SHIFT, emulate_e4m3

    table = [float(v) for v in mxfp4.e2m1_decode(torch.arange(16))]
    rng = random.Random(7)
    words = [rng.getrandbits(32) for _ in range(500)] + [c << (4 * k) for c in range(16) for k in range(8)]
    for q in words:
        even, odd = emulate_e4m3(q)
        got = torch.tensor([(r >> (8 * i)) & 0xFF for i in range(4) for r in (even, odd)], dtype=torch.uint8)
        vals = got.view(torch.float8_e4m3fn).float().tolist()
        want = [table[(q >> (4 * (2 * i + p))) & 15] * 2.0 ** -E4M3_SCALE_SHIFT for i in range(4) for p in (0, 1)]
        assert vals == want, hex(q)


def test_f16_path_a_halves_meet_their_b_pairs():
    """'f16': mma 1 of a group takes bytes 0, 1 of `decode_e4m3`'s even and odd registers (cvt to f16 pairs), mma 2
    bytes 2, 3; the B registers hold z's codes `moe_pipe.F16_B_PAIRS` in the same order, so each A half is codes
    (F16_B_PAIRS[q]) of the word times 2^-6, for random words."""
    import random

    from kimi_decode.kernels.moe_pipe import F16_B_PAIRS
    from kimi_decode.kernels.mxfp4_decode import E4M3_SCALE_SHIFT, emulate_e4m3

    table = [float(v) for v in mxfp4.e2m1_decode(torch.arange(16))]
    rng = random.Random(11)
    for _ in range(300):
        q = rng.getrandbits(32)
        even, odd = emulate_e4m3(q)
        halves = [(even, 0), (odd, 0), (even, 2), (odd, 2)]  # mma 1: b0 b1; mma 2: b0 b1
        for (reg, byte), pair in zip(halves, F16_B_PAIRS):
            got = torch.tensor([(reg >> (8 * (byte + j))) & 0xFF for j in range(2)], dtype=torch.uint8)
            vals = got.view(torch.float8_e4m3fn).half().float().tolist()
            assert vals == [table[(q >> (4 * k)) & 15] * 2.0 ** -E4M3_SCALE_SHIFT for k in pair], hex(q)


def test_f16_staged_z_is_closer_than_bf16():
    """'f16' stages z times 2^-k (its largest |z| in [2^14, 2^15), the kernel's exponent arithmetic) in f16: 11
    significant bits, nearer to z than bf16's 8, element-wise and on a dot product, for activations spanning several
    orders of magnitude; zeros stay zero."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(8, 3584, generator=g) * torch.logspace(-3, 2, 8).unsqueeze(1)
    z[0, :10] = 0.0
    e = (z.abs().amax(1, keepdim=True).view(torch.int32) >> 23).clamp(15, 254)
    down, up = ((268 - e) << 23).view(torch.float32), ((e - 14) << 23).view(torch.float32)
    zs = z * down
    assert float(zs.abs().max()) < 2 ** 15 and float(zs.abs().amax(1).min()) >= 2 ** 14
    back = zs.half().float() * up
    w = torch.randint(-6, 7, (256, 3584), generator=g).float()
    ref = w @ z.T
    err_f16 = float((back - z).norm() / z.norm())
    err_bf = float((z.bfloat16().float() - z).norm() / z.norm())
    dot_f16 = float((w @ back.T - ref).norm() / ref.norm())
    dot_bf = float((w @ z.bfloat16().float().T - ref).norm() / ref.norm())
    assert err_f16 < err_bf / 4 and dot_f16 < dot_bf / 4, (err_f16, err_bf, dot_f16, dot_bf)
    assert torch.equal(back[0, :10], torch.zeros(10))
