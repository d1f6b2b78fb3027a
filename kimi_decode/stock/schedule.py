"""The stock-vLLM launch sequence of one layer on one rank (`kimi_k3_layer.md` §9).

`StockLayer(weights, state)` preallocates every buffer and builds the list of
launches; calling it runs one decode step in place (the KDA state, MLA cache and
AttnRes carry are updated as vLLM updates them). The same object runs on CPU
tensors (Triton through its interpreter; for correctness tests) and on a GPU
(one kernel per launch; capturable in a CUDA graph).

Single-GPU all-reduce emulation: each all-reduce is one launch that reads `tp`
buffers of the reduced tensor (the rank's own partial and `tp − 1` stand-ins for
the peers' partials, holding random data) and writes the result. The
coefficients are a runtime tensor [1, 0, …, 0], so every peer buffer is really
read while the result equals the rank's partial — the same value the
single-rank reference produces. This reads the bytes a one-shot all-reduce
reads on a rank (its own and its peers' buffers, here all from local HBM instead
of over NVLink) and writes the same bytes.
"""

from __future__ import annotations

import functools

import torch

from ..config import DecodeShape
from ..state import DecodeState
from ..weights import LayerWeights
from .launch import Executor, Fork, Join, Launch, Step, launches_of

BF16 = 2
FP32 = 4


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@functools.lru_cache(maxsize=None)
def _mm_out_dtype_supported(device) -> bool:
    """Whether torch.mm can write an fp32 result from bf16 inputs in one cuBLAS call (probed once per device)."""
    a = torch.ones(1, 16, dtype=torch.bfloat16, device=device)
    out = torch.empty(1, 16, dtype=torch.float32, device=device)
    try:
        torch.mm(a, a.new_ones(16, 16), out_dtype=torch.float32, out=out)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


class _Ops:
    """Imports of the Triton stand-ins (kept lazy so the inventory works without Triton)."""

    def __init__(self):
        from . import triton_kda, triton_mla, triton_moe, triton_small
        self.small, self.kda, self.mla, self.moe = triton_small, triton_kda, triton_mla, triton_moe


ALLREDUCE_KINDS = ("nccl", "oneshot")
ROW_PAD = 8  # bf16 columns after each partial row of the DCP exchange: its fp32 log-sum-exp, then padding


