"""KDA decode, one rank: `kimi_k3_layer.md` §4.2 (stock: in_proj GEMM, f_b GEMM,
`fused_kda_decode`, o_proj GEMM; all-reduce outside).

The decode is the composition of small steps so that tests can swap the
recurrence for an independent formulation:
`project` (eq. 1-2) → `conv_step` (eq. 3) → `gates` (eq. 4-6) →
`recurrent_step` (eq. 7) → `gated_output` (eq. 8) → o_proj (eq. 9, partial).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import KimiK3Config
from ..state import KDAState
from ..weights import KDAWeights
from .common import linear
from .precision import Storage, f32


@dataclass
class KDAProjections:
    qkv: torch.Tensor  # [N, 3P] pre-conv mixed q|k|v
    g_out: torch.Tensor  # [N, P] output-gate logits
    g_raw: torch.Tensor  # [N, P] forget-gate logits (f_a · W_fbᵀ)
    beta_raw: torch.Tensor  # [N, H]


def project(x: torch.Tensor, w: KDAWeights, storage: Storage = Storage.FP32) -> KDAProjections:
    """Eq. 1-2: z = x·W_inᵀ split into its sections; g_raw = f_a·W_fbᵀ."""
    z = linear(x, w.in_proj, storage)
    s = w.in_proj_sections()
    g_raw = linear(z[:, s["f_a"]], w.f_b, storage)
    return KDAProjections(qkv=z[:, s["qkv"]], g_out=z[:, s["g_out"]], g_raw=g_raw, beta_raw=z[:, s["b"]])


def conv_step(window_state: torch.Tensor, x: torch.Tensor, conv_w: torch.Tensor,
              storage: Storage = Storage.FP32) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 3 for one token: u = SiLU(Σ_i w[c,i]·s[c,i] + w[c,3]·x[c]) rounded to bf16;
    the state shifts by one and takes x (stored bf16, the state dtype).

    window_state: [width-1, C] (oldest first); x: [C]; conv_w: [C, width].
    """
    win = torch.cat([f32(window_state), f32(x)[None]], 0)  # [width, C]
    u = F.silu((win * f32(conv_w).t()).sum(0))
    u = storage.store(u)  # stored bf16 by the stock kernel
    new_state = torch.cat([f32(window_state)[1:], f32(x).to(torch.bfloat16).float()[None]], 0)
    return u, new_state


@dataclass
class KDAGates:
    q: torch.Tensor  # [H, D] normalised and scaled q̂
    k: torch.Tensor  # [H, D] normalised k̂
    v: torch.Tensor  # [H, D]
    alpha: torch.Tensor  # [H, D] log decay in (lower_bound, 0)
    beta: torch.Tensor  # [H] write strength


def gates(u: torch.Tensor, g_raw: torch.Tensor, beta_raw: torch.Tensor, w: KDAWeights,
          cfg: KimiK3Config) -> KDAGates:
    """Eq. 4-6 for one token: q̂, k̂ (ε inside the sum of squares), α, β."""
    H, D = w.heads, w.head_dim
    q, k, v = (t.view(H, D) for t in u.split(H * D))
    eps = cfg.kda_qk_norm_eps
    qh = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps) * D ** -0.5
    kh = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    a = torch.exp(f32(w.A_log))[:, None] * (f32(g_raw).view(H, D) + f32(w.dt_bias).view(H, D))
    alpha = cfg.gate_lower_bound * torch.sigmoid(a)
    beta = torch.sigmoid(f32(beta_raw))
    return KDAGates(qh, kh, v, alpha, beta)


def recurrent_step(S: torch.Tensor, g: KDAGates) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 7, the delta rule for one token. S: [H, V, K] fp32. Returns (o [H, V], S')."""
    S = S * torch.exp(g.alpha)[:, None, :]
    r = g.v - torch.einsum("hvk,hk->hv", S, g.k)
    r = g.beta[:, None] * r
    S = S + r[:, :, None] * g.k[:, None, :]
    o = torch.einsum("hvk,hk->hv", S, g.q)
    return o, S


def gated_output(o: torch.Tensor, g_out: torch.Tensor, w: KDAWeights, cfg: KimiK3Config,
                 storage: Storage = Storage.FP32) -> torch.Tensor:
    """Eq. 8: y_h = RMSNorm(o_h) ⊙ w_onorm ⊙ σ(g_out[h]); o is rounded to bf16 first. [H*D]."""
    H, D = w.heads, w.head_dim
    o = storage.store(o)
    y = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + cfg.kda_o_norm_eps) * f32(w.o_norm)
    y = y * torch.sigmoid(f32(g_out).view(H, D))
    return storage.store(y.reshape(H * D))


def kda_decode(x: torch.Tensor, w: KDAWeights, state: KDAState, tokens_per_seq: int,
               cfg: KimiK3Config, storage: Storage = Storage.FP32) -> tuple[torch.Tensor, KDAState]:
    """One decode step of the KDA sub-block on one rank.

    x: [N, d] (N = batch · tokens_per_seq, sequence-major). Returns the rank's
    partial o_proj output [N, d] (fp32; sum over ranks = the all-reduce) and the
    updated state (a copy; `state` is not modified). Tokens of a null slot
    (slot <= 0) give zero output and leave no trace in the state.
    """
    N = x.shape[0]
    B = state.slots.shape[0]
    T = tokens_per_seq
    if N != B * T:
        raise ValueError(f"{N} tokens for {B} sequences x {T} tokens")
    pr = project(x, w, storage)
    new = state.clone()
    y = torch.zeros(N, w.proj, dtype=torch.float32, device=x.device)
    for b in range(B):
        slot = int(state.slots[b])
        if slot <= 0:
            continue
        win = f32(new.conv[slot])
        S = new.recurrent[slot].clone()
        for t in range(T):
            i = b * T + t
            u, win = conv_step(win, pr.qkv[i], w.conv1d, storage)
            g = gates(u, pr.g_raw[i], pr.beta_raw[i], w, cfg)
            o, S = recurrent_step(S, g)
            y[i] = gated_output(o, pr.g_out[i], w, cfg, storage)
        new.conv[slot] = win.to(new.conv.dtype)
        new.recurrent[slot] = S
    return linear(y, w.o_proj, storage), new
