"""Decode-time state of one layer on one rank (`kimi_k3_layer.md` §3.1, §4.3, §5.3, §8).

- KDA: conv state (bf16, "SD" layout [slot, width-1, 3P_l], oldest first) and
  the recurrent state (fp32 [slot, H_l, V=128, K=128]), indexed by a per-sequence
  slot; slot 0 is the null/padding slot (zero output, no update).
- MLA: the paged latent KV cache, bf16 [num_blocks, block_size, 576] rows
  [c (512) | k_pe (64)], a block table per sequence and the cached length per
  sequence. The step's new rows go to `slot_mapping`.
- AttnRes carry: p [N, d], the block stack B [N, 8, d] and the previous
  sublayer output h [N, d] (bf16, rebuilt every step; nothing persists).

Tokens of a step are laid out sequence-major: token i belongs to sequence
i // tokens_per_seq. All contents are seeded random (never zeros).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch

from .config import DecodeShape, KimiK3Config, ShardSpec

MLA_BLOCK_SIZE = 64


def _gen(seed: int, *key) -> torch.Generator:
    h = hashlib.sha256(repr(("state", seed) + key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))


@dataclass
class KDAState:
    conv: torch.Tensor  # [num_slots, width-1, 3 P_l] bf16
    recurrent: torch.Tensor  # [num_slots, H_l, V, K] fp32
    slots: torch.Tensor  # [batch] int64 slot per sequence (0 = null)

    def clone(self) -> "KDAState":
        return KDAState(self.conv.clone(), self.recurrent.clone(), self.slots.clone())

    def nbytes_per_seq(self) -> int:
        return (self.conv[0].numel() * self.conv.element_size()
                + self.recurrent[0].numel() * self.recurrent.element_size())

    def to(self, device) -> "KDAState":
        return KDAState(self.conv.to(device), self.recurrent.to(device), self.slots.to(device))


@dataclass
class MLAKVCache:
    kv: torch.Tensor  # [num_blocks, block_size, 576] bf16
    block_table: torch.Tensor  # [batch, max_blocks] int64
    context_lens: torch.Tensor  # [batch] int64 cached tokens before this step
    block_size: int = MLA_BLOCK_SIZE
    # decode context parallelism: this cache holds only the positions τ ≡ dcp_rank (mod dcp) of each
    # sequence, τ at local row τ // dcp (`dcp.shard_cache`); context_lens stay global positions
    dcp: int = 1
    dcp_rank: int = 0

    def clone(self) -> "MLAKVCache":
        return dataclasses.replace(self, kv=self.kv.clone())

    def slot_mapping(self, tokens_per_seq: int) -> torch.Tensor:
        """Flat cache row index [batch * tokens_per_seq] for each new token of the step
        (−1 for a token whose position another DCP rank holds: the cache insert skips it)."""
        B = self.block_table.shape[0]
        pos = self.context_lens[:, None] + torch.arange(tokens_per_seq, device=self.kv.device)
        local = pos // self.dcp
        blk = torch.gather(self.block_table, 1, local // self.block_size)
        slot = blk * self.block_size + local % self.block_size
        if self.dcp > 1:
            slot = torch.where(pos % self.dcp == self.dcp_rank, slot, torch.full_like(slot, -1))
        return slot.reshape(B * tokens_per_seq)

    def gather(self, seq: int, length: int) -> torch.Tensor:
        """The first `length` cache rows of sequence `seq`, [length, 576], in position order."""
        nblk = -(-length // self.block_size)
        rows = self.kv[self.block_table[seq, :nblk]].reshape(-1, self.kv.shape[-1])
        return rows[:length]

    def to(self, device) -> "MLAKVCache":
        return dataclasses.replace(self, kv=self.kv.to(device), block_table=self.block_table.to(device),
                                   context_lens=self.context_lens.to(device))


@dataclass
class AttnResCarry:
    p: torch.Tensor  # [N, d] bf16 prefix sum
    blocks: torch.Tensor  # [N, slots, d] bf16 block stack
    h: torch.Tensor | None  # [N, d] bf16 previous sublayer output (None before layer 0)

    def clone(self) -> "AttnResCarry":
        return AttnResCarry(self.p.clone(), self.blocks.clone(), None if self.h is None else self.h.clone())

    def to(self, device) -> "AttnResCarry":
        return AttnResCarry(self.p.to(device), self.blocks.to(device),
                            None if self.h is None else self.h.to(device))


@dataclass
class DecodeState:
    """Everything one layer's decode step reads besides its weights."""

    shape: DecodeShape
    carry: AttnResCarry
    kda: KDAState | None = None
    mla: MLAKVCache | None = None

    def clone(self) -> "DecodeState":
        return DecodeState(self.shape, self.carry.clone(),
                           None if self.kda is None else self.kda.clone(),
                           None if self.mla is None else self.mla.clone())

    def to(self, device) -> "DecodeState":
        return DecodeState(self.shape, self.carry.to(device),
                           None if self.kda is None else self.kda.to(device),
                           None if self.mla is None else self.mla.to(device))


