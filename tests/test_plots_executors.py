"""The executors-vs-batch figure, drawn from the committed H200 MoE measurements."""

import matplotlib

matplotlib.use("Agg")

from kimi_decode import measured, plots  # noqa: E402


def test_executors_vs_batch_draws_every_executor_and_the_floor():
    df = measured.load("moe_half_h200_tp8")
    ax = plots.plot_executors_vs_batch(df)
    labels = ax.get_legend_handles_labels()[1]
    assert set(df.executor) <= set(labels) and any("floor" in l for l in labels)
    notes = [t.get_text() for t in ax.texts]
    assert len(notes) == len(df) and all(n.endswith(" k") for n in notes)
    assert {int(float(n.split()[0])) for n in notes} == {int(k) for k in df.kernels_measured}


def test_graph_breakdown_plot_stacks_each_executors_launches():
    import matplotlib
    matplotlib.use("Agg")
    from kimi_decode import measured, plots
    df = measured.load("moe_breakdown_h200_tp8")
    ax = plots.plot_graph_breakdown(df, batch=1)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == list(dict.fromkeys(df[df.batch == 1].executor))
    fused = df[(df.batch == 1) & (df.executor == "fused")]
    n = len(fused)
    assert any(t.get_text().strip().startswith(f"{n} launches, {fused.added_us.sum():,.1f} µs") for t in ax.texts)
    import pytest
    with pytest.raises(ValueError, match="batches present"):
        plots.plot_graph_breakdown(df, batch=3)


def test_dcp_plot_draws_one_line_and_floor_per_batch_and_context():
    """Structure only: a frame shaped like a `sweep --dcps` CSV (floors from the byte counts; the timings are
    the floors scaled, as test input) gives one line per (batch, context) over the DCP sizes."""
    import pandas as pd
    import pytest

    from kimi_decode.byte_counts import floor_sweep
    f = floor_sweep(layers=("mla_moe",), tps=(8,), batches=(1, 64), contexts=(8192, 32768), dcps=(1, 2, 4, 8))
    df = pd.DataFrame({"executor": "stock", "layer": "mla_moe", "tp": 8, "dcp": f.dcp, "batch": f.batch,
                       "context": f.context, "floor_us": f.floor_us_h200, "us_median": 1.5 * f.floor_us_h200,
                       "us_p10": 1.4 * f.floor_us_h200, "us_p90": 1.6 * f.floor_us_h200, "check_ok": True})
    ax = plots.plot_dcp_measured(df)
    labels = ax.get_legend_handles_labels()[1]
    assert len(labels) == 4 and "batch 64, context 32,768" in labels
    assert [int(t) for t in ax.get_xticks()] == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="no timed rows"):
        plots.plot_dcp_measured(df.drop(columns=["us_median"]))


def test_collectives_plot_puts_each_real_run_beside_its_emulation():
    df = measured.load("multi_gpu_dryrun_h200")
    ax = plots.plot_collectives_vs_emulation(df)
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["real collectives: nccl", "single-GPU emulation of the same rank"]
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert ticks == [f"{l}, TP8 rank, batch 1, 1 process" for l in df.layer]
    widths = sorted(round(p.get_width(), 3) for p in ax.patches)
    assert widths == sorted(round(v, 3) for v in [*df.us_median, *df.emulated_us_median])
