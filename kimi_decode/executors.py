"""The executors that run one decode step, by name: what `sweep` and `profile` accept.

'stock' and 'compile' run a whole layer; 'stock-moe' and 'fused-moe' run only the MoE
half of an MoE layer (the stock schedule's 15 launches, or the fused 4), on a fresh
input of the step's token count; 'cute-kernels' runs the layer's stand-alone CuTe DSL
kernels (its AttnRes launches and the decode GEMVs) for the profiler.
"""

from __future__ import annotations

EXECUTORS = ("stock", "compile", "stock-moe", "fused-moe", "fused5-moe", "cute-kernels")


def make_executor(name: str):
    """A factory `(weights, state) -> executor` for `name` (see EXECUTORS)."""
    if name == "stock":
        from .stock.schedule import StockLayer
        return StockLayer
    if name == "compile":
        from .compile_peer import CompilePeer
        return lambda w, st: CompilePeer(w, st, compile=True, mode="default")
    if name in ("stock-moe", "fused-moe", "fused5-moe"):
        from .moe_bench import make_moe_executor, moe_input
        make = make_moe_executor(name.split("-")[0])
        return lambda w, st: make(w, moe_input(st.shape.num_tokens, w.cfg.hidden_size, seed=0,
                                                device=st.carry.p.device))
    if name == "cute-kernels":
        from .cute_kernels import CuteKernelSet
        return CuteKernelSet
    raise ValueError(f"executor must be one of {EXECUTORS}, got {name!r}")
