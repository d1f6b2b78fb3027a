"""Where the reference rounds.

The reference computes in fp32 (the oracle). `Storage.BF16` additionally
rounds every value that the stock kernels store as bf16 (linear outputs, the
bf16 tensors between kernels), which models "the same computation done in bf16
by plain PyTorch" for the accuracy rule of `style.md` (kernel error at most
about twice the bf16 error). Inputs and weights are bf16 either way; state
tensors keep their contract dtypes (bf16 conv state and MLA cache, fp32 KDA
recurrent state).
"""

from __future__ import annotations

import enum

import torch


class Storage(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"

    def store(self, x: torch.Tensor) -> torch.Tensor:
        """Round `x` as a stored bf16 intermediate would be (fp32 result either way)."""
        if self is Storage.BF16:
            return x.to(torch.bfloat16).to(torch.float32)
        return x.to(torch.float32)


def f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)
