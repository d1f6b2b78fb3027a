"""Tensor parallelism on a scaled-down config: combining every rank's partial outputs
(the all-reduces as sums over ranks) equals the unsharded (TP1) layer."""

import pytest
import torch

from kimi_decode.accuracy import rel_err
from kimi_decode.config import DecodeShape, ShardSpec
from kimi_decode.reference import decoder_layer
from kimi_decode.state import DecodeState, make_decode_state, unshard_kda_state
from kimi_decode.weights import make_layer_weights, unshard


@pytest.mark.parametrize("kind", ["dense", "kda_moe", "mla_moe"])
@pytest.mark.parametrize("tp", [2, 4])
def test_all_ranks_equal_unsharded(tiny_cfg, kind, tp):
    shape = DecodeShape(3, 2, (4, 0, 21))
    specs = ShardSpec(tp=tp, cfg=tiny_cfg).all_ranks()
    ws = [make_layer_weights(kind, s, seed=11) for s in specs]
    sts = [make_decode_state(kind, s, shape, seed=11) for s in specs]
    full_w = unshard(ws)
    assert full_w.shard.tp == 1
    full_st = DecodeState(shape=shape, carry=sts[0].carry, mla=sts[0].mla)
    if kind != "mla_moe":
        full_st.kda = unshard_kda_state([s.kda for s in sts], tiny_cfg.kda_head_dim)
    sharded = decoder_layer(ws, sts)
    single = decoder_layer(full_w, full_st)
    assert rel_err(sharded.attn, single.attn) < 1e-5
    assert rel_err(sharded.h, single.h) < 1e-5
    assert torch.equal(sharded.carry.p, single.carry.p) or rel_err(sharded.carry.p, single.carry.p) < 1e-2
    if kind != "mla_moe":
        st_full = unshard_kda_state([s.kda for s in sharded.states], tiny_cfg.kda_head_dim)
        assert rel_err(st_full.recurrent, single.states[0].kda.recurrent) < 1e-5
    # a single rank alone is not the layer: the all-reduce matters
    alone = decoder_layer(ws[0], sts[0])
    assert rel_err(alone.attn, single.attn) > 0.05


def test_unshard_layout(tiny_cfg):
    specs = ShardSpec(tp=2, cfg=tiny_cfg).all_ranks()
    ws = [make_layer_weights("kda_moe", s, seed=3) for s in specs]
    full = unshard(ws)
    ref = make_layer_weights("kda_moe", ShardSpec(tp=1, cfg=tiny_cfg), seed=3)
    # replicated tensors are identical; split ones are rank slices of one layer
    assert torch.equal(full.moe.gate, ref.moe.gate) and torch.equal(full.kda.in_proj[full.kda.in_proj_sections()["f_a"]],
                                                                  ref.kda.in_proj[ref.kda.in_proj_sections()["f_a"]])
    assert full.kda.in_proj.shape == ref.kda.in_proj.shape
    assert full.moe.w1_packed.shape == ref.moe.w1_packed.shape
    assert full.moe.w2_packed.shape == ref.moe.w2_packed.shape
