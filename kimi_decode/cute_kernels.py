"""The stand-alone CuTe DSL kernels of one layer as an executor, for the profiler.

`kimi-decode profile --executor cute-kernels --layer L --tp 8 --batch B` runs, on the
layer's own AttnRes state (block stack, partial sum, the layer's norm weights):

  - the two AttnRes launches of the layer (`kernels/attn_res.py`), with the layer's
    (n, j) of §3.3: before attention (δ = the previous sublayer's output) and before
    the MLP (δ a stand-in for the attention output, which this executor does not compute);
  - one decode GEMV (`kernels/gemv.py`) at each TP8 decode shape K×N of `gpu_facts.md`,
    on random bf16 weights and activations of the step's token count.

Each launch carries the bytes it must move, so the profile's achieved bandwidth reads
against the copy bandwidth like the stock schedule's. The fused MoE half has its own
executor (`fused-moe`).
"""

from __future__ import annotations

import torch

from .stock.launch import Launch
from .weights import LayerWeights

BF16 = 2


class CuteKernelSet:
    """The layer's AttnRes launches and the decode GEMVs, as CuTe DSL launches (see the module doc)."""

    def __init__(self, weights: LayerWeights, state, seed: int = 0):
        from .kernels import attn_res as A
        from .kernels import gemv as G

        c = state.carry
        if c.p.device.type != "cuda":
            raise ValueError(f"the CuTe kernels run on a CUDA device, got the state on {c.p.device}")
        cfg, ar = weights.cfg, weights.attn_res
        T, d = c.p.shape
        if not 1 <= T <= A.MAX_BATCH:
            raise ValueError(f"tokens per step {T} outside the kernels' 1..{A.MAX_BATCH}")
        self.h = None
        self.routing = None
        nb, bw = cfg.attn_res_position(weights.layer)
        j = weights.layer // cfg.attn_res_block_size if bw else -1
        gen = torch.Generator(device=c.p.device).manual_seed(seed)  # on the GPU: ~0.4 GB of GEMV weights
        rnd = lambda *s: torch.randn(*s, generator=gen, device=c.p.device).to(torch.bfloat16)  # noqa: E731
        delta_attn = c.h if c.h is not None else rnd(T, d)
        delta_mlp = rnd(T, d)
        self.y_attn, self.y_mlp = torch.empty_like(c.p), torch.empty_like(c.p)
        launches = []

        def ar_launch(label, delta, n, jj, w_n, w_q, w_o, y):
            rd = T * d * BF16 * (1 + n + (delta is not None)) + 3 * d * BF16
            wr = T * d * BF16 * (1 + (delta is not None) + (jj >= 0))
            return Launch(label, "_attn_res_kernel", "CuTe DSL", rd, wr, 0,
                          run=lambda: A.attn_res_fused(c.p, delta, c.blocks, n, jj, w_n, w_q, w_o,
                                                       cfg.rms_norm_eps, cfg.rms_norm_eps, out=y))

        launches.append(ar_launch("attn.attn_res", delta_attn, nb, j, ar.self_attention_res_norm,
                                  ar.self_attention_res_proj, ar.input_layernorm, self.y_attn))
        launches.append(ar_launch("mlp.attn_res", None if bw else delta_mlp, nb + int(bw), -1, ar.mlp_res_norm,
                                  ar.mlp_res_proj, ar.post_attention_layernorm, self.y_mlp))
        self.gemv_operands = []
        for k, n in G.DECODE_SHAPES:
            x, w, out = rnd(T, k), rnd(n, k) * 0.02, torch.empty(T, n, dtype=torch.bfloat16, device=c.p.device)
            self.gemv_operands.append((x, w, out))
            launches.append(Launch(f"gemv.{k}x{n}", "cuBLAS GEMM (decode GEMV)", "CuTe DSL",
                                   (n * k + T * k) * BF16, T * n * BF16, 2 * T * k * n,
                                   run=lambda x=x, w=w, out=out: G.gemv(x, w, out=out)))
        self._launches = launches

    def launches(self) -> list[Launch]:
        return list(self._launches)

    def __call__(self) -> None:
        for launch in self._launches:
            launch.run()
