"""The executors that run one layer's decode step, by name: what `sweep` and `profile` accept."""

from __future__ import annotations

EXECUTORS = ("stock", "compile")


def make_executor(name: str):
    """A factory `(weights, state) -> executor` for `name`: 'stock' (the stock-vLLM schedule) or
    'compile' (the reference under torch.compile)."""
    if name == "stock":
        from .stock.schedule import StockLayer
        return StockLayer
    if name == "compile":
        from .compile_peer import CompilePeer
        return lambda w, st: CompilePeer(w, st, compile=True, mode="default")
    raise ValueError(f"executor must be one of {EXECUTORS}, got {name!r}")
