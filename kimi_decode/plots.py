"""Matplotlib figures built from the package's data (never from hand-typed numbers)."""

from __future__ import annotations

from typing import Iterable

import matplotlib.pyplot as plt

from .byte_counts import H200_COPY_BANDWIDTH, LayerBytes


def plot_bytes_per_sub_block(items: Iterable[LayerBytes], ax=None, title: str | None = None):
    """Stacked horizontal bars: the bytes one rank streams per decode step, by sub-block.

    The secondary axis reads the same bytes as time at the H200's measured copy
    bandwidth (the memory floor).
    """
    items = list(items)
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.6 + 0.55 * len(items)))
    labels = [f"{b.layer} TP{b.tp}, batch {b.batch}" + (f", ctx {b.context:,}" if b.layer == "mla_moe" else "")
              for b in items]
    cmap = plt.get_cmap("tab20")
    colors: dict[str, tuple] = {}
    for i, b in enumerate(items):
        left = 0.0
        for name, nbytes in b.sub_blocks().items():
            key = name.split(" (")[0]
            c = colors.setdefault(key, cmap(len(colors) % 20))
            ax.barh(i, nbytes / 1e6, left=left, color=c, label=key if key not in ax.get_legend_handles_labels()[1] else None)
            left += nbytes / 1e6
        ax.text(left, i, f"  {left:,.0f} MB  ({b.floor_seconds() * 1e6:.1f} µs floor)", va="center", fontsize=8)
    ax.set_yticks(range(len(items)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("MB streamed per decode step, one rank")
    ax.set_xlim(0, max(b.streamed for b in items) / 1e6 * 1.45)
    sec = ax.secondary_xaxis("top", functions=(lambda mb: mb * 1e6 / H200_COPY_BANDWIDTH * 1e6,
                                               lambda us: us * 1e-6 * H200_COPY_BANDWIDTH / 1e6))
    sec.set_xlabel(f"µs at the H200's measured copy bandwidth ({H200_COPY_BANDWIDTH / 1e12:.2f} TB/s)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "Kimi K3 decode: bytes each rank must move per layer", pad=12)
    ax.figure.tight_layout()
    return ax


def plot_gemv_vs_cublas(df, M: int = 1, copy_bw_GBps: float = H200_COPY_BANDWIDTH / 1e9, ax=None):
    """Decode GEMV time per shape: the CuTe DSL kernel against cuBLAS (torch.mm), from a measured CSV.

    Bars are µs (lower is better); labels give the fused kernel's achieved GB/s as a share of the
    measured copy bandwidth.
    """
    import numpy as np

    d = df[(df.kernel == "gemv") & (df.M == M)]
    if d.empty:
        raise ValueError(f"no GEMV rows with M={M}")
    shapes = list(dict.fromkeys(zip(d.K, d.N)))
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 4))
    x = np.arange(len(shapes))
    impls = [("cute_gemv", "CuTe DSL GEMV (ours)", "tab:blue"), ("torch.mm", "cuBLAS (torch.mm)", "tab:gray")]
    for i, (impl, label, color) in enumerate(impls):
        us = [float(d[(d.impl == impl) & (d.K == k) & (d.N == n)].us_median.iloc[0]) for k, n in shapes]
        bars = ax.bar(x + (i - 0.5) * 0.38, us, 0.38, label=label, color=color)
        if impl == "cute_gemv":
            for b_, (k, n) in zip(bars, shapes):
                gbs = float(d[(d.impl == impl) & (d.K == k) & (d.N == n)].gbs.iloc[0])
                ax.annotate(f"{gbs / copy_bw_GBps:.0%}", (b_.get_x() + b_.get_width() / 2, b_.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"{M}×{k}×{n}" for k, n in shapes], rotation=20)
    ax.set_xlabel("M × K × N (bf16 weights, rotated out of L2)")
    ax.set_ylabel("µs per GEMV (median of graph replays)")
    ax.set_title(f"Decode GEMV on the H200 at M={M}: labels = achieved bandwidth / "
                 f"{copy_bw_GBps / 1e3:.2f} TB/s copy bandwidth")
    ax.legend(frameon=False)
    ax.figure.tight_layout()
    return ax


def plot_latency_vs_batch(df, kernel: str, group: str = "params", ax=None):
    """µs per launch against batch (M) for each variant of a measured kernel (e.g. AttnRes per n)."""
    d = df[df.kernel == kernel]
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for key, g in d.groupby(group):
        g = g.sort_values("M")
        ax.errorbar(g.M, g.us_median, yerr=[g.us_median - g.us_p10, g.us_p90 - g.us_median], marker="o",
                    capsize=3, label=str(key))
    ax.set_xscale("log", base=2)
    ms = sorted(set(int(m) for m in d.M))
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("tokens in the step (M)")
    ax.set_ylabel("µs per launch (median, p10–p90)")
    ax.set_title(f"{kernel} (CuTe DSL) on the H200, per launch under CUDA graphs")
    ax.legend(fontsize=8, frameon=False)
    ax.figure.tight_layout()
    return ax


def plot_kernel_counts(counts: dict[str, int], published=None, ax=None):
    """Kernels per decoder layer: this project's executors (H200 inventories) beside published figures.

    `counts` maps a label (e.g. 'stock, KDA+MoE, TP8 (H200)') to a launch count; `published` is the
    `data/published` table, whose GB300 rows are drawn hatched and labelled as GB300.
    """
    labels, values, styles = [], [], []
    for k, v in counts.items():
        labels.append(k)
        values.append(v)
        styles.append(("tab:blue", None))
    if published is not None:
        for r in published[published.unit == "kernels"].itertuples():
            name = r.figure.replace("kernels per decoder layer ", "").strip("()")
            labels.append(f"{name} [{r.system}, published]")
            values.append(r.value)
            styles.append(("tab:orange", "//"))
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.8 + 0.42 * len(labels)))
    for i, (v, (c, h)) in enumerate(zip(values, styles)):
        ax.barh(i, v, color=c, hatch=h, edgecolor="white" if h is None else "black")
        ax.text(v, i, f" {v:g}", va="center", fontsize=9)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("kernel launches per decoder layer (decode step)")
    ax.set_title("Kernels per Kimi K3 decoder layer")
    ax.figure.tight_layout()
    return ax


