"""Decode context parallelism (DCP) for the MLA layers, in the reference's fp32 math.

With DCP size D, the latent KV cache of every sequence is sharded by token
position: position τ lives on DCP rank τ mod D (interleaved, so every rank holds
an equal share of every sequence however long). Each rank attends over its own
rows only and returns, per head, its normalised partial output and the
log-sum-exp of its scores; the exact result is the LSE-weighted merge

    o = Σ_r exp(lse_r − lse_max) · o_r / Σ_r exp(lse_r − lse_max).

KDA layers keep their per-sequence recurrent state; DCP does not apply to them.

`mla_attention_dcp` simulates the D ranks on one device (a loop);
`merge_partials` is the merge, shared with the `torch.distributed` path, where
each process computes its partial and the merge runs on an all-gather.
"""

from __future__ import annotations

import torch

from .config import KimiK3Config
from .reference.precision import f32


def owned_positions(length: int, dcp: int, rank: int, device=None) -> torch.Tensor:
    """Token positions 0..length-1 that DCP rank `rank` holds (τ mod dcp == rank)."""
    if not 0 <= rank < dcp:
        raise ValueError(f"rank {rank} outside 0..{dcp - 1}")
    if rank >= length:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.arange(rank, length, dcp, device=device)


def shard_cache(cache, context_per_seq, tokens_per_seq: int, dcp: int, rank: int):
    """DCP rank `rank`'s share of a full paged latent cache: a new `MLAKVCache` holding the positions
    τ ≡ rank (mod dcp) of each sequence's context at local rows τ // dcp (copied from `cache`), with
    room for the step's tokens (written by the cache insert, which skips the positions other ranks hold).

    `context_per_seq` are Python ints (the shape's contexts), so sizes are known on the meta device too.
    """
    import dataclasses

    if not 0 <= rank < dcp:
        raise ValueError(f"DCP rank {rank} outside 0..{dcp - 1}")
    if cache.dcp != 1:
        raise ValueError(f"shard_cache takes a full cache, got one already sharded (DCP{cache.dcp})")
    bs, dev = cache.block_size, cache.kv.device
    B = len(context_per_seq)
    # local rows: up to the last step token's local index (a position other ranks hold maps there too)
    need = [-(-((c + tokens_per_seq - 1) // dcp + 1) // bs) for c in context_per_seq]
    total, width = sum(need), max(need)
    table = torch.zeros(B, width, dtype=torch.int64)
    off = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.arange(off, off + n)
        off += n
    kv = torch.empty(total, bs, cache.kv.shape[-1], dtype=cache.kv.dtype, device=dev)
    if dev.type != "meta":
        kv.fill_(float("nan"))  # rows no position maps to stay NaN: a read of one would show
        flat = kv.view(-1, kv.shape[-1])
        for b, c in enumerate(context_per_seq):
            pos = owned_positions(c, dcp, rank, device=dev)  # this rank's context positions
            if pos.numel():
                src = cache.block_table[b].to(dev)[pos // bs] * bs + pos % bs
                local = pos // dcp
                flat[table[b].to(dev)[local // bs] * bs + local % bs] = cache.kv.view(-1, kv.shape[-1])[src]
    return dataclasses.replace(cache, kv=kv, block_table=table.to(cache.block_table.device), dcp=dcp, dcp_rank=rank)


def partial_attention(q: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, limit: int,
                      scale: float, kv_lora: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's share of MLA decode attention for one token.

    q [H, 576] (absorbed query), rows [n, 576] the rank's cache rows at `positions`; only positions
    <= `limit` are attended. Returns (o [H, kv_lora] normalised within the shard, lse [H]); a shard
    with no visible row gives o = 0 and lse = -inf.
    """
    H = q.shape[0]
    visible = positions <= limit
    if not bool(visible.any()):
        return (torch.zeros(H, kv_lora, dtype=torch.float32, device=q.device),
                torch.full((H,), float("-inf"), dtype=torch.float32, device=q.device))
    r = f32(rows[visible])
    s = scale * (f32(q) @ r.t())  # [H, n]
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ r[:, :kv_lora]
    return o, lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Exact merge of DCP partials: outs [D, ..., C], lses [D, ...] -> [..., C]."""
    m = lses.max(0).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m)  # [D, ...]; exp(-inf) = 0 for empty shards
    return (w[..., None] * outs).sum(0) / w.sum(0)[..., None]


def mla_attention_dcp(mqa_q: torch.Tensor, seq_rows: list[torch.Tensor], context_lens: list[int],
                      tokens_per_seq: int, dcp: int, cfg: KimiK3Config, storage=None) -> torch.Tensor:
    """Eq. 6 of §5.2 over D simulated DCP ranks. mqa_q [N, H, 576]; seq_rows[b] = the sequence's rows
    (context + the step's tokens, position order). Returns o_lat [N, H, kv_lora] (fp32).

    storage: `Storage.BF16` rounds each rank's partial output as the ranks exchange it (bf16, with fp32
    log-sum-exps, as vLLM's DCP does)."""
    N, H, _ = mqa_q.shape
    kl = cfg.kv_lora_rank
    out = torch.empty(N, H, kl, dtype=torch.float32, device=mqa_q.device)
    for b, rows in enumerate(seq_rows):
        L = rows.shape[0]
        shards = [owned_positions(L, dcp, r, rows.device) for r in range(dcp)]
        for t in range(tokens_per_seq):
            i = b * tokens_per_seq + t
            limit = context_lens[b] + t
            parts = [partial_attention(mqa_q[i], rows[pos], pos, limit, cfg.mla_softmax_scale, kl)
                     for pos in shards]
            o = torch.stack([p[0] for p in parts])
            out[i] = merge_partials(o if storage is None else storage.store(o), torch.stack([p[1] for p in parts]))
    return out
