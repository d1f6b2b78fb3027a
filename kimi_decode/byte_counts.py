"""Bytes a rank must move for one decode step of one layer (`kimi_k3_layer.md` §11).

Counted exactly from the per-rank shapes of `ShardSpec` (no tensors are built):

- weights: every weight the step reads once (all replicated and split weights
  of the layer; of the routed experts only the active ones);
- KV (MLA layers): the cached latent rows each sequence attends over (1/dcp of
  them per rank) plus the step's new rows written;
- state (KDA layers): conv and recurrent state read and written per sequence;
- activations: the AttnRes carry and the layer's input/output rows (small).

Streamed = what one step reads and writes. Resident = what must live on the
rank (all 896 experts, the whole KV cache, the state). The floor of a step is
streamed bytes over the measured copy bandwidth (4.27 TB/s on the H200,
`gpu_facts.md`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from . import mxfp4
from .config import LAYER_KINDS, DecodeShape, KimiK3Config, ShardSpec

H200_COPY_BANDWIDTH = 4.272e12  # bytes/s, measured: read + written, gpu_facts.md

BF16, FP32 = 2, 4


def attn_res_weight_bytes(cfg: KimiK3Config) -> int:
    """Six bf16 [d] vectors per layer: 4 norms and 2 AttnRes projections."""
    return 6 * cfg.hidden_size * BF16


def kda_weight_bytes(sh: ShardSpec) -> int:
    c = sh.cfg
    P, H, d = sh.kda_proj, sh.kda_heads, c.hidden_size
    return (sh.kda_in_proj_rows * d * BF16  # in_proj (incl. pad rows)
            + P * c.kda_f_rank * BF16  # f_b
            + 3 * P * c.short_conv_kernel_size * FP32  # conv1d
            + H * FP32  # A_log
            + P * FP32  # dt_bias
            + c.kda_head_dim * BF16  # o_norm
            + d * P * BF16)  # o_proj


def mla_weight_bytes(sh: ShardSpec) -> int:
    """W_UK_T/W_UV are views of kv_b and are counted once."""
    c = sh.cfg
    d, N = c.hidden_size, sh.mla_heads
    return ((c.q_lora_rank + c.mla_latent_dim) * d * BF16  # fused_qkv_a (replicated)
            + (c.q_lora_rank + c.kv_lora_rank) * BF16  # the two norms
            + sh.mla_q_b_rows * c.q_lora_rank * BF16
            + N * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank * BF16  # kv_b
            + sh.mla_gate_rows * d * BF16  # g_proj
            + d * N * c.v_head_dim * BF16)  # o_proj


def moe_replicated_bytes(cfg: KimiK3Config) -> int:
    """Router, its fp32 bias, latent down, latent norm, latent up: replicated bf16."""
    d, E, L = cfg.hidden_size, cfg.num_experts, cfg.routed_expert_hidden_size
    return E * d * BF16 + E * FP32 + L * d * BF16 + L * BF16 + d * L * BF16


def shared_expert_bytes(sh: ShardSpec) -> int:
    return 3 * sh.shared_intermediate * sh.cfg.hidden_size * BF16


def routed_expert_bytes(sh: ShardSpec) -> int:
    """One routed expert on one rank: w1, w3 [I_loc, L] and w2 [L, I_loc] in MXFP4 (padding included)."""
    L, I = sh.cfg.routed_expert_hidden_size, sh.expert_intermediate_local
    return 2 * mxfp4.packed_nbytes(I, L) + mxfp4.packed_nbytes(L, I)


def dense_mlp_bytes(sh: ShardSpec) -> int:
    return 3 * sh.dense_intermediate * sh.cfg.hidden_size * BF16


def expected_active_experts(cfg: KimiK3Config, num_tokens: int) -> int:
    """Distinct experts touched by `num_tokens` tokens under uniform random routing (rounded).

    E·(1 − (1 − k/E)^N); exactly k for one token.
    """
    E, k = cfg.num_experts, cfg.num_experts_per_token
    if num_tokens <= 1:
        return k * num_tokens
    return round(E * (1.0 - (1.0 - k / E) ** num_tokens))


@dataclass(frozen=True)
class LayerBytes:
    layer: str
    tp: int
    dcp: int
    batch: int
    tokens_per_seq: int
    context: int
    active_experts: int
    weights_attn_res: int
    weights_attention: int
    weights_mlp_replicated: int  # MoE router/latent projections, or the dense MLP
    weights_shared_experts: int
    weights_routed_experts: int  # active experts only
    kv_read: int
    kv_write: int
    state_read: int
    state_write: int
    activations: int
    resident_weights: int
    resident_kv: int
    resident_state: int

    @property
    def weights_streamed(self) -> int:
        return (self.weights_attn_res + self.weights_attention + self.weights_mlp_replicated
                + self.weights_shared_experts + self.weights_routed_experts)

    @property
    def streamed(self) -> int:
        return (self.weights_streamed + self.kv_read + self.kv_write + self.state_read
                + self.state_write + self.activations)

    @property
    def resident(self) -> int:
        return self.resident_weights + self.resident_kv + self.resident_state

    def floor_seconds(self, bandwidth: float = H200_COPY_BANDWIDTH) -> float:
        """The memory floor: streamed bytes over the copy bandwidth."""
        return self.streamed / bandwidth

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(weights_streamed=self.weights_streamed, streamed=self.streamed,
                 resident=self.resident, floor_us_h200=self.floor_seconds() * 1e6)
        return d

    def sub_blocks(self) -> dict[str, int]:
        """Streamed bytes per sub-block, for plots."""
        attn_name = "MLA" if self.layer == "mla_moe" else "KDA"
        out = {"AttnRes + norms": self.weights_attn_res + self.activations,
               f"{attn_name} weights": self.weights_attention}
        if self.layer == "mla_moe":
            out["MLA latent KV"] = self.kv_read + self.kv_write
        else:
            out["KDA state"] = self.state_read + self.state_write
        if self.layer == "dense":
            out["dense MLP"] = self.weights_mlp_replicated
        else:
            out["MoE router + latent proj"] = self.weights_mlp_replicated
            out["shared experts"] = self.weights_shared_experts
            out[f"routed experts ({self.active_experts} active)"] = self.weights_routed_experts
        return out


def layer_bytes(layer: str, shard: ShardSpec | None = None, shape: DecodeShape | None = None,
                active_experts: int | None = None) -> LayerBytes:
    """Byte accounting of one decode step of one layer on one rank.

    `active_experts` defaults to `expected_active_experts` for the step's tokens.
    """
    if layer not in LAYER_KINDS:
        raise ValueError(f"layer must be one of {LAYER_KINDS}, got {layer!r}")
    sh = shard or ShardSpec()
    shape = shape or DecodeShape()
    c = sh.cfg
    N, B, T = shape.num_tokens, shape.batch, shape.tokens_per_seq
    d = c.hidden_size

    attn_w = kda_weight_bytes(sh) if layer in ("dense", "kda_moe") else mla_weight_bytes(sh)
    if layer == "dense":
        mlp_rep, shared, routed, active = dense_mlp_bytes(sh), 0, 0, 0
        routed_resident = 0
    else:
        active = expected_active_experts(c, N) if active_experts is None else active_experts
        if not 0 <= active <= c.num_experts:
            raise ValueError(f"active_experts must be in 0..{c.num_experts}, got {active}")
        mlp_rep, shared = moe_replicated_bytes(c), shared_expert_bytes(sh)
        routed = active * routed_expert_bytes(sh)
        routed_resident = c.num_experts * routed_expert_bytes(sh)

    kv_read = kv_write = st_read = st_write = 0
    res_kv = res_state = 0
    row = c.mla_latent_dim * BF16
    if layer == "mla_moe":
        # each rank reads its 1/dcp share of every sequence's rows (context + the step's tokens)
        kv_read = sum(-(-(ctx + T) // sh.dcp) for ctx in shape.context_per_seq) * row
        kv_write = N * row  # the new rows (under DCP only the owning rank writes; counted once)
        res_kv = sum(-(-(ctx + T) // sh.dcp) for ctx in shape.context_per_seq) * row
    else:
        conv = (c.short_conv_kernel_size - 1) * 3 * sh.kda_proj * BF16
        rec = sh.kda_heads * c.kda_head_dim * c.kda_head_dim * FP32
        st_read = st_write = B * (conv + rec)
        res_state = B * (conv + rec)

    nb, bw = c.attn_res_position(c.representative_layer(layer))
    # AttnRes: read p, δ and the nb (+1) block rows; write p; plus the layer input/output rows
    act = N * d * BF16 * ((nb + 3) + (nb + int(bw) + 3) + 2)

    return LayerBytes(
        layer=layer, tp=sh.tp, dcp=sh.dcp, batch=B, tokens_per_seq=T,
        context=max(shape.context_per_seq), active_experts=active,
        weights_attn_res=attn_res_weight_bytes(c), weights_attention=attn_w,
        weights_mlp_replicated=mlp_rep, weights_shared_experts=shared,
        weights_routed_experts=routed,
        kv_read=kv_read, kv_write=kv_write, state_read=st_read, state_write=st_write,
        activations=act,
        resident_weights=attn_res_weight_bytes(c) + attn_w + mlp_rep + shared + routed_resident,
        resident_kv=res_kv, resident_state=res_state,
    )


def byte_table(tps=(8, 16), shape: DecodeShape | None = None, layers=LAYER_KINDS):
    """A pandas DataFrame: one row per (layer, tp) with streamed/resident bytes and the H200 floor."""
    import pandas as pd

    rows = []
    for tp in tps:
        for layer in layers:
            rows.append(layer_bytes(layer, ShardSpec(tp=tp), shape).as_dict())
    return pd.DataFrame(rows)


def floor_sweep(layers=LAYER_KINDS, tps=(8, 16), batches=(1, 2, 4, 8, 16, 32, 64), contexts=(8192, 32768),
                dcps=(1,), tokens_per_seq: int = 1):
    """The memory floor over batch, context and DCP: a DataFrame, one row per configuration.

    Context and DCP only change MLA layers (KDA layers keep per-sequence state), so KDA and dense
    rows are computed once per batch.
    """
    import pandas as pd

    rows = []
    for tp in tps:
        for layer in layers:
            ctxs = contexts if layer == "mla_moe" else contexts[:1]
            ds = dcps if layer == "mla_moe" else (1,)
            for ctx in ctxs:
                for dcp in ds:
                    for b in batches:
                        lb = layer_bytes(layer, ShardSpec(tp=tp, dcp=dcp), DecodeShape(b, tokens_per_seq, ctx))
                        rows.append({"layer": layer, "tp": tp, "dcp": dcp, "batch": b, "context": ctx,
                                     "tokens_per_seq": tokens_per_seq, "active_experts": lb.active_experts,
                                     "weights_streamed": lb.weights_streamed, "kv_and_state": lb.kv_read + lb.kv_write
                                     + lb.state_read + lb.state_write, "streamed": lb.streamed,
                                     "floor_us_h200": lb.floor_seconds() * 1e6})
    return pd.DataFrame(rows)