def plot_floor_vs_batch(df, tp: int = 8, ax=None):
    """The H200 memory floor per layer against batch, one line per layer type / context / DCP."""
    d = df[df.tp == tp]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.5))
    for (layer, ctx, dcp), g in d.groupby(["layer", "context", "dcp"]):
        g = g.sort_values("batch")
        label = layer if layer != "mla_moe" else f"mla_moe, ctx {ctx:,}" + (f", DCP{dcp}" if dcp > 1 else "")
        ax.plot(g.batch, g.floor_us_h200, marker="o", label=label)
    ax.set_xscale("log", base=2)
    bs = sorted(set(int(b) for b in d.batch))
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("decode batch (sequences, 1 token each)")
    ax.set_ylabel(f"µs per layer at {H200_COPY_BANDWIDTH / 1e12:.2f} TB/s")
    ax.set_title(f"Memory floor of one decode step per layer, TP{tp} rank on an H200")
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    ax.figure.tight_layout()
    return ax


def plot_dcp_measured(df, ax=None, title: str | None = None):
    """Measured µs per MLA+MoE layer step of one rank against the DCP size (a `kimi-decode sweep --dcps`
    CSV such as `stock_dcp_h200_tp8`): one line per (batch, context) with p10–p90 bars, and dashed in the
    same colour the memory floor of the same bytes (the rank's 1/DCP share of the latent cache)."""
    d = df[df.get("check_ok", True) & df.us_median.notna()] if "us_median" in df.columns else df.iloc[0:0]
    if d.empty:
        raise ValueError("no timed rows (us_median) in this frame")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.5))
    for (b, ctx), g in d.groupby(["batch", "context"]):
        g = g.sort_values("dcp")
        line = ax.errorbar(g.dcp, g.us_median, yerr=[g.us_median - g.us_p10, g.us_p90 - g.us_median], marker="o",
                           capsize=3, label=f"batch {b}, context {ctx:,}")
        ax.plot(g.dcp, g.floor_us, "--", lw=1, color=line[0].get_color())
    ax.set_xscale("log", base=2)
    ds = sorted(set(int(x) for x in d.dcp))
    ax.set_xticks(ds, [str(x) for x in ds])
    ax.set_yscale("log")
    ax.set_xlabel("decode context parallel size (latent cache sharded by position over the ranks)")
    ax.set_ylabel("µs per layer step on one rank (median, p10–p90)")
    gpu = d.gpu.iloc[0] if "gpu" in d.columns else "GPU"
    ax.set_title(title or f"MLA+MoE layer, TP{int(d.tp.iloc[0])} rank on the {gpu}: measured (solid) and memory "
                          f"floor (dashed)", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    ax.figure.tight_layout()
    return ax


def plot_ring_rate(df, ax=None, title: str | None = None):
    """A `kimi-decode ring-rate` CSV (such as `ring_rate_h200`): for each ring geometry (KB per slot × slots, CTAs
    per SM, KB in flight per SM) the fraction of this card's copy bandwidth the ring streams at, with the consumers
    idle and with the tail ring's row loop, p10–p90 bars; a line at 1.0 (the copy) and, dotted, the tail ring's
    geometry."""
    need = {"slot_kb", "stages", "ctas_per_sm", "work", "us_median", "us_p10", "us_p90", "fraction_of_copy"}
    if not need <= set(df.columns):
        raise ValueError(f"not a ring-rate frame: missing {sorted(need - set(df.columns))}")
    if df.empty:
        raise ValueError("no rows in this frame")
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4.5))
    geo = df[["slot_kb", "stages", "ctas_per_sm"]].drop_duplicates().sort_values(["ctas_per_sm", "slot_kb", "stages"])
    labels = [f"{r.slot_kb} KB × {r.stages}" + (f", {r.ctas_per_sm} CTAs/SM" if r.ctas_per_sm > 1 else "")
              for r in geo.itertuples()]
    width = 0.38
    for j, (work, name) in enumerate(((False, "consumers release at once"), (True, "consumers run the row loop"))):
        xs, fr, lo, hi = [], [], [], []
        for i, r in enumerate(geo.itertuples()):
            row = df[(df.slot_kb == r.slot_kb) & (df.stages == r.stages) & (df.ctas_per_sm == r.ctas_per_sm)
                     & (df.work == work)]
            if row.empty:
                continue
            row = row.iloc[0]
            xs.append(i + (j - 0.5) * width)
            fr.append(row.fraction_of_copy)
            # a slower replay (p90 µs) streams a smaller fraction
            lo.append(row.fraction_of_copy - row.fraction_of_copy * row.us_median / row.us_p90)
            hi.append(row.fraction_of_copy * row.us_median / row.us_p10 - row.fraction_of_copy)
        ax.bar(xs, fr, width, yerr=[lo, hi], capsize=2, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    tail = [i for i, r in enumerate(geo.itertuples()) if (r.slot_kb, r.stages, r.ctas_per_sm) == (28, 7, 1)]
    for i in tail:
        ax.axvline(i, color="k", ls=":", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("bytes read / time, as a fraction of the copy bandwidth")
    gpu = df.gpu.iloc[0] if "gpu" in df.columns else "GPU"
    copy = f", copy {df.copy_GBps.iloc[0] / 1e3:.2f} TB/s" if "copy_GBps" in df.columns else ""
    ax.set_title(title or f"A bulk-copy ring alone on the {gpu}{copy} (dotted: the tail ring's geometry)",
                 fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="lower right")
    ax.grid(alpha=0.3, axis="y")
    ax.figure.tight_layout()
    return ax


def plot_collectives_vs_emulation(df, ax=None, title: str | None = None):
    """One layer step on one rank with real collectives (one bar per all-reduce kind: NCCL, one-shot) beside the
    single-GPU emulation of the same rank, from `python -m kimi_decode.multi_gpu` CSVs (median µs, p10–p90 on
    the real ones). The gap is the emulation's error."""
    import numpy as np

    d = df if "dcp" in df.columns else df.assign(dcp=1)
    keys = ["layer", "tp", "dcp", "batch", "processes"]
    groups = d.groupby(keys, sort=False)
    configs = list(groups.groups)
    kinds = list(dict.fromkeys(d.collectives))
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 1.6 + 0.3 * len(configs) * (len(kinds) + 1)))
    y = np.arange(len(configs))
    h = 0.8 / (len(kinds) + 1)
    for i, kind in enumerate(kinds):
        rows = [g[g.collectives == kind] for g in (groups.get_group(c) for c in configs)]
        us = np.array([r.us_median.iloc[0] if len(r) else np.nan for r in rows])
        lo = [u - r.us_p10.iloc[0] if len(r) else 0 for u, r in zip(us, rows)]
        hi = [r.us_p90.iloc[0] - u if len(r) else 0 for u, r in zip(us, rows)]
        ax.barh(y + i * h, us, h, xerr=[lo, hi], capsize=2, label=f"real collectives: {kind}")
    emu = [groups.get_group(c).emulated_us_median.dropna() for c in configs]
    ax.barh(y + len(kinds) * h, [e.iloc[0] if len(e) else np.nan for e in emu], h, color="0.6", hatch="//",
            label="single-GPU emulation of the same rank")
    ax.set_yticks(y + h * len(kinds) / 2,
                  [f"{layer}, TP{tp} rank" + (f", DCP{dcp}" if dcp > 1 else "") + f", batch {b}, "
                   f"{n} process{'es' if n > 1 else ''}" for layer, tp, dcp, b, n in configs])
    ax.invert_yaxis()
    ax.set_xlabel("µs per layer step (median of CUDA-graph replays; bars: p10–p90)")
    gpu = d.gpu.iloc[0] if "gpu" in d.columns else "GPU"
    ax.set_title(title or f"Real collectives against their single-GPU emulation ({gpu})", fontsize=10, pad=24)
    ax.legend(fontsize=8, frameon=False, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=len(kinds) + 1)
    ax.grid(axis="x", alpha=0.3)
    ax.figure.tight_layout()
    return ax


