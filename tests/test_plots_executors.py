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
