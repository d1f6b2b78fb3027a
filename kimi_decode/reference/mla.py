"""MLA decode with NoPE and the sigmoid output gate, one rank: `kimi_k3_layer.md` §5.2
(stock: fused_qkv_a GEMM, fused_q_kv_rmsnorm, q_b GEMM, bmm W_UK_T, q concat + cache
insert, MLA decode attention (+ split-KV combine), bmm W_UV, g_proj GEMM, gate
multiply, o_proj GEMM; all-reduce outside).

`mla_decode` is the absorbed form that vLLM runs (attention over the 576-wide
latent rows); `mla_decode_unabsorbed` is the textbook form (per-head k_nope and
v expanded from the latent), kept as an independent cross-check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import KimiK3Config
from ..state import MLAKVCache
from ..weights import MLAWeights
from .common import linear, rms_norm
from .precision import Storage, f32


@dataclass
class MLAQuery:
    q_nope: torch.Tensor  # [N, H, nope]
    q_pe: torch.Tensor  # [N, H, rope]
    new_rows: torch.Tensor  # [N, kv_lora + rope] latent cache rows of the step's tokens


def query_and_latent(x: torch.Tensor, w: MLAWeights, cfg: KimiK3Config,
                     storage: Storage = Storage.FP32) -> MLAQuery:
    """Eq. 1-3: W_a projection, the q/kv RMSNorm pair (k_pe not normalised), q_b."""
    ql, kl = cfg.q_lora_rank, cfg.kv_lora_rank
    a = linear(x, w.fused_qkv_a, storage)
    q_c, c_kv, k_pe = a[:, :ql], a[:, ql:ql + kl], a[:, ql + kl:]
    q_c = storage.store(rms_norm(q_c, w.q_a_norm, cfg.rms_norm_eps))
    c = storage.store(rms_norm(c_kv, w.kv_a_norm, cfg.rms_norm_eps))
    q = linear(q_c, w.q_b, storage).view(x.shape[0], w.heads, cfg.mla_qk_head_dim)
    return MLAQuery(q_nope=q[..., :w.nope_dim], q_pe=q[..., w.nope_dim:],
                    new_rows=torch.cat([c, k_pe], -1))


def insert_rows(cache: MLAKVCache, rows: torch.Tensor, tokens_per_seq: int) -> MLAKVCache:
    """Eq. 5 (cache half): write the step's rows at slot_mapping; returns a new cache (a whole cache: the
    reference simulates DCP ranks from it, `kimi_decode.dcp`)."""
    if cache.dcp != 1:
        raise ValueError(f"insert_rows takes a whole cache, got one DCP rank's share (DCP{cache.dcp})")
    new = cache.clone()
    flat = new.kv.view(-1, new.kv.shape[-1])
    flat[cache.slot_mapping(tokens_per_seq)] = rows.to(flat.dtype)
    return new


def _gate_and_project(o: torch.Tensor, x: torch.Tensor, w: MLAWeights,
                      storage: Storage) -> torch.Tensor:
    """Eq. 8-10: o ⊙ σ(x·W_gᵀ), then the partial o_proj."""
    g = linear(x, w.g_proj, storage)
    o = storage.store(o.reshape(x.shape[0], -1) * torch.sigmoid(g))
    return linear(o, w.o_proj, storage)


def mla_decode(x: torch.Tensor, w: MLAWeights, cache: MLAKVCache, tokens_per_seq: int,
               cfg: KimiK3Config, storage: Storage = Storage.FP32, dcp: int = 1) -> tuple[torch.Tensor, MLAKVCache]:
    """Absorbed MLA decode (what vLLM runs). Returns (partial o_proj output [N, d], new cache).

    Token t of sequence b attends to the cached context and the step's tokens up
    to and including itself. With `dcp` > 1 the attention runs as DCP ranks over
    interleaved token shards merged by log-sum-exp (`kimi_decode.dcp`).
    """
    N, B, T = x.shape[0], cache.block_table.shape[0], tokens_per_seq
    if N != B * T:
        raise ValueError(f"{N} tokens for {B} sequences x {T} tokens")
    kl = cfg.kv_lora_rank
    q = query_and_latent(x, w, cfg, storage)
    q_lat = storage.store(torch.einsum("nhd,hdl->nhl", q.q_nope, f32(w.W_UK_T)))  # eq. 4
    mqa_q = torch.cat([q_lat, q.q_pe], -1)  # [N, H, 576], eq. 5
    new = insert_rows(cache, q.new_rows, T)
    ctxs = [int(c) for c in cache.context_lens]
    if dcp > 1:
        from ..dcp import mla_attention_dcp
        o_lat = mla_attention_dcp(mqa_q, [new.gather(b, ctxs[b] + T) for b in range(B)], ctxs, T, dcp, cfg, storage)
    else:
        o_lat = torch.empty(N, w.heads, kl, dtype=torch.float32, device=x.device)
        for b in range(B):
            rows = f32(new.gather(b, ctxs[b] + T))  # [ctx+T, 576]
            for t in range(T):
                i = b * T + t
                L = ctxs[b] + t + 1
                s = cfg.mla_softmax_scale * (mqa_q[i] @ rows[:L].t())  # [H, L], eq. 6
                p = torch.softmax(s, -1)
                o_lat[i] = p @ rows[:L, :kl]
    o_lat = storage.store(o_lat)
    o = storage.store(torch.einsum("nhl,hlv->nhv", o_lat, f32(w.W_UV)))  # eq. 7
    return _gate_and_project(o, x, w, storage), new


def mla_decode_unabsorbed(x: torch.Tensor, w: MLAWeights, cache: MLAKVCache, tokens_per_seq: int,
                          cfg: KimiK3Config) -> tuple[torch.Tensor, MLAKVCache]:
    """The un-absorbed equivalent (§5.2, last paragraph), fp32 throughout.

    k_nope[h,τ] = W_UK[h] c_τ, v[h,τ] = W_UV[h]ᵀ c_τ, k_pe shared by all heads;
    score = scale · (q_nope·k_nope + q_pe·k_pe); out = Σ p v.
    """
    N, B, T = x.shape[0], cache.block_table.shape[0], tokens_per_seq
    kl, nope = cfg.kv_lora_rank, w.nope_dim
    q = query_and_latent(x, w, cfg, Storage.FP32)
    new = insert_rows(cache, q.new_rows, T)
    kvb = f32(w.kv_b).view(w.heads, nope + w.v_dim, kl)
    W_UK, W_V = kvb[:, :nope], kvb[:, nope:]  # [H, nope, kl], [H, v, kl]
    o = torch.empty(N, w.heads, w.v_dim, dtype=torch.float32, device=x.device)
    for b in range(B):
        ctx = int(cache.context_lens[b])
        rows = f32(new.gather(b, ctx + T))
        c, k_pe = rows[:, :kl], rows[:, kl:]
        k_nope = torch.einsum("hdl,tl->htd", W_UK, c)  # [H, L, nope]
        v = torch.einsum("hvl,tl->htv", W_V, c)  # [H, L, v]
        for t in range(T):
            i = b * T + t
            L = ctx + t + 1
            s = torch.einsum("hd,htd->ht", q.q_nope[i], k_nope[:, :L]) + q.q_pe[i] @ k_pe[:L].t()
            p = torch.softmax(cfg.mla_softmax_scale * s, -1)
            o[i] = torch.einsum("ht,htv->hv", p, v[:, :L])
    return _gate_and_project(o, x, w, Storage.FP32), new