# ------------------------------------------------------------ Nsight Compute profiles (kimi_decode.profile)


def _launch_labels(df) -> list[str]:
    """The y labels of a profile frame: its `label` column (e.g. '03 moe.router'), else order + kernel.

    Where the labels repeat (executors profiled as one unlabelled 'step'), the kernel name is added.
    """
    kernels = [str(k) for k in df["kernel"]] if "kernel" in df.columns else [""] * len(df)
    orders = list(df["order"]) if "order" in df.columns else list(range(1, len(df) + 1))
    if "label" in df.columns:
        labels = ["" if (isinstance(v, float) and v != v) else str(v) for v in df["label"]]
    else:
        labels = [""] * len(df)
    if len(set(labels)) < len(labels) or not all(labels):
        labels = [f"{int(o):02d} {lab + ': ' if lab else ''}{k[:48]}" for o, lab, k in zip(orders, labels, kernels)]
    return labels


def _profile_name(df) -> str:
    """'<executor> <config>' of a loaded profile (from its folder), or '' for a frame never saved."""
    folder = df.attrs.get("folder") if hasattr(df, "attrs") else None
    if folder:
        from pathlib import Path

        p = Path(folder)
        return f"{p.parent.name} {p.name}"
    return ""


def _profile_gpu(df) -> str:
    prov = df.attrs.get("provenance", {}) if hasattr(df, "attrs") else {}
    return prov.get("gpu") or "the GPU"


