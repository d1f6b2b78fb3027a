"""The torch.compile peer: what a researcher would try first.

The layer of `kimi_k3_layer.md` §3.3 written once more in plain, vectorised
PyTorch on bf16 tensors (no Python loops over sequences or experts, no host
synchronisation), so that `torch.compile` can fuse it and a CUDA graph can
capture it. It is a peer, not a reference: it runs bf16 storage with fp32 only
where PyTorch users would reach for it (softmax, norms, the recurrence), and it
dequantises the gathered MXFP4 experts per token (no custom kernels).

`CompilePeer(weights, state)` behaves like `StockLayer`: calling it runs one
decode step in place (KDA state, MLA cache and AttnRes carry are updated) and
leaves the layer output in `.h`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import mxfp4
from .reference.attn_res import attn_res
from .reference.common import rms_norm, situ_glu
from .reference.precision import Storage
from .state import DecodeState
from .weights import LayerWeights


def _dequant(packed: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[..., out, in/2] uint8 + [..., out, in/32] -> bf16 [..., out, in] (`mxfp4.unpack` without its
    host-side NaN-scale check, so that it traces into one graph)."""
    vals = table[mxfp4.unpack_codes(packed).long()]
    s = torch.exp2(scales.float() - mxfp4.E8M0_BIAS).repeat_interleave(mxfp4.GROUP, -1)
    return (vals * s).to(torch.bfloat16)


def _attn_res_bf16(p, delta, blocks, n: int, j: int, w_n, w_q, w_o, eps: float):
    """§3.2 over all tokens (the reference's vectorised operator), bf16 output."""
    y, p_new, blocks = attn_res(p, delta, blocks, n, j, w_n, w_q, w_o, eps, eps, storage=Storage.BF16)
    return y.to(torch.bfloat16), p_new, blocks


RECOMPILE_LIMIT = 1024