def make_kda_state(cfg: KimiK3Config, shard: ShardSpec, batch: int, seed: int = 0,
                   layer: int = 0, null_slots: tuple[int, ...] = ()) -> KDAState:
    """Random KDA state for `batch` sequences; slots are a shuffled 1..batch.

    `null_slots` lists sequence indices that get the null slot 0 (padding).
    """
    g = _gen(seed, "kda", layer, shard.rank)
    n_slots = batch + 1
    P, H, D = shard.kda_proj, shard.kda_heads, cfg.kda_head_dim
    conv = torch.randn(n_slots, cfg.short_conv_kernel_size - 1, 3 * P, generator=g).to(torch.bfloat16)
    rec = 0.05 * torch.randn(n_slots, H, D, D, generator=g)
    # the slot of a sequence is the same on every rank
    slots = torch.randperm(batch, generator=_gen(seed, "kda-slots", layer)) + 1
    for s in null_slots:
        slots[s] = 0
    return KDAState(conv, rec, slots)


def make_mla_cache(cfg: KimiK3Config, shape: DecodeShape, seed: int = 0, layer: int = 0,
                   block_size: int = MLA_BLOCK_SIZE, device="cpu") -> MLAKVCache:
    """Random paged latent cache holding each sequence's context, with room for the step."""
    g = _gen(seed, "mla", layer)
    ctx = torch.tensor(shape.context_per_seq, dtype=torch.int64)
    need = (ctx + shape.tokens_per_seq + block_size - 1) // block_size
    total = int(need.sum())
    max_blocks = int(need.max())
    perm = torch.randperm(total, generator=g)  # blocks scattered through the pool
    table = torch.zeros(shape.batch, max_blocks, dtype=torch.int64)
    off = 0
    for b in range(shape.batch):
        n = int(need[b])
        table[b, :n] = perm[off:off + n]
        off += n
    if str(device).startswith("cuda"):  # long contexts: draw the cache on the GPU
        gd = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
        kv = torch.randn(total, block_size, cfg.mla_latent_dim, generator=gd, device=device).to(torch.bfloat16)
        return MLAKVCache(kv=kv, block_table=table.to(device), context_lens=ctx.to(device), block_size=block_size)
    kv = torch.randn(total, block_size, cfg.mla_latent_dim, generator=g).to(torch.bfloat16)
    return MLAKVCache(kv=kv, block_table=table, context_lens=ctx, block_size=block_size)


def make_attn_res_carry(cfg: KimiK3Config, shape: DecodeShape, layer: int, seed: int = 0) -> AttnResCarry:
    """A random carry as it arrives at `layer`: every block slot, p and h (not before layer 0) set."""
    g = _gen(seed, "carry", layer)
    N, d, S = shape.num_tokens, cfg.hidden_size, cfg.num_attn_res_blocks
    blocks = torch.randn(N, S, d, generator=g).to(torch.bfloat16)
    # slots past the layer's nb sources hold stale values from earlier steps, never read
    p = torch.randn(N, d, generator=g).to(torch.bfloat16)
    h = None if layer == 0 else torch.randn(N, d, generator=g).to(torch.bfloat16)
    return AttnResCarry(p=p, blocks=blocks, h=h)


def make_decode_state(kind: str, shard: ShardSpec, shape: DecodeShape, seed: int = 0,
                      layer: int | None = None, device="cpu") -> DecodeState:
    cfg = shard.cfg
    layer = cfg.representative_layer(kind) if layer is None else layer
    st = DecodeState(shape=shape, carry=make_attn_res_carry(cfg, shape, layer, seed))
    if kind in ("dense", "kda_moe"):
        st.kda = make_kda_state(cfg, shard, shape.batch, seed, layer)
    else:
        st.mla = make_mla_cache(cfg, shape, seed, layer, device=device)
    return st.to(device) if str(device) != "cpu" else st


def unshard_kda_state(states: list[KDAState], head_dim: int) -> KDAState:
    """The TP1 KDA state from all ranks' states (heads and channels concatenated)."""
    conv = [s.conv for s in states]
    P = conv[0].shape[-1] // 3
    full_conv = torch.cat([torch.cat([c[..., i * P:(i + 1) * P] for c in conv], -1) for i in range(3)], -1)
    rec = torch.cat([s.recurrent for s in states], 1)
    for s in states[1:]:
        if not torch.equal(s.slots, states[0].slots):
            raise ValueError("ranks disagree on the slot of a sequence")
    return KDAState(full_conv, rec, states[0].slots.clone())