def _durations_us(df) -> list[float]:
    col = df["duration_us"] if "duration_us" in df.columns else df["duration_ns"] / 1e3
    return [float(v) for v in col]


def plot_profile_durations(df, ax=None, title: str | None = None):
    """One horizontal bar per kernel launch of a saved Nsight Compute profile, in launch order.

    x is the launch's duration in µs (``gpu__time_duration`` under ncu: cold L2, clocks unlocked);
    each bar is annotated with its share of the layer time (sum of all launches of the profile).
    """
    if len(df) == 0:
        raise ValueError("the profile holds no kernel launches")
    us = _durations_us(df)
    total = sum(us)
    share = [float(v) for v in df["share_of_layer"]] if "share_of_layer" in df.columns else [u / total for u in us]
    labels = _launch_labels(df)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.4 + 0.34 * len(df)))
    y = list(range(len(df)))
    ax.barh(y, us, color="tab:blue", label="µs of the launch\n(label: share of the\nsummed layer time)")
    for yi, u, s in zip(y, us, share):
        ax.text(u, yi, f" {s:.1%}", va="center", fontsize=8)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlim(0, max(us) * 1.18 if max(us) > 0 else 1)
    ax.set_xlabel("µs per launch (Nsight Compute gpu__time_duration; cold L2, clocks unlocked)")
    ax.set_ylabel("kernel launch, in launch order")
    name = _profile_name(df)
    ax.set_title(title or f"{name + ': ' if name else ''}{len(df)} kernel launches, {total:,.1f} µs summed "
                          f"(per-kernel times under ncu on {_profile_gpu(df)})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    ax.figure.tight_layout()
    return ax


def plot_profile_bandwidth(df, copy_bw: float = H200_COPY_BANDWIDTH, ax=None, title: str | None = None):
    """Achieved DRAM bandwidth (read + written bytes / duration, GB/s) per launch, against the copy bandwidth.

    Needs the DRAM byte counters, i.e. a profile collected with the 'memory' or 'full' metric set;
    `copy_bw` is in bytes/s (default: the H200's measured copy bandwidth, read + write counted).
    """
    if "dram_GBps" not in df.columns or df["dram_GBps"].isna().all():
        raise ValueError("this profile has no DRAM bandwidth (dram_GBps): it needs the DRAM byte counters of the "
                         "'memory' or 'full' metric set; re-profile with `kimi-decode profile --metrics full` "
                         "(or --metrics memory)")
    if len(df) == 0:
        raise ValueError("the profile holds no kernel launches")
    gbps = [float(v) for v in df["dram_GBps"]]
    copy_gbps = copy_bw / 1e9
    labels = _launch_labels(df)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.6 + 0.34 * len(df)))
    y = list(range(len(df)))
    ax.barh(y, [0.0 if g != g else g for g in gbps], color="tab:green",
            label="achieved DRAM GB/s,\nread + write (label: share\nof the copy bandwidth)")
    for yi, g in zip(y, gbps):
        ax.text(0.0 if g != g else g, yi, " n/a" if g != g else f" {g / copy_gbps:.0%}", va="center", fontsize=8)
    ax.axvline(copy_gbps, color="tab:red", ls="--",
               label=f"measured copy bandwidth\n{copy_gbps:,.0f} GB/s ({copy_bw / 1e12:.2f} TB/s,\nread + write)")
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    finite = [g for g in gbps if g == g]
    ax.set_xlim(0, max(finite + [copy_gbps]) * 1.25)
    ax.set_xlabel("GB/s achieved from DRAM ((dram bytes read + written) / kernel duration)")
    ax.set_ylabel("kernel launch, in launch order")
    name = _profile_name(df)
    ax.set_title(title or f"{name + ': ' if name else ''}DRAM bandwidth per launch on {_profile_gpu(df)}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    ax.figure.tight_layout()
    return ax


def _stacked_launch_bars(segments: dict, ax, xlabel: str, title: str, unit: str, units: str):
    """One stacked horizontal bar per name: `segments[name]` = [(launch label, µs), ...] in launch order,
    segments numbered (and named, for bars of a few launches), each bar ending with its count of `units`
    (e.g. "kernels", "launches") and total µs."""
    from matplotlib.patches import Patch

    names = list(segments)
    cmap = plt.get_cmap("tab20")
    totals = [sum(u for _, u in segments[n]) for n in names]
    span = max(totals) if totals and max(totals) > 0 else 1.0
    for i, name in enumerate(names):
        left = 0.0
        for j, (_, u) in enumerate(segments[name]):
            ax.barh(i, u, left=left, color=cmap(j % 20), edgecolor="white", linewidth=0.6, height=0.6)
            if u > 0.035 * span:  # launch numbers (and short names) inside segments wide enough to hold them
                label = segments[name][j][0].split(".")[-1]
                text = f"{j + 1} {label}" if label and len(segments[name]) <= 6 and u > 0.09 * span else str(j + 1)
                ax.text(left + u / 2, i, text, ha="center", va="center", fontsize=7, color="black")
            left += u
        ax.text(left, i, f"  {len(segments[name])} {units}, {left:,.1f} µs", va="center", fontsize=9)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, span * 1.35)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("executor")
    ax.legend(handles=[Patch(facecolor=cmap(0), edgecolor="white"), Patch(facecolor="none", edgecolor="none")],
              labels=[f"one segment = one {unit}\n(numbered, in\nlaunch order)",
                      f"bar end: {units}\nand total µs"],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(title)
    ax.figure.tight_layout()
    return ax


def plot_profiles_side_by_side(frames: dict, ax=None, title: str | None = None):
    """One stacked horizontal bar per executor: its launches' durations (µs) end to end, in launch order.

    `frames` maps a name (e.g. 'stock-moe', 'fused-moe') to a profile frame; the end of each bar
    gives the executor's kernel count and its summed µs.
    """
    if not frames:
        raise ValueError("no profiles to compare: pass {name: profile frame}")
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.6 + 0.7 * len(frames)))
    segments = {name: [("", u) for u in _durations_us(df)] for name, df in frames.items()}
    return _stacked_launch_bars(segments, ax, "µs per step: per-kernel Nsight Compute durations summed (cold L2, "
                                "clocks unlocked)", title or "Kernel launches per step, stacked: " + " vs ".join(frames),
                                "kernel", "kernels")


