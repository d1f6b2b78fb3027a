"""Pieces of the benchmark sweep that run without a GPU."""

import torch

from kimi_decode.config import DecodeShape, ShardSpec
from kimi_decode.state import make_decode_state
from kimi_decode.stock.schedule import StockLayer
from kimi_decode.sweeps import check_against_reference, choose_copies, stock_configs, weight_copy
from kimi_decode.weights import make_layer_weights

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_weight_copy_is_distinct_with_equal_bytes(tiny_cfg):
    w = make_layer_weights("kda_moe", ShardSpec(tp=2, cfg=tiny_cfg))
    c = weight_copy(w, 1)
    assert c.nbytes() == w.nbytes()
    assert torch.equal(c.kda.in_proj, -w.kda.in_proj)
    assert torch.equal(c.moe.w1_packed ^ 0x88, w.moe.w1_packed)
    assert c.moe.w1_packed.data_ptr() != w.moe.w1_packed.data_ptr()
    c0 = weight_copy(w, 2)
    assert torch.equal(c0.moe.gate, w.moe.gate) and c0.moe.gate.data_ptr() != w.moe.gate.data_ptr()


def test_choose_copies_exceeds_l2():
    assert choose_copies(300e6) == 2
    assert choose_copies(10e6) == 8
    assert choose_copies(60e6) * 60e6 >= 4 * 60 * 2**20


def test_check_against_reference_catches_a_wrong_executor(tiny_cfg):
    sh = ShardSpec(tp=2, cfg=tiny_cfg)
    w = make_layer_weights("dense", sh).to(DEV)
    st = make_decode_state("dense", sh, DecodeShape(2, 1, 0), device=DEV)
    good = check_against_reference(StockLayer, w, st)
    assert good["check_ok"] and good["all_written"]

    def broken(w_, st_):
        layer = StockLayer(w_, st_)
        layer.steps.pop()  # drop the final all-reduce: the output stays NaN-poisoned
        return layer

    bad = check_against_reference(lambda a, b: _Run(broken(a, b)), w, st)
    assert not bad["check_ok"] and not bad["all_written"]


class _Run:
    def __init__(self, layer):
        self.layer = layer

    def __call__(self):
        for s in self.layer.steps:
            if hasattr(s, "run"):
                s.run()

    @property
    def h(self):
        return self.layer.h


def test_stock_configs_cover_the_issue_matrix():
    cfgs = stock_configs()
    assert len(cfgs) == 2 * 4 * (1 + 1 + 2)
    assert {(k, t) for k, t, _, _ in cfgs} == {(k, t) for k in ("dense", "kda_moe", "mla_moe") for t in (8, 16)}
    assert {s.batch for _, _, s, _ in cfgs} == {1, 8, 32, 64}
    assert {s.context_lens for k, _, s, _ in cfgs if k == "mla_moe"} == {8192, 32768}
    assert {d for *_, d in cfgs} == {1}
    # DCP multiplies the MLA configurations only (KDA layers keep their per-sequence state)
    d = stock_configs(dcps=(1, 2, 4, 8))
    assert len(d) == 2 * 4 * (1 + 1 + 2 * 4)
    assert {k for k, _, _, dcp in d if dcp > 1} == {"mla_moe"}
