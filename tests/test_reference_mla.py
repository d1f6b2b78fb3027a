"""MLA decode (§5.2): the absorbed form vLLM runs equals the un-absorbed form; the cache insert and causality."""

import pytest
import torch

from kimi_decode.accuracy import rel_err
from kimi_decode.config import DecodeShape, ShardSpec
from kimi_decode.reference import mla as M
from kimi_decode.state import make_mla_cache
from kimi_decode.weights import make_layer_weights


def _setup(cfg, shape, seed=0, tp=2):
    sh = ShardSpec(tp=tp, cfg=cfg)
    w = make_layer_weights("mla_moe", sh, seed=seed).mla
    cache = make_mla_cache(cfg, shape, seed=seed, layer=3, block_size=8)
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(shape.num_tokens, cfg.hidden_size, generator=g).to(torch.bfloat16)
    return w, cache, x


@pytest.mark.parametrize("shape", [DecodeShape(1, 1, 0), DecodeShape(3, 1, (5, 17, 40)),
                                   DecodeShape(2, 4, (9, 30)), DecodeShape(4, 8, (0, 1, 8, 63))])
def test_absorbed_equals_unabsorbed(tiny_cfg, shape):
    w, cache, x = _setup(tiny_cfg, shape, seed=shape.batch)
    out_a, cache_a = M.mla_decode(x, w, cache, shape.tokens_per_seq, tiny_cfg)
    out_u, cache_u = M.mla_decode_unabsorbed(x, w, cache, shape.tokens_per_seq, tiny_cfg)
    assert rel_err(out_a, out_u) < 1e-5
    assert torch.equal(cache_a.kv, cache_u.kv)


def test_cache_insert_positions(tiny_cfg):
    shape = DecodeShape(3, 2, (7, 8, 15))  # block size 8: crosses block boundaries
    w, cache, x = _setup(tiny_cfg, shape)
    q = M.query_and_latent(x, w, tiny_cfg)
    _, new = M.mla_decode(x, w, cache, 2, tiny_cfg)
    for b, ctx in enumerate(shape.context_per_seq):
        rows = new.gather(b, ctx + 2)
        assert torch.equal(rows[:ctx], cache.gather(b, ctx))  # history untouched
        assert torch.equal(rows[ctx:], q.new_rows[2 * b:2 * b + 2].to(torch.bfloat16))
    # nothing outside the new slots changed
    changed = (new.kv != cache.kv).any(-1).flatten().nonzero().flatten()
    assert set(changed.tolist()) <= set(cache.slot_mapping(2).tolist())


def test_speculative_tokens_are_causal(tiny_cfg):
    """Token t of a verify step sees the context and tokens <= t: equal to t+1 plain steps."""
    shape = DecodeShape(2, 3, (6, 11))
    w, cache, x = _setup(tiny_cfg, shape, seed=7)
    out_multi, _ = M.mla_decode(x, w, cache, 3, tiny_cfg)
    cur = cache
    outs = []
    for t in range(3):
        o, cur = M.mla_decode(x.view(2, 3, -1)[:, t], w, cur, 1, tiny_cfg)
        cur.context_lens = cur.context_lens + 1
        outs.append(o)
    assert rel_err(torch.stack(outs, 1).reshape(6, -1), out_multi) < 1e-6


def test_softmax_scale_and_nope(tiny_cfg):
    assert tiny_cfg.mla_softmax_scale == pytest.approx((16 + 8) ** -0.5)
    # k_pe is not normalised, c is (RMSNorm with kv_a_norm)
    shape = DecodeShape(1, 1, 3)
    w, cache, x = _setup(tiny_cfg, shape)
    q = M.query_and_latent(x, w, tiny_cfg)
    a = x.float() @ w.fused_qkv_a.float().t()
    kl, ql = tiny_cfg.kv_lora_rank, tiny_cfg.q_lora_rank
    assert torch.allclose(q.new_rows[:, kl:], a[:, ql + kl:])