def plot_graph_breakdown(df, batch: int = 1, ax=None, title: str | None = None):
    """What each launch adds inside the CUDA graph (`kimi-decode moe --breakdown`, e.g. the CSV
    `moe_breakdown_h200_tp8`): one stacked bar per executor, a segment per launch in launch order whose width
    is the growth of the graph's median when that launch is added; the bar's end is the whole step."""
    d = df[df.batch == batch]
    if d.empty:
        raise ValueError(f"no breakdown rows at batch {batch}; batches present: {sorted(set(df.batch))}")
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.6 + 0.7 * d.executor.nunique()))
    segments = {name: [(r.label, r.added_us) for r in g.sort_values("launch").itertuples()]
                for name, g in d.groupby("executor", sort=False)}
    gpu = d.gpu.iloc[0] if "gpu" in d.columns else "GPU"
    return _stacked_launch_bars(
        segments, ax, "µs per step inside the CUDA graph (each segment: what adding that launch costs)",
        title or f"Where the time goes in the graph, batch {batch}, TP{int(d.tp.iloc[0])}, {gpu}", "launch", "launches")


def plot_executors_vs_batch(df, ax=None, title: str | None = None, part: str = "MoE half"):
    """µs per step against batch for each executor of a measured sweep (e.g. `moe_half_h200_tp8`),
    with p10–p90 bars, the memory floor of the same bytes, and each point's kernel count."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, g) in enumerate(df.groupby("executor", sort=False)):
        g = g.sort_values("batch")
        line = ax.errorbar(g.batch, g.us_median, yerr=[g.us_median - g.us_p10, g.us_p90 - g.us_median], marker="o",
                           capsize=3, label=name)
        for b, us, k in zip(g.batch, g.us_median, g.kernels_measured):
            ax.annotate(f"{k:.0f} k", (b, us), textcoords="offset points", xytext=(6, -12 + 10 * i), fontsize=7,
                        color=line[0].get_color())
    floor = df.groupby("batch").floor_us.first().sort_index()
    ax.plot(floor.index, floor.values, "k--", lw=1, label="memory floor (bytes / measured copy bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    bs = sorted(set(int(b) for b in df.batch))
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("batch (sequences, 1 token each)")
    ax.set_ylabel(f"µs per {part} (median, p10–p90)")
    gpu = df.gpu.iloc[0] if "gpu" in df.columns else "GPU"
    ax.set_title(title or f"{part}, TP{int(df.tp.iloc[0])} rank, on the {gpu} (k = kernels in the CUDA graph)")
    ax.legend(fontsize=8, frameon=False)
    ax.figure.tight_layout()
    return ax


def plot_moe_trace(df, batch: int = 1, copy: int | None = None, ax=None, title: str | None = None):
    """Timeline of the pipelined expert kernels inside the graph (`moe_trace.run_moe_trace` rows): one line per
    CTA (moe_up above, moe_down below) from its start to its end; the wait for the previous launch, the staging,
    and each item from its slot's arrival to its completion drawn as segments, so idle gaps show as thin line."""
    d = df[df.batch == batch]
    if d.empty:
        raise ValueError(f"no trace rows for batch {batch}")
    copy = int(d["copy"].min()) if copy is None else copy
    d = d[d["copy"] == copy]
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 6))
    colors = {"wait": "0.75", "staging": "tab:orange", "item": "tab:blue", "flush": "tab:red"}
    y, ticks, seen = 0, [], set()

    def seg(y_, a, b, what):
        ax.plot([a / 1e3, b / 1e3], [y_, y_], color=colors[what], lw=2.2, solid_capstyle="butt",
                label=what if what not in seen else None)
        seen.add(what)

    for kernel in ("moe.up", "moe.down"):
        k = d[d.kernel == kernel]
        first = y
        for cta, c in k.groupby("cta"):
            t = dict(zip(c.checkpoint, c.ns))
            if "start" in t and "end" in t:
                ax.plot([t["start"] / 1e3, t["end"] / 1e3], [y, y], color="0.85", lw=0.6)
            if "start" in t and "wait_done" in t:
                seg(y, t["start"], t["wait_done"], "wait")
            last = t.get("wait_done", t.get("start"))
            if "staged" in t and last is not None:
                seg(y, max(last, t.get("ring_issued", last)), t["staged"], "staging")
            n = 0
            while f"item{n}_arrived" in t and f"item{n}_done" in t:
                seg(y, t[f"item{n}_arrived"], t[f"item{n}_done"], "item")
                n += 1
            if "flush_start" in t and "flush_counted" in t:
                seg(y, t["flush_start"], t.get("allreduce_done", t["flush_counted"]), "flush")
            y += 1
        ticks.append(((first + y - 1) / 2, f"{kernel}\n({y - first} CTAs)"))
        y += 8
    ax.set_yticks([p for p, _ in ticks], [s for _, s in ticks])
    ax.invert_yaxis()
    ax.set_xlabel("µs from the first moe_up CTA's start (%globaltimer)")
    step = d.step_us_median.iloc[0] if "step_us_median" in d else None
    ax.set_title(title or f"Pipelined expert kernels inside the graph, TP{int(d.tp.iloc[0])} batch {batch}, layer "
                 f"copy {copy}" + (f" (whole step {step:.1f} µs)" if step else ""))
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return ax


