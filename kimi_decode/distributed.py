"""Real collectives across processes (`torch.distributed`): TP all-reduce and the DCP merge.

One process per GPU (NCCL) or per CPU worker (gloo, for tests). NVLink
multicast stays off everywhere, also in any subprocess this code starts:
`NCCL_NVLS_ENABLE=0`, `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`, `NVSHMEM_DISABLE_NVLS=1`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .config import KimiK3Config
from .dcp import merge_partials, owned_positions, partial_attention

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def multicast_off_env(env: dict | None = None) -> dict:
    """A copy of `env` (default: this process's) with NVLink multicast switched off, for subprocesses."""
    out = dict(os.environ if env is None else env)
    out.update(MULTICAST_OFF)
    return out


def apply_multicast_off() -> None:
    os.environ.update(MULTICAST_OFF)


apply_multicast_off()


def init(rank: int, world_size: int, init_method: str, backend: str | None = None) -> None:
    """Join the process group (NCCL on GPUs, gloo on CPU)."""
    apply_multicast_off()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def dcp_groups(dcp: int, group=None):
    """This rank's DCP process group: consecutive blocks of `dcp` ranks of the TP group (TP ranks
    k·dcp .. k·dcp + dcp − 1 shard the latent cache of the heads they gather; DCP rank = `ShardSpec.dcp_rank`).
    Every rank must call this (it creates every block's group); None for dcp 1."""
    if dcp == 1:
        return None
    world = dist.get_world_size(group)
    if world % dcp:
        raise ValueError(f"DCP{dcp} does not divide the {world} TP ranks")
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    mine = None
    for k in range(world // dcp):
        g = dist.new_group(ranks[k * dcp:(k + 1) * dcp])
        if dist.get_rank() in ranks[k * dcp:(k + 1) * dcp]:
            mine = g
    return mine


def tp_allreduce(t: torch.Tensor, group=None) -> torch.Tensor:
    """The TP all-reduce of a rank's partial output (sum, in place)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def dcp_local_attention(mqa_q: torch.Tensor, seq_rows: list[torch.Tensor], context_lens: list[int],
                        tokens_per_seq: int, dcp_rank: int, dcp: int, cfg: KimiK3Config
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """This DCP rank's partials over its own token positions: (o [N, H, kv_lora], lse [N, H]).

    `seq_rows[b]` holds only the rows this rank owns (positions τ ≡ dcp_rank mod dcp, in order).
    """
    N, H, _ = mqa_q.shape
    kl = cfg.kv_lora_rank
    o = torch.empty(N, H, kl, dtype=torch.float32, device=mqa_q.device)
    lse = torch.empty(N, H, dtype=torch.float32, device=mqa_q.device)
    for b, rows in enumerate(seq_rows):
        L = context_lens[b] + tokens_per_seq
        pos = owned_positions(L, dcp, dcp_rank, rows.device)
        if pos.numel() != rows.shape[0]:
            raise ValueError(f"sequence {b}: rank {dcp_rank} holds {rows.shape[0]} rows, owns {pos.numel()}")
        for t in range(tokens_per_seq):
            i = b * tokens_per_seq + t
            o[i], lse[i] = partial_attention(mqa_q[i], rows, pos, context_lens[b] + t, cfg.mla_softmax_scale, kl)
    return o, lse


def dcp_merge(o: torch.Tensor, lse: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather every DCP rank's (o, lse) and merge exactly."""
    world = dist.get_world_size(group)
    os_ = [torch.empty_like(o) for _ in range(world)]
    ls_ = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(os_, o.contiguous(), group=group)
    dist.all_gather(ls_, lse.contiguous(), group=group)
    return merge_partials(torch.stack(os_), torch.stack(ls_))
