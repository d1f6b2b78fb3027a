"""Model configuration, tensor-parallel shard sizes and decode shapes.

Implements `kimi_k3_layer.md` §1 (the published Kimi K3 values), the per-rank
sizes of §4.1, §5.1, §6.1 and §7 (including the in_proj row padding and the
192 -> 256 routed-expert padding at TP16) and the layer schedule of §3.

Everything here is plain Python: no torch, no GPU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

LAYER_KINDS = ("dense", "kda_moe", "mla_moe")
"""Layer types: layer 0 (KDA + dense MLP), KDA + MoE, MLA + MoE."""


def _default_kda_layers() -> tuple[int, ...]:
    # config.json lists 1-based KDA layers: every layer except each 4th, and
    # except the last one (93), which is full attention.
    full = _default_full_attn_layers()
    return tuple(i for i in range(1, 94) if i not in full)


def _default_full_attn_layers() -> tuple[int, ...]:
    return tuple(list(range(4, 93, 4)) + [93])


@dataclass(frozen=True)
class KimiK3Config:
    """Kimi K3 text model hyper-parameters (`kimi_k3_layer.md` §1).

    The defaults are the published values. `KimiK3Config.tiny()` gives a
    scaled-down config with the same structure for fast CPU tests.
    """

    hidden_size: int = 7168
    num_hidden_layers: int = 93
    # 1-based layer numbers, as in config.json
    kda_layers: tuple[int, ...] = field(default_factory=_default_kda_layers)
    full_attn_layers: tuple[int, ...] = field(default_factory=_default_full_attn_layers)

    # KDA (§4)
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    kda_f_rank: int = 128  # low-rank forget gate f_a width (replicated)
    kda_qk_norm_eps: float = 1e-6  # inside the sum of squares (§4.2 step 4)
    kda_o_norm_eps: float = 1e-5

    # MLA (§5)
    mla_num_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True

    # MoE (§6)
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584  # latent width
    latent_moe_use_norm: bool = True
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    min_moe_intermediate_per_partition: int = 256
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1

    # dense MLP (§7)
    intermediate_size: int = 33792

    # activation (§2)
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0

    # AttnRes (§3)
    attn_res_block_size: int = 12
    rms_norm_eps: float = 1e-5

    # quantisation (§6.2)
    mxfp4_group_size: int = 32

    vocab_size: int = 163840

    # ---------------------------------------------------------------- derived
    @property
    def kda_proj_size(self) -> int:
        """P = H * D (12288)."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def mla_qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_dim(self) -> int:
        """Width of one latent KV cache row: kv_lora_rank + rope dim (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mla_softmax_scale(self) -> float:
        """(qk_nope + qk_rope)^-1/2 = 192^-1/2 (§5)."""
        return self.mla_qk_head_dim ** -0.5

    @property
    def shared_intermediate_size(self) -> int:
        """The two shared experts are one MLP of 2 * 3072 = 6144."""
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def num_attn_res_blocks(self) -> int:
        """cdiv(93, 12) = 8 block slots."""
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    # --------------------------------------------------------------- schedule
    def is_kda_layer(self, layer: int) -> bool:
        """0-based layer index; `is_kda_layer(i) = (i+1) in kda_layers`."""
        self._check_layer(layer)
        return (layer + 1) in self.kda_layers

    def is_mla_layer(self, layer: int) -> bool:
        self._check_layer(layer)
        return (layer + 1) in self.full_attn_layers

    def is_moe_layer(self, layer: int) -> bool:
        self._check_layer(layer)
        return layer >= self.first_k_dense_replace and (layer % self.moe_layer_freq == 0)

    def layer_kind(self, layer: int) -> str:
        """'dense' (KDA + dense MLP), 'kda_moe' or 'mla_moe' for a 0-based layer."""
        attn = "kda" if self.is_kda_layer(layer) else "mla"
        if not self.is_moe_layer(layer):
            if attn != "kda":
                raise ValueError(f"layer {layer}: a dense MLA layer is not part of Kimi K3")
            return "dense"
        return f"{attn}_moe"

    def layer_schedule(self) -> list[str]:
        return [self.layer_kind(i) for i in range(self.num_hidden_layers)]

    def attn_res_position(self, layer: int) -> tuple[int, bool]:
        """(nb, bw) of §3.3: nb = ceil(L/12) block sources, bw = block write at L."""
        self._check_layer(layer)
        nb = math.ceil(layer / self.attn_res_block_size)
        bw = layer % self.attn_res_block_size == 0
        return nb, bw

    def representative_layer(self, kind: str) -> int:
        """The first layer of a kind (0 for dense, 1 for kda_moe, 3 for mla_moe)."""
        if kind not in LAYER_KINDS:
            raise ValueError(f"layer kind must be one of {LAYER_KINDS}, got {kind!r}")
        for i in range(self.num_hidden_layers):
            if self.layer_kind(i) == kind:
                return i
        raise ValueError(f"no layer of kind {kind!r} in this config")

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_hidden_layers:
            raise ValueError(f"layer index {layer} outside 0..{self.num_hidden_layers - 1}")

    # ------------------------------------------------------------ variants
    @property
    def is_published(self) -> bool:
        return self == KimiK3Config()

    @classmethod
    def tiny(cls, **overrides) -> "KimiK3Config":
        """A scaled-down config with Kimi K3's structure, for fast CPU tests.

        Every divisibility the real model has is kept (MXFP4 groups of 32,
        head splits, expert padding at the larger TP) so the same code paths run.
        """
        layers = 13
        full = (4, 8, 12, 13)
        base = dict(
            hidden_size=128,
            num_hidden_layers=layers,
            kda_layers=tuple(i for i in range(1, layers + 1) if i not in full),
            full_attn_layers=full,
            kda_num_heads=8,
            kda_head_dim=16,
            kda_f_rank=16,
            mla_num_heads=8,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            num_experts=32,
            num_experts_per_token=4,
            moe_intermediate_size=128,
            routed_expert_hidden_size=64,
            min_moe_intermediate_per_partition=96,
            intermediate_size=256,
            attn_res_block_size=4,
        )
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes) -> "KimiK3Config":
        return dataclasses.replace(self, **changes)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class ShardSpec:
    """One tensor-parallel rank's view of the layer (§4.1, §5.1, §6.1, §7).

    `tp` is the tensor-parallel size, `rank` which rank this is, `dcp` the
    decode-context-parallel size for MLA layers (latent KV sharded by token
    position). Sizes are checked for divisibility here; whether the shard is
    *supported* (TP8/TP16 of the published model) is `support.check_supported`.
    """

    tp: int = 8
    rank: int = 0
    dcp: int = 1
    cfg: KimiK3Config = field(default_factory=KimiK3Config, compare=True, repr=False)

    def __post_init__(self):
        c = self.cfg
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank must be in 0..{self.tp - 1}, got {self.rank}")
        if self.dcp < 1:
            raise ValueError(f"dcp must be >= 1, got {self.dcp}")
        for name, n in (
            ("kda_num_heads", c.kda_num_heads),
            ("mla_num_heads", c.mla_num_heads),
            ("moe_intermediate_size", c.moe_intermediate_size),
            ("intermediate_size", c.intermediate_size),
            ("hidden_size", c.hidden_size),
        ):
            if n % self.tp:
                raise ValueError(f"tp={self.tp} does not divide {name}={n}")
        g = c.mxfp4_group_size
        if self.expert_intermediate_local % g:
            raise ValueError(
                f"per-rank expert intermediate {self.expert_intermediate_local} is not a "
                f"multiple of the MXFP4 group size {g}"
            )

    # ---- KDA
    @property
    def kda_heads(self) -> int:
        """H_l: 12 at TP8, 6 at TP16."""
        return self.cfg.kda_num_heads // self.tp

    @property
    def kda_proj(self) -> int:
        """P_l = H_l * D: 1536 at TP8, 768 at TP16."""
        return self.kda_heads * self.cfg.kda_head_dim

    @property
    def kda_in_proj_rows_unpadded(self) -> int:
        return 4 * self.kda_proj + self.cfg.kda_f_rank + self.kda_heads

    @property
    def kda_in_proj_rows(self) -> int:
        """[q; k; v; g_out; f_a; b; pad] rows, padded to a multiple of 16: 6288 (TP8), 3216 (TP16)."""
        return _round_up(self.kda_in_proj_rows_unpadded, 16)

    @property
    def kda_in_proj_pad(self) -> int:
        return self.kda_in_proj_rows - self.kda_in_proj_rows_unpadded

    # ---- MLA
    @property
    def mla_heads(self) -> int:
        """N_l: 12 at TP8, 6 at TP16."""
        return self.cfg.mla_num_heads // self.tp

    @property
    def mla_q_b_rows(self) -> int:
        """N_l * 192: 2304 at TP8."""
        return self.mla_heads * self.cfg.mla_qk_head_dim

    @property
    def mla_gate_rows(self) -> int:
        """g_proj rows per rank: N_l * v_head_dim (1536 at TP8)."""
        return self.mla_heads * self.cfg.v_head_dim

    # ---- MoE
    @property
    def expert_intermediate_real(self) -> int:
        """The rank's real slice I_r of the 3072 expert intermediate: 384 (TP8), 192 (TP16)."""
        return self.cfg.moe_intermediate_size // self.tp

    @property
    def expert_intermediate_local(self) -> int:
        """Stored rows per rank after padding to `min_moe_intermediate_per_partition`: 384 (TP8), 256 (TP16)."""
        return max(self.expert_intermediate_real, self.cfg.min_moe_intermediate_per_partition)

    @property
    def expert_intermediate_pad(self) -> int:
        return self.expert_intermediate_local - self.expert_intermediate_real

    @property
    def shared_intermediate(self) -> int:
        """Shared-expert intermediate per rank: 768 (TP8), 384 (TP16)."""
        return self.cfg.shared_intermediate_size // self.tp

    # ---- dense
    @property
    def dense_intermediate(self) -> int:
        """Dense MLP intermediate per rank: 4224 (TP8), 2112 (TP16)."""
        return self.cfg.intermediate_size // self.tp

    def with_rank(self, rank: int) -> "ShardSpec":
        return dataclasses.replace(self, rank=rank)

    @property
    def dcp_rank(self) -> int:
        """This rank's place in its DCP group: the groups are consecutive blocks of `dcp` TP ranks."""
        return self.rank % self.dcp

    def all_ranks(self) -> list["ShardSpec"]:
        return [self.with_rank(r) for r in range(self.tp)]

    def describe(self) -> str:
        return f"TP{self.tp} rank {self.rank}" + (f", DCP{self.dcp}" if self.dcp > 1 else "")


