"""Check and time the MoE half of a layer (§6.3): the stock schedule's 15 launches vs the fused 4.

Same protocol as `sweeps` (the field's standard): fresh random input each
configuration, NaN-poisoned outputs, comparison with the fp32 reference (and its
bf16-storage twin for the tolerance), then CUDA-graph timing of several layer
copies (distinct weights, so nothing is L2-hot), kernels counted in the captured
graph, bytes over the measured copy bandwidth for the floor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import pandas as pd
import torch

from .accuracy import compare_step
from .byte_counts import moe_replicated_bytes, routed_expert_bytes, shared_expert_bytes
from .config import ShardSpec
from .reference import Storage
from .reference.moe import moe_block_one_rank
from .support import GPURequired
from .weights import LayerWeights, make_layer_weights

MOE_EXECUTORS = ("stock", "fused", "fused5", "fused-nopdl", "fused-pdl", "fused-direct", "fused-pipeup")


def make_moe_executor(name: str):
    """`(weights, x) -> executor` of the MoE half: 'stock' (15 launches), 'fused' (CuTe DSL: 4 launches
    with the routing in the front GEMV's last router CTA up to 8 tokens, 5 beyond) or 'fused5' (always 5:
    routing as its own launch), 'fused-pdl' (as 'fused' with programmatic dependent launch at every token
    count, as before run 46; 'fused' uses it at one token, `fused_moe.PDL_MAX_TOKENS`), 'fused-nopdl' (as 'fused', each launch waiting for the previous one to
    finish: no programmatic dependent launch); these use the pipelined expert kernels (`kernels/moe_pipe.py`) up
    to 8 tokens and the wide ones (`kernels/moe_wide.py`) above.
    'fused-direct' is 'fused' with the first expert kernels (a CTA per expert row block, `kernels/moe.py`),
    'fused-pipeup' the pipelined gate/up with the direct down. 'fused-direct@w4r1-w4r8e2s8' picks a launch
    shape of the direct expert kernels (`kernels.moe.parse_variant`) for tuning runs; 'fused@run17' (run 17's
    kernels) or 'fused@pf1' sets options of the pipelined kernels (`kernels.moe_pipe.parse_pipe_variant`),
    'fused@wsync' those of the wide ones above 8 tokens (`kernels.moe_wide.parse_wide_options`), and
    'fused@focc12' the front kernel's (`kernels.moe.split_front_options`)."""
    if name == "stock":
        from .stock.schedule import StockMoEHalf
        return StockMoEHalf
    base, _, variant = name.partition("@")
    if base in MOE_EXECUTORS:  # the fused ones (stock returned above)
        from .fused_moe import FusedMoE
        if variant:  # refuse a malformed name before any GPU work
            if base == "fused-direct":
                from .kernels.moe import parse_variant
                parse_variant(variant)
            elif base == "fused":
                from .kernels.moe import split_front_options
                from .kernels.moe_pipe import parse_pipe_variant
                from .kernels.moe_wide import parse_wide_options
                from .fused_moe import split_gemm_options
                rest = split_gemm_options(variant)[2]  # 'fgemm' / 'tgemm' (front / tail as the GEMM), then
                rest = split_front_options(rest)[1]  # 'focc12' (the front kernel's) then the expert kernels'
                rest = parse_wide_options(rest)[2]  # the wide kernels' (above 8 tokens), then the pipelined ones'
                if rest:
                    try:
                        parse_pipe_variant(rest)
                    except ValueError as e:
                        raise ValueError(f"{e}. Besides these: the front and routing kernels' options (cand0, mtfit0, "
                                         "tring0, tringRxS, fring, fringRxS, cotail, tringco, skeys, foccN, fpdl, "
                                         "mma0, rspread0, mrowsR[wW]; kernels.moe.split_front_options), the wide "
                                         "expert kernels' above 8 tokens (wsync, wstN, wupstN, wdownstN, wdownc16, "
                                         "wupc16, wdownr128, wdownpf, wdownsh8, wzpar; moe_wide.parse_wide_options) "
                                         "and fgemm / tgemm (fused_moe.split_gemm_options)") from None
            else:
                raise ValueError(f"variants apply to fused-direct (launch shapes, e.g. fused-direct@w4r2-w4r4e4s4) "
                                 f"and fused (options of the pipelined kernels, e.g. fused@run17), got {name!r}")
        experts = {"fused-direct": "direct", "fused-pipeup": "pipe-up"}.get(base, "pipe")
        return lambda w, x: FusedMoE(w, x, separate_routing=True if base == "fused5" else None,
                                     variant=variant or None, experts=experts,
                                     pdl={"fused-nopdl": False, "fused-pdl": True}.get(base))
    raise ValueError(f"MoE executor must be one of {MOE_EXECUTORS} (optionally with @variant), got {name!r}")


