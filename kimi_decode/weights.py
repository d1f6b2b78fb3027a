"""Seeded random weights for one tensor-parallel rank at real shapes.

Shapes and dtypes follow `kimi_k3_layer.md` §3.3 (AttnRes), §4.1 (KDA),
§5.1 (MLA), §6.1 (MoE) and §7 (dense). Every tensor is drawn from its own
generator keyed by (seed, layer, name) for replicated tensors and
(seed, layer, name, rank) for split ones, so that the ranks of one layer are
consistent slices of one full layer: `unshard` concatenates them back, which
the tensor-parallel tests use.

Scales: bf16 matrices ~ N(0, 1/K_full) (K_full = the unsplit input width) so
activations stay O(1); norm weights 1 + 0.1 N(0,1); MXFP4 experts uniform
E2M1 codes with E8M0 scales near 1/(2.93 sqrt(K)). Only padding rows are zero
(the in_proj pad rows and the TP16 expert padding), as in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, fields

import torch

from . import mxfp4
from .config import LAYER_KINDS, KimiK3Config, ShardSpec

_E2M1_RMS = math.sqrt(sum(v * v for v in mxfp4.E2M1_VALUES) / len(mxfp4.E2M1_VALUES))


def _generator(seed: int, *key) -> torch.Generator:
    h = hashlib.sha256(repr((seed,) + key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))


class _Draw:
    """Draws the tensors of one layer on one rank."""

    device = "cpu"

    def __init__(self, seed: int, layer: int, rank: int):
        self.seed, self.layer, self.rank = seed, layer, rank

    def zeros(self, *shape, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=self.device)

    def gen(self, name: str, split: bool) -> torch.Generator:
        key = (self.layer, name, self.rank) if split else (self.layer, name)
        return _generator(self.seed, *key)

    def linear(self, name: str, rows: int, cols: int, fan_in: int, split: bool) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=self.gen(name, split)) / math.sqrt(fan_in)
        return w.to(torch.bfloat16)

    def norm(self, name: str, n: int) -> torch.Tensor:
        w = 1.0 + 0.1 * torch.randn(n, generator=self.gen(name, False))
        return w.to(torch.bfloat16)

    def normal(self, name: str, shape, std: float, mean: float = 0.0, split: bool = False,
               dtype=torch.float32) -> torch.Tensor:
        return (mean + std * torch.randn(*shape, generator=self.gen(name, split))).to(dtype)

    def uniform(self, name: str, shape, lo: float, hi: float, split: bool) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(*shape, generator=self.gen(name, split))

    def random_bytes(self, name: str, shape, split: bool) -> torch.Tensor:
        n = math.prod(shape)
        n8 = (n + 7) // 8
        words = torch.empty(n8, dtype=torch.int64).random_(-(2 ** 63), 2 ** 63 - 1,
                                                          generator=self.gen(name, split))
        return words.view(torch.uint8)[:n].reshape(shape)


class _MetaDraw(_Draw):
    """Shapes and dtypes only (device "meta"): for launch inventories and byte counts at real size."""

    device = "meta"

    def linear(self, name, rows, cols, fan_in, split):
        return torch.empty(rows, cols, dtype=torch.bfloat16, device="meta")

    def norm(self, name, n):
        return torch.empty(n, dtype=torch.bfloat16, device="meta")

    def normal(self, name, shape, std, mean=0.0, split=False, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    def uniform(self, name, shape, lo, hi, split):
        return torch.empty(*shape, dtype=torch.float32, device="meta")

    def random_bytes(self, name, shape, split):
        return torch.empty(*shape, dtype=torch.uint8, device="meta")


@dataclass
class _Weights:
    """Base: tensor iteration, byte counts, device moves."""

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device) -> "_Weights":
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})


@dataclass
class AttnResWeights(_Weights):
    """The six per-layer AttnRes/norm vectors, all bf16 [d], replicated (§3.3)."""

    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    self_attention_res_norm: torch.Tensor
    mlp_res_norm: torch.Tensor
    self_attention_res_proj: torch.Tensor
    mlp_res_proj: torch.Tensor


@dataclass
class KDAWeights(_Weights):
    """KDA sub-block, one rank (§4.1)."""

    in_proj: torch.Tensor  # [4P_l + f_rank + H_l + pad, d] bf16: [q; k; v; g_out; f_a; b; pad]
    f_b: torch.Tensor  # [P_l, f_rank] bf16
    conv1d: torch.Tensor  # [3P_l, 4] fp32, packed q|k|v depthwise taps (oldest first)
    A_log: torch.Tensor  # [H_l] fp32
    dt_bias: torch.Tensor  # [P_l] fp32
    o_norm: torch.Tensor  # [D] bf16
    o_proj: torch.Tensor  # [d, P_l] bf16 (row parallel)
    heads: int = 0
    head_dim: int = 0
    f_rank: int = 0

    @property
    def proj(self) -> int:
        return self.heads * self.head_dim

    def in_proj_sections(self) -> dict[str, slice]:
        """Row ranges of in_proj: qkv (3P_l), g_out, f_a, b, pad."""
        P, f, H = self.proj, self.f_rank, self.heads
        return {
            "qkv": slice(0, 3 * P),
            "g_out": slice(3 * P, 4 * P),
            "f_a": slice(4 * P, 4 * P + f),
            "b": slice(4 * P + f, 4 * P + f + H),
            "pad": slice(4 * P + f + H, self.in_proj.shape[0]),
        }


@dataclass
class MLAWeights(_Weights):
    """MLA sub-block, one rank (§5.1). kv_b is kept as [N_l*(128+128), 512]."""

    fused_qkv_a: torch.Tensor  # [q_lora + kv_lora + rope, d] bf16, replicated
    q_a_norm: torch.Tensor  # [q_lora] bf16
    kv_a_norm: torch.Tensor  # [kv_lora] bf16
    q_b: torch.Tensor  # [N_l * 192, q_lora] bf16
    kv_b: torch.Tensor  # [N_l * (nope + v), kv_lora] bf16, per head [k_nope; v]
    g_proj: torch.Tensor  # [N_l * v, d] bf16
    o_proj: torch.Tensor  # [d, N_l * v] bf16 (row parallel)
    heads: int = 0
    nope_dim: int = 0
    rope_dim: int = 0
    v_dim: int = 0

    @property
    def W_UK_T(self) -> torch.Tensor:
        """[N_l, nope, kv_lora]: q_lat[h] = q_nope[h] @ W_UK_T[h]."""
        kvb = self.kv_b.view(self.heads, self.nope_dim + self.v_dim, -1)
        return kvb[:, : self.nope_dim]

    @property
    def W_UV(self) -> torch.Tensor:
        """[N_l, kv_lora, v]: o[h] = o_lat[h] @ W_UV[h]."""
        kvb = self.kv_b.view(self.heads, self.nope_dim + self.v_dim, -1)
        return kvb[:, self.nope_dim:].transpose(1, 2)


@dataclass
class MoEWeights(_Weights):
    """Latent MoE, one rank (§6.1). All experts are resident; MXFP4 packed per §6.2."""

    gate: torch.Tensor  # [E, d] bf16 router
    e_score_correction_bias: torch.Tensor  # [E] fp32
    down: torch.Tensor  # [latent, d] bf16 routed_expert_down_proj
    norm: torch.Tensor  # [latent] bf16 routed_expert_norm
    up: torch.Tensor  # [d, latent] bf16 routed_expert_up_proj
    w1_packed: torch.Tensor  # [E, I_loc, latent/2] uint8 (gate)
    w1_scale: torch.Tensor  # [E, I_loc, latent/32] uint8
    w3_packed: torch.Tensor  # [E, I_loc, latent/2] uint8 (up)
    w3_scale: torch.Tensor
    w2_packed: torch.Tensor  # [E, latent, I_loc/2] uint8 (down)
    w2_scale: torch.Tensor  # [E, latent, I_loc/32] uint8
    shared_gate_up: torch.Tensor  # [2 S_l, d] bf16, gate rows first
    shared_down: torch.Tensor  # [d, S_l] bf16 (row parallel)
    inter_real: int = 0  # the rank's real intermediate rows; the rest is zero padding

    def expert_nbytes(self) -> int:
        """Bytes of one routed expert on this rank (packed codes + scales, padding included)."""
        e = self.w1_packed.shape[0]
        return sum(getattr(self, n).numel() for n in
                   ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")) // e


@dataclass
class DenseWeights(_Weights):
    """Dense SiTU MLP of layer 0, one rank (§7)."""

    gate_up: torch.Tensor  # [2 I_l, d] bf16, gate rows first
    down: torch.Tensor  # [d, I_l] bf16 (row parallel)


@dataclass
class LayerWeights:
    """All weights of one decoder layer on one rank."""

    kind: str
    layer: int
    shard: ShardSpec
    attn_res: AttnResWeights
    kda: KDAWeights | None = None
    mla: MLAWeights | None = None
    moe: MoEWeights | None = None
    dense: DenseWeights | None = None
    seed: int = 0
    _parts = ("attn_res", "kda", "mla", "moe", "dense")

    @property
    def cfg(self) -> KimiK3Config:
        return self.shard.cfg

    def parts(self) -> dict[str, _Weights]:
        return {p: getattr(self, p) for p in self._parts if getattr(self, p) is not None}

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in self.parts().values())

    def to(self, device) -> "LayerWeights":
        return dataclasses.replace(self, **{p: w.to(device) for p, w in self.parts().items()})


# ---------------------------------------------------------------------------
# generation


def _attn_res(cfg: KimiK3Config, dr: _Draw) -> AttnResWeights:
    d = cfg.hidden_size
    names = [f.name for f in fields(AttnResWeights)]
    vals = {}
    for n in names:
        if n.endswith("_proj"):
            vals[n] = dr.normal(n, (d,), std=1.0 / math.sqrt(d), dtype=torch.bfloat16)
        else:
            vals[n] = dr.norm(n, d)
    return AttnResWeights(**vals)


def _kda(cfg: KimiK3Config, sh: ShardSpec, dr: _Draw) -> KDAWeights:
    d, P, H, D, f = cfg.hidden_size, sh.kda_proj, sh.kda_heads, cfg.kda_head_dim, cfg.kda_f_rank
    rows = [
        dr.linear("in_proj.q", P, d, d, split=True),
        dr.linear("in_proj.k", P, d, d, split=True),
        dr.linear("in_proj.v", P, d, d, split=True),
        dr.linear("in_proj.g_out", P, d, d, split=True),
        dr.linear("in_proj.f_a", f, d, d, split=False),
        dr.linear("in_proj.b", H, d, d, split=True),
        dr.zeros(sh.kda_in_proj_pad, d),
    ]
    in_proj = torch.cat(rows, 0)
    conv = torch.cat([dr.normal(f"conv1d.{p}", (P, cfg.short_conv_kernel_size), std=0.5, split=True)
                      for p in "qkv"], 0)
    return KDAWeights(
        in_proj=in_proj,
        f_b=dr.linear("f_b", P, f, f, split=True),
        conv1d=conv,
        A_log=torch.log(dr.uniform("A_log", (H,), 0.1, 1.0, split=True)),
        dt_bias=dr.normal("dt_bias", (P,), std=0.5, split=True),
        o_norm=dr.norm("o_norm", D),
        o_proj=dr.linear("o_proj", d, P, cfg.kda_proj_size, split=True),
        heads=H, head_dim=D, f_rank=f,
    )


def _mla(cfg: KimiK3Config, sh: ShardSpec, dr: _Draw) -> MLAWeights:
    d, N = cfg.hidden_size, sh.mla_heads
    ql, kl, r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    return MLAWeights(
        fused_qkv_a=dr.linear("fused_qkv_a", ql + kl + r, d, d, split=False),
        q_a_norm=dr.norm("q_a_norm", ql),
        kv_a_norm=dr.norm("kv_a_norm", kl),
        q_b=dr.linear("q_b", N * cfg.mla_qk_head_dim, ql, ql, split=True),
        kv_b=dr.linear("kv_b", N * (nope + v), kl, kl, split=True),
        g_proj=dr.linear("g_proj", N * v, d, d, split=True),
        o_proj=dr.linear("o_proj", d, N * v, cfg.mla_num_heads * v, split=True),
        heads=N, nope_dim=nope, rope_dim=r, v_dim=v,
    )


def _mxfp4_expert_matrix(dr: _Draw, name: str, E: int, rows: int, cols: int, fan_in: int,
                         pad_rows: int = 0, pad_cols: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed [E, rows, cols] with the last pad_rows rows / pad_cols cols zero."""
    g = mxfp4.GROUP
    packed = dr.random_bytes(name + ".codes", (E, rows, cols // 2), split=True)
    e = round(math.log2(1.0 / (_E2M1_RMS * math.sqrt(fan_in))))
    jitter = dr.random_bytes(name + ".scales", (E, rows, cols // g), split=True) % 3
    scales = (jitter.to(torch.int16) - 1 + e + mxfp4.E8M0_BIAS).to(torch.uint8)
    if pad_rows:
        packed[:, rows - pad_rows:] = 0
        scales[:, rows - pad_rows:] = mxfp4.E8M0_BIAS
    if pad_cols:
        real = cols - pad_cols
        if real % 2:
            raise ValueError("odd real column count cannot be packed")
        packed[..., real // 2:] = 0
        scales[..., -(-real // g):] = mxfp4.E8M0_BIAS  # groups that hold only padding
    return packed, scales


def _moe(cfg: KimiK3Config, sh: ShardSpec, dr: _Draw) -> MoEWeights:
    d, E, L = cfg.hidden_size, cfg.num_experts, cfg.routed_expert_hidden_size
    I, pad, S = sh.expert_intermediate_local, sh.expert_intermediate_pad, sh.shared_intermediate
    w1 = _mxfp4_expert_matrix(dr, "w1", E, I, L, L, pad_rows=pad)
    w3 = _mxfp4_expert_matrix(dr, "w3", E, I, L, L, pad_rows=pad)
    w2 = _mxfp4_expert_matrix(dr, "w2", E, L, I, cfg.moe_intermediate_size, pad_cols=pad)
    return MoEWeights(
        gate=dr.linear("gate", E, d, d, split=False),
        e_score_correction_bias=dr.normal("e_score_correction_bias", (E,), std=0.05),
        down=dr.linear("down", L, d, d, split=False),
        norm=dr.norm("routed_expert_norm", L),
        up=dr.linear("up", d, L, L, split=False),
        w1_packed=w1[0], w1_scale=w1[1],
        w3_packed=w3[0], w3_scale=w3[1],
        w2_packed=w2[0], w2_scale=w2[1],
        shared_gate_up=torch.cat([dr.linear("shared.gate", S, d, d, split=True),
                                  dr.linear("shared.up", S, d, d, split=True)], 0),
        shared_down=dr.linear("shared.down", d, S, cfg.shared_intermediate_size, split=True),
        inter_real=sh.expert_intermediate_real,
    )


def _dense(cfg: KimiK3Config, sh: ShardSpec, dr: _Draw) -> DenseWeights:
    d, I = cfg.hidden_size, sh.dense_intermediate
    return DenseWeights(
        gate_up=torch.cat([dr.linear("dense.gate", I, d, d, split=True),
                           dr.linear("dense.up", I, d, d, split=True)], 0),
        down=dr.linear("dense.down", d, I, cfg.intermediate_size, split=True),
    )


def make_layer_weights(kind: str, shard: ShardSpec | None = None, seed: int = 0,
                       layer: int | None = None, device="cpu") -> LayerWeights:
    """Random weights of one layer of `kind` ('dense', 'kda_moe', 'mla_moe') on one rank.

    `layer` defaults to the first layer of that kind; it seeds the draw and
    fixes the AttnRes position (§3.3).
    """
    shard = shard or ShardSpec()
    cfg = shard.cfg
    if kind not in LAYER_KINDS:
        raise ValueError(f"layer kind must be one of {LAYER_KINDS}, got {kind!r}")
    layer = cfg.representative_layer(kind) if layer is None else layer
    if cfg.layer_kind(layer) != kind:
        raise ValueError(f"layer {layer} is {cfg.layer_kind(layer)}, not {kind}")
    dr = _MetaDraw(seed, layer, shard.rank) if str(device) == "meta" else _Draw(seed, layer, shard.rank)
    w = LayerWeights(kind=kind, layer=layer, shard=shard, attn_res=_attn_res(cfg, dr), seed=seed)
    if kind in ("dense", "kda_moe"):
        w.kda = _kda(cfg, shard, dr)
    else:
        w.mla = _mla(cfg, shard, dr)
    if kind == "dense":
        w.dense = _dense(cfg, shard, dr)
    else:
        w.moe = _moe(cfg, shard, dr)
    return w.to(device) if str(device) not in ("cpu", "meta") else w


# ---------------------------------------------------------------------------
# TP: the unsharded layer from all ranks' shards


def unshard(ranks: list[LayerWeights]) -> LayerWeights:
    """Concatenate the shards of all TP ranks of one layer into the TP1 layer.

    Used by the tensor-parallel tests: running the TP1 layer must equal
    combining the partial outputs of all ranks.
    """
    tp = len(ranks)
    r0 = ranks[0]
    if sorted(r.shard.rank for r in ranks) != list(range(tp)) or r0.shard.tp != tp:
        raise ValueError("unshard needs exactly the ranks 0..tp-1 of one layer")
    cfg = r0.cfg
    full = ShardSpec(tp=1, rank=0, dcp=r0.shard.dcp, cfg=cfg)
    ranks = sorted(ranks, key=lambda r: r.shard.rank)
    cat = lambda ts, dim=0: torch.cat(list(ts), dim)
    out = LayerWeights(kind=r0.kind, layer=r0.layer, shard=full, attn_res=r0.attn_res, seed=r0.seed)
    if r0.kda is not None:
        ks = [r.kda for r in ranks]
        sec = [k.in_proj_sections() for k in ks]
        part = lambda name: cat(k.in_proj[s[name]] for k, s in zip(ks, sec))
        P = ks[0].proj
        qkv = [cat(k.in_proj[s["qkv"]][i * P:(i + 1) * P] for k, s in zip(ks, sec)) for i in range(3)]
        rows = qkv + [part("g_out"), ks[0].in_proj[sec[0]["f_a"]], part("b")]
        pad = full.kda_in_proj_pad
        rows.append(torch.zeros(pad, cfg.hidden_size, dtype=torch.bfloat16, device=rows[0].device))
        convs = [cat(k.conv1d[i * P:(i + 1) * P] for k in ks) for i in range(3)]
        out.kda = KDAWeights(
            in_proj=cat(rows), f_b=cat(k.f_b for k in ks), conv1d=cat(convs),
            A_log=cat(k.A_log for k in ks), dt_bias=cat(k.dt_bias for k in ks),
            o_norm=ks[0].o_norm, o_proj=cat((k.o_proj for k in ks), 1),
            heads=ks[0].heads * tp, head_dim=ks[0].head_dim, f_rank=ks[0].f_rank,
        )
    if r0.mla is not None:
        ms = [r.mla for r in ranks]
        out.mla = dataclasses.replace(
            ms[0], q_b=cat(m.q_b for m in ms), kv_b=cat(m.kv_b for m in ms),
            g_proj=cat(m.g_proj for m in ms), o_proj=cat((m.o_proj for m in ms), 1),
            heads=ms[0].heads * tp,
        )
    if r0.moe is not None:
        ms = [r.moe for r in ranks]
        real = ms[0].inter_real
        g = mxfp4.GROUP
        if real % g:
            raise ValueError(f"unshard needs the expert slice ({real}) to be whole MXFP4 groups")
        S = ms[0].shared_down.shape[1]
        out.moe = dataclasses.replace(
            ms[0],
            w1_packed=cat((m.w1_packed[:, :real] for m in ms), 1),
            w1_scale=cat((m.w1_scale[:, :real] for m in ms), 1),
            w3_packed=cat((m.w3_packed[:, :real] for m in ms), 1),
            w3_scale=cat((m.w3_scale[:, :real] for m in ms), 1),
            w2_packed=cat((m.w2_packed[..., : real // 2] for m in ms), 2),
            w2_scale=cat((m.w2_scale[..., : real // g] for m in ms), 2),
            shared_gate_up=cat([cat(m.shared_gate_up[:S] for m in ms), cat(m.shared_gate_up[S:] for m in ms)]),
            shared_down=cat((m.shared_down for m in ms), 1),
            inter_real=real * tp,
        )
    if r0.dense is not None:
        ds = [r.dense for r in ranks]
        I = ds[0].down.shape[1]
        out.dense = DenseWeights(
            gate_up=cat([cat(x.gate_up[:I] for x in ds), cat(x.gate_up[I:] for x in ds)]),
            down=cat((x.down for x in ds), 1),
        )
    return out