@dataclass(frozen=True)
class DecodeShape:
    """What one decode step processes.

    batch: sequences in the step (1..64 supported).
    tokens_per_seq: 1 for plain decode, 2..8 for speculative verify.
    context_lens: tokens already cached per sequence before this step (MLA
        layers); one int for all sequences or one per sequence.
    """

    batch: int = 1
    tokens_per_seq: int = 1
    context_lens: int | tuple[int, ...] = 1024

    def __post_init__(self):
        if isinstance(self.context_lens, Sequence) and not isinstance(self.context_lens, str):
            object.__setattr__(self, "context_lens", tuple(int(c) for c in self.context_lens))
            if len(self.context_lens) != self.batch:
                raise ValueError(
                    f"context_lens has {len(self.context_lens)} entries for batch {self.batch}"
                )

    @property
    def num_tokens(self) -> int:
        return self.batch * self.tokens_per_seq

    @property
    def context_per_seq(self) -> tuple[int, ...]:
        if isinstance(self.context_lens, tuple):
            return self.context_lens
        return (int(self.context_lens),) * self.batch

    @property
    def max_context(self) -> int:
        """Longest sequence after this step's tokens are appended."""
        return max(self.context_per_seq) + self.tokens_per_seq

    def describe(self) -> str:
        ctx = self.context_per_seq
        c = str(ctx[0]) if len(set(ctx)) == 1 else f"{min(ctx)}..{max(ctx)}"
        return f"batch {self.batch} x {self.tokens_per_seq} tok, context {c}"
