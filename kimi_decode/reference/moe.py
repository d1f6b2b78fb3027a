"""Latent MoE, one rank: `kimi_k3_layer.md` §6.3 (stock: router GEMM, grouped_topk,
latent down GEMM, Marlin MoE (align, GEMM1, situ_and_mul, GEMM2, top-k sum),
fused all-reduce + RMSNorm, up_proj GEMM, shared expert GEMMs, add).

The block is split at its all-reduces: `moe_partials` is what one rank computes
(its routed-latent partial and its shared-expert partial), `moe_tail` what runs
after the two all-reduces (RMSNorm of the summed latent, up-projection, add).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import mxfp4
from ..config import KimiK3Config
from ..weights import MoEWeights
from .common import linear, rms_norm, situ_and_mul, situ_glu
from .precision import Storage, f32


@dataclass
class Routing:
    ids: torch.Tensor  # [N, k] int64 selected experts
    weights: torch.Tensor  # [N, k] fp32 renormalised weights
    scores: torch.Tensor  # [N, E] fp32 sigmoid scores (unbiased)


def route(x: torch.Tensor, w: MoEWeights, cfg: KimiK3Config) -> Routing:
    """Eq. 1: sigmoid scores; selection on s + bias; weights from the unbiased s, renormalised."""
    logits = f32(x) @ f32(w.gate).t()  # fp32 router output
    s = torch.sigmoid(logits)
    ids = torch.topk(s + f32(w.e_score_correction_bias), cfg.num_experts_per_token, dim=-1).indices
    wts = s.gather(-1, ids)
    if cfg.moe_renormalize:
        wts = wts / wts.sum(-1, keepdim=True)
    return Routing(ids=ids, weights=wts * cfg.routed_scaling_factor, scores=s)


def expert_matrices(w: MoEWeights, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dequantised W1 [I_loc, L], W3 [I_loc, L], W2 [L, I_loc] of expert e (fp32)."""
    return (mxfp4.unpack(w.w1_packed[e], w.w1_scale[e]),
            mxfp4.unpack(w.w3_packed[e], w.w3_scale[e]),
            mxfp4.unpack(w.w2_packed[e], w.w2_scale[e]))


def expert_forward(z: torch.Tensor, w: MoEWeights, e: int, cfg: KimiK3Config,
                   storage: Storage = Storage.FP32) -> torch.Tensor:
    """Eq. 3 for one expert: SiTU(z·W1ᵀ, z·W3ᵀ)·W2ᵀ, partial over the rank's slice. [n, L]."""
    W1, W3, W2 = expert_matrices(w, e)
    h1, h3 = storage.store(z @ W1.t()), storage.store(z @ W3.t())
    a = storage.store(situ_glu(h1, h3, cfg.situ_beta, cfg.situ_linear_beta))
    return a @ W2.t()


@dataclass
class MoEPartials:
    latent: torch.Tensor  # [N, L] routed latent partial (all-reduced, fp32 accumulation)
    shared: torch.Tensor  # [N, d] shared-expert partial (all-reduced)
    routing: Routing


def moe_partials(x: torch.Tensor, w: MoEWeights, cfg: KimiK3Config,
                 storage: Storage = Storage.FP32) -> MoEPartials:
    """Eq. 1-4 and 6 up to their all-reduces, on one rank."""
    r = route(x, w, cfg)
    z = linear(x, w.down, storage)  # eq. 2
    acc = torch.zeros(x.shape[0], z.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(r.ids).tolist():
        tok, slot = (r.ids == e).nonzero(as_tuple=True)
        y = expert_forward(z[tok], w, e, cfg, storage)
        acc.index_add_(0, tok, storage.store(r.weights[tok, slot, None] * y))
    latent = storage.store(acc)
    sh = storage.store(situ_and_mul(linear(x, w.shared_gate_up, storage), cfg.situ_beta, cfg.situ_linear_beta))
    return MoEPartials(latent=latent, shared=linear(sh, w.shared_down, storage), routing=r)


def moe_tail(latent_sum: torch.Tensor, shared_sum: torch.Tensor, w: MoEWeights, cfg: KimiK3Config,
             storage: Storage = Storage.FP32) -> torch.Tensor:
    """Eq. 4 (after the all-reduce), 5 and 7: RMSNorm(r)·W_upᵀ + shared."""
    rh = storage.store(rms_norm(latent_sum, w.norm, cfg.rms_norm_eps))
    routed = linear(rh, w.up, storage)
    return storage.store(routed + f32(shared_sum))


def moe_block_one_rank(x: torch.Tensor, w: MoEWeights, cfg: KimiK3Config,
                       storage: Storage = Storage.FP32) -> tuple[torch.Tensor, Routing]:
    """The whole MoE half on one rank with its all-reduces over that rank alone (what a single-GPU
    run of one rank computes): moe_tail(moe_partials(x))."""
    p = moe_partials(x, w, cfg, storage)
    return moe_tail(p.latent, p.shared, w, cfg, storage), p.routing


def moe_dense_masked(x: torch.Tensor, w: MoEWeights, cfg: KimiK3Config) -> torch.Tensor:
    """Routed latent computed densely: every expert on every token, masked by the routing.

    An independent formulation of the routed part of `moe_partials` (fp32), for tests.
    """
    r = route(x, w, cfg)
    z = linear(x, w.down)
    E = w.w1_packed.shape[0]
    mask = torch.zeros(x.shape[0], E, dtype=torch.float32, device=x.device)
    mask.scatter_(1, r.ids, r.weights)
    W1 = mxfp4.unpack(w.w1_packed, w.w1_scale)  # [E, I, L]
    W3 = mxfp4.unpack(w.w3_packed, w.w3_scale)
    W2 = mxfp4.unpack(w.w2_packed, w.w2_scale)  # [E, L, I]
    a = situ_glu(torch.einsum("nl,eil->nei", z, W1), torch.einsum("nl,eil->nei", z, W3),
                 cfg.situ_beta, cfg.situ_linear_beta)
    y = torch.einsum("nei,eli->nel", a, W2)
    return (mask[..., None] * y).sum(1)
