"""Nsight profiles as data: the profile plots, fed by synthetic profile folders saved with save_profile."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import nbformat  # noqa: E402
import pytest  # noqa: E402

from kimi_decode import plots  # noqa: E402
from kimi_decode import profile as P  # noqa: E402
from kimi_decode.byte_counts import H200_COPY_BANDWIDTH  # noqa: E402

STOCK_MOE = ["moe.router", "moe.grouped_topk", "moe.shared_gemm13", "moe.shared_situ", "moe.align_block_size",
             "moe.experts_gemm1", "moe.experts_situ", "moe.experts_gemm2", "moe.topk_sum", "moe.allreduce",
             "moe.shared_down", "moe.shared_allreduce", "moe.add", "moe.rmsnorm", "moe.up"]
FUSED_MOE = ["moe.front", "moe.up", "moe.down", "moe.tail"]
PROVENANCE = {"gpu": "NVIDIA H200", "driver": "570.00", "ncu": "2025.3.1.0", "git_commit": "abc1234",
              "utc_time": "2026-01-01T00:00:00Z"}


def synthetic_frame(names, metric_set="full", seed=1):
    """A per-launch frame as kimi_decode.profile builds it from ncu metrics (durations 1..n µs scaled)."""
    rows = []
    for i, name in enumerate(names):
        dur_ns = 1000.0 * (i + seed)
        row = {"label": f"{i + 1:02d} {name}", "kernel": f"kernel_{name.replace('.', '_')}"}
        for m in P.METRIC_SETS[metric_set]:
            row[m] = 64.0 * (i + 1)
        row["gpu__time_duration.sum"] = dur_ns
        if "dram__bytes_read.sum" in row:  # (i + 1) TB/s read + write
            row["dram__bytes_read.sum"] = 0.5 * (i + 1) * 1e3 * dur_ns
            row["dram__bytes_write.sum"] = 0.5 * (i + 1) * 1e3 * dur_ns
        rows.append(row)
    return P.frame_from_rows(rows, "ncu-cli")


@pytest.fixture
def profiles(tmp_path):
    """profiles/ with stock-moe (15 launches), fused-moe (4) and a time-only stock profile."""
    P.save_profile(synthetic_frame(STOCK_MOE), tmp_path / "stock-moe" / "kda_moe-tp8-b1", PROVENANCE)
    P.save_profile(synthetic_frame(FUSED_MOE), tmp_path / "fused-moe" / "kda_moe-tp8-b1", PROVENANCE)
    P.save_profile(synthetic_frame(["a", "b", "c"], metric_set="time"), tmp_path / "stock" / "kda_moe-tp8-b1", {})
    yield tmp_path
    plt.close("all")


def _load(root, executor, config="kda_moe-tp8-b1"):
    listing = P.saved_profiles(root=root)
    row = listing[(listing.executor == executor) & (listing.config == config)]
    assert len(row) == 1
    return P.load_profile(row.folder.iloc[0])


def test_saved_profiles_lists_the_synthetic_folders(profiles):
    listing = P.saved_profiles(root=profiles)
    got = dict(zip(listing.executor, listing.kernels))
    assert got == {"fused-moe": 4, "stock": 3, "stock-moe": 15}
    fused = listing[listing.executor == "fused-moe"]
    assert fused.total_us.iloc[0] == pytest.approx(1 + 2 + 3 + 4)
    assert _load(profiles, "fused-moe").attrs["provenance"]["gpu"] == "NVIDIA H200"


def test_durations_one_bar_per_launch_in_order(profiles):
    df = _load(profiles, "stock-moe")
    ax = plots.plot_profile_durations(df)
    bars = ax.containers[0]
    assert len(bars) == 15
    assert [b.get_width() for b in bars] == pytest.approx(list(df.duration_us))
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"{i + 1:02d} {n}" for i, n in enumerate(STOCK_MOE)]
    shares = [t.get_text().strip() for t in ax.texts]
    assert len(shares) == 15 and all(s.endswith("%") for s in shares)
    assert shares[-1] == f"{15 / sum(range(1, 16)):.1%}"  # 15 µs of 120 µs
    assert "µs" in ax.get_xlabel()
    assert "stock-moe" in ax.get_title() and "15" in ax.get_title()
    assert ax.get_legend() is not None
    # launch order reads top to bottom
    assert ax.get_ylim()[0] > ax.get_ylim()[1]


def test_durations_title_and_axes_can_be_given(profiles):
    _, ax = plt.subplots()
    out = plots.plot_profile_durations(_load(profiles, "fused-moe"), ax=ax, title="fused")
    assert out is ax and ax.get_title() == "fused" and len(ax.containers[0]) == 4


def test_durations_label_repeated_step_with_kernel_name():
    df = synthetic_frame(["x", "y"])
    df["label"] = "step"
    ax = plots.plot_profile_durations(df)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["01 step: kernel_x", "02 step: kernel_y"]
    plt.close("all")


def test_bandwidth_bars_and_copy_line(profiles):
    df = _load(profiles, "fused-moe")
    ax = plots.plot_profile_bandwidth(df)
    bars = ax.containers[0]
    assert len(bars) == 4
    assert [b.get_width() for b in bars] == pytest.approx([1000.0, 2000.0, 3000.0, 4000.0])  # GB/s
    assert [b.get_width() for b in bars] == pytest.approx(list(df.dram_GBps))
    vlines = [ln for ln in ax.get_lines() if ln.get_xdata()[0] == pytest.approx(H200_COPY_BANDWIDTH / 1e9)]
    assert len(vlines) == 1
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("4.27 TB/s" in t for t in legend)
    assert [t.get_text().strip() for t in ax.texts] == [f"{g * 1e9 / H200_COPY_BANDWIDTH:.0%}"
                                                        for g in (1000, 2000, 3000, 4000)]
    assert "GB/s" in ax.get_xlabel()
    assert ax.get_xlim()[1] > H200_COPY_BANDWIDTH / 1e9


def test_bandwidth_line_follows_copy_bw(profiles):
    ax = plots.plot_profile_bandwidth(_load(profiles, "fused-moe"), copy_bw=2.0e12)
    assert any(ln.get_xdata()[0] == pytest.approx(2000.0) for ln in ax.get_lines())


def test_bandwidth_needs_the_memory_metrics(profiles):
    df = _load(profiles, "stock")
    assert "dram_GBps" not in df.columns
    with pytest.raises(ValueError, match="'memory' or 'full'"):
        plots.plot_profile_bandwidth(df)
    nan = synthetic_frame(["a"])
    nan["dram_GBps"] = float("nan")
    with pytest.raises(ValueError, match="dram_GBps"):
        plots.plot_profile_bandwidth(nan)


def test_side_by_side_stacks_each_executor(profiles):
    frames = {"stock-moe": _load(profiles, "stock-moe"), "fused-moe": _load(profiles, "fused-moe")}
    ax = plots.plot_profiles_side_by_side(frames)
    assert len(ax.patches) == 15 + 4
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stock-moe", "fused-moe"]
    ends = [t.get_text().strip() for t in ax.texts if "kernels" in t.get_text()]
    assert ends == ["15 kernels, 120.0 µs", "4 kernels, 10.0 µs"]
    # segments of one bar are end to end and add up to the total
    stock = [p for p in ax.patches if abs(p.get_y() + p.get_height() / 2) < 1e-9]
    assert sum(p.get_width() for p in stock) == pytest.approx(120.0)
    assert max(p.get_x() + p.get_width() for p in stock) == pytest.approx(120.0)
    assert "µs" in ax.get_xlabel() and ax.get_legend() is not None
    assert "stock-moe" in ax.get_title() and "fused-moe" in ax.get_title()


def test_side_by_side_refuses_nothing():
    with pytest.raises(ValueError, match="no profiles"):
        plots.plot_profiles_side_by_side({})


@pytest.mark.slow
def test_notebook_02_plots_saved_profiles(profiles, monkeypatch):
    """Notebook 02 against a profiles/ that holds profiles: the plotting cells run and draw."""
    from nbclient import NotebookClient

    path = Path(__file__).resolve().parents[1] / "notebooks" / "02_profile_fused_kernels.ipynb"
    monkeypatch.setenv("KIMI_DECODE_PROFILES", str(profiles))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    # durations, bandwidth, stock-moe vs fused-moe (the time-only stock profile has no pair)
    assert len(images) >= 3
    text = "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "fused-moe" in text and "NVIDIA H200" in text


def test_stall_hotspots_bars_split_by_warp_state():
    import pandas as pd

    from kimi_decode.plots import STALL_GROUPS, plot_stall_hotspots

    page = pd.DataFrame({"op": ["LOP3", "LOP3", "BRA", "HMMA"],
                         "Warp Stall Sampling (All Samples)": [6, 4, 8, 2], "Instructions Executed": [1, 1, 1, 1],
                         "stall_selected": [1, 1, 0, 1], "stall_math": [3, 2, 0, 0], "stall_long_sb": [0, 0, 7, 0],
                         "stall_wait": [2, 1, 0, 1]})
    ax = plot_stall_hotspots(page, title="k")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["LOP3", "BRA", "HMMA"]  # by samples: 10, 8, 2
    widths = {}
    for bars, group in zip(ax.containers, [*STALL_GROUPS, "other"]):
        widths[group] = [b.get_width() for b in bars]
    assert widths["global memory / mbarrier"][1] == pytest.approx(7 / 20)
    assert widths["ALU/math pipe busy"][0] == pytest.approx(5 / 20)
    assert widths["other"][1] == pytest.approx(1 / 20)  # BRA's sample without a named state
    assert sum(sum(w) for w in widths.values()) == pytest.approx(1.0)
    plt.close("all")
    with pytest.raises(ValueError, match="no warp samples"):
        plot_stall_hotspots(page.assign(**{"Warp Stall Sampling (All Samples)": 0}))
