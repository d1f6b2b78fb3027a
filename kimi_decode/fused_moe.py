"""The fused MoE half of a layer (four or five CuTe DSL launches, `kernels/moe.py`) as an executor.

`FusedMoE(weights, x)` validates everything before any launch (layer kind,
TP shape, batch, dtype, device, MXFP4 scale range), prepares the fused weight
layout once (the router, latent down and shared gate/up rows concatenated into
one [E + L + 2S, d] matrix, since all three read x), preallocates NaN-poisoned
outputs, and runs one step per call. `launches()` lists the launches (four; five
when routing gets its own launch above 8 tokens) with the bytes each must move,
like the stock schedule's inventory.

The stock schedule's MoE half (`stock.schedule.StockMoEHalf`) is the baseline:
same input, same weights, same single-GPU all-reduce emulation.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import ShardSpec
from .kernels.gemm import MIN_M as GEMM_MIN_TOKENS  # 'fgemm' / 'tgemm': from here the front / tail may run as the GEMM
from .stock.launch import Launch
from .weights import LayerWeights

MOE_KINDS = ("kda_moe", "mla_moe")
EXPERT_KERNELS = ("pipe", "direct", "pipe-up")
ROUTE_IN_FRONT_MAX = 8  # tokens routed by the front kernel's last router CTA (4 warps); more: a fifth launch
PDL_MAX_TOKENS = 1  # programmatic dependent launch up to this many tokens per step (FusedMoE's pdl=None)


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def check_moe_input(weights: LayerWeights, x: torch.Tensor) -> None:
    """Refuse, before any launch, what the fused MoE does not support (clear messages)."""
    from .kernels import moe as km
    from .support import UnsupportedConfiguration, check_supported

    if weights.kind not in MOE_KINDS or weights.moe is None:
        raise UnsupportedConfiguration("layer for the fused MoE", weights.kind, "MoE layers: " + ", ".join(MOE_KINDS))
    shard: ShardSpec = weights.shard
    check_supported(layer=weights.kind, shard=shard)
    ref = km.shapes_for_tp(shard.tp)
    w = weights.moe
    if (w.w1_packed.shape[1], w.shared_down.shape[1]) != (ref.inter, ref.shared) or w.gate.shape != (km.E, km.D):
        raise UnsupportedConfiguration(
            "MoE weight shapes", f"experts {tuple(w.w1_packed.shape)}, shared {w.shared_down.shape[1]}",
            f"Kimi K3 at TP{shard.tp}: experts ({km.E}, {ref.inter}, {km.L // 2}), shared {ref.shared}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != km.D:
        raise ValueError(f"x must be [tokens, {km.D}], got {tuple(getattr(x, 'shape', ()))}")
    if not 1 <= x.shape[0] <= km.MAX_M:
        raise UnsupportedConfiguration("tokens per step (batch x tokens per sequence) in the fused MoE", x.shape[0],
                                       f"1..{km.MAX_M}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    if x.device.type != "cuda":
        raise ValueError(f"the fused MoE runs on a CUDA device, got x on {x.device}")
    for name, t in w.tensors().items():
        if t.device != x.device:
            raise ValueError(f"weight {name} is on {t.device}, x on {x.device}: put both on one device")
    km.check_scales(w.w1_scale, w.w3_scale, w.w2_scale)


def check_flag_handshake(up_key, down_key) -> None:
    """'dflag' is one option of both pipelined expert kernels: moe_up's CTAs count themselves done and moe_down
    waits for as many as its own launch has. Refuses (ValueError) keys that disagree or differ in CTA count."""
    from .kernels import moe_pipe as kp

    up = isinstance(up_key, kp.MoEUpPipeKey) and up_key.done_flag != 0
    down = isinstance(down_key, kp.MoEDownPipeKey) and down_key.flag_wait
    if up != down:
        raise ValueError("dflag needs both pipelined expert kernels: moe_up counting its CTAs done and moe_down "
                         f"waiting on that count (got moe_up {type(up_key).__name__} done_flag={up}, moe_down "
                         f"{type(down_key).__name__} flag_wait={down})")
    if up and up_key.ctas != down_key.ctas:
        raise ValueError(f"dflag: moe_down waits for as many moe_up CTAs as it has itself ({down_key.ctas}), "
                         f"but moe_up launches {up_key.ctas}")
    early = isinstance(up_key, kp.MoEUpPipeKey) and up_key.route_early > 0
    reset = isinstance(down_key, kp.MoEDownPipeKey) and down_key.route_reset
    if early != reset:  # a flag nobody clears lets the next step's moe_up read stale tables; one never set, hang
        raise ValueError("uflag needs both pipelined expert kernels: moe_up polling the front's routing flag and "
                         f"moe_down clearing it (got moe_up route_early={early}, moe_down route_reset={reset})")
    if early and up:
        raise ValueError("uflag and dflag use the same word of meta (kernels.moe.ROUTED_FLAG): choose one")


GEMM_BM128_ABOVE = 256  # 'fgemm' / 'tgemm': 128 tokens a GEMM CTA above this many, 64 up to it


def split_gemm_options(variant: str | None) -> tuple[bool, bool, str | None]:
    """Take 'fgemm' and 'tgemm' out of a '-'-joined variant: (front, tail, the rest or None). From
    GEMM_MIN_TOKENS tokens, 'fgemm' runs the front as the shared-memory GEMM of `kernels/gemm.py` (its output is
    the front's fp32 [tokens, E + L + 2S] as it is; the routing has its own launch there) and 'tgemm' the tail (the
    same GEMM with the tail GEMV's epilogue: RMSNorm scale, shared all-reduce read, add, bf16), instead of the
    tensor-core GEMV, which reads its weights once per 64 tokens."""
    parts = (variant or "").split("-")
    rest = "-".join(p for p in parts if p and p not in ("fgemm", "tgemm"))
    return "fgemm" in parts, "tgemm" in parts, rest or None


def gemm_bm(tokens: int) -> int:
    """Tokens a GEMM CTA takes ('fgemm', 'tgemm'): 64 up to GEMM_BM128_ABOVE tokens (94-188 CTAs for the front at
    TP8 on 132 SMs), else 128."""
    return 128 if tokens > GEMM_BM128_ABOVE else 64


def expert_kernel_keys(shape, tokens: int, experts: str = "pipe", variant: str | None = None, pdl: bool = True,
                       arch: str = "sm_90a", trace: bool = False):
    """(moe_up key, moe_down key, variant name) of the fused MoE half for `tokens` tokens per step; refuses
    (before any launch) an unknown `experts`, a variant for 'pipe-up', a trace outside the pipelined kernels, or
    more tokens than the chosen moe_down holds. See `FusedMoE` for what `experts` selects."""
    from .kernels import moe as km
    from .kernels import moe_pipe as kp
    from .support import UnsupportedConfiguration

    if experts not in EXPERT_KERNELS:
        raise ValueError(f"experts must be one of {EXPERT_KERNELS}, got {experts!r}")
    if variant and experts == "pipe-up":
        raise ValueError("variants apply to experts='direct' (launch shapes, e.g. w4r2-w4r4e4s4) or experts='pipe' "
                         "(options of the pipelined kernels, e.g. run17 or pf1-tail2048)")
    direct_v = variant if experts == "direct" else None
    pipe_v = variant if experts == "pipe" else None
    from .kernels.moe_wide import parse_wide_options
    wup_kw, wdown_kw, pipe_v = parse_wide_options(pipe_v)  # the wide kernels' options (above PIPE_MAX_M tokens)
    up_kw, down_kw = km.parse_variant(direct_v) if direct_v else ({}, {})
    pup_kw, pdown_kw = kp.parse_pipe_variant(pipe_v) if pipe_v else ({}, {})
    up_key = km.MoEUpKey(shape, pdl=pdl, arch=arch, **up_kw)
    down_key = km.MoEDownKey(shape, pdl=pdl, arch=arch, **down_kw)
    name = km.variant_name(up_key, down_key)
    cap = km.down_token_capacity(down_key)
    # the pipelined kernels keep activations and routing tables in shared memory: up to PIPE_MAX_M tokens
    if experts != "direct" and tokens <= kp.PIPE_MAX_M:
        up_key, name = kp.MoEUpPipeKey(shape, pdl=pdl, arch=arch, trace=trace, **pup_kw), experts
        if experts == "pipe":
            down_key = kp.MoEDownPipeKey(shape, pdl=pdl, arch=arch, trace=trace, **pdown_kw)
            cap = min(kp.down_pipe_capacity(down_key), up_key.max_tokens)
            if pipe_v:
                name = f"pipe@{kp.pipe_variant_name(up_key, down_key)}"
    elif experts == "pipe":  # above PIPE_MAX_M: rings whose items take up to 8 of an expert's tokens at a time
        from .kernels.moe_wide import MoEDownWideKey, MoEUpWideKey, wide_variant_name
        up_key = MoEUpWideKey(shape, pdl=pdl, arch=arch, **wup_kw)
        down_key = MoEDownWideKey(shape, pdl=pdl, arch=arch, **wdown_kw)
        cap, name = km.MAX_M, wide_variant_name(up_key, down_key)
    check_flag_handshake(up_key, down_key)
    if tokens > cap:
        raise UnsupportedConfiguration(f"tokens per step with the expert-kernel variant {name}", tokens,
                                       f"1..{cap} (its expert kernels hold {cap} tokens)")
    if trace and not (isinstance(up_key, kp.MoEUpPipeKey) and isinstance(down_key, kp.MoEDownPipeKey)):
        raise UnsupportedConfiguration("timeline tracing", f"{name} kernels at {tokens} tokens",
                                       f"the pipelined expert kernels (experts='pipe', 1..{kp.PIPE_MAX_M} tokens)")
    return up_key, down_key, name


class FusedMoE:
    """One decode step of the MoE half (§6.3) on one rank in four launches (five above 8 tokens)."""

    def __init__(self, weights: LayerWeights, x: torch.Tensor, seed: int = 0, arch: str | None = None,
                 separate_routing: bool | None = None, variant: str | None = None, pdl: bool | None = None,
                 experts: str = "pipe", trace: bool = False):
        """separate_routing: route in a fifth launch (one warp per token, a CTA per 16 tokens; the last CTA to
        finish builds the expert-major tables) instead of in the CTA that finishes the router rows of the front
        GEMV last (4 warps); None chooses by the token count (a fifth launch above ROUTE_IN_FRONT_MAX tokens);
        'rspread0' makes that launch one CTA of 16 warps (before 2026-12-07).
        variant: with experts='direct', the expert kernels' launch shape, e.g. 'w4r2-w4r4e4s4'
        (`kernels.moe.parse_variant`); with experts='pipe', options of the pipelined kernels, e.g. 'run17' (run 17's kernels) or
        'pf1-tail2048' (`kernels.moe_pipe.parse_pipe_variant`); None: the defaults. With either, 'fgemm' runs the
        front from GEMM_MIN_TOKENS tokens as the shared-memory GEMM of `kernels/gemm.py` and 'tgemm' the tail
        (`split_gemm_options`; neither yet measured), and 'foccN'
        (`kernels.moe.split_front_options`) builds the routing front kernel for N resident CTAs per SM (ptxas caps
        its registers); it applies at one token (m_tile 1) with routing in the front kernel, and the variant name
        shows it only there; at one token the tail is a persistent GEMV streaming W_up through a bulk-copy ring
        (`kernels/moe_tail_ring.py`, since run 49; 'tring0' takes the plain GEMV), and 'fring' makes the front one
        too (`kernels/moe_front_ring.py`; runs 50-51: slower; 'fringRxS[cN]' with R rows per slot, S slots and N CTAs
        per SM; 'tringRxS[cN]' the tail ring's geometry the same way); 'cotail'
        stages moe_down for one token and puts a smaller tail ring beside it, which streams W_up while moe_down
        runs ('tringco': that ring alone, after the usual moe_down); 'cand0' routes by the bitwise search alone (the kernels before run 43); 'mtfit0' runs
        the front and tail GEMVs at m_tile 8 from 2 tokens on (before run 49) instead of the smallest m_tile of
        1, 2, 4, 8 that holds the step (`kernels.moe.pick_m_tile`); 'mma0' keeps the front and tail GEMVs on CUDA
        cores at m_tile 8 from 5 tokens on, where they run on tensor cores by default (`kernels.moe.MMA_MIN_TOKENS`,
        m_tile 8 up to 8 tokens and 64 above); 'fpdl' launches the one-token front as a
        programmatic dependent too (its weight rows before the wait; the tail ring triggers at its start; needs pdl);
        'uflagN' (pipelined kernels, routing in the front) lets moe_up request N ring slots before its wait on a flag
        the front's routing sets and moe_down clears (run 68: both correct, no faster); 'merge' (pipelined kernels)
        runs moe_up and moe_down as two phases of one launch (`kernels.moe_pipe.MoEExpertsPipeKey`, three launches
        in all; refused on a device with fewer SMs than its CTAs, which wait for each other: it also needs the GPU to
        itself, since another process's kernels holding SMs (MPS) could keep one of its CTAs from starting).
        pdl: launch each kernel after the first as a programmatic dependent of the one before (its
        weight loads overlap the previous kernel's last wave; `kernels/moe.py`); False: plain stream order;
        None (the default): PDL up to PDL_MAX_TOKENS tokens per step, plain order above (run 45: PDL saved
        3.9 µs at one token and cost 2.7-19 µs at 2-64 tokens, `moe_pdl_h200_tp8`).
        experts: 'pipe' (up to `kernels.moe_pipe.PIPE_MAX_M` tokens, the expert kernels of `kernels/moe_pipe.py`:
        persistent CTAs streaming the experts' bytes through a bulk-copy ring; gate/up on tensor cores; more
        tokens take the rings of `kernels/moe_wide.py`, whose items take up to 8 of an expert's tokens at a time:
        moe_up stages each chunk's z when it reaches it, moe_down's slots bring the chunk's a rows; their options
        in `variant`: 'wsync', 'wstN', 'wupstN', 'wdownstN', 'wdownc16', 'wupc16', 'wdownr128', 'wdownpf', 'wdownsh8', 'wzpar',
        `moe_wide.parse_wide_options`),
        'direct' (`kernels/moe.py`: a CTA per expert row block, codes loaded into registers; the launch-shape
        variants apply to these), or 'pipe-up' (the pipelined gate/up with the direct down, up to PIPE_MAX_M
        tokens).
        trace: the pipelined expert kernels' timeline builds, which record per-CTA checkpoints (%globaltimer and
        %clock64) into `trace_up` / `trace_down` ([CTAs, 2, TRACE_BUF] int64, `kernels.moe_pipe.TRACE_UP` /
        `TRACE_DOWN` name the first 32 slots, `warp_trace_name` moe_up's per-warp ones; `moe_trace` reads them)."""
        from . import compile as kc
        from .kernels import moe as km
        from .kernels import moe_pipe as kp
        from .kernels.moe_tail_ring import cotail_key, tail_ring_key
        from .kernels.moe_wide import MoEDownWideKey

        check_moe_input(weights, x)
        if pdl is None:
            pdl = x.shape[0] <= PDL_MAX_TOKENS
        self.w, self.x = weights, x
        w, dev = weights.moe, x.device
        N = x.shape[0]
        self.N, self.device = N, dev
        tp = weights.shard.tp
        self.shape = shape = km.shapes_for_tp(tp)
        arch = kc.resolve_arch(arch)
        if separate_routing is None:
            separate_routing = N > ROUTE_IN_FRONT_MAX
        self.separate_routing = separate_routing
        front_gemm, tail_gemm, variant = split_gemm_options(variant)
        front_gemm = front_gemm and N >= GEMM_MIN_TOKENS
        tail_gemm = tail_gemm and N >= GEMM_MIN_TOKENS
        route_kw, variant = km.split_front_options(variant)
        up_key, down_key, self.variant = expert_kernel_keys(shape, N, experts=experts, variant=variant, pdl=pdl,
                                                            arch=arch, trace=trace)
        cand = route_kw.get("candidates", km.MoEFrontKey.candidates)
        # the front kernel and, in the variant name, the routing kernels' options where they changed it
        # 'uflag': the front's routing sets the flag moe_up polls before its wait
        route_flag = isinstance(up_key, kp.MoEUpPipeKey) and up_key.route_early > 0
        # 'shup': moe_up streams the shared gate/up rows, the front GEMV stops before them
        self.shared_up = shup = isinstance(up_key, kp.MoEUpPipeKey) and up_key.shared_up
        if shup and separate_routing:
            raise ValueError("shup streams the shared gate/up rows in moe_up at one or two tokens, with the routing in "
                             "the front kernel: it cannot go with separate_routing=True")
        # 'shfrontK': the front keeps the first K shared columns' gate/up rows, moe_up streams the rest
        keep = up_key.shared_front if shup else 0
        if keep and not keep < shape.shared:
            raise ValueError(f"shfront{keep}: the front keeps a share of the {shape.shared} shared columns at "
                             f"TP{shape.tp}; K must be below {shape.shared}")
        front_key, tags = km.front_key_for(shape, N, separate_routing, route_kw, arch, route_flag=route_flag,
                                           shared_rows=not shup, shared_keep=keep)
        if front_gemm:  # 'fgemm': the front's GEMV as the shared-memory GEMM (plain fp32 out: routing is its own launch)
            from .kernels.gemm import GemmKey
            if not separate_routing or shup:
                raise ValueError("fgemm runs the front as a plain GEMM: it needs the routing in its own launch and the "
                                 "shared rows in the front (not separate_routing=False or shup)")
            front_key = GemmKey(n=shape.ncat, k=km.D, bm=gemm_bm(N), arch=arch)
            tags.append("fgemm")
        front_pdl = getattr(front_key, "pdl", False)
        if front_pdl and not pdl:
            raise ValueError("fpdl launches the front as a programmatic dependent: it cannot go with pdl=False")
        # 'rspread0': the routing launch as one CTA (the kernel before 2026-12-07) instead of one CTA per 16 tokens
        spread = route_kw.get("route_spread", km.MoERouteKey.spread)
        route_key = (km.MoERouteKey(shape, pdl=pdl, candidates=cand, arch=arch, spread=spread) if separate_routing
                     else None)
        if separate_routing and not spread:
            tags.append("rspread0")
        # one token: the tail as a persistent GEMV streaming W_up through a bulk-copy ring ('tring0': the plain one)
        ring = N == 1 and route_kw.get("tail_ring", True)
        if N == 1 and not ring:
            tags.append("tring0")
        # 'cotail' (one token): moe_down staged for one token and a tail ring that fits beside it, so that the
        # tail's CTAs stream W_up while moe_down still runs
        co = N == 1 and route_kw.get("co_tail", False)
        if co:
            if not ring or not pdl or not isinstance(down_key, kp.MoEDownPipeKey):
                raise ValueError("cotail puts the one-token tail ring beside the pipelined moe_down under PDL: it "
                                 "cannot go with tring0, pdl=False or experts other than 'pipe'")
            down_key = dataclasses.replace(down_key, max_tokens=1)
            tags.append("cotail")
        co_ring = N == 1 and ring and route_kw.get("co_tail_ring_only", False) and not co
        if co_ring:
            tags.append("tringco")
        geometry = route_kw.get("tail_ring_geometry")
        if geometry and (co or co_ring):
            raise ValueError("a tail ring geometry (tringRxS[cN]) cannot go with cotail or tringco, which fix theirs")
        tail_key = (cotail_key(shape, pdl=pdl, arch=arch) if co or co_ring
                    else tail_ring_key(shape, geometry, pdl=pdl, arch=arch, trigger=front_pdl) if ring
                    else km.tail_key_for(shape, N, pdl, route_kw, arch))
        if ring and geometry:
            tags.append("tring" + tail_key.geometry_tag)
        if tail_gemm:  # 'tgemm': the tail as the shared-memory GEMM with the tail GEMV's epilogue (same arguments)
            from .kernels.gemm import tail_key as gemm_tail_key
            tail_key = gemm_tail_key(tp, gemm_bm(N), arch, eps=shape.eps)
            tags.append("tgemm")
        self.variant = "+".join([*tags, self.variant])
        self.pdl = pdl
        # 'merge': moe_up and moe_down as the two phases of one launch, met on a counter that needs every CTA resident
        self.merged = merged = isinstance(down_key, kp.MoEDownPipeKey) and down_key.merged
        if merged:
            from .support import UnsupportedConfiguration
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            if sms < down_key.ctas:
                raise UnsupportedConfiguration("SMs for the merged expert kernel (merge)", sms,
                                               f"{down_key.ctas} or more: its {down_key.ctas} CTAs wait for each other")
        expert_keys = (kp.MoEExpertsPipeKey(up_key, down_key),) if merged else (up_key, down_key)
        # the kernels this step launches, in order (recorded by `kimi-decode moe` next to each timing)
        self.kernels_used = "+".join(kc.spec_for(k).name for k in (front_key, route_key, *expert_keys, tail_key)
                                     if k is not None)
        # f[1] runs the expert kernel(s): moe_up, or with 'merge' both phases (f[2], moe_down, is then None)
        self._fns = [kc.load(k) for k in (front_key, *expert_keys, tail_key)]
        if merged:
            self._fns.insert(2, None)
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def nan(*size, dtype=torch.bfloat16):
            return torch.full(size, float("nan"), dtype=dtype, device=dev)

        I, S = shape.inter, shape.shared
        self.w_front = torch.cat([w.gate, w.down, w.shared_gate_up], 0).contiguous()  # [E + L + 2S, d]
        self.bias = w.e_score_correction_bias.float().contiguous()
        self.w1 = w.w1_packed.view(torch.int32)
        self.w3 = w.w3_packed.view(torch.int32)
        self.w2 = w.w2_packed.view(torch.int32)
        self.s1, self.s3, self.s2 = w.w1_scale, w.w3_scale, w.w2_scale
        self.norm = w.norm.view(1, km.L)
        self.front = nan(N, shape.ncat, dtype=torch.float32)
        # [active experts, router CTA counter, dflag's counter or uflag's routing flag, dflag's pass count]
        self.meta = torch.zeros(km.META_WORDS, dtype=torch.int32, device=dev)
        self.ids = torch.full((N, km.TOPK), -1, dtype=torch.int32, device=dev)
        self.wts = nan(N, km.TOPK, dtype=torch.float32)
        self.we = torch.zeros(km.E, N, dtype=torch.float32, device=dev)  # routing weight of (expert, token)
        self.act = torch.zeros(km.E, dtype=torch.int32, device=dev)
        self.list = torch.zeros(km.E, 2, dtype=torch.int32, device=dev)  # (offset, count) per active expert
        self.tok = torch.zeros(km.TOPK * N, dtype=torch.int32, device=dev)  # token ids grouped by expert
        self.route_cnt = torch.zeros(km.E, dtype=torch.int32, device=dev)  # the spread routing's counts (zero between steps)
        self.a = nan(km.TOPK * N, I)  # SiTU output per (expert, token) pair, in the order of `tok`
        self.cnt = torch.zeros(km.L // down_key.rows_per_item, dtype=torch.int32, device=dev)  # completion counter per latent row block
        self.a_sh = nan(N, S)
        # all-reduce buffers: slot 0 this rank's partial, the rest stand-ins for the peers (random)
        self.lat = torch.randn(tp, N, km.L, generator=gen).to(dev)
        self.sh = torch.randn(tp, N, km.D, generator=gen).to(torch.bfloat16).to(dev)
        self.coef = torch.zeros(tp, dtype=torch.float32, device=dev)
        self.coef[0] = 1.0
        self.r = nan(N, km.L)  # the reduced latent times the RMSNorm weight (moe_down's all-reduce read)
        self.ssq = nan(N, dtype=torch.float32)  # Σ r² per token: zeroed by moe_up, summed by moe_down
        self.h = nan(N, km.D)
        self.routing = (self.ids, self.wts)
        self.buffers = dict(front=self.front, topk_ids=self.ids, topk_weights=self.wts, experts_act=self.a,
                            shared_act=self.a_sh, latent=self.lat, latent_reduced=self.r, shared_partial=self.sh[0])
        e_up = _nbytes(w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale) // km.E
        e_down = _nbytes(w.w2_packed, w.w2_scale) // km.E
        from .byte_counts import expected_active_experts
        act = expected_active_experts(weights.cfg, N)
        f = self._fns
        # the pipelined kernels also take the next launch's weights (which they may prefetch into L2) and a
        # timeline buffer (written only by their trace builds)
        self.trace_up = torch.zeros(kp.H200_SMS, 2, kp.TRACE_BUF, dtype=torch.int64, device=dev)
        self.trace_down = torch.zeros_like(self.trace_up)
        up_extra = (self.w2, self.s2, w.shared_down, self.trace_up) if isinstance(up_key, kp.MoEUpPipeKey) else ()
        if shup:  # x and the shared gate/up rows, which moe_up streams itself
            up_extra += (x, w.shared_gate_up)
        ring_down = isinstance(down_key, (kp.MoEDownPipeKey, MoEDownWideKey))  # moe_pipe's arguments
        down_extra = (w.up, self.front, self.trace_down) if ring_down else ()
        self._route = kc.load(route_key) if separate_routing else None
        # 'shup': x and the shared gate/up rows moe_up streams (all but the 2·keep the front keeps, whose fp32
        # pre-activations it reads instead)
        up_bytes = act * e_up + N * km.L * 4 + N * 2 * (keep if shup else S) * 4 + (
            _nbytes(x) + _nbytes(w.shared_gate_up) * (S - keep) // S if shup else 0)
        front_rows = shape.sh0 + 2 * keep if shup else shape.ncat  # weight rows the front GEMV streams
        front_w_bytes = _nbytes(self.w_front) * front_rows // shape.ncat
        down_bytes = act * e_down + _nbytes(self.a, self.lat[1:], w.shared_down, self.a_sh, w.norm)
        up_flops, down_flops = 2 * N * 16 * km.L * 2 * I, 2 * N * 16 * I * km.L + 2 * N * S * km.D
        if shup:
            up_flops += 2 * N * 2 * (S - keep) * km.D
        if merged:
            experts = [Launch(
                "moe.experts", "Marlin GEMM1 + situ_and_mul + GEMM2 + top-k sum + latent all-reduce read, shared "
                "situ_and_mul + down (fused, one launch)", "CuTe DSL", up_bytes + down_bytes,
                _nbytes(self.a, self.a_sh, self.lat[0], self.r, self.sh[0]), up_flops + down_flops,
                run=lambda: f[1](self.front, self.w1, self.s1, self.w3, self.s3, self.meta, self.act, self.list,
                                 self.tok, self.a, self.a_sh, self.lat, self.ssq, *up_extra, self.we, self.coef,
                                 self.cnt, self.r, self.sh, self.norm, w.up, self.trace_down))]
        else:
            experts = [
                Launch("moe.up", "Marlin GEMM1 + situ_and_mul, shared " + ("gate_up + " if shup else "") +
                       "situ_and_mul (fused)", "CuTe DSL",
                       up_bytes, _nbytes(self.a, self.a_sh), up_flops,
                       run=lambda: f[1](self.front, self.w1, self.s1, self.w3, self.s3, self.meta, self.act, self.list,
                                        self.tok, self.a, self.a_sh, self.lat, self.ssq, *up_extra)),
                Launch("moe.down", "Marlin GEMM2 + top-k sum + latent all-reduce read, shared down (fused)", "CuTe DSL",
                       down_bytes, _nbytes(self.lat[0], self.r, self.sh[0]), down_flops,
                       run=lambda: f[2](self.a, self.w2, self.s2, self.meta, self.act, self.list, self.tok, self.we,
                                        self.lat, self.coef, self.cnt, self.r, self.a_sh, w.shared_down, self.sh,
                                        self.norm, self.ssq, *down_extra))]
        self._launches = [
            Launch("moe.front", "router GEMM + grouped_topk + down_proj" + ("" if shup else " + shared gate_up") +
                   " (fused)", "CuTe DSL", front_w_bytes + _nbytes(x, self.bias), _nbytes(self.front, self.ids, self.wts),
                   2 * N * km.D * front_rows,
                   run=(lambda: f[0](self.w_front, x, self.front)) if front_gemm else
                   (lambda: f[0](self.w_front, x, self.front, self.bias, self.meta, self.ids, self.wts, self.we,
                                 self.act, self.list, self.tok))),
            *([Launch("moe.route", "grouped_topk + expert-major tables (fused)", "CuTe DSL",
                      N * km.E * 4 + km.E * 4, _nbytes(self.ids, self.wts) + N * km.TOPK * 4, 0,
                      run=lambda: self._route(self.front, self.bias, self.meta, self.ids, self.wts, self.we,
                                              self.act, self.list, self.tok, self.route_cnt))]
              if separate_routing else []),
            *experts,
            Launch("moe.tail", "RMSNorm + up_proj + shared all-reduce + add (fused)", "CuTe DSL",
                   _nbytes(w.up, self.r, self.ssq, self.sh), _nbytes(self.h), 2 * N * km.L * km.D,
                   run=lambda: f[3](w.up, self.r, self.ssq, self.sh, self.coef, self.h)),
        ]

    def launches(self) -> list[Launch]:
        return list(self._launches)

    def __call__(self) -> None:
        for launch in self._launches:
            launch.run()
