"""Dense SiTU MLP of layer 0, one rank: `kimi_k3_layer.md` §7
(stock: gate_up GEMM, situ_and_mul, down GEMM; all-reduce outside)."""

from __future__ import annotations

import torch

from ..config import KimiK3Config
from ..weights import DenseWeights
from .common import linear, situ_and_mul
from .precision import Storage


def dense_partial(x: torch.Tensor, w: DenseWeights, cfg: KimiK3Config,
                  storage: Storage = Storage.FP32) -> torch.Tensor:
    """SiTU(x·W_gᵀ, x·W_uᵀ)·W_dᵀ over the rank's slice: the partial before the all-reduce."""
    a = storage.store(situ_and_mul(linear(x, w.gate_up, storage), cfg.situ_beta, cfg.situ_linear_beta))
    return linear(a, w.down, storage)
