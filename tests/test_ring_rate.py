"""The bulk-copy ring rate microbenchmark (kernels/ring_rate.py, kimi-decode ring-rate): keys, builds, refusals."""

import pandas as pd
import pytest
import torch

from kimi_decode.cli import main
from kimi_decode.kernels import ring_rate as kr


def test_keys_refuse_what_cannot_launch():
    with pytest.raises(ValueError, match="even number"):
        kr.RingRateKey(slot_kb=7)
    with pytest.raises(ValueError, match="stages"):
        kr.RingRateKey(stages=1)
    with pytest.raises(ValueError, match="ctas"):
        kr.RingRateKey(ctas=100)
    with pytest.raises(ValueError, match="do not fit"):
        kr.RingRateKey(slot_kb=56, stages=5)
    with pytest.raises(ValueError, match="do not fit"):  # 2 CTAs of 196 KB on one SM
        kr.RingRateKey(slot_kb=28, stages=7, ctas=2 * kr.H200_SMS)
    assert kr.RingRateKey().kb_in_flight_per_sm == 196
    assert kr.RingRateKey(28, 3, 2 * kr.H200_SMS).kb_in_flight_per_sm == 168


def test_ahead_of_time_builds_stream_and_keep_the_row_loop(compiler):
    """Every geometry built ahead of time streams by bulk copies, keeps the tail ring's row loop (8 FFMA per
    16-byte chunk of a warp's quarter slot) and does not spill."""
    import re

    from kimi_decode import compile as kc
    keys = kr.rate_keys("sm_90a")
    assert kr.RingRateKey(28, 7) in keys and kr.RingRateKey(56, 3) in keys  # the tail ring's and the front's
    for key in keys:
        sass = kc.sass_text(key)
        chunks = key.slot_bytes // kr.RING_RATE_WARPS // 16 // 32
        assert len(re.findall(r"\bFFMA\b", sass)) >= 8 * chunks, key
        assert len(re.findall(r"\bLDS\.128\b", sass)) >= chunks, key
        assert "cp.async.bulk.shared::cluster.global" in kc.ptx_text(key), key
        assert kc.resource_usage(key)["STACK"] == 0, key


def test_runner_refuses_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["ring-rate", "--no-progress"]) == 3
    assert "needs one" in capsys.readouterr().err


def test_results_table_has_its_own_columns(tmp_path, monkeypatch):
    from kimi_decode import measured
    df = pd.DataFrame([dict(slot_kb=28, stages=7, ctas_per_sm=1, kb_in_flight_per_sm=196, work=True, us_median=20.0,
                            us_p10=19.0, us_p90=21.0, achieved_GBps=2570.0, fraction_of_copy=0.86, checked=True,
                            gpu="test", git_commit="0" * 40, utc_time="2026-12-06T00:00:00Z")])
    monkeypatch.setattr(measured, "load", lambda name: df)
    md = measured.results_markdown("ring_rate_test")
    assert "kb_in_flight_per_sm" in md.splitlines()[0] and "fraction_of_copy" in md.splitlines()[0]


@pytest.mark.gpu
def test_rate_is_measured_and_checked_on_the_gpu():
    from kimi_decode.ring_rate import run_ring_rate
    df = run_ring_rate([kr.RingRateKey(28, 7), kr.RingRateKey(28, 3, 2 * kr.H200_SMS)], mb=8.0, copies=2,
                       replays=10, progress=False)
    assert len(df) == 4 and set(df.work) == {False, True} and df[df.work].checked.all()
    assert (df.achieved_GBps > 100).all() and (df.fraction_of_copy < 1.5).all()


def test_ring_rate_plot_draws_both_consumer_modes_per_geometry():
    """Structure only: a frame shaped like a `ring-rate` CSV (its fractions are test input, not measurements)
    gives two bars per geometry, the copy line, and the tail ring's geometry marked."""
    import matplotlib
    matplotlib.use("Agg")
    from kimi_decode import plots
    geos = kr.RING_RATE_GEOMETRIES
    df = pd.DataFrame([dict(slot_kb=kb, stages=st, ctas_per_sm=c, work=w, us_median=20.0, us_p10=19.0, us_p90=22.0,
                            fraction_of_copy=0.8, copy_GBps=3000.0, gpu="test GPU")
                       for kb, st, c in geos for w in (False, True)])
    ax = plots.plot_ring_rate(df)
    assert len(ax.patches) == 2 * len(geos)
    assert ax.get_legend_handles_labels()[1] == ["consumers release at once", "consumers run the row loop"]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert "28 KB × 7" in ticks and "28 KB × 3, 2 CTAs/SM" in ticks and "test GPU" in ax.get_title()
    with pytest.raises(ValueError, match="not a ring-rate frame"):
        plots.plot_ring_rate(df.drop(columns=["fraction_of_copy"]))
