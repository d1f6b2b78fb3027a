"""The timeline builds of the pipelined expert kernels and the code that reads them (kimi-decode moe --trace)."""

import pytest
import torch

from kimi_decode.support import UnsupportedConfiguration


class _FakeTraced:
    """What trace_rows reads from a traced FusedMoE: two [CTAs, 2, TRACE_BUF] int64 buffers."""

    def __init__(self, ctas=4):
        from kimi_decode.kernels.moe_pipe import TRACE_BUF
        self.trace_up = torch.zeros(ctas, 2, TRACE_BUF, dtype=torch.int64)
        self.trace_down = torch.zeros_like(self.trace_up)


def test_trace_rows_are_relative_to_the_earliest_up_start_and_skip_unreached_checkpoints():
    from kimi_decode.moe_trace import trace_rows
    ex = _FakeTraced()
    for cta in range(4):
        ex.trace_up[cta, 0, 0] = 1_000_000 + 100 * cta  # start
        ex.trace_up[cta, 1, 0] = 5_000 + cta
        ex.trace_up[cta, 0, 4] = 1_002_000 + 100 * cta  # item0_arrived
        ex.trace_up[cta, 1, 4] = 9_000 + cta
        ex.trace_up[cta, 0, 31] = 1_010_000  # end
        ex.trace_down[cta, 0, 0] = 1_009_000
        ex.trace_down[cta, 0, 26] = 1_020_000 if cta == 2 else 0  # allreduce_done: one CTA
    rows = trace_rows(ex, copy=3)
    up = [r for r in rows if r["kernel"] == "moe.up"]
    assert {r["checkpoint"] for r in up} == {"start", "item0_arrived", "end"}
    assert min(r["ns"] for r in up if r["checkpoint"] == "start") == 0
    a = [r for r in up if r["checkpoint"] == "item0_arrived" and r["cta"] == 1][0]
    assert (a["ns"], a["clk"], a["copy"]) == (2_100, 4_000, 3)
    ar = [r for r in rows if r["checkpoint"] == "allreduce_done"]
    assert len(ar) == 1 and ar[0]["cta"] == 2 and ar[0]["ns"] == 20_000


def test_per_warp_checkpoints_are_named_and_summarised_from_the_item_arrival():
    """moe_up's per-warp slots (after the 32 CTA checkpoints) read back as itemN_wW_waited / _computed and
    itemN_epi_began / _ended; warp_item_summary gives the median cycles from the item's slot arrival."""
    import pandas as pd

    from kimi_decode.kernels.moe_pipe import TRACE_BUF, TRACE_SLOTS, WARP_TRACE_EPI, warp_trace_name, warp_trace_slot
    from kimi_decode.moe_trace import sub_partition_summary, trace_rows, warp_item_summary
    assert warp_trace_slot(0, 0, 0) == TRACE_SLOTS and warp_trace_slot(3, WARP_TRACE_EPI, 1) == TRACE_BUF - 1
    assert warp_trace_name(warp_trace_slot(1, 5, 1)) == "item1_w5_computed"
    assert warp_trace_name(warp_trace_slot(2, WARP_TRACE_EPI, 0)) == "item2_epi_began"
    rows = []
    for copy in (0, 1):
        ex = _FakeTraced(ctas=2)
        for cta in range(2):
            ex.trace_up[cta, 0, 0] = 1000  # start
            ex.trace_up[cta, 0, 4], ex.trace_up[cta, 1, 4] = 2000, 10_000  # item0_arrived
            for warp in (0, 1):
                for k, dclk in ((0, 50 + warp), (1, 900 + 100 * warp + 10 * copy)):
                    c = warp_trace_slot(0, warp, k)
                    ex.trace_up[cta, 0, c], ex.trace_up[cta, 1, c] = 2000 + dclk, 10_000 + dclk
            for k, dclk in ((0, 1200), (1, 1500)):
                c = warp_trace_slot(0, WARP_TRACE_EPI, k)
                ex.trace_up[cta, 0, c], ex.trace_up[cta, 1, c] = 2000 + dclk, 10_000 + dclk
        rows += [dict(r, batch=1, variant=None) for r in trace_rows(ex, copy=copy)]
    df = pd.DataFrame(rows)
    assert {"item0_w1_computed", "item0_epi_ended"} <= set(df.checkpoint)
    s = warp_item_summary(df).set_index("warp")
    assert (s.loc["w0", "waited"], s.loc["w0", "computed"], s.loc["w1", "computed"]) == (50, 905, 1005)
    assert (s.loc["epi", "began"], s.loc["epi", "ended"]) == (1200, 1500)
    sp = sub_partition_summary(df).iloc[0]  # warps 0 and 1: sub-partitions 0 and 1, one warp each
    assert (sp.sp0, sp.sp1, sp.warps_per_sp, sp.epi_began, sp.epi_ended) == (905, 1005, "1/1", 1200, 1500)
    with pytest.raises(ValueError, match="per-warp"):
        warp_item_summary(df[~df.checkpoint.str.contains("_w|_epi")])