STALL_GROUPS = {  # ncu's sampled warp states (source page columns) -> what a reader calls them
    "issued": ("stall_selected",),
    "ALU/math pipe busy": ("stall_math", "stall_not_selected", "stall_dispatch"),
    "fixed-latency dependency": ("stall_wait",),
    "shared memory": ("stall_short_sb", "stall_mio"),
    "global memory / mbarrier": ("stall_long_sb", "stall_lg"),
    "CTA barrier": ("stall_barrier", "stall_membar"),
}


def plot_stall_hotspots(page, top: int = 10, ax=None, title: str | None = None):
    """Where one kernel's warps were sampled (`profile.read_source_page` frame of ncu's source page): one bar per
    opcode (its `top` busiest), split into groups of warp states (`STALL_GROUPS`); the rest of the states are
    'other'. Bars are shares of all the kernel's samples."""
    from .profile import stall_hotspots

    hot = stall_hotspots(page, top=top)
    if hot.empty or float(hot["samples"].sum()) == 0:
        raise ValueError("the source page holds no warp samples")
    total = float(page["Warp Stall Sampling (All Samples)"].sum())
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * len(hot) + 1.5))
    left = [0.0] * len(hot)
    labels = list(hot.index)
    for group, cols in list(STALL_GROUPS.items()) + [("other", None)]:
        if cols is None:
            vals = [(hot.loc[o, "samples"] - sum(hot.loc[o, c] for gcols in STALL_GROUPS.values() for c in gcols
                                                  if c in hot.columns)) / total for o in labels]
        else:
            vals = [sum(hot.loc[o, c] for c in cols if c in hot.columns) / total for o in labels]
        ax.barh(labels, vals, left=left, label=group)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("share of the kernel's warp samples")
    ax.set_title(title or "Where the warps were sampled, by SASS opcode")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return ax


