"""Error measures used to compare any executor with the fp32 reference.

The accuracy rule (style.md, after FlashAttention-4): a kernel's error against
the fp32 reference must be at most about twice the error of the same
computation done in bf16 by plain PyTorch (`reference` with `Storage.BF16`),
plus a small absolute slack for outputs that are near zero.
"""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64. NaN in either gives NaN (which fails every bound)."""
    a, b = out.detach().double().cpu(), ref.detach().double().cpu()
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    den = b.norm()
    if den == 0:
        raise ValueError("reference is all zeros: compare on non-zero data")
    return float((a - b).norm() / den)


def within_bf16_rule(out: torch.Tensor, ref_fp32: torch.Tensor, ref_bf16: torch.Tensor,
                     factor: float = 2.0, slack: float = 1e-3) -> tuple[bool, float, float]:
    """(ok, err, bound): err = rel_err(out, ref_fp32) <= factor * rel_err(ref_bf16, ref_fp32) + slack."""
    err = rel_err(out, ref_fp32)
    bound = factor * rel_err(ref_bf16, ref_fp32) + slack
    return bool(err <= bound), err, bound


def all_written(out: torch.Tensor) -> bool:
    """True when no element is NaN: outputs are poisoned with NaN before a launch."""
    return not bool(torch.isnan(out).any())
