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