def plot_item_warps(df, batch: int = 1, item: int = 2, ax=None, title: str | None = None):
    """One moe_up item, warp by warp (`moe_trace.warp_item_summary` of a timeline with per-warp checkpoints):
    a bar per compute warp from getting past the slot's mbarrier to having stored its K partials, coloured by the
    SM sub-partition it runs on (w mod 4), and the reducing warp's span; cycles from the slot's arrival, medians
    over CTAs and layer copies. The item ends when its slowest sub-partition does."""
    from .moe_trace import warp_item_summary

    w = warp_item_summary(df)
    w = w[(w.batch == batch) & (w["item"] == item)]
    if w.empty:
        raise ValueError(f"no per-warp checkpoints for batch {batch}, item {item}")
    if w.variant.nunique() > 1:
        raise ValueError(f"the trace holds several variants ({sorted(w.variant.unique())}): pass one")
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 5))
    comp = w[w.warp.str.startswith("w")].copy()
    comp["n"] = comp.warp.str[1:].astype(int)
    comp = comp.sort_values(["n"])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = []
    for y, r in enumerate(comp.itertuples()):
        sp = r.n % 4
        ax.barh(y, r.computed - r.waited, left=r.waited, color=colors[sp], height=0.7,
                label=f"sub-partition {sp}" if sp not in labels else None)
        labels.append(sp)
    epi = w[w.warp == "epi"]
    ticks = [f"warp {n}" for n in comp.n]
    if not epi.empty:
        e = epi.iloc[0]
        ax.barh(len(comp), e.ended - e.began, left=e.began, color="0.5", height=0.7,
                label="reducing warp (this item's partials)")
        ticks.append("reducer")
    ax.set_yticks(range(len(ticks)), ticks)
    ax.invert_yaxis()
    ax.set_xlabel("cycles from the item's slot arrival (%clock64, median over CTAs and copies)")
    v = w.variant.iloc[0] or "default kernels"
    ax.set_title(title or f"moe_up item {item} warp by warp, batch {batch} ({v})")
    end = max([float(comp.computed.max())] + ([float(epi.ended.max())] if not epi.empty else []))
    ax.set_xlim(0, end * 1.4)  # room on the right for the legend
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return ax
