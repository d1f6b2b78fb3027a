"""Sweeps over layer type, TP, batch and context that write `data/measured/*.csv`.

Every configuration is checked against the fp32 reference on fresh random
inputs (NaN-poisoned outputs, every element written) before it is timed; a
configuration that fails the check is recorded as failed and not timed.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd
import torch

from .accuracy import compare_step
from .bench import measure_copy_bandwidth, provenance, time_graph
from .byte_counts import layer_bytes
from .config import DecodeShape, ShardSpec
from .reference import Storage, decoder_layer
from .state import DecodeState, make_decode_state
from .support import GPURequired, check_supported
from .weights import LayerWeights, make_layer_weights

L2_BYTES = 60 * 2**20


def weight_copy(w: LayerWeights, i: int) -> LayerWeights:
    """A distinct copy of a layer's weights on its device: bf16 tensors sign-flipped on odd copies,
    MXFP4 codes with both nibbles' sign bits flipped (same bytes to read, different values)."""
    flip = i % 2 == 1

    def cp(name: str, t: torch.Tensor) -> torch.Tensor:
        if flip and name.endswith("_packed"):
            return t ^ 0x88  # flips the sign bit of both E2M1 codes in each byte
        if flip and t.dtype == torch.bfloat16 and t.dim() >= 2:
            return -t
        return t.clone()

    parts = {name: dataclasses.replace(part, **{k: cp(k, t) for k, t in part.tensors().items()})
             for name, part in w.parts().items()}
    return dataclasses.replace(w, **parts)


def choose_copies(streamed_bytes: int, minimum: int = 2, target_l2_multiple: int = 8, maximum: int = 8) -> int:
    """Enough layer copies that one replay streams `target_l2_multiple` × L2."""
    return max(minimum, min(maximum, math.ceil(target_l2_multiple * L2_BYTES / max(streamed_bytes, 1))))


def check_against_reference(make_executor: Callable[[LayerWeights, DecodeState], object],
                            w: LayerWeights, st: DecodeState) -> dict:
    """Run the executor once on a copy of `st` and compare with the fp32 / bf16-storage reference.

    MoE layers: tokens whose top-k set differs from the reference's (allowed only at near-ties of the
    biased router score) are left out of the comparison and counted in `routing_flips`.
    """
    ref = decoder_layer(w, st.clone())
    ref_bf16 = decoder_layer(w, st.clone(), storage=Storage.BF16)
    ex = make_executor(w, st.clone())
    ex()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    routing = getattr(ex, "routing", None)
    return compare_step(ex.h, ref.h, ref_bf16.h, routing[0] if routing is not None else None, ref.x_mlp, w.moe,
                        w.cfg)


def copies_of_step(make_executor, kind: str, shard: ShardSpec, shape: DecodeShape, weights: LayerWeights,
                   copies: int, seed: int, device) -> list:
    """`copies` executors of one step, each on its own weights (`weight_copy`; the first the given ones)
    and its own decode state, for a CUDA graph that streams them in turn (nothing L2-hot)."""
    return [make_executor(weights if i == 0 else weight_copy(weights, i),
                          make_decode_state(kind, shard, shape, seed=seed + i, device=device))
            for i in range(copies)]


def bench_config(kind: str, tp: int, shape: DecodeShape, make_executor, executor_name: str,
                 weights: LayerWeights, copy_bw: float, replays: int = 100, seed: int = 0,
                 timed: bool = True) -> dict:
    """Check one configuration against the reference, then time it. The DCP size is the weights' own
    (`weights.shard.dcp`; MLA layers only)."""
    shard = ShardSpec(tp=tp, dcp=weights.shard.dcp)
    check_supported(layer=kind, shard=shard, shape=shape)
    dev = weights.attn_res.input_layernorm.device
    st = make_decode_state(kind, shard, shape, seed=seed, device=dev)
    row = {"executor": executor_name, "layer": kind, "tp": tp, "dcp": shard.dcp, "batch": shape.batch,
           "tokens_per_seq": shape.tokens_per_seq, "context": max(shape.context_per_seq)}
    row.update(check_against_reference(make_executor, weights, st))
    if not row["check_ok"] or not timed:
        return row
    b0 = layer_bytes(kind, shard, shape)
    copies = choose_copies(b0.streamed)
    execs = copies_of_step(make_executor, kind, shard, shape, weights, copies, seed, dev)
    timing = time_graph(execs, replays=replays)
    active = None
    routing = getattr(execs[0], "routing", None)
    if routing is not None:
        active = int(torch.unique(routing[0]).numel())
    b = layer_bytes(kind, shard, shape, active_experts=active)
    row.update(
        us_median=timing.us_median, us_p10=timing.us_p10, us_p90=timing.us_p90, replays=timing.replays,
        copies=copies, **timing.count_columns(),
        kernels_inventory=(len(execs[0].launches()) or None) if hasattr(execs[0], "launches") else None,
        graph_nodes=";".join(f"{k}={v}" for k, v in sorted(timing.node_counts.items())),
        active_experts=b.active_experts, bytes_streamed=b.streamed,
        achieved_GBps=b.streamed / (timing.us_median * 1e-6) / 1e9,
        copy_bw_GBps=copy_bw / 1e9, floor_us=b.streamed / copy_bw * 1e6,
    )
    row["fraction_of_floor"] = row["floor_us"] / row["us_median"]
    if row["kernels_inventory"] is not None and row["launches_measured"] == row["launches_measured"]:  # not NaN
        row["counts_match"] = bool(row["launches_measured"] == row["kernels_inventory"])
    del execs
    torch.cuda.empty_cache()
    return row