def test_trace_rows_refuse_a_step_whose_kernels_recorded_nothing():
    from kimi_decode.moe_trace import trace_rows
    with pytest.raises(RuntimeError, match="recorded no start"):
        trace_rows(_FakeTraced(), copy=0)


def test_summary_takes_first_median_last_cta_then_the_median_over_copies():
    import pandas as pd
    from kimi_decode.moe_trace import summarize_trace
    rows = []
    for copy, shift in ((0, 0), (1, 1000), (2, 2000)):
        for cta, ns in enumerate((1000, 2000, 6000)):
            rows.append(dict(batch=1, kernel="moe.up", slot=0, checkpoint="start", copy=copy, ns=ns + shift))
        rows.append(dict(batch=1, kernel="moe.down", slot=0, checkpoint="start", copy=copy, ns=9000))
    s = summarize_trace(pd.DataFrame(rows))
    up = s[(s.kernel == "moe.up")].iloc[0]
    assert (up.first_us, up.median_us, up.last_us, up.ctas) == (2.0, 3.0, 7.0, 3)
    assert list(s.kernel) == ["moe.up", "moe.down"]


def test_tracing_is_refused_outside_the_pipelined_kernels():
    from kimi_decode.fused_moe import expert_kernel_keys
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    up, down, _ = expert_kernel_keys(s, 8, trace=True)
    assert up.trace and down.trace
    for kw in (dict(tokens=kp.PIPE_MAX_M + 1), dict(tokens=1, experts="direct"), dict(tokens=1, experts="pipe-up")):
        n = kw.pop("tokens")
        with pytest.raises(UnsupportedConfiguration, match="timeline tracing"):
            expert_kernel_keys(s, n, trace=True, **kw)
    assert kp.MoEUpPipeKey(s, trace=True) in kp.UP_PIPE.aot_keys("sm_90a")
    assert kp.MoEDownPipeKey(s, trace=True) in kp.DOWN_PIPE.aot_keys("sm_90a")


def test_trace_builds_record_timestamps_without_spills(compiler):
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    for key in (kp.MoEUpPipeKey(s, trace=True), kp.MoEDownPipeKey(s, trace=True)):
        ptx = kc.ptx_text(key)
        assert "%globaltimer" in ptx and "%clock64" in ptx
        assert kc.resource_usage(key)["STACK"] == 0
    assert "%globaltimer" not in kc.ptx_text(kp.MoEUpPipeKey(s))  # the shipped builds record nothing


