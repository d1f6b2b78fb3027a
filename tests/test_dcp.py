"""Decode context parallelism (MLA): interleaved KV shards merged by log-sum-exp equal DCP 1."""

import pytest
import torch

from kimi_decode.accuracy import rel_err
from kimi_decode.config import DecodeShape, ShardSpec
from kimi_decode.dcp import merge_partials, owned_positions, partial_attention
from kimi_decode.reference import decoder_layer
from kimi_decode.reference.mla import mla_decode
from kimi_decode.state import make_decode_state, make_mla_cache
from kimi_decode.weights import make_layer_weights


def test_owned_positions_partition():
    for dcp in (1, 2, 4, 8):
        got = torch.cat([owned_positions(37, dcp, r) for r in range(dcp)])
        assert sorted(got.tolist()) == list(range(37))
    with pytest.raises(ValueError):
        owned_positions(10, 2, 2)


def test_merge_is_exact_and_handles_empty_shards():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 24, generator=g)
    rows = torch.randn(11, 24, generator=g)
    pos = torch.arange(11)
    o_full, lse_full = partial_attention(q, rows, pos, 10, 0.2, 16)
    parts = [partial_attention(q, rows[pos % 4 == r], pos[pos % 4 == r], 10, 0.2, 16) for r in range(4)]
    merged = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert rel_err(merged, o_full) < 1e-6
    # limit 1: ranks 2 and 3 see nothing (lse = -inf) and must not disturb the merge
    parts = [partial_attention(q, rows[pos % 4 == r], pos[pos % 4 == r], 1, 0.2, 16) for r in range(4)]
    assert torch.isinf(parts[3][1]).all()
    merged = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert rel_err(merged, partial_attention(q, rows, pos, 1, 0.2, 16)[0]) < 1e-6


@pytest.mark.parametrize("dcp", [2, 4, 8])
@pytest.mark.parametrize("shape", [DecodeShape(1, 1, 0), DecodeShape(3, 3, (5, 64, 130))])
def test_mla_decode_dcp_equals_dcp1(tiny_cfg, dcp, shape):
    sh = ShardSpec(tp=2, cfg=tiny_cfg)
    w = make_layer_weights("mla_moe", sh, seed=dcp).mla
    cache = make_mla_cache(tiny_cfg, shape, seed=dcp, block_size=16)
    x = torch.randn(shape.num_tokens, tiny_cfg.hidden_size).to(torch.bfloat16)
    ref, c1 = mla_decode(x, w, cache, shape.tokens_per_seq, tiny_cfg)
    out, c2 = mla_decode(x, w, cache, shape.tokens_per_seq, tiny_cfg, dcp=dcp)
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(c1.kv, c2.kv)


def test_whole_layer_with_dcp(tiny_cfg):
    shape = DecodeShape(2, 1, (33, 70))
    ref = decoder_layer(make_layer_weights("mla_moe", ShardSpec(tp=2, cfg=tiny_cfg)),
                        make_decode_state("mla_moe", ShardSpec(tp=2, cfg=tiny_cfg), shape))
    sh = ShardSpec(tp=2, dcp=4, cfg=tiny_cfg)
    out = decoder_layer(make_layer_weights("mla_moe", sh), make_decode_state("mla_moe", sh, shape))
    assert rel_err(out.h, ref.h) < 1e-4
