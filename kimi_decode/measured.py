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


def load(name: str) -> pd.DataFrame:
    """Load `data/measured/<name>.csv`; a clear error names what exists when it is missing."""
    path = measured_dir() / (name if name.endswith(".csv") else f"{name}.csv")
    if not path.exists():
        have = sorted(p.stem for p in measured_dir().glob("*.csv"))
        raise FileNotFoundError(f"no measured data {path.name!r} in {path.parent}; available: {have}")
    return pd.read_csv(path)


def provenance_summary(df: pd.DataFrame) -> str:
    """One line naming where and when the rows were measured."""
    parts = []
    for col in ("gpu", "driver", "torch", "cutlass_dsl", "git_commit", "utc", "utc_time"):
        if col in df.columns:
            vals = sorted({str(v) for v in df[col].dropna()})
            if vals:
                parts.append(f"{col}={vals[0] if len(vals) == 1 else vals[0] + '…' + vals[-1]}")
    return ", ".join(parts)
