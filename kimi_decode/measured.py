"""Reading the project's measured evidence (`data/measured/*.csv`) for plots and notebooks."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

PROVENANCE_COLUMNS = ("gpu", "driver", "cuda", "torch", "python", "cutlass_dsl", "tvm_ffi", "triton",
                      "git_commit", "kernel_sources", "utc", "utc_time", "host")


def measured_dir() -> Path:
    """`$KIMI_DECODE_DATA/measured`, else `data/measured` of this checkout."""
    root = os.environ.get("KIMI_DECODE_DATA")
    base = Path(root) if root else Path(__file__).resolve().parents[1] / "data"
    return base / "measured"


def names(pattern: str = "*") -> list[str]:
    """Names, for `load`, of the measured CSVs matching a glob without its `.csv`, e.g. 'stock_dcp_*_tp8'
    (one file per card: stock_dcp_h200_tp8, stock_dcp_h100_tp8, ...)."""
    return sorted(p.name.removesuffix(".csv") for p in measured_dir().glob(f"{pattern}.csv"))


def load(name: str) -> pd.DataFrame:
    """Load `data/measured/<name>.csv` (or `<name>.csv.xz`: the large timeline CSVs are kept compressed); a clear
    error names what exists when it is missing."""
    name = name.removesuffix(".xz").removesuffix(".csv")
    for path in (measured_dir() / f"{name}.csv", measured_dir() / f"{name}.csv.xz"):
        if path.exists():
            return pd.read_csv(path)
    import difflib

    have = all_names()
    close = difflib.get_close_matches(name, have, n=5, cutoff=0.6)
    raise FileNotFoundError(f"no measured data {name + '.csv'!r} in {measured_dir()}; "
                            + (f"closest available: {', '.join(close)}; " if close else "")
                            + f"{len(have)} available (`kimi-decode results --list [GLOB]` lists them)")


def all_names(pattern: str = "*") -> list[str]:
    """Every name `load` takes that matches a glob (the plain CSVs and the compressed timelines), sorted."""
    return sorted({p.name.removesuffix(".xz").removesuffix(".csv") for p in measured_dir().glob(f"{pattern}.csv*")})


def provenance_summary(df: pd.DataFrame) -> str:
    """One line naming where and when the rows were measured."""
    parts = []
    for col in ("gpu", "driver", "torch", "cutlass_dsl", "git_commit", "utc", "utc_time"):
        if col in df.columns:
            vals = sorted({str(v) for v in df[col].dropna()})
            if vals:
                parts.append(f"{col}={vals[0] if len(vals) == 1 else vals[0] + '…' + vals[-1]}")
    return ", ".join(parts)


def markdown_table(df: pd.DataFrame, columns: list[str] | None = None, digits: int = 1) -> str:
    """A GitHub-markdown table of `df` (for docs: paste the command's output, never typed figures)."""
    cols = [c for c in (columns or list(df.columns)) if c in df.columns]

    def fmt(v) -> str:
        if isinstance(v, float):
            if v != v:
                return ""
            return f"{v:,.{digits + 1 if abs(v) < 10 else digits}f}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df[cols].itertuples(index=False)]
    return "\n".join(lines)


RESULT_COLUMNS = {
    "stock": ["executor", "layer", "tp", "dcp", "batch", "context", "us_median", "us_p10", "us_p90", "kernels_measured",
              "launches_measured", "kernels_inventory", "achieved_GBps", "floor_us", "fraction_of_floor", "check_ok"],
    "check": ["executor", "layer", "tp", "dcp", "batch", "tokens_per_seq", "context", "check_ok", "err_vs_fp32", "err_bound",
              "routing_flips", "active_experts"],
    "moe": ["executor", "tp", "batch", "tokens_per_seq", "us_median", "us_p10", "us_p90", "kernels_measured",
            "active_experts", "achieved_GBps", "floor_us", "floor_ratio", "speedup_vs_stock", "check_ok"],
    "breakdown": ["executor", "batch", "launch", "label", "prefix_us", "prefix_p10", "prefix_p90", "added_us",
                  "GBps_of_added"],
    "ring_rate": ["slot_kb", "stages", "ctas_per_sm", "kb_in_flight_per_sm", "work", "us_median", "us_p10", "us_p90",
                  "achieved_GBps", "fraction_of_copy", "checked"],
    "mma_rate": ["warps", "chains", "decode", "cycles_per_mma", "clock_GHz", "moe_up_item_cycles_if_mma_bound"],
    "kernels": ["impl", "M", "K", "N", "us_median", "us_p10", "us_p90", "gbs", "max_abs_diff_vs_torch"],
    "collectives": ["layer", "tp", "dcp", "processes", "batch", "collectives", "ranks_agree", "all_written",
                    "rel_err_vs_dcp1", "us_median", "us_p10", "us_p90", "kernels_measured", "emulated_us_median",
                    "emulation_error", "floor_us_h200"],
}


def results_markdown(name: str, kind: str | None = None) -> str:
    """The docs table of a measured CSV (`kimi-decode results NAME`), with its provenance line."""
    df = load(name)
    if kind is None:
        if "prefix_us" in df.columns:
            kind = "breakdown"
        elif "cycles_per_mma" in df.columns:
            kind = "mma_rate"
        elif "kb_in_flight_per_sm" in df.columns:
            kind = "ring_rate"
        elif "emulated_us_median" in df.columns:
            kind = "collectives"
        elif "impl" in df.columns and "gbs" in df.columns:  # scripts/bench_kernels.py
            kind = "kernels"
        else:
            kind = "check" if "us_median" not in df.columns else "moe" if "floor_ratio" in df.columns else "stock"
    if kind not in RESULT_COLUMNS:
        raise ValueError(f"kind must be one of {sorted(RESULT_COLUMNS)}, got {kind!r}")
    cols = [c for c in RESULT_COLUMNS[kind] if c in df.columns]
    if not cols:
        raise ValueError(f"{name}: none of the {kind} table's columns ({', '.join(RESULT_COLUMNS[kind])}) is in it")
    digits = 4 if kind == "check" else 1
    return markdown_table(df, cols, digits=digits) + f"\n\nMeasured: {provenance_summary(df)}."


PROFILE_OVERHEAD_BOUNDS = (0.95, 1.30)  # profile sum / graph time: see docs/profiling.md


def profile_vs_graph() -> pd.DataFrame:
    """Each saved profile's summed kernel time beside the graph-replay median of the same configuration,
    and their ratio. The graph time comes from the profiling run itself where the profile recorded one
    (`profile.graph_time`: same code, same machine); older profiles are matched with the benchmark CSVs in
    `data/measured`. Under Nsight Compute every kernel runs alone with a cold L2 and no stream overlap, so
    the sum exceeds the replay time; PROFILE_OVERHEAD_BOUNDS is the band documented in docs/profiling.md."""
    from .profile import load_profile, saved_profiles

    graph = []
    for name in ("stock_h200_tp8", "moe_half_h200_tp8"):
        try:
            graph.append(load(name))
        except FileNotFoundError:
            continue
    rows = []
    for _, p in saved_profiles().iterrows():
        prov = load_profile(p.folder).attrs["provenance"]
        req = prov.get("request")
        if not req:
            continue
        match, source = prov.get("graph_us_median"), "profiling run"
        if match is None:
            source = "data/measured"
            whole_layer = req["executor"] in ("stock", "compile")
            name = req["executor"] if whole_layer else req["executor"].removesuffix("-moe")
            for df in graph:
                if whole_layer != ("layer" in df.columns) or "us_median" not in df.columns:
                    continue
                q = df[(df.executor == name) & (df.tp == req["tp"]) & (df.batch == req["batch"])
                       & (df.tokens_per_seq == req["tokens"])]
                if whole_layer:
                    q = q[(q.layer == req["layer"]) & (q.context == req["context"])]
                if len(q):
                    match = float(q.us_median.iloc[0])
        if match is not None:
            rows.append({"executor": p.executor, "config": p.config, "kernels": p.kernels,
                         "profile_sum_us": p.total_us, "graph_us": match, "ratio": p.total_us / match,
                         "graph_from": source})
    return pd.DataFrame(rows, columns=["executor", "config", "kernels", "profile_sum_us", "graph_us", "ratio",
                                       "graph_from"])
