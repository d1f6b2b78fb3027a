"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`), `kimi_k3_layer.md` §6.2.

- `weight_packed`: uint8 [out, in/2]; byte = code[2i] | code[2i+1] << 4
  (even element in the low nibble).
- E2M1 code: sign in bit 3, magnitude index 0..7 -> {0, .5, 1, 1.5, 2, 3, 4, 6}.
- `weight_scale`: uint8 E8M0 [out, in/32]; scale = 2^(s - 127).
- W[o, i] = e2m1(code[o, i]) * 2^(s[o, i // 32] - 127).
"""

from __future__ import annotations

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E8M0_BIAS = 127


def _table(device) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])  # codes 0..15; code 8 is -0.0


def _check_packed(packed: torch.Tensor, scales: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 2 != scales.shape[-1] * GROUP:
        raise ValueError(
            f"packed {tuple(packed.shape)} and scales {tuple(scales.shape)} disagree: "
            f"expected scales [..., in/{GROUP}] for packed [..., in/2]"
        )


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., in/2] -> uint8 codes [..., in] (low nibble first)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., in] (values 0..15, in even) -> uint8 [..., in/2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"the packed dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return c[..., 0] | (c[..., 1] << 4)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15) -> fp32 values."""
    return _table(codes.device)[codes.long()]


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 powers of two 2^(s-127). (s = 255, NaN in OCP MX, is refused.)"""
    if bool((scales == 255).any()):
        raise ValueError("E8M0 scale byte 255 (NaN) found")
    return torch.exp2(scales.to(torch.float32) - E8M0_BIAS)


def unpack(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise: uint8 [..., in/2] + uint8 [..., in/32] -> fp32 [..., in]."""
    _check_packed(packed, scales)
    vals = e2m1_decode(unpack_codes(packed))
    s = scale_values(scales).repeat_interleave(GROUP, dim=-1)
    return vals * s


def choose_scales(w: torch.Tensor) -> torch.Tensor:
    """The smallest power-of-two scale per group with max|w|/scale <= 6 (E8M0 bytes)."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"the input dim {w.shape[-1]} is not a multiple of {GROUP}")
    amax = w.float().abs().unflatten(-1, (-1, GROUP)).amax(-1)
    e = torch.ceil(torch.log2(torch.clamp(amax / E2M1_MAX, min=2.0 ** -E8M0_BIAS)))
    return (e + E8M0_BIAS).clamp(0, 254).to(torch.uint8)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> nearest E2M1 code, ties to even code.

    Values beyond ±6 saturate. The sign of zero is kept (-0.0 -> code 8).
    """
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    a = x.abs().clamp(max=E2M1_MAX)
    dist = (a[..., None] - mags).abs()  # [..., 8]
    best = dist.min(-1, keepdim=True).values
    # among equidistant candidates take the even index (round half to even mantissa)
    cand = dist == best
    idx = torch.arange(8, device=x.device)
    score = torch.where(cand, (idx % 2) * 8 + idx, torch.full_like(idx, 100))
    mag_idx = score.argmin(-1).to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return mag_idx | sign


def pack(w: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise fp32/bf16 [..., in] -> (packed uint8 [..., in/2], scales uint8 [..., in/32]).

    With `scales` given they are used as they are; then `pack(unpack(p, s), s)`
    returns exactly (p, s) for any packed bytes p (the round trip is exact).
    """
    w = w.float()
    if scales is None:
        scales = choose_scales(w)
    sv = scale_values(scales).repeat_interleave(GROUP, dim=-1)
    codes = encode_e2m1(w / sv)
    return pack_codes(codes), scales


def random_packed(
    out_features: int,
    in_features: int,
    generator: torch.Generator,
    scale_exponent: int,
    scale_jitter: int = 1,
    leading: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 weights [*leading, out, in]: uniform codes, E8M0 scales 2^(e ± jitter)."""
    if in_features % GROUP:
        raise ValueError(f"in_features {in_features} is not a multiple of {GROUP}")
    packed = torch.randint(0, 256, (*leading, out_features, in_features // 2),
                           generator=generator, dtype=torch.uint8)
    s = torch.randint(-scale_jitter, scale_jitter + 1, (*leading, out_features, in_features // GROUP),
                      generator=generator) + scale_exponent + E8M0_BIAS
    return packed, s.to(torch.uint8)


def packed_nbytes(out_features: int, in_features: int) -> int:
    """Bytes of one MXFP4 matrix: in/2 code bytes + in/32 scale bytes per row (4.25 bits/param)."""
    return out_features * (in_features // 2 + in_features // GROUP)