def _partial_views(buf: torch.Tensor, kl: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs [..., kl] bf16, log-sum-exps [...] fp32) of a DCP exchange buffer [..., kl + ROW_PAD]."""
    return buf[..., :kl], buf[..., kl:].view(torch.float32)[..., 0]


def _check_oneshot(group, device) -> None:
    """Refuse the one-shot all-reduce where it cannot run, before anything is built."""
    if group is None:
        raise ValueError("allreduce='oneshot' is a real collective: it needs group (the TP ranks' process group)")
    if torch.device(device).type != "cuda":
        raise ValueError(f"allreduce='oneshot' reads peers' symmetric memory over NVLink: it needs CUDA tensors, "
                         f"got {device}")
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        raise ValueError(f"this torch ({torch.__version__}) has no torch.ops.symm_mem.one_shot_all_reduce_out")


class StockLayer:
    """One decode step of one layer on one rank, as stock vLLM launches it."""

    def __init__(self, weights: LayerWeights, state: DecodeState, seed: int = 0, build_ops: bool = True,
                 kda_fused: bool | None = None, group=None, dcp_group=None, allreduce: str = "nccl"):
        """kda_fused: None follows vLLM (the fused KDA op only for 12, 24, 48 or 96 local heads).

        group: a `torch.distributed` process group of the TP ranks. With it every all-reduce is a real
        collective (`dist.all_reduce` in place on the partial; the MoE latent all-reduce is then
        followed by a separate RMSNorm launch); without it they are emulated on one GPU.

        dcp_group: with `weights.shard.dcp` > 1 on an MLA layer and a `group`, the process group of this
        rank's DCP ranks (size dcp, this rank at `shard.dcp_rank`): the query all-gather and the
        partials' exchange are real collectives. Without `group` they are emulated (module docstring).

        allreduce: with `group`, "nccl" (`dist.all_reduce` in place) or "oneshot" (each partial is written to
        symmetric memory and `torch.ops.symm_mem.one_shot_all_reduce_out` reads every peer's copy over
        NVLink into a local result, what vLLM's custom all-reduce does for small decode tensors; CUDA only,
        no multicast).
        """
        if allreduce not in ALLREDUCE_KINDS:
            raise ValueError(f"allreduce must be one of {ALLREDUCE_KINDS}, got {allreduce!r}")
        if allreduce == "oneshot":
            _check_oneshot(group, state.carry.p.device)
        self.kda_fused = kda_fused
        self.group = group
        self.dcp_group = dcp_group
        self.allreduce = allreduce
        self._dcp_peers = None  # emulated DCP: the peers' exchange slots (`_dcp_combine_exchange_merge`)
        dcp = weights.shard.dcp
        if dcp_group is not None and group is None:
            raise ValueError("dcp_group needs group (the TP ranks' process group) too")
        if group is not None and dcp > 1 and weights.mla is not None:
            import torch.distributed as dist
            if dcp_group is None:
                raise ValueError(f"DCP{dcp} with real collectives needs dcp_group (the process group of the DCP ranks)")
            if dist.get_world_size(dcp_group) != dcp or dist.get_rank(dcp_group) != weights.shard.dcp_rank:
                raise ValueError(f"dcp_group has size {dist.get_world_size(dcp_group)} and this rank at "
                                 f"{dist.get_rank(dcp_group)}; DCP{dcp} TP rank {weights.shard.rank} needs size {dcp}, "
                                 f"rank {weights.shard.dcp_rank}")
        self.w, self.st = weights, state
        self.cfg, self.kind, self.shard = weights.cfg, weights.kind, weights.shard
        self.shape: DecodeShape = state.shape
        self.N = self.shape.num_tokens
        self.device = state.carry.p.device
        self.ops = _Ops() if build_ops else None
        self._gen = torch.Generator(device="cpu").manual_seed(seed)
        self.steps: list[Step] = []
        self.buffers: dict[str, torch.Tensor] = {}  # named intermediates, for inspection
        self._build()
        self.executor = Executor(self.steps, self.device)
        if self._dcp_peers is not None and self.device.type != "meta":
            self._fill_dcp_peers()

    # ------------------------------------------------------------------ utils
    def _empty(self, *shape, dtype=torch.bfloat16) -> torch.Tensor:
        """Output buffers start as NaN so an unwritten element is visible."""
        t = torch.empty(*shape, dtype=dtype, device=self.device)
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        return t

    def _peer_buffers(self, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[tp, n, width] all-reduce buffers: slot 0 is this rank's partial, the rest random peers."""
        tp = 1 if self.group is not None else self.shard.tp  # real collectives: only this rank's buffer
        bufs = torch.randn(tp, n, width, generator=self._gen).to(torch.bfloat16).to(self.device)
        if self.group is not None and self.allreduce == "oneshot":  # the partial lives in symmetric memory
            import torch.distributed._symmetric_memory as symm_mem

            sym = symm_mem.empty((1, n, width), dtype=torch.bfloat16, device=self.device)
            sym.copy_(bufs)
            symm_mem.rendezvous(sym, self.group.group_name)
            bufs = sym
        coef = torch.zeros(tp, dtype=torch.float32, device=self.device)
        coef[0] = 1.0
        return bufs, coef

    def _gemm(self, label: str, vllm_op: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> Launch:
        """out = x · wᵀ through cuBLAS (torch.mm), bf16 in and out, fp32 accumulation."""
        M, K = x.shape
        Nout = w.shape[0]
        return Launch(label, vllm_op, "cuBLAS", _nbytes(x, w), _nbytes(out), 2 * M * K * Nout,
                      run=lambda: torch.mm(x, w.t(), out=out))

    def __call__(self) -> None:
        self.executor()

    def launches(self) -> list[Launch]:
        return launches_of(self.steps)

    # ------------------------------------------------------------------ build
    def _build(self) -> None:
        nb, bw = self.cfg.attn_res_position(self.w.layer)
        c = self.st.carry
        self.p, self.blocks, self.h_prev = c.p, c.blocks, c.h
        self._attn_res("attn", delta=self.h_prev, n=nb, j=(self.w.layer // self.cfg.attn_res_block_size if bw else -1),
                       w_n=self.w.attn_res.self_attention_res_norm, w_q=self.w.attn_res.self_attention_res_proj,
                       w_o=self.w.attn_res.input_layernorm, p=self.p)
        x_attn = self.y_attn_res
        if self.w.kda is not None:
            a = self._kda(x_attn)
        else:
            a = self._mla(x_attn)
        self.attn_out = a
        if bw:  # the block boundary resets p to the attention output: read it directly, no copy
            p_mlp, delta = a, None
        else:
            p_mlp, delta = self.p, a
        self._attn_res("mlp", delta=delta, n=nb + int(bw), j=-1, w_n=self.w.attn_res.mlp_res_norm,
                       w_q=self.w.attn_res.mlp_res_proj, w_o=self.w.attn_res.post_attention_layernorm, p=p_mlp)
        self.p_out = p_mlp
        x_mlp = self.y_attn_res
        self.h = self._dense(x_mlp) if self.kind == "dense" else self._moe(x_mlp)

    def _attn_res(self, half: str, delta, n: int, j: int, w_n, w_q, w_o, p) -> None:
        N, d = self.N, self.cfg.hidden_size
        y = self._empty(N, d)
        blocks = self.blocks
        eps = self.cfg.rms_norm_eps
        ops = self.ops
        rd = N * d * BF16 * (1 + n + (delta is not None)) + 3 * d * BF16
        wr = N * d * BF16 * (1 + (delta is not None) + (j >= 0))

        def run():
            ops.small.attn_res(y, p, delta, blocks, n, j, w_n, w_q, w_o, eps, eps)

        self.steps.append(Launch(f"{half}.attn_res", "_attn_res_kernel (Triton)", "Triton", rd, wr, 0, run=run))
        self.y_attn_res = y

    # ------------------------------------------------------------------ KDA
    def _kda(self, x: torch.Tensor) -> torch.Tensor:
        w, st, cfg, N, ops = self.w.kda, self.st.kda, self.cfg, self.N, self.ops
        P, H, f = w.proj, w.heads, w.f_rank
        T, B = self.shape.tokens_per_seq, self.shape.batch
        sec = w.in_proj_sections()
        z = self._empty(N, w.in_proj.shape[0])
        self.steps.append(self._gemm("kda.in_proj", "in_proj_qkvgfab GEMM", x, w.in_proj, z))
        g_raw = self._empty(N, P)
        self.steps.append(self._gemm("kda.f_b", "f_b_proj GEMM (strided f_a view)", z[:, sec["f_a"]], w.f_b, g_raw))
        y = self._empty(N, P)
        o_norm = w.o_norm.float()
        conv_w, A_log, dt_bias = w.conv1d, w.A_log, w.dt_bias
        state_bytes = _nbytes(st.conv[0], st.recurrent[0]) * B
        args = dict(lower_bound=cfg.gate_lower_bound, qk_eps=cfg.kda_qk_norm_eps, f_rank=f)
        fused = H in (12, 24, 48, 96) if self.kda_fused is None else self.kda_fused
        if fused:
            ws = ops.kda.make_fused_workspace(B, H, self.device) if ops else None
            args.update(o_eps=cfg.kda_o_norm_eps, workspace=ws)
            rd = N * (4 * P + H) * BF16 + N * P * BF16 + _nbytes(conv_w, A_log, dt_bias, o_norm) + state_bytes
            self.steps.append(Launch(
                "kda.fused_decode", "torch.ops._C.fused_kda_decode", "Triton", rd, N * P * BF16 + state_bytes,
                0, run=lambda: ops.kda.fused_kda_decode(y, z, g_raw, conv_w, A_log, dt_bias, o_norm, st.conv,
                                                          st.recurrent, st.slots, T, H, **args)))
        else:
            # TP16: the fused op does not take 6 heads; vLLM runs four launches
            u = self._empty(N, 3 * P)
            o = self._empty(N, P)
            core = self._empty(N, P)
            conv_bytes = _nbytes(st.conv[0]) * B
            rec_bytes = _nbytes(st.recurrent[0]) * B
            self.steps.append(Launch(
                "kda.conv1d_update", "causal_conv1d_update (Triton)", "Triton",
                N * 3 * P * BF16 + _nbytes(conv_w) + conv_bytes, N * 3 * P * BF16 + conv_bytes, 0,
                run=lambda: ops.kda.causal_conv1d_update(u, z, conv_w, st.conv, st.slots, T)))
            self.steps.append(Launch(
                "kda.recurrent", "fused_recurrent_kda_packed_decode (Triton)", "Triton",
                N * 3 * P * BF16 + N * P * BF16 + N * H * BF16 + _nbytes(A_log, dt_bias) + rec_bytes,
                N * P * BF16 + rec_bytes, 0,
                run=lambda: ops.kda.fused_recurrent_kda(o, u, g_raw, z, A_log, dt_bias, st.recurrent, st.slots,
                                                        T, H, **args)))
            self.steps.append(Launch(
                "kda.copy_core_attn_out", "copy into core_attn_out", "torch", N * P * BF16, N * P * BF16, 0,
                run=lambda: core.copy_(o)))
            self.steps.append(Launch(
                "kda.rmsnorm_gated", "FusedRMSNormGated (Triton)", "Triton",
                2 * N * P * BF16 + _nbytes(o_norm), N * P * BF16, 0,
                run=lambda: ops.kda.rmsnorm_gated(y, core, z, o_norm, H, cfg.kda_o_norm_eps)))
        return self._o_proj_allreduce("kda", y, w.o_proj)

    def _o_proj_allreduce(self, prefix: str, y: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
        N, d = self.N, self.cfg.hidden_size
        bufs, coef = self._peer_buffers(N, d)
        self.steps.append(self._gemm(f"{prefix}.o_proj", "o_proj GEMM (RowParallel)", y, o_proj, bufs[0]))
        return self._allreduce(f"{prefix}.allreduce", bufs, coef)

    def _collective(self, label: str, vllm_op: str, buf: torch.Tensor) -> tuple[Launch, torch.Tensor]:
        """A real all-reduce of `buf`: (its launch, the tensor that holds the sum afterwards)."""
        import torch.distributed as dist

        group, n = self.group, _nbytes(buf)
        if self.allreduce == "oneshot":
            out = self._empty(*buf.shape, dtype=buf.dtype)
            name, world = group.group_name, dist.get_world_size(group)
            op = torch.ops.symm_mem.one_shot_all_reduce_out
            return Launch(label, vllm_op.replace("real collective", "one-shot over peer memory"), "torch symm_mem",
                          n * world, n, 0, run=lambda: op(buf, "sum", name, out)), out
        return Launch(label, vllm_op, "torch.distributed", n, n, 0,
                      run=lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)), buf

    def _allreduce(self, label: str, bufs: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            launch, out = self._collective(label, "all-reduce (real collective)", bufs[0])
            self.steps.append(launch)
            return out
        tp, N, width = bufs.shape
        out = self._empty(N, width)
        ops = self.ops
        self.steps.append(Launch(label, "custom one-shot all-reduce (emulated on one GPU)", "Triton",
                                 _nbytes(bufs, coef), _nbytes(out), 0,
                                 run=lambda: ops.small.allreduce_emulated(out, bufs, coef)))
        return out

    # ------------------------------------------------------------------ MLA
    def _mla(self, x: torch.Tensor) -> torch.Tensor:
        w, cache, cfg, N, ops = self.w.mla, self.st.mla, self.cfg, self.N, self.ops
        H, ql, kl, r = w.heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        T, B = self.shape.tokens_per_seq, self.shape.batch
        V, nope, qk = w.v_dim, w.nope_dim, cfg.mla_qk_head_dim
        g = self._empty(N, H * V)
        self.steps.append(Fork([self._gemm("mla.g_proj", "g_proj GEMM (aux stream)", x, w.g_proj, g)]))
        a = self._empty(N, ql + kl + r)
        self.steps.append(self._gemm("mla.fused_qkv_a", "fused_qkv_a GEMM", x, w.fused_qkv_a, a))
        qc, c = self._empty(N, ql), self._empty(N, kl)
        q_a_norm, kv_a_norm = w.q_a_norm, w.kv_a_norm
        self.steps.append(Launch("mla.q_kv_rmsnorm", "fused_q_kv_rmsnorm", "Triton",
                                 N * (ql + kl) * BF16 + (ql + kl) * BF16, N * (ql + kl) * BF16, 0,
                                 run=lambda: ops.small.fused_q_kv_rmsnorm(qc, c, a[:, :ql], a[:, ql:ql + kl],
                                                                          q_a_norm, kv_a_norm, cfg.rms_norm_eps)))
        q = self._empty(N, H * qk)
        self.steps.append(self._gemm("mla.q_b", "q_b GEMM", qc, w.q_b, q))
        q3 = q.view(N, H, qk)
        q_nope_t = q3[..., :nope].transpose(0, 1)  # [H, N, nope]
        q_lat = self._empty(H, N, kl)
        W_UK_T, W_UV = w.W_UK_T, w.W_UV
        self.steps.append(Launch("mla.bmm_w_uk", "bmm W_UK_T", "cuBLAS", N * H * nope * BF16 + _nbytes(W_UK_T),
                                 _nbytes(q_lat), 2 * N * H * nope * kl,
                                 run=lambda: torch.bmm(q_nope_t, W_UK_T, out=q_lat)))
        mqa_q = self._empty(N, H, kl + r)
        dcp = self.shard.dcp
        if dcp > 1:  # this rank's share of the latent cache: the positions τ ≡ rank (mod dcp)
            from ..dcp import shard_cache
            cache = shard_cache(cache, self.shape.context_per_seq, T, dcp, self.shard.dcp_rank)
        self.mla_cache = cache
        slot_mapping = cache.slot_mapping(T)
        k_pe = a[:, ql + kl:]
        row = (kl + r) * BF16
        self.steps.append(Launch("mla.q_concat_cache_insert", "fused_mla_decode_q_concat_kv_cache_insert", "Triton",
                                 _nbytes(q_lat) + N * H * r * BF16 + N * row + _nbytes(slot_mapping),
                                 _nbytes(mqa_q) + N * row, 0,
                                 run=lambda: ops.mla.mla_q_concat_cache_insert(mqa_q, q_lat, q3[..., nope:], cache.kv,
                                                                               c, k_pe, slot_mapping)))
        self._mla_step = dict(mqa_q=mqa_q, c=c, k_pe=k_pe)
        q_attn = self._dcp_gather_queries(mqa_q) if dcp > 1 else mqa_q
        Hq = dcp * H  # the heads this rank attends for: every DCP rank's
        splits = (ops.mla.choose_num_splits(B, T, self.shape.max_context, heads=Hq, dcp=dcp) if ops else 1)
        o_part, lse = ops.mla.split_kv_scratch(N, Hq, splits, self.device, d_lat=kl) if ops else (None, None)
        block_table = cache.block_table
        ctx = cache.context_lens
        dr = self.shard.dcp_rank
        kv_rows = sum(max(0, -(-(c_ + T - dr) // dcp)) for c_ in self.shape.context_per_seq)
        part_bytes = (N * Hq * splits * (kl + 1)) * FP32
        scale = cfg.mla_softmax_scale
        self.steps.append(Launch("mla.decode", "MLA decode attention, split-KV (FlashMLA / FA-MLA)", "Triton",
                                 _nbytes(q_attn) + kv_rows * row + _nbytes(block_table, ctx), part_bytes,
                                 sum(2 * Hq * max(0, (c_ + t - dr) // dcp + 1) * (2 * kl + r)
                                     for c_ in self.shape.context_per_seq for t in range(T) if c_ + t >= dr),
                                 run=lambda: ops.mla.mla_decode_split_kv(o_part, lse, q_attn, cache.kv, block_table,
                                                                         ctx, T, scale, splits, dcp=dcp, dcp_rank=dr)))
        o_lat = self._empty(H, N, kl)
        if dcp == 1:
            self.steps.append(Launch("mla.decode_combine", "split-KV combine", "Triton", part_bytes, _nbytes(o_lat), 0,
                                     run=lambda: ops.mla.mla_decode_combine(o_lat, o_part, lse)))
        else:
            self._dcp_combine_exchange_merge(o_lat, o_part, lse, part_bytes)
        o = self._empty(H, N, V)
        self.steps.append(Launch("mla.bmm_w_uv", "bmm W_UV", "cuBLAS", _nbytes(o_lat) + H * kl * V * BF16,
                                 _nbytes(o), 2 * N * H * kl * V, run=lambda: torch.bmm(o_lat, W_UV, out=o)))
        self.steps.append(Join("g_proj"))
        og = self._empty(N, H * V)
        self.steps.append(Launch("mla.gate_mul", "sigmoid output-gate multiply (torch.compile'd)", "Triton",
                                 2 * N * H * V * BF16, N * H * V * BF16, 0,
                                 run=lambda: ops.small.sigmoid_gate_mul(og, o, g)))
        return self._o_proj_allreduce("mla", og, w.o_proj)

    # ------------------------------------------------------------------ MLA with DCP
    def _dcp_gather_queries(self, mqa_q: torch.Tensor) -> torch.Tensor:
        """The all-gather of every DCP rank's queries [dcp, N, H, 576] (slot = DCP rank), as vLLM gathers
        the decode queries over the DCP group before attention."""
        import torch.distributed as dist

        dcp, dr = self.shard.dcp, self.shard.dcp_rank
        q_all = self._empty(dcp, *mqa_q.shape)
        if self.group is not None:
            g = self.dcp_group
            self.steps.append(Launch("mla.dcp_q_allgather", "DCP all-gather of the decode queries (real collective)",
                                     "torch.distributed", _nbytes(mqa_q), _nbytes(q_all), 0,
                                     run=lambda: dist.all_gather_into_tensor(q_all.view(-1, *mqa_q.shape[1:]),
                                                                             mqa_q, group=g)))
            return q_all
        # emulated: the peers' queries are random stand-ins (their outputs go back to them, unread here)
        peers = torch.randn(dcp - 1, *mqa_q.shape, generator=self._gen).to(torch.bfloat16).to(self.device)
        parts = [peers[:dr], mqa_q[None], peers[dr:]]
        self.steps.append(Launch("mla.dcp_q_allgather", "DCP all-gather of the decode queries (emulated on one GPU)",
                                 "torch", _nbytes(q_all), _nbytes(q_all), 0,
                                 run=lambda: torch.cat(parts, out=q_all)))
        return q_all

    def _dcp_combine_exchange_merge(self, o_lat, o_part, lse, part_bytes: int) -> None:
        """Combine the splits into every gathered head's partial and log-sum-exp, exchange them so each
        rank holds all ranks' partials for its own heads (one all-to-all: the bytes of vLLM's reduce-scatter
        of the outputs plus its all-gather of the log-sum-exps), and merge them exactly.

        The exchange buffer is bf16 [dcp, H, N, kl + 8]: slot s holds the partials for DCP rank s's heads,
        each row the bf16 output, its fp32 log-sum-exp in bf16 columns kl, kl + 1, and padding to a 16-byte
        row (1040 bytes at kl = 512) so the combine's stores and the merge's loads stay vectorised."""
        import torch.distributed as dist

        ops = self.ops
        dcp, dr = self.shard.dcp, self.shard.dcp_rank
        H, N, kl = o_lat.shape
        row = kl + ROW_PAD
        send = self._empty(dcp, H, N, row)
        recv = self._empty(dcp, H, N, row)
        o_send, lse_send = _partial_views(send.view(dcp * H, N, row), kl)  # all gathered heads, for the combine
        self.steps.append(Launch("mla.decode_combine", "split-KV combine with log-sum-exp (DCP partials)", "Triton",
                                 part_bytes, _nbytes(send), 0,
                                 run=lambda: ops.mla.mla_decode_combine(o_send, o_part, lse, lse_out=lse_send)))
        if self.group is not None:
            g = self.dcp_group
            self.steps.append(Launch("mla.dcp_exchange", "DCP all-to-all of the partials and log-sum-exps "
                                     "(real collective)", "torch.distributed", _nbytes(send), _nbytes(recv), 0,
                                     run=lambda: dist.all_to_all_single(recv, send, group=g)))
        else:
            # emulated: the peers' partials for this rank's heads, filled once the step has run
            # (`_fill_dcp_peers`), so the merged result is the whole attention and checkable
            peers = self._empty(dcp - 1, H, N, row)
            parts = [peers[:dr], send[dr:dr + 1], peers[dr:]]
            self.steps.append(Launch("mla.dcp_exchange", "DCP all-to-all of the partials and log-sum-exps "
                                     "(emulated on one GPU)", "torch", _nbytes(recv), _nbytes(recv), 0,
                                     run=lambda: torch.cat(parts, out=recv)))
            self._dcp_peers = peers
        o_ranks, lse_ranks = _partial_views(recv, kl)
        self.steps.append(Launch("mla.dcp_merge", "DCP log-sum-exp merge of the ranks' partials", "Triton",
                                 _nbytes(recv), _nbytes(o_lat), 0,
                                 run=lambda: ops.mla.mla_dcp_merge(o_lat, o_ranks, lse_ranks)))
        self.buffers.update(dcp_send=send, dcp_recv=recv)

    def _fill_dcp_peers(self) -> None:
        """Emulated DCP: run the step's launches up to the query / cache insert once, then compute what
        each peer DCP rank would send this rank (its partial attention for this rank's heads over the
        positions it holds, in the reference's fp32 math from this step's queries and cache rows) into the
        peers' exchange slots. The AttnRes carry those launches update in place is restored after."""
        from ..dcp import owned_positions, partial_attention
        from .launch import Fork

        carry = self.st.carry
        saved = [(t, t.clone()) for t in (carry.p, carry.blocks, carry.h) if t is not None]
        for step in self.steps:
            for launch in (step.launches if isinstance(step, Fork) else [step] if isinstance(step, Launch) else []):
                launch.run()
            if isinstance(step, Launch) and step.label == "mla.q_concat_cache_insert":
                break
        for t, copy in saved:
            t.copy_(copy)
        cache = self.st.mla  # the whole cache: every position's rows
        dcp, dr = self.shard.dcp, self.shard.dcp_rank
        T, kl = self.shape.tokens_per_seq, self.cfg.kv_lora_rank
        m = self._mla_step
        new_rows = torch.cat([m["c"], m["k_pe"]], -1)  # the step's rows [N, 576]
        peers = self._dcp_peers
        o_v, lse_v = _partial_views(peers, kl)
        for b, ctx in enumerate(self.shape.context_per_seq):
            rows = torch.cat([cache.gather(b, ctx), new_rows[b * T:(b + 1) * T]])
            for s in range(dcp):
                if s == dr:
                    continue
                j = s if s < dr else s - 1
                pos = owned_positions(ctx + T, dcp, s, device=rows.device)
                mine = rows[pos]  # rank s's rows, gathered once for the step's tokens
                for t in range(T):
                    i = b * T + t
                    o, lse = partial_attention(m["mqa_q"][i], mine, pos, ctx + t, self.cfg.mla_softmax_scale, kl)
                    o_v[j, :, i] = o.to(o_v.dtype)
                    lse_v[j, :, i] = lse

    # ------------------------------------------------------------------ MoE
    def _moe(self, x: torch.Tensor) -> torch.Tensor:
        w, cfg, N, ops = self.w.moe, self.cfg, self.N, self.ops
        d, E, k, L = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token, cfg.routed_expert_hidden_size
        I, S = w.w1_packed.shape[1], w.shared_down.shape[1]
        beta, beta_lin = cfg.situ_beta, cfg.situ_linear_beta
        zl = self._empty(N, L)
        self.steps.append(Fork([self._gemm("moe.down_proj", "routed_expert_down_proj GEMM (aux stream)",
                                           x, w.down, zl)]))
        logits = self._empty(N, E, dtype=torch.float32)
        gate = w.gate
        if self.device.type == "cuda" and _mm_out_dtype_supported(self.device):
            def router():  # one cuBLAS GEMM with bf16 inputs and fp32 output
                torch.mm(x, gate.t(), out_dtype=torch.float32, out=logits)
        elif self.device.type == "cuda":
            raise RuntimeError("this torch has no torch.mm(..., out_dtype=torch.float32, out=...) on CUDA: "
                               "the router GEMM (bf16 -> fp32 in one launch) needs torch >= 2.9")
        else:
            def router():
                torch.mm(x.float(), gate.float().t(), out=logits)
        self.steps.append(Launch("moe.router", "router GEMM bf16→fp32 (router_gemm_bf16_fp32)", "cuBLAS",
                                 _nbytes(x, gate), _nbytes(logits), 2 * N * d * E, run=router))
        ids = torch.zeros(N, k, dtype=torch.int32, device=self.device)
        wts = self._empty(N, k, dtype=torch.float32)
        bias = w.e_score_correction_bias
        self.steps.append(Launch("moe.grouped_topk", "grouped_topk (sigmoid, noaux_tc)", "Triton",
                                 _nbytes(logits, bias), _nbytes(ids, wts), 0,
                                 run=lambda: ops.small.grouped_topk(ids, wts, logits, bias, cfg.moe_renormalize,
                                                                    cfg.routed_scaling_factor)))
        # shared experts
        sh13 = self._empty(N, 2 * S)
        self.steps.append(self._gemm("moe.shared_gate_up", "shared_experts gate_up GEMM", x, w.shared_gate_up, sh13))
        sha = self._empty(N, S)
        self.steps.append(Launch("moe.shared_situ", "situ_and_mul", "Triton", _nbytes(sh13), _nbytes(sha), 0,
                                 run=lambda: ops.small.situ_and_mul(sha, sh13, beta, beta_lin)))
        sh_bufs, sh_coef = self._peer_buffers(N, d)
        self.steps.append(self._gemm("moe.shared_down", "shared_experts down GEMM (reduce deferred)",
                                     sha, w.shared_down, sh_bufs[0]))
        self.steps.append(Join("down_proj"))
        # routed experts (Marlin W4A16 stand-in)
        block_m = ops.moe.choose_block_m(N, k, E) if ops else 16
        sorted_ids, expert_ids, ntpp = ops.moe.align_buffers(N, k, E, block_m, self.device) if ops else (None,) * 3
        self.steps.append(Launch("moe.align_block_size", "moe_align_block_size", "Triton", _nbytes(ids),
                                 0 if sorted_ids is None else _nbytes(sorted_ids, expert_ids, ntpp), 0,
                                 run=lambda: ops.moe.moe_align_block_size(sorted_ids, expert_ids, ntpp, ids,
                                                                          block_m, E)))
        self.w13_packed = torch.cat([w.w1_packed, w.w3_packed], 1)  # Marlin repacks w13 once at load
        self.w13_scale = torch.cat([w.w1_scale, w.w3_scale], 1)
        w13p, w13s, w2p, w2s = self.w13_packed, self.w13_scale, w.w2_packed, w.w2_scale
        from ..byte_counts import expected_active_experts
        active = expected_active_experts(cfg, N)
        e13 = (_nbytes(w13p) + _nbytes(w13s)) // E
        e2 = (_nbytes(w2p) + _nbytes(w2s)) // E
        h13 = self._empty(N * k, 2 * I)
        self.steps.append(Launch("moe.experts_gemm1", "Marlin MoE GEMM1 (w13, MXFP4 W4A16)", "Triton",
                                 active * e13 + _nbytes(zl), _nbytes(h13), 2 * N * k * L * 2 * I,
                                 run=lambda: ops.moe.mxfp4_moe_gemm1(h13, zl, w13p, w13s, sorted_ids, expert_ids,
                                                                     ntpp, k, block_m)))
        act = self._empty(N * k, I)
        self.steps.append(Launch("moe.experts_situ", "situ_and_mul", "Triton", _nbytes(h13), _nbytes(act), 0,
                                 run=lambda: ops.small.situ_and_mul(act, h13, beta, beta_lin)))
        y = self._empty(N * k, L)
        self.steps.append(Launch("moe.experts_gemm2", "Marlin MoE GEMM2 (w2 × top-k weights, MXFP4 W4A16)", "Triton",
                                 active * e2 + _nbytes(act, wts), _nbytes(y), 2 * N * k * I * L,
                                 run=lambda: ops.moe.mxfp4_moe_gemm2(y, act, w2p, w2s, wts, sorted_ids, expert_ids,
                                                                     ntpp, block_m)))
        lat_bufs, lat_coef = self._peer_buffers(N, L)
        lat0 = lat_bufs[0]
        self.steps.append(Launch("moe.topk_sum", "moe top-k sum", "Triton", _nbytes(y), _nbytes(lat0), 0,
                                 run=lambda: ops.moe.moe_topk_sum(lat0, y)))
        rh = self._empty(N, L)
        norm = w.norm
        rms_in = lat_bufs
        if self.group is not None:  # a real all-reduce, then the RMSNorm (the reduce of one buffer)
            launch, reduced = self._collective("moe.latent_allreduce", "latent all-reduce (real collective)", lat0)
            self.steps.append(launch)
            rms_in = reduced.unsqueeze(0)
            rms_label, rms_op = "moe.latent_rmsnorm", "RMSNorm of the reduced latent"
        else:
            rms_label, rms_op = "moe.allreduce_rmsnorm", "fused all-reduce + RMSNorm (flashinfer, emulated)"
        self.steps.append(Launch(rms_label, rms_op,
                                 "Triton", _nbytes(rms_in, lat_coef, norm), _nbytes(rh), 0,
                                 run=lambda: ops.small.allreduce_rmsnorm_emulated(rh, rms_in, lat_coef, norm,
                                                                                  cfg.rms_norm_eps)))
        if self.group is not None:
            launch, sh_out = self._collective("moe.shared_allreduce",
                                              "shared-expert all-reduce (aux stream, real collective)", sh_bufs[0])
            self.steps.append(Fork([launch]))
        else:
            sh_out = self._empty(N, d)
            self.steps.append(Fork([Launch("moe.shared_allreduce", "shared-expert all-reduce (aux stream, emulated)",
                                           "Triton", _nbytes(sh_bufs, sh_coef), _nbytes(sh_out), 0,
                                           run=lambda: ops.small.allreduce_emulated(sh_out, sh_bufs, sh_coef))]))
        routed = self._empty(N, d)
        self.steps.append(self._gemm("moe.up_proj", "routed_expert_up_proj GEMM", rh, w.up, routed))
        self.steps.append(Join("shared all-reduce"))
        self.steps.append(Launch("moe.add", "add_ (routed + shared)", "torch", 2 * N * d * BF16, N * d * BF16, 0,
                                 run=lambda: routed.add_(sh_out)))
        self.routing = (ids, wts)
        self.buffers.update(moe_z=zl, logits=logits, topk_ids=ids, topk_weights=wts, sorted_token_ids=sorted_ids,
                            expert_ids=expert_ids, num_tokens_post_pad=ntpp, experts_h13=h13, experts_act=act,
                            experts_y=y, latent_partial=lat0, latent_normed=rh, shared_partial=sh_bufs[0],
                            shared=sh_out, routed=routed)
        return routed

    # ------------------------------------------------------------------ dense
    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        w, cfg, N, ops = self.w.dense, self.cfg, self.N, self.ops
        I = w.down.shape[1]
        gu = self._empty(N, 2 * I)
        self.steps.append(self._gemm("dense.gate_up", "gate_up GEMM", x, w.gate_up, gu))
        a = self._empty(N, I)
        self.steps.append(Launch("dense.situ", "situ_and_mul", "Triton", _nbytes(gu), _nbytes(a), 0,
                                 run=lambda: ops.small.situ_and_mul(a, gu, cfg.situ_beta, cfg.situ_linear_beta)))
        bufs, coef = self._peer_buffers(N, cfg.hidden_size)
        self.steps.append(self._gemm("dense.down", "down GEMM (RowParallel)", a, w.down, bufs[0]))
        return self._allreduce("dense.allreduce", bufs, coef)


class StockMoEHalf(StockLayer):
    """Only the MoE half (§6.3, 15 launches) of a layer, from its input x [N, d] (the AttnRes + RMSNorm
    output): the baseline of the fused MoE. Same launches, buffers and all-reduce emulation as the
    MoE part of `StockLayer`."""

    def __init__(self, weights: LayerWeights, x: torch.Tensor, seed: int = 0, group=None):
        if weights.moe is None:
            raise ValueError(f"StockMoEHalf needs an MoE layer, got {weights.kind!r}")
        self.kda_fused, self.group, self.dcp_group, self.allreduce = None, group, None, "nccl"
        self.w, self.st = weights, None
        self.cfg, self.kind, self.shard = weights.cfg, weights.kind, weights.shard
        self.N = x.shape[0]
        self.device = x.device
        self.ops = _Ops()
        self._gen = torch.Generator(device="cpu").manual_seed(seed)
        self.steps: list[Step] = []
        self.buffers: dict[str, torch.Tensor] = {}
        self.x = x
        self.h = self._moe(x)
        self.executor = Executor(self.steps, self.device)

