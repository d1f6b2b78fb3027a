"""The main CPU job: one rank of each layer type at real shapes through the reference.

For each layer type it builds a TP rank's seeded random weights and decode
state at the published shapes, runs one decode step through the fp32
reference, and reports the streamed weight bytes, the H200 memory floor of the
step (streamed bytes at the measured 4.27 TB/s copy bandwidth) and the time the
reference took on this CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from .byte_counts import H200_COPY_BANDWIDTH, layer_bytes
from .config import LAYER_KINDS, DecodeShape, ShardSpec
from .reference import decoder_layer
from .state import make_decode_state
from .support import check_supported
from .weights import make_layer_weights


@dataclass
class DemoRow:
    layer: str
    layer_index: int
    weight_bytes_streamed: int
    bytes_streamed: int
    h200_floor_us: float
    build_s: float
    reference_step_s: float
    output_rms: float


def run_demo(tp: int = 8, shape: DecodeShape | None = None, seed: int = 0,
             layers=LAYER_KINDS, progress: bool = True) -> pd.DataFrame:
    shape = shape or DecodeShape(batch=1, tokens_per_seq=1, context_lens=4096)
    shard = ShardSpec(tp=tp)
    for kind in layers:
        check_supported(layer=kind, shard=shard, shape=shape)
    rows = []
    torch.manual_seed(seed)
    for kind in tqdm(layers, desc="reference decode step", disable=not progress, unit="layer"):
        t0 = time.perf_counter()
        w = make_layer_weights(kind, shard, seed=seed)
        st = make_decode_state(kind, shard, shape, seed=seed)
        t1 = time.perf_counter()
        out = decoder_layer(w, st)
        t2 = time.perf_counter()
        b = layer_bytes(kind, shard, shape)
        rows.append(DemoRow(
            layer=kind, layer_index=w.layer, weight_bytes_streamed=b.weights_streamed,
            bytes_streamed=b.streamed, h200_floor_us=b.streamed / H200_COPY_BANDWIDTH * 1e6,
            build_s=t1 - t0, reference_step_s=t2 - t1,
            output_rms=float(out.h.pow(2).mean().sqrt()),
        ))
        if not torch.isfinite(out.h).all():
            raise RuntimeError(f"{kind}: the reference produced non-finite values")
        del w, st, out
    return pd.DataFrame([r.__dict__ for r in rows])


def format_demo(df: pd.DataFrame, tp: int, shape: DecodeShape) -> str:
    lines = [
        f"Kimi K3 decode step, one TP{tp} rank, {shape.describe()} (fp32 reference on this CPU)",
        "",
        f"{'layer':<9} {'index':>5} {'weight bytes':>14} {'all bytes':>14} {'H200 floor':>11} {'CPU ref step':>13}",
    ]
    for r in df.itertuples():
        lines.append(
            f"{r.layer:<9} {r.layer_index:>5} {r.weight_bytes_streamed:>14,} {r.bytes_streamed:>14,} "
            f"{r.h200_floor_us:>8.1f} µs {r.reference_step_s * 1e3:>10.0f} ms"
        )
    lines += ["", f"H200 floor = all bytes streamed (weights + KV/state + activations) at the measured "
                  f"{H200_COPY_BANDWIDTH / 1e12:.2f} TB/s copy bandwidth."]
    return "\n".join(lines)