def moe_input(tokens: int, d: int, seed: int, device) -> torch.Tensor:
    """A fresh MoE input: unit-RMS rows like an RMSNorm output, bf16."""
    g = torch.Generator(device="cpu").manual_seed(10_000 + seed)
    return torch.randn(tokens, d, generator=g).to(torch.bfloat16).to(device)


def moe_streamed_bytes(shard: ShardSpec, active_experts: int, tokens: int) -> int:
    """Weight bytes the MoE half must stream (replicated bf16, shared experts, active experts) plus
    its activations in and out (bf16)."""
    d = shard.cfg.hidden_size
    return (moe_replicated_bytes(shard.cfg) + shared_expert_bytes(shard) + active_experts * routed_expert_bytes(shard)
            + 2 * tokens * d * 2)


def check_moe(make, w: LayerWeights, x: torch.Tensor) -> dict:
    """One step of `make(w, x)` against the fp32 reference of the MoE half (bf16 accuracy rule)."""
    ref, routing = moe_block_one_rank(x, w.moe, w.cfg)
    ref_bf, _ = moe_block_one_rank(x, w.moe, w.cfg, Storage.BF16)
    ex = make(w, x)
    ex()
    torch.cuda.synchronize()
    return {**compare_step(ex.h, ref, ref_bf, ex.routing[0], x, w.moe, w.cfg),
            "active_experts": int(torch.unique(routing.ids).numel()),
            "kernels_used": getattr(ex, "kernels_used", "stock schedule")}


def run_moe_sweep(executors: Iterable[str] = MOE_EXECUTORS, tps: Iterable[int] = (8,),
                  batches: Iterable[int] = (1, 8, 64), tokens: Iterable[int] = (1,), replays: int = 100,
                  out_csv: str | Path | None = None, timed: bool = True, progress: bool = True,
                  seed: int = 0) -> pd.DataFrame:
    """Check (and with `timed`, time) each executor's MoE half over TP, batch and tokens per sequence."""
    from tqdm.auto import tqdm

    from .bench import measure_copy_bandwidth, provenance, time_graph
    from .sweeps import choose_copies

    if not torch.cuda.is_available():
        raise GPURequired("the MoE sweep needs a CUDA GPU; on a CPU machine read data/measured/ instead")
    executors, tps, batches, tokens = list(executors), list(tps), list(batches), list(tokens)
    copy_bw = measure_copy_bandwidth() if timed else float("nan")
    prov = provenance()
    rows = []
    configs = [(tp, b, n) for tp in tps for b in batches for n in tokens]
    bar = tqdm(total=len(configs) * len(executors), desc="MoE half", disable=not progress)
    for tp in tps:
        shard = ShardSpec(tp=tp)
        w = make_layer_weights("kda_moe", shard, seed=seed).to("cuda")
        copies_w = None
        for b, n in [(b, n) for b in batches for n in tokens]:
            N = b * n
            x = moe_input(N, shard.cfg.hidden_size, seed + 31 * N + tp, "cuda")
            for name in executors:
                make = make_moe_executor(name)
                row = {"executor": name, "part": "moe_half", "tp": tp, "batch": b, "tokens_per_seq": n}
                try:
                    row.update(check_moe(make, w, x))
                    if row["check_ok"] and timed:
                        streamed = moe_streamed_bytes(shard, row["active_experts"], N)
                        copies = choose_copies(streamed)
                        copies_w, execs = _moe_copies(make, w, copies_w, copies, N, seed)
                        t = time_graph(execs, replays=replays)
                        row.update(us_median=t.us_median, us_p10=t.us_p10, us_p90=t.us_p90, replays=t.replays,
                                   us_first=t.us_first, warmup_replays=t.warmup_replays,
                                   copies=copies, **t.count_columns(),
                                   kernels_inventory=len(execs[0].launches()), bytes_streamed=streamed,
                                   achieved_GBps=streamed / (t.us_median * 1e-6) / 1e9, copy_bw_GBps=copy_bw / 1e9,
                                   floor_us=streamed / copy_bw * 1e6)
                        row["floor_ratio"] = row["us_median"] / row["floor_us"]
                        del execs
                except Exception as e:  # record and go on
                    row.update(check_ok=False, error=f"{type(e).__name__}: {e}"[:500])
                row.update(prov)
                rows.append(row)
                if out_csv:
                    pd.DataFrame(rows).to_csv(out_csv, index=False)
                bar.update(1)
                if progress:
                    tqdm.write(_summary(row))
        del w, copies_w
        torch.cuda.empty_cache()
    bar.close()
    df = add_speedup(pd.DataFrame(rows))
    if out_csv:
        df.to_csv(out_csv, index=False)
    return df