@pytest.mark.gpu
@pytest.mark.parametrize("batch, variant", [(1, None), (8, None), (1, "merge"), (8, "merge")])
def test_traced_step_is_correct_and_every_cta_records_its_start_and_end(batch, variant):
    """The timeline builds, also the merged expert kernel's ('merge': its two phases write trace_up and trace_down;
    moe_down's phase starts after moe_up's last item, in the same CTA)."""
    from kimi_decode.config import ShardSpec
    from kimi_decode.fused_moe import FusedMoE
    from kimi_decode.kernels.moe_pipe import TRACE_SLOTS
    from kimi_decode.moe_bench import check_moe, moe_input
    from kimi_decode.weights import make_layer_weights
    w = make_layer_weights("kda_moe", ShardSpec(tp=8), seed=0).to("cuda")
    made = []

    def make(wc, x):
        made.append(FusedMoE(wc, x, trace=True, variant=variant))
        return made[-1]

    r = check_moe(make, w, moe_input(batch, 7168, seed=80 + batch, device="cuda"))
    assert r["all_written"] and r["check_ok"], r
    ex = made[-1]
    for buf in (ex.trace_up, ex.trace_down):
        start, end = buf[:, 0, 0], buf[:, 0, TRACE_SLOTS - 1]
        assert bool((start > 0).all()) and bool((end >= start).all())
    # moe_up's first item, per warp: every compute warp and the reducer recorded, in order, after the slot arrived
    from kimi_decode.kernels.moe_pipe import WARP_TRACE_EPI, MoEUpPipeKey, warp_trace_slot
    clk = ex.trace_up[:, 1]
    for warp in range(MoEUpPipeKey.warps):
        waited, computed = clk[:, warp_trace_slot(0, warp, 0)], clk[:, warp_trace_slot(0, warp, 1)]
        assert bool((waited > 0).all()) and bool((computed > waited).all()), warp
    began, ended = clk[:, warp_trace_slot(0, WARP_TRACE_EPI, 0)], clk[:, warp_trace_slot(0, WARP_TRACE_EPI, 1)]
    assert bool((began > 0).all()) and bool((ended > began).all())
    assert int(ex.trace_down[:, 0, 0].max()) > int(ex.trace_up[:, 0, 0].min())
    if variant == "merge":  # each CTA's moe_down phase begins once its moe_up phase has ended
        assert bool((ex.trace_down[:, 0, 0] >= ex.trace_up[:, 0, TRACE_SLOTS - 1]).all())


def test_trace_plot_draws_one_line_per_cta_and_refuses_a_missing_batch():
    import matplotlib
    matplotlib.use("Agg")
    import pandas as pd
    from kimi_decode.plots import plot_moe_trace
    rows = []
    for kernel, ctas, t0 in (("moe.up", 3, 0), ("moe.down", 2, 9000)):
        for cta in range(ctas):
            for name, ns in (("start", t0), ("wait_done", t0 + 500), ("staged", t0 + 900),
                             ("item0_arrived", t0 + 1200), ("item0_done", t0 + 2000), ("end", t0 + 2100)):
                rows.append(dict(tp=8, batch=1, copy=0, kernel=kernel, cta=cta, checkpoint=name, ns=ns,
                                 step_us_median=80.0))
    df = pd.DataFrame(rows)
    ax = plot_moe_trace(df)
    assert [t.get_text().split("\n")[0] for t in ax.get_yticklabels()] == ["moe.up", "moe.down"]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"wait", "staging", "item"}
    assert "80.0 µs" in ax.get_title()
    with pytest.raises(ValueError, match="batch 8"):
        plot_moe_trace(df, batch=8)


def test_item_warp_plot_draws_a_bar_per_warp_and_the_reducer_and_refuses_a_missing_item():
    import matplotlib
    matplotlib.use("Agg")
    import pandas as pd

    from kimi_decode.kernels.moe_pipe import WARP_TRACE_EPI, warp_trace_slot
    from kimi_decode.moe_trace import trace_rows
    from kimi_decode.plots import plot_item_warps
    ex = _FakeTraced(ctas=1)
    ex.trace_up[0, 0, 0] = 1000
    ex.trace_up[0, 0, 4], ex.trace_up[0, 1, 4] = 2000, 10_000  # item0_arrived
    for warp in range(5):
        for k, dclk in ((0, 20), (1, 800 + 100 * (warp % 4 < 2))):
            c = warp_trace_slot(0, warp, k)
            ex.trace_up[0, 0, c], ex.trace_up[0, 1, c] = 2000 + dclk, 10_000 + dclk
    for k, dclk in ((0, 1000), (1, 1600)):
        c = warp_trace_slot(0, WARP_TRACE_EPI, k)
        ex.trace_up[0, 0, c], ex.trace_up[0, 1, c] = 2000 + dclk, 10_000 + dclk
    df = pd.DataFrame([dict(r, batch=1, variant="") for r in trace_rows(ex, copy=0)])
    ax = plot_item_warps(df, batch=1, item=0)
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"warp {n}" for n in range(5)] + ["reducer"]
    assert len(ax.patches) == 6 and ax.patches[0].get_width() == 880 and ax.patches[-1].get_x() == 1000
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {
        "sub-partition 0", "sub-partition 1", "sub-partition 2", "sub-partition 3", "reducing warp (this item's partials)"}
    with pytest.raises(ValueError, match="item 3"):
        plot_item_warps(df, batch=1, item=3)
