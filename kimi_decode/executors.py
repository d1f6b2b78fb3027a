"""The executors that run one decode step, by name: what `sweep` and `profile` accept.

'stock' and 'compile' run a whole layer; 'stock-moe' and 'fused-moe' run only the MoE
half of an MoE layer (the stock schedule's 15 launches, or the fused 4), on a fresh
input of the step's token count; 'cute-kernels' runs the layer's stand-alone CuTe DSL
kernels (its AttnRes launches and the decode GEMVs) for the profiler.
"""

from __future__ import annotations

EXECUTORS = ("stock", "compile", "stock-moe", "fused-moe", "fused5-moe", "cute-kernels")
VARIANT_EXECUTORS = ("fused-moe",)  # this one also takes '@VARIANT' (options of the fused kernels)


def _moe_half_name(name: str) -> tuple[str, str]:
    """(base, the `moe_bench` executor name) of `name`, refusing an unknown base or a variant where none is
    taken: 'fused-moe@fring' -> ('fused-moe', 'fused@fring')."""
    base, at, variant = name.partition("@")
    if base not in EXECUTORS or (at and base not in VARIANT_EXECUTORS):
        raise ValueError(f"executor must be one of {EXECUTORS} ({', '.join(VARIANT_EXECUTORS)} optionally with "
                         f"@VARIANT, e.g. fused-moe@fring), got {name!r}")
    return base, base.split("-")[0] + (f"@{variant}" if at else "")


def check_executor_name(name: str) -> None:
    """Refuse an unknown executor, or a malformed variant of a fused one, before any GPU work."""
    base, moe_name = _moe_half_name(name)
    if "@" in name:
        from .moe_bench import make_moe_executor
        make_moe_executor(moe_name)  # parses the variant


def make_executor(name: str):
    """A factory `(weights, state) -> executor` for `name` (see EXECUTORS; 'fused-moe@VARIANT' runs the fused
    MoE half with the kernels' options of `kimi-decode moe --executors fused@VARIANT`)."""
    base, moe_name = _moe_half_name(name)
    if base == "stock":
        from .stock.schedule import StockLayer
        return StockLayer
    if base == "compile":
        from .compile_peer import CompilePeer
        return lambda w, st: CompilePeer(w, st, compile=True, mode="default")
    if base in ("stock-moe", "fused-moe", "fused5-moe"):
        from .moe_bench import make_moe_executor, moe_input
        make = make_moe_executor(moe_name)  # (a variant is parsed here)
        return lambda w, st: make(w, moe_input(st.shape.num_tokens, w.cfg.hidden_size, seed=0,
                                                device=st.carry.p.device))
    from .cute_kernels import CuteKernelSet  # the last of EXECUTORS
    return CuteKernelSet
