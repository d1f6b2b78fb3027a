"""Attention Residuals, `kimi_k3_layer.md` §3.2 (stock: `_attn_res_kernel`).

AR(p, δ, B, n, j, w_n, w_q, w_o, ε, ε_o), one row per token, fp32 math:
1. p ← bf16(p + δ) if δ is given;
2. B[j] ← p if j >= 0;
3. sources v_0..v_{n-1} = B[0..n-1], v_n = p; ℓ_i = (Σ_c v_i·w_n·w_q) · rsqrt(mean(v_i²)+ε);
   a = softmax(ℓ); m = Σ_i a_i v_i (raw v). With n = 0, m = p;
4. y = RMSNorm(m; w_o, ε_o) if w_o is given, else m. bf16 out.
"""

from __future__ import annotations

import torch

from .precision import Storage, f32


def attn_res(
    p: torch.Tensor,
    delta: torch.Tensor | None,
    blocks: torch.Tensor,
    n: int,
    j: int,
    w_n: torch.Tensor,
    w_q: torch.Tensor,
    w_o: torch.Tensor | None,
    eps: float = 1e-5,
    eps_o: float = 1e-5,
    storage: Storage = Storage.FP32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (y, p_new, blocks_new); inputs are not modified.

    p: [T, d] bf16 prefix sum; delta: [T, d] bf16 or None; blocks: [T, S, d]
    bf16 block stack (S = 8 slots); n: number of block sources (0..S);
    j: block slot to write p into, or -1; w_n, w_q, w_o: [d] bf16.
    y is fp32 holding bf16-representable values (the kernel's bf16 output);
    p_new and blocks_new are bf16 like the carry they replace.
    """
    T, d = p.shape
    if blocks.dim() != 3 or blocks.shape[0] != T or blocks.shape[2] != d:
        raise ValueError(f"blocks must be [T={T}, slots, d={d}], got {tuple(blocks.shape)}")
    if not 0 <= n <= blocks.shape[1]:
        raise ValueError(f"n={n} outside 0..{blocks.shape[1]}")
    if not -1 <= j < blocks.shape[1]:
        raise ValueError(f"j={j} outside -1..{blocks.shape[1] - 1}")
    if delta is not None:
        p_new = (f32(p) + f32(delta)).to(torch.bfloat16)  # stored in place as bf16
    else:
        p_new = p.clone()
    blocks_new = blocks.clone()
    if j >= 0:
        blocks_new[:, j] = p_new
    if n == 0:
        m = f32(p_new)
    else:
        v = torch.cat([f32(blocks_new[:, :n]), f32(p_new)[:, None]], dim=1)  # [T, n+1, d]
        wq = f32(w_n) * f32(w_q)
        logits = (v * wq).sum(-1) * torch.rsqrt((v * v).mean(-1) + eps)  # [T, n+1]
        a = torch.softmax(logits, dim=-1)
        m = (a[..., None] * v).sum(1)
    if w_o is not None:
        y = m * torch.rsqrt((m * m).mean(-1, keepdim=True) + eps_o) * f32(w_o)
    else:
        y = m
    # y is the kernel's bf16 output: it is always a stored tensor
    y = y.to(torch.bfloat16).to(torch.float32) if storage is Storage.BF16 else y
    return y, p_new, blocks_new