def _moe_copies(make, w: LayerWeights, copies_w: list | None, copies: int, tokens: int, seed: int):
    """(weight copies, executors): `copies` MoE halves on distinct weights (the copies made so far are
    reused and extended) with their own inputs, for a CUDA graph that streams them in turn."""
    from .sweeps import weight_copy

    if copies_w is None or len(copies_w) < copies:
        copies_w = [w] + [weight_copy(w, i) for i in range(1, copies)]
    d = w.cfg.hidden_size
    return copies_w, [make(copies_w[i], moe_input(tokens, d, seed + i, "cuda")) for i in range(copies)]


class _LaunchPrefix:
    """The first `k` launches of an executor, as an executor (for the in-graph breakdown)."""

    def __init__(self, ex, k: int):
        self.ex, self.k = ex, k

    def launches(self):
        return self.ex.launches()[: self.k]

    def __call__(self) -> None:
        for launch in self.launches():
            launch.run()


def run_moe_breakdown(executors: Iterable[str] = ("fused",), tp: int = 8, batches: Iterable[int] = (1,),
                      replays: int = 200, out_csv: str | Path | None = None, seed: int = 0) -> pd.DataFrame:
    """Where the time goes inside the CUDA graph: for k = 1..n, time the graph of every layer copy's first
    k launches (L2 rotated as in the sweep); a launch's cost is the median's growth when it is added, which
    counts its overlap with its neighbours (programmatic dependent launch) and the gaps between launches,
    unlike a profiler that runs each kernel alone with cold caches."""
    from .bench import measure_copy_bandwidth, provenance, time_graph
    from .sweeps import choose_copies

    if not torch.cuda.is_available():
        raise GPURequired("the breakdown needs a CUDA GPU; on a CPU machine read data/measured/ instead")
    shard = ShardSpec(tp=tp)
    w = make_layer_weights("kda_moe", shard, seed=seed).to("cuda")
    copy_bw = measure_copy_bandwidth()
    prov = provenance()
    rows = []
    copies_w = None
    for b in batches:
        for name in executors:
            make = make_moe_executor(name)
            check = check_moe(make, w, moe_input(b, shard.cfg.hidden_size, seed + 31 * b + tp, "cuda"))
            copies = choose_copies(moe_streamed_bytes(shard, check["active_experts"], b))
            copies_w, execs = _moe_copies(make, w, copies_w, copies, b, seed)
            prev = 0.0
            launches = execs[0].launches()
            for k in range(1, len(launches) + 1):
                t = time_graph([_LaunchPrefix(e, k) for e in execs], replays=replays)
                lc = launches[k - 1]
                moved = lc.bytes
                rows.append({"executor": name, "tp": tp, "batch": b, "launch": k, "label": lc.label,
                             "prefix_us": t.us_median, "prefix_p10": t.us_p10, "prefix_p90": t.us_p90,
                             "added_us": t.us_median - prev, "bytes_moved": moved,
                             "GBps_of_added": moved / max(t.us_median - prev, 1e-3) / 1e3,
                             "kernels_in_prefix": t.kernels_per_layer, "copies": copies,
                             "check_ok": check["check_ok"], "copy_bw_GBps": copy_bw / 1e9, **prov})
                prev = t.us_median
                if out_csv:
                    pd.DataFrame(rows).to_csv(out_csv, index=False)
            del execs
    return pd.DataFrame(rows)


def add_speedup(df: pd.DataFrame) -> pd.DataFrame:
    """Stock µs over fused µs for each (tp, batch, tokens) measured by both."""
    if "us_median" not in df or not {"stock", "fused"} <= set(df.executor):
        return df
    key = ["tp", "batch", "tokens_per_seq"]
    stock = df[df.executor == "stock"].set_index(key).us_median.rename("stock_us")
    df = df.join(stock, on=key)
    df["speedup_vs_stock"] = df.stock_us / df.us_median
    return df.drop(columns="stock_us")


def _summary(r: dict) -> str:
    head = f"{r['executor']:<6} moe tp{r['tp']:<3} b{r['batch']:<3} t{r['tokens_per_seq']}"
    if not r.get("check_ok"):
        return (f"{head} FAILED {r.get('error', '')} err={r.get('err_vs_fp32', float('nan')):.2e} "
                f"bound={r.get('err_bound', float('nan')):.2e} written={r.get('all_written')}")
    if "us_median" not in r:
        return f"{head} check ok err {r['err_vs_fp32']:.1e} (bound {r['err_bound']:.1e}) flips {r['routing_flips']}"
    return (f"{head} {r['us_median']:8.1f} us [{r['us_p10']:.1f},{r['us_p90']:.1f}] kernels "
            f"{r['kernels_measured']:.0f}/{r['kernels_inventory']} {r['achieved_GBps']:6.0f} GB/s floor "
            f"{r['floor_us']:.1f} us (x{r['floor_ratio']:.2f}) err {r['err_vs_fp32']:.1e} flips {r['routing_flips']}")
