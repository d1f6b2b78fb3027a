"""One Kimi K3 decoder layer at decode time: `kimi_k3_layer.md` §3.3.

The layer runs over the shards of one or more tensor-parallel ranks. Each
all-reduce is the sum of the ranks' partial outputs (fp32), stored as bf16
where the stock all-reduce stores bf16. With a single rank this is the
single-GPU emulation used everywhere else in the project (the rank's partial
stands in for the reduced value); with all `tp` ranks it is the real layer,
which the TP tests compare against the unsharded (TP1) layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..state import AttnResCarry, DecodeState
from ..weights import LayerWeights
from .attn_res import attn_res
from .dense import dense_partial
from .kda import kda_decode
from .mla import mla_decode
from .moe import moe_partials, moe_tail
from .precision import Storage, f32


@dataclass
class LayerOutput:
    h: torch.Tensor  # [N, d] fp32: this layer's MLP output (the next layer's δ)
    attn: torch.Tensor  # [N, d] fp32: the attention half's all-reduced output
    x_attn: torch.Tensor  # [N, d] AttnRes output feeding the attention half
    x_mlp: torch.Tensor  # [N, d] AttnRes output feeding the MLP half
    carry: AttnResCarry  # (p, B, h) handed to the next layer
    states: list[DecodeState]  # per rank, with updated KDA state / MLA cache


def _allreduce(parts: list[torch.Tensor], storage: Storage) -> torch.Tensor:
    return storage.store(torch.stack([f32(p) for p in parts]).sum(0))


def decoder_layer(weights: list[LayerWeights] | LayerWeights,
                  states: list[DecodeState] | DecodeState,
                  storage: Storage = Storage.FP32) -> LayerOutput:
    """Run one decode step of one layer over the given ranks' shards.

    All ranks share the replicated AttnRes carry (taken from the first state).
    """
    ws = weights if isinstance(weights, list) else [weights]
    sts = states if isinstance(states, list) else [states]
    if len(ws) != len(sts):
        raise ValueError(f"{len(ws)} weight shards but {len(sts)} states")
    w0, st0 = ws[0], sts[0]
    cfg, L, kind = w0.cfg, w0.layer, w0.kind
    T = st0.shape.tokens_per_seq
    nb, bw = cfg.attn_res_position(L)
    ar = w0.attn_res
    c = st0.carry
    eps = cfg.rms_norm_eps

    x_attn, p, blocks = attn_res(
        c.p, c.h, c.blocks, n=nb, j=(L // cfg.attn_res_block_size if bw else -1),
        w_n=ar.self_attention_res_norm, w_q=ar.self_attention_res_proj, w_o=ar.input_layernorm,
        eps=eps, eps_o=eps, storage=storage)

    new_states = []
    parts = []
    for w, st in zip(ws, sts):
        ns = DecodeState(shape=st.shape, carry=st.carry, kda=st.kda, mla=st.mla)
        if w.kda is not None:
            out, ns.kda = kda_decode(x_attn, w.kda, st.kda, T, cfg, storage)
        else:
            out, ns.mla = mla_decode(x_attn, w.mla, st.mla, T, cfg, storage, dcp=w.shard.dcp)
        parts.append(out)
        new_states.append(ns)
    a = _allreduce(parts, storage)

    if bw:
        p, delta = a.to(torch.bfloat16), None  # the block boundary resets p to a
    else:
        delta = a
    x_mlp, p, blocks = attn_res(
        p, delta, blocks, n=nb + int(bw), j=-1,
        w_n=ar.mlp_res_norm, w_q=ar.mlp_res_proj, w_o=ar.post_attention_layernorm,
        eps=eps, eps_o=eps, storage=storage)

    if kind == "dense":
        h = _allreduce([dense_partial(x_mlp, w.dense, cfg, storage) for w in ws], storage)
    else:
        mp = [moe_partials(x_mlp, w.moe, cfg, storage) for w in ws]
        latent = torch.stack([m.latent for m in mp]).sum(0)  # fused AR + RMSNorm accumulates in fp32
        shared = _allreduce([m.shared for m in mp], storage)
        h = moe_tail(latent, shared, w0.moe, cfg, storage)

    carry = AttnResCarry(p=p, blocks=blocks, h=h.to(torch.bfloat16))
    for ns in new_states:
        ns.carry = carry
    return LayerOutput(h=h, attn=a, x_attn=x_attn, x_mlp=x_mlp, carry=carry, states=new_states)
