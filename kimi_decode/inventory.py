"""Launch inventories: every launch an executor makes for one layer's decode step.

Built on the "meta" device (shapes only, no data), so real-size inventories are
instant on any machine. The benchmark harness checks that the kernels counted
in a captured CUDA graph equal these counts.
"""

from __future__ import annotations

import pandas as pd

from .config import DecodeShape, ShardSpec
from .state import make_decode_state
from .support import check_supported
from .weights import make_layer_weights

EXECUTORS = ("stock",)


def stock_layer_meta(layer: str, tp: int, shape: DecodeShape, dcp: int = 1):
    from .stock.schedule import StockLayer

    shard = ShardSpec(tp=tp, dcp=dcp)
    w = make_layer_weights(layer, shard, device="meta")
    st = make_decode_state(layer, shard, shape).to("meta")
    return StockLayer(w, st)


def inventory(layer: str, tp: int = 8, shape: DecodeShape | None = None, executor: str = "stock",
              dcp: int = 1) -> pd.DataFrame:
    """One row per launch, in order: label, vLLM op, implementation, stream, bytes, FLOPs.
    `dcp` > 1: one DCP rank's launches, its collectives emulated (MLA layers; the KDA and dense layers'
    launches do not change: DCP does not apply to them)."""
    shape = shape or DecodeShape()
    check_supported(layer=layer, tp=tp, dcp=dcp, shape=shape)
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    sl = stock_layer_meta(layer, tp, shape, dcp)
    df = pd.DataFrame([l.row() for l in sl.launches()])
    df.insert(0, "n", range(1, len(df) + 1))
    return df