def _config(c) -> tuple[str, int, DecodeShape, int]:
    """(layer, tp, shape) or (layer, tp, shape, dcp) -> (layer, tp, shape, dcp)."""
    if len(c) == 3:
        return (*c, 1)
    kind, tp, shape, dcp = c
    if dcp > 1 and kind != "mla_moe":
        raise ValueError(f"DCP{dcp} applies to MLA layers only (KDA layers keep per-sequence state), got {kind}")
    return kind, tp, shape, dcp


def run_sweep(make_executor, executor_name: str, configs: Iterable[tuple],
              out_csv: str | Path | None = None, replays: int = 100, progress: bool = True,
              timed: bool = True) -> pd.DataFrame:
    """Benchmark `configs` = [(layer, tp, shape)] or [(layer, tp, shape, dcp)], reusing weights per
    (layer, tp); append to `out_csv`.

    `timed=False` only checks each configuration against the reference (no CUDA graph, no timing)."""
    from tqdm.auto import tqdm

    if not torch.cuda.is_available():
        raise GPURequired("timing needs a CUDA GPU; on a CPU machine read data/measured/ instead")
    configs = [_config(c) for c in configs]
    for kind, tp, shape, dcp in configs:
        check_supported(layer=kind, tp=tp, dcp=dcp, shape=shape)
    copy_bw = measure_copy_bandwidth() if timed else float("nan")
    prov = provenance()
    rows = []
    cache: dict = {}
    for kind, tp, shape, dcp in tqdm(configs, desc=f"{executor_name} sweep", disable=not progress):
        key = (kind, tp)
        if key not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            cache[key] = make_layer_weights(kind, ShardSpec(tp=tp), seed=0).to("cuda")
        weights = dataclasses.replace(cache[key], shard=ShardSpec(tp=tp, dcp=dcp)) if dcp > 1 else cache[key]
        try:
            row = bench_config(kind, tp, shape, make_executor, executor_name, weights, copy_bw, replays,
                               timed=timed)
        except Exception as e:  # record and go on: one failing config must not lose the sweep
            row = {"executor": executor_name, "layer": kind, "tp": tp, "dcp": dcp, "batch": shape.batch,
                   "tokens_per_seq": shape.tokens_per_seq, "context": max(shape.context_per_seq),
                   "check_ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        row.update(prov)
        rows.append(row)
        if out_csv:
            pd.DataFrame(rows).to_csv(out_csv, index=False)
        if progress:
            tqdm.write(_summary(row))
    return pd.DataFrame(rows)


def _summary(r: dict) -> str:
    head = (f"{r['executor']:<6} {r['layer']:<8} tp{r['tp']:<3}" + (f" dcp{r['dcp']}" if r.get("dcp", 1) > 1 else "")
            + f" b{r['batch']:<3} ctx{r['context']:<6}")
    if r.get("check_ok") and "us_median" not in r:
        return f"{head} t{r['tokens_per_seq']} check ok  err {r['err_vs_fp32']:.1e} (bound {r['err_bound']:.1e}) " \
               f"routing flips {r['routing_flips']}"
    if not r.get("check_ok"):
        return f"{head} FAILED {r.get('error', '')} err={r.get('err_vs_fp32', float('nan')):.2e} " \
               f"bound={r.get('err_bound', float('nan')):.2e}"
    return (f"{head} {r['us_median']:8.1f} us  [{r['us_p10']:.1f},{r['us_p90']:.1f}]  kernels {r['kernels_measured']:.0f}"
            f" (launches {r['launches_measured']:.0f}/{r['kernels_inventory']})  {r['achieved_GBps']:7.0f} GB/s  floor {r['floor_us']:.1f} us "
            f"({r['fraction_of_floor']:.2f})  err {r['err_vs_fp32']:.1e}")


def stock_configs(kinds=("dense", "kda_moe", "mla_moe"), tps=(8, 16), batches=(1, 8, 32, 64),
                  contexts=(8192, 32768), dcps=(1,)) -> list[tuple[str, int, DecodeShape, int]]:
    """(layer, tp, shape, dcp) for each combination; MLA layers take every context and DCP size, the
    others the first context and DCP 1."""
    out = []
    for tp in tps:
        for kind in kinds:
            for b in batches:
                for c in (contexts if kind == "mla_moe" else (contexts[0],)):
                    for d in (dcps if kind == "mla_moe" else (1,)):
                        out.append((kind, tp, DecodeShape(b, 1, c), d))
    return out
