"""Byte accounting equals kimi_k3_layer.md §11 exactly, and equals the bytes of the generated tensors."""

import pytest

from kimi_decode.byte_counts import expected_active_experts, layer_bytes, routed_expert_bytes
from kimi_decode.config import DecodeShape, ShardSpec
from kimi_decode.weights import make_layer_weights

SECTION_11 = {  # (layer, tp): streamed weight bytes at batch 1
    ("kda_moe", 8): 296_465_200, ("mla_moe", 8): 268_372_480, ("dense", 8): 294_390_064,
    ("kda_moe", 16): 212_965_144, ("mla_moe", 16): 213_027_328, ("dense", 16): 148_270_360,
}


@pytest.mark.parametrize("layer,tp", sorted(SECTION_11))
def test_streamed_weights_match_section_11(layer, tp):
    assert layer_bytes(layer, ShardSpec(tp=tp)).weights_streamed == SECTION_11[(layer, tp)]


def test_components_match_section_11():
    b8 = layer_bytes("kda_moe", ShardSpec(tp=8))
    assert b8.weights_attn_res == 86_016
    assert b8.weights_attention == 112_638_256
    assert b8.weights_mlp_replicated == 115_616_256
    assert b8.weights_shared_experts == 33_030_144
    assert b8.weights_routed_experts == 35_094_528
    assert routed_expert_bytes(ShardSpec(tp=8)) == 2_193_408
    assert routed_expert_bytes(ShardSpec(tp=16)) == 1_462_272
    assert layer_bytes("mla_moe", ShardSpec(tp=8)).weights_attention == 84_545_536
    assert layer_bytes("mla_moe", ShardSpec(tp=16)).weights_attention == 57_413_632
    assert layer_bytes("kda_moe", ShardSpec(tp=16)).weights_attention == 57_351_448
    assert layer_bytes("dense", ShardSpec(tp=8)).weights_mlp_replicated == 181_665_792
    # resident: 2.227 GB / 2.199 GB at TP8, 1.500 GB at TP16
    assert round(layer_bytes("kda_moe", ShardSpec(tp=8)).resident_weights / 1e9, 3) == 2.227
    assert round(layer_bytes("mla_moe", ShardSpec(tp=8)).resident_weights / 1e9, 3) == 2.199
    assert round(layer_bytes("kda_moe", ShardSpec(tp=16)).resident_weights / 1e9, 3) == 1.500


def test_kv_state_and_batch_scaling():
    b = layer_bytes("mla_moe", ShardSpec(tp=8), DecodeShape(4, 2, (10, 20, 30, 40)))
    assert b.kv_read == (12 + 22 + 32 + 42) * 1152 and b.kv_write == 8 * 1152
    bd = layer_bytes("mla_moe", ShardSpec(tp=8, dcp=4), DecodeShape(1, 1, 8191))
    assert bd.kv_read == 2048 * 1152
    k = layer_bytes("kda_moe", ShardSpec(tp=8), DecodeShape(3, 1, 0))
    assert k.state_read == k.state_write == 3 * (27_648 + 786_432)  # §4.3 per TP8 rank
    assert expected_active_experts(ShardSpec().cfg, 1) == 16
    assert 16 < expected_active_experts(ShardSpec().cfg, 64) < 896
    assert layer_bytes("kda_moe", ShardSpec(tp=8), DecodeShape(64), active_experts=896).weights_routed_experts \
        == 1_965_293_568


def test_analytic_equals_generated_tiny(tiny_cfg):
    for tp in (1, 2, 4):
        for kind in ("dense", "kda_moe", "mla_moe"):
            sh = ShardSpec(tp=tp, cfg=tiny_cfg)
            w = make_layer_weights(kind, sh)
            assert w.nbytes() == layer_bytes(kind, sh).resident_weights, (kind, tp)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "kda_moe", "mla_moe"])
def test_analytic_equals_generated_real(kind):
    sh = ShardSpec(tp=8)
    w = make_layer_weights(kind, sh)
    b = layer_bytes(kind, sh)
    assert w.nbytes() == b.resident_weights
    if w.moe is not None:
        assert w.moe.expert_nbytes() == routed_expert_bytes(sh)


def test_floor_sweep_dcp_only_changes_mla():
    from kimi_decode.byte_counts import floor_sweep
    f = floor_sweep(tps=(8,), batches=(1, 64), contexts=(32768,), dcps=(1, 4))
    assert set(f[f.layer != "mla_moe"].dcp) == {1}
    mla = f[(f.layer == "mla_moe") & (f.batch == 64)].set_index("dcp")
    assert mla.loc[4, "kv_and_state"] < mla.loc[1, "kv_and_state"] / 3
    assert (mla.weights_streamed.nunique()) == 1
    assert (f.floor_us_h200 > 0).all()