class CompilePeer:
    """One layer's decode step in vectorised PyTorch, optionally under torch.compile."""

    def __init__(self, weights: LayerWeights, state: DecodeState, compile: bool = True,
                 mode: str = "max-autotune-no-cudagraphs"):
        if weights.shard.dcp != 1 and weights.mla is not None:
            raise ValueError(f"CompilePeer has no decode context parallel path (DCP{weights.shard.dcp}); "
                             "the stock schedule has one")
        self.w, self.st = weights, state
        self.cfg = weights.cfg
        self.shape = state.shape
        self.table = mxfp4.e2m1_decode(torch.arange(16, dtype=torch.uint8)).to(state.carry.p.device)
        fn = self._forward
        # every CompilePeer compiles the same `_forward` code object (one Dynamo cache entry per layer kind,
        # shape and weight copy): a sweep needs far more than Dynamo's default of 8 before it refuses
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        # fullgraph: a graph break would hide a host sync or a Python fallback inside the "compiled" layer
        self.fn = torch.compile(fn, mode=mode, dynamic=False, fullgraph=True) if compile else fn
        self.h = None
        self.routing = None

    def __call__(self) -> None:
        c = self.st.carry
        h, p, blocks, ids = self.fn(c.p, c.h, c.blocks)
        self.h, self.p_out, self.blocks_out = h, p, blocks
        self.routing = (ids,) if ids is not None else None

    def launches(self):  # the peer has no static inventory: kernels are counted from the graph
        return []

    # ----------------------------------------------------------------- layer
    def _forward(self, p, h_prev, blocks):
        cfg, w = self.cfg, self.w
        L = w.layer
        nb, bw = cfg.attn_res_position(L)
        ar = w.attn_res
        eps = cfg.rms_norm_eps
        x, p, blocks = _attn_res_bf16(p, h_prev, blocks, nb, (L // cfg.attn_res_block_size if bw else -1),
                                    ar.self_attention_res_norm, ar.self_attention_res_proj, ar.input_layernorm, eps)
        a = self._kda(x) if w.kda is not None else self._mla(x)
        if bw:
            p, delta = a, None
        else:
            delta = a
        x2, p, blocks = _attn_res_bf16(p, delta, blocks, nb + int(bw), -1, ar.mlp_res_norm, ar.mlp_res_proj,
                                     ar.post_attention_layernorm, eps)
        ids = None
        if w.dense is not None:
            h = self._dense(x2)
        else:
            h, ids = self._moe(x2)
        return h, p, blocks, ids

    # ------------------------------------------------------------------- KDA
    def _kda(self, x):
        cfg, w, st = self.cfg, self.w.kda, self.st.kda
        B, T = self.shape.batch, self.shape.tokens_per_seq
        H, D, P = w.heads, w.head_dim, w.proj
        sec = w.in_proj_sections()
        z = x @ w.in_proj.t()
        g_raw = (z[:, sec["f_a"]] @ w.f_b.t()).view(B, T, H, D).float()
        qkv = z[:, sec["qkv"]].view(B, T, 3 * P)
        g_out = z[:, sec["g_out"]].view(B, T, H, D)
        beta = torch.sigmoid(z[:, sec["b"]].float()).view(B, T, H)
        slots = st.slots
        valid = (slots > 0)
        conv = st.conv[slots].float()  # [B, 3, 3P]
        S = st.recurrent[slots]  # [B, H, V, K]
        decay_scale = torch.exp(w.A_log.float())[None, :, None]
        ys = []
        for t in range(T):
            xt = qkv[:, t].float()
            win = torch.cat([conv, xt[:, None]], 1)
            u = F.silu((win * w.conv1d.float().t()[None]).sum(1)).to(torch.bfloat16).float()
            conv = torch.cat([conv[:, 1:], xt.to(torch.bfloat16).float()[:, None]], 1)
            q, k, v = u.view(B, 3, H, D).unbind(1)
            q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + cfg.kda_qk_norm_eps) * D ** -0.5
            k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + cfg.kda_qk_norm_eps)
            alpha = cfg.gate_lower_bound * torch.sigmoid(decay_scale * (g_raw[:, t] + w.dt_bias.float().view(H, D)))
            S = S * torch.exp(alpha)[:, :, None, :]
            r = (v - torch.einsum("bhvk,bhk->bhv", S, k)) * beta[:, t, :, None]
            S = S + r[..., None] * k[:, :, None, :]
            o = torch.einsum("bhvk,bhk->bhv", S, q).to(torch.bfloat16).float()
            y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.kda_o_norm_eps) * w.o_norm.float()
            ys.append((y * torch.sigmoid(g_out[:, t].float())).to(torch.bfloat16))
        y = torch.stack(ys, 1) * valid[:, None, None, None]
        keep = valid[:, None, None]
        st.conv.index_copy_(0, slots, torch.where(keep, conv.to(torch.bfloat16), st.conv[slots]))
        st.recurrent.index_copy_(0, slots, torch.where(keep[..., None], S, st.recurrent[slots]))
        return y.reshape(B * T, P) @ w.o_proj.t()

    # ------------------------------------------------------------------- MLA
    def _mla(self, x):
        cfg, w, cache = self.cfg, self.w.mla, self.st.mla
        B, T, N = self.shape.batch, self.shape.tokens_per_seq, self.shape.num_tokens
        H, ql, kl, nope = w.heads, cfg.q_lora_rank, cfg.kv_lora_rank, w.nope_dim
        g = x @ w.g_proj.t()
        a = x @ w.fused_qkv_a.t()
        qc = rms_norm(a[:, :ql], w.q_a_norm, cfg.rms_norm_eps).to(torch.bfloat16)
        c = rms_norm(a[:, ql:ql + kl], w.kv_a_norm, cfg.rms_norm_eps).to(torch.bfloat16)
        q = (qc @ w.q_b.t()).view(N, H, -1)
        q_lat = torch.einsum("nhd,hdl->nhl", q[..., :nope], w.W_UK_T)
        mqa_q = torch.cat([q_lat, q[..., nope:]], -1).view(B, T, H, -1)
        flat = cache.kv.view(-1, cache.kv.shape[-1])  # a whole cache (CompilePeer has no DCP path)
        flat.index_copy_(0, cache.slot_mapping(T), torch.cat([c, a[:, ql + kl:]], -1))
        Lmax = self.shape.max_context
        pos = torch.arange(Lmax, device=x.device)
        blk = cache.block_table[:, pos // cache.block_size]  # [B, Lmax]
        rows = cache.kv[blk, pos % cache.block_size]  # [B, Lmax, 576]
        limit = cache.context_lens[:, None] + torch.arange(T, device=x.device)[None]  # [B, T]
        mask = pos[None, None, :] <= limit[..., None]  # [B, T, Lmax]
        s = torch.einsum("bthc,blc->bthl", mqa_q.float(), rows.float()) * cfg.mla_softmax_scale
        s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
        o_lat = torch.einsum("bthl,blc->bthc", torch.softmax(s, -1), rows[..., :kl].float()).to(torch.bfloat16)
        o = torch.einsum("nhl,hlv->nhv", o_lat.view(N, H, kl), w.W_UV)
        o = (o.reshape(N, -1).float() * torch.sigmoid(g.float())).to(torch.bfloat16)
        return o @ w.o_proj.t()

    # ------------------------------------------------------------------- MoE
    def _moe(self, x):
        cfg, w = self.cfg, self.w.moe
        k = cfg.num_experts_per_token
        s = torch.sigmoid(x.float() @ w.gate.float().t())
        ids = torch.topk(s + w.e_score_correction_bias, k, dim=-1).indices
        wts = s.gather(-1, ids)
        wts = wts / wts.sum(-1, keepdim=True) * cfg.routed_scaling_factor
        zl = x @ w.down.t()
        acc = torch.zeros(x.shape[0], zl.shape[1], dtype=torch.float32, device=x.device)
        for j in range(k):
            e = ids[:, j]
            W1 = _dequant(w.w1_packed[e], w.w1_scale[e], self.table)  # [N, I, L]
            W3 = _dequant(w.w3_packed[e], w.w3_scale[e], self.table)
            W2 = _dequant(w.w2_packed[e], w.w2_scale[e], self.table)  # [N, L, I]
            h1 = torch.bmm(W1, zl[:, :, None])[..., 0]
            h3 = torch.bmm(W3, zl[:, :, None])[..., 0]
            act = situ_glu(h1, h3, cfg.situ_beta, cfg.situ_linear_beta).to(torch.bfloat16)
            acc = acc + wts[:, j, None] * torch.bmm(W2, act[:, :, None])[..., 0].float()
        rh = rms_norm(acc, w.norm, cfg.rms_norm_eps).to(torch.bfloat16)
        sh = x @ w.shared_gate_up.t()
        S = sh.shape[1] // 2
        sha = situ_glu(sh[:, :S], sh[:, S:], cfg.situ_beta, cfg.situ_linear_beta).to(torch.bfloat16)
        return (rh @ w.up.t()) + (sha @ w.shared_down.t()), ids

    # ----------------------------------------------------------------- dense
    def _dense(self, x):
        cfg, w = self.cfg, self.w.dense
        gu = x @ w.gate_up.t()
        I = gu.shape[1] // 2
        a = situ_glu(gu[:, :I], gu[:, I:], cfg.situ_beta, cfg.situ_linear_beta).to(torch.bfloat16)
        return a @ w.down.t()
