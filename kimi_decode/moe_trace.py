"""Where a pipelined expert kernel spends its time, CTA by CTA, inside the CUDA graph (`kimi-decode moe --trace`).

The in-graph breakdown (`moe_bench.run_moe_breakdown`) says what each launch adds to the step; a profiler runs
each kernel alone. Neither says *why* a launch takes as long as it does. The timeline builds of the pipelined
kernels (`FusedMoE(trace=True)`, `kernels.moe_pipe.MoEUpPipeKey(trace=True)` and the down key) record, per CTA,
%globaltimer (ns, one clock for the whole GPU) and %clock64 at named checkpoints (`TRACE_UP`, `TRACE_DOWN`):
the start, the end of the wait for the previous launch, the first ring requests, the end of the staging, each
item's slot arrival and completion, moe_down's row-block flush and all-reduce read (by its flush warps since run
39, whose end is 'flusher_end'), the end; and for moe_up's first items (`WARP_TRACE_ITEMS`), per warp, when it passed the slot's mbarrier and when it had stored its K partials, and
when the reducing warp began and ended the item's reduction (`warp_item_summary`).

`run_moe_trace` times the traced step like the sweep (L2 rotated over layer copies), then replays the graph
once more with zeroed buffers and returns one row per (copy, kernel, CTA, checkpoint): the time in ns from the
earliest moe_up start of that copy's step. `summarize_trace` turns it into one row per (batch, kernel,
checkpoint) with the median over copies of the earliest, median and latest CTA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import pandas as pd
import torch

from .config import ShardSpec
from .moe_bench import _moe_copies, check_moe, moe_input, moe_streamed_bytes
from .support import GPURequired
from .weights import make_layer_weights


def trace_rows(ex, copy: int) -> list[dict]:
    """One row per recorded checkpoint of `ex` (a traced FusedMoE) after a step: kernel, cta, checkpoint, ns
    (from the earliest moe_up start)."""
    from .kernels.moe_pipe import TRACE_BUF, TRACE_DOWN, TRACE_SLOTS, TRACE_UP, warp_trace_name

    bufs = {"moe.up": (ex.trace_up.cpu(), TRACE_UP), "moe.down": (ex.trace_down.cpu(), TRACE_DOWN)}
    up_ns = bufs["moe.up"][0][:, 0, 0]
    if int((up_ns == 0).sum()):
        raise RuntimeError("a moe_up CTA recorded no start: the step did not run the traced kernels")
    t0 = int(up_ns.min())
    rows = []
    for kernel, (buf, names) in bufs.items():
        names = list(names) + [""] * (TRACE_SLOTS - 1 - len(names)) + ["end"]
        if kernel == "moe.up":  # the per-warp checkpoints of its first items
            names += [warp_trace_name(c) for c in range(TRACE_SLOTS, TRACE_BUF)]
        for cta in range(buf.shape[0]):
            for c, name in enumerate(names):
                ns = int(buf[cta, 0, c])
                if name and ns:
                    rows.append({"copy": copy, "kernel": kernel, "cta": cta, "checkpoint": name, "slot": c,
                                 "ns": ns - t0, "clk": int(buf[cta, 1, c] - buf[cta, 1, 0])})
    return rows


def run_moe_trace(tp: int = 8, batches: Iterable[int] = (1, 8), variant: str | None = None, replays: int = 100,
                  out_csv: str | Path | None = None, seed: int = 0, progress: bool = True) -> pd.DataFrame:
    """Timeline of the pipelined expert kernels in the CUDA graph of the fused MoE half (see the module)."""
    from .bench import provenance, time_graph
    from .fused_moe import FusedMoE
    from .sweeps import choose_copies

    if not torch.cuda.is_available():
        raise GPURequired("the timeline needs a CUDA GPU; on a CPU machine read data/measured/ instead")
    shard = ShardSpec(tp=tp)
    w = make_layer_weights("kda_moe", shard, seed=seed).to("cuda")
    prov = provenance()

    def make(wc, x):
        return FusedMoE(wc, x, variant=variant, trace=True)

    rows, copies_w = [], None
    batches = list(batches)
    it = batches
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(batches, desc="moe trace")
    for b in it:
        check = check_moe(make, w, moe_input(b, shard.cfg.hidden_size, seed + 31 * b + tp, "cuda"))
        if not check["check_ok"]:
            raise RuntimeError(f"the traced fused MoE failed its check at batch {b}: {check}")
        copies = choose_copies(moe_streamed_bytes(shard, check["active_experts"], b))
        copies_w, execs = _moe_copies(make, w, copies_w, copies, b, seed)
        timing = time_graph(execs, replays=replays)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for e in execs:
                e()
        for _ in range(3):
            g.replay()
        for e in execs:
            e.trace_up.zero_()
            e.trace_down.zero_()
        g.replay()
        torch.cuda.synchronize()
        for i, e in enumerate(execs):
            for r in trace_rows(e, i):
                rows.append({"tp": tp, "batch": b, "variant": variant or "", "step_us_median": timing.us_median,
                             "active_experts": check["active_experts"], **r, **prov})
        del execs, g
        if out_csv:
            pd.DataFrame(rows).to_csv(out_csv, index=False)
    return pd.DataFrame(rows)


def summarize_trace(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (batch, kernel, checkpoint): the earliest, median and latest CTA (µs from the earliest moe_up
    start), each the median over the layer copies; how many CTAs reached the checkpoint."""
    per_copy = (df.groupby(["batch", "kernel", "slot", "checkpoint", "copy"]).ns
                .agg(first="min", median="median", last="max", ctas="count").reset_index())
    out = (per_copy.groupby(["batch", "kernel", "slot", "checkpoint"])
           [["first", "median", "last", "ctas"]].median().reset_index())
    for c in ("first", "median", "last"):
        out[c] = out[c] / 1e3
    out = out.rename(columns={"first": "first_us", "median": "median_us", "last": "last_us"})
    order = {"moe.up": 0, "moe.down": 1}
    out["k"] = out.kernel.map(order)
    return out.sort_values(["batch", "k", "slot"]).drop(columns=["k", "slot"]).reset_index(drop=True)


