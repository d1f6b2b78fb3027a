"""The published configuration, the layer schedule and the per-rank shard sizes (§1, §3, §4.1, §5.1, §6.1, §7)."""

import pytest

from kimi_decode.config import DecodeShape, KimiK3Config, ShardSpec


def test_published_values():
    c = KimiK3Config()
    assert (c.hidden_size, c.num_hidden_layers) == (7168, 93)
    assert (c.kda_num_heads, c.kda_head_dim, c.kda_proj_size) == (96, 128, 12288)
    assert (c.q_lora_rank, c.kv_lora_rank, c.mla_latent_dim) == (1536, 512, 576)
    assert c.mla_softmax_scale == pytest.approx(192 ** -0.5)
    assert (c.num_experts, c.num_experts_per_token, c.routed_expert_hidden_size) == (896, 16, 3584)
    assert c.shared_intermediate_size == 6144
    assert c.intermediate_size == 33792
    assert (c.situ_beta, c.situ_linear_beta, c.gate_lower_bound) == (4.0, 25.0, -5.0)
    assert c.num_attn_res_blocks == 8
    assert c.is_published and not KimiK3Config.tiny().is_published


def test_layer_schedule():
    c = KimiK3Config()
    kinds = c.layer_schedule()
    assert kinds[0] == "dense"
    mla = [i for i, k in enumerate(kinds) if k == "mla_moe"]
    assert mla == list(range(3, 88, 4)) + [91, 92]
    assert len(mla) == 24 and kinds.count("kda_moe") == 68 and len(c.kda_layers) == 69
    assert all(c.is_kda_layer(i) == ((i + 1) in c.kda_layers) for i in range(93))
    assert [c.representative_layer(k) for k in ("dense", "kda_moe", "mla_moe")] == [0, 1, 3]
    with pytest.raises(ValueError):
        c.layer_kind(93)


def test_attn_res_positions():
    c = KimiK3Config()
    assert c.attn_res_position(0) == (0, True)
    assert c.attn_res_position(1) == (1, False)
    assert c.attn_res_position(12) == (1, True)
    assert c.attn_res_position(13) == (2, False)
    assert c.attn_res_position(92) == (8, False)
    assert max(c.attn_res_position(L)[0] + c.attn_res_position(L)[1] for L in range(93)) <= 8


@pytest.mark.parametrize("tp,heads,proj,rows,pad,qb,inter,inter_pad,shared,dense", [
    (8, 12, 1536, 6288, 4, 2304, 384, 0, 768, 4224),
    (16, 6, 768, 3216, 10, 1152, 256, 64, 384, 2112),
])
def test_shard_sizes(tp, heads, proj, rows, pad, qb, inter, inter_pad, shared, dense):
    s = ShardSpec(tp=tp)
    assert (s.kda_heads, s.kda_proj, s.kda_in_proj_rows, s.kda_in_proj_pad) == (heads, proj, rows, pad)
    assert (s.mla_heads, s.mla_q_b_rows, s.mla_gate_rows) == (heads, qb, proj)
    assert (s.expert_intermediate_local, s.expert_intermediate_pad) == (inter, inter_pad)
    assert s.expert_intermediate_real == 3072 // tp
    assert (s.shared_intermediate, s.dense_intermediate) == (shared, dense)


def test_shard_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="rank"):
        ShardSpec(tp=8, rank=8)
    with pytest.raises(ValueError, match="does not divide"):
        ShardSpec(tp=7)


def test_decode_shape():
    s = DecodeShape(batch=3, tokens_per_seq=2, context_lens=(5, 9, 1))
    assert s.num_tokens == 6 and s.max_context == 11 and s.context_per_seq == (5, 9, 1)
    assert DecodeShape(2, 1, 7).context_per_seq == (7, 7)
    with pytest.raises(ValueError):
        DecodeShape(batch=2, context_lens=(1, 2, 3))
