"""Building blocks shared by the reference sub-blocks (`kimi_k3_layer.md` §2)."""

from __future__ import annotations

import torch

from .precision import Storage, f32


def linear(x: torch.Tensor, w: torch.Tensor, storage: Storage = Storage.FP32) -> torch.Tensor:
    """y = x · Wᵀ with fp32 accumulation; the bf16 output is a storage point."""
    return storage.store(f32(x) @ f32(w).t())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + ε) ⊙ w, fp32."""
    x = f32(x)
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * f32(w)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """SiTU-GLU: β·tanh(gate/β)·σ(gate) · (β_lin·tanh(up/β_lin)); β_lin <= 0 leaves up as is."""
    gate, up = f32(gate), f32(up)
    a = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    u = beta_lin * torch.tanh(up / beta_lin) if beta_lin > 0 else up
    return a * u


def situ_and_mul(gate_up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """The fused op on a [.., 2I] input laid out [gate | up]."""
    I = gate_up.shape[-1] // 2
    return situ_glu(gate_up[..., :I], gate_up[..., I:], beta, beta_lin)