def warp_item_summary(df: pd.DataFrame) -> pd.DataFrame:
    """moe_up's per-warp checkpoints (`run_moe_trace` rows) -> one row per (batch, variant, item, warp): the
    median over CTAs and copies of the cycles from the item's slot arrival (CTA checkpoint itemN_arrived) to the
    warp getting past the mbarrier ('waited') and to its partials being stored ('computed'); the reducing warp as
    warp 'epi' (began / ended its reduction)."""
    up = df[df.kernel == "moe.up"].assign(variant=lambda d: d["variant"].fillna(""))
    per = up[up.checkpoint.str.match(r"item\d+_(w\d+|epi)_")].copy()
    if per.empty:
        raise ValueError("no per-warp checkpoints: the trace was made by a build without them (before run 27)")
    parts = per.checkpoint.str.extract(r"item(?P<item>\d+)_(?P<warp>w\d+|epi)_(?P<what>\w+)")
    per = pd.concat([per, parts], axis=1)
    per["item"] = per["item"].astype(int)
    arrived = up[up.checkpoint.str.fullmatch(r"item\d+_arrived")].copy()
    arrived["item"] = arrived.checkpoint.str.extract(r"item(\d+)_")[0].astype(int)
    keys = ["batch", "variant", "copy", "cta", "item"]
    per = per.merge(arrived[keys + ["clk"]].rename(columns={"clk": "arrived_clk"}), on=keys)
    per["cycles"] = per.clk - per.arrived_clk
    out = per.pivot_table(index=["batch", "variant", "item", "warp"], columns="what", values="cycles",
                          aggfunc="median").reset_index()
    out.columns.name = None
    return out


def sub_partition_summary(df: pd.DataFrame) -> pd.DataFrame:
    """`warp_item_summary` by SM sub-partition (warp w runs on w mod 4): one row per (batch, variant, item) with,
    per sub-partition, the cycles from the slot's arrival until its last compute warp had stored its partials
    (`sp0` .. `sp3`), how many compute warps it has, and when the reducing warp began and ended."""
    w = warp_item_summary(df)
    comp = w[w.warp.str.startswith("w")].copy()
    comp["sp"] = comp.warp.str[1:].astype(int) % 4
    last = comp.pivot_table(index=["batch", "variant", "item"], columns="sp", values="computed", aggfunc="max")
    last.columns = [f"sp{c}" for c in last.columns]
    count = comp.pivot_table(index=["batch", "variant", "item"], columns="sp", values="computed", aggfunc="count")
    last["warps_per_sp"] = count.astype(int).astype(str).agg("/".join, axis=1)
    out = last.reset_index()
    epi = w[w.warp == "epi"][["batch", "variant", "item", "began", "ended"]]
    return out.merge(epi, on=["batch", "variant", "item"], how="left").rename(
        columns={"began": "epi_began", "ended": "epi_ended"})
