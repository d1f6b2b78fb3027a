"""Latent MoE (§6.3): routing rules, and the routed output against a dense all-experts computation."""

import torch

from kimi_decode.accuracy import rel_err
from kimi_decode.config import ShardSpec
from kimi_decode.reference import moe as R
from kimi_decode.reference.common import situ_glu
from kimi_decode.weights import make_layer_weights


def _w(cfg, tp=2, seed=0):
    return make_layer_weights("kda_moe", ShardSpec(tp=tp, cfg=cfg), seed=seed).moe


def test_routing_rules(tiny_cfg):
    w = _w(tiny_cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, tiny_cfg.hidden_size, generator=g).to(torch.bfloat16)
    r = R.route(x, w, tiny_cfg)
    k = tiny_cfg.num_experts_per_token
    logits = x.double() @ w.gate.double().t()
    s = torch.sigmoid(logits)
    biased = s + w.e_score_correction_bias.double()
    for n in range(5):
        # selection by the biased score, weights from the unbiased score, renormalised
        assert set(r.ids[n].tolist()) == set(torch.argsort(biased[n], descending=True)[:k].tolist())
        expect = s[n, r.ids[n]] / s[n, r.ids[n]].sum()
        assert torch.allclose(r.weights[n].double(), expect, atol=1e-6)
    assert torch.allclose(r.weights.sum(-1), torch.ones(5))


def test_bias_changes_selection_not_weights(tiny_cfg):
    w = _w(tiny_cfg)
    x = torch.randn(1, tiny_cfg.hidden_size).to(torch.bfloat16)
    r0 = R.route(x, w, tiny_cfg)
    e = int(torch.argsort(r0.scores[0])[0])  # the lowest-scoring expert
    w.e_score_correction_bias[e] = 100.0
    r1 = R.route(x, w, tiny_cfg)
    assert e in r1.ids[0].tolist()
    i = r1.ids[0].tolist().index(e)
    assert torch.allclose(r1.weights[0, i], r0.scores[0, e] / r0.scores[0, r1.ids[0]].sum())


def test_routed_equals_dense_masked(tiny_cfg):
    for tp in (1, 2, 4):
        w = _w(tiny_cfg, tp=tp, seed=tp)
        g = torch.Generator().manual_seed(tp)
        x = torch.randn(9, tiny_cfg.hidden_size, generator=g).to(torch.bfloat16)
        x[5] = x[2]  # two tokens with identical routing share every expert
        p = R.moe_partials(x, w, tiny_cfg)
        assert torch.equal(p.routing.ids[5], p.routing.ids[2])
        dense = R.moe_dense_masked(x, w, tiny_cfg)
        assert rel_err(p.latent, dense) < 1e-5


def test_disjoint_routing(tiny_cfg):
    """Tokens whose experts do not overlap: each token's output depends only on its own experts."""
    w = _w(tiny_cfg)
    k = tiny_cfg.num_experts_per_token
    x = torch.randn(2, tiny_cfg.hidden_size).to(torch.bfloat16)
    w.e_score_correction_bias.zero_()
    w.e_score_correction_bias[:k] = 50.0  # token 0 -> experts 0..k-1
    p0 = R.moe_partials(x[:1], w, tiny_cfg)
    w.e_score_correction_bias.zero_()
    w.e_score_correction_bias[k:2 * k] = 50.0
    p1 = R.moe_partials(x[1:], w, tiny_cfg)
    assert not set(p0.routing.ids[0].tolist()) & set(p1.routing.ids[0].tolist())
    dense0 = R.moe_dense_masked(x[:1], w, tiny_cfg)  # with token 1's routing, token 0 differs
    assert rel_err(p0.latent, dense0) > 0.1


def test_expert_padding_is_inert(tiny_cfg):
    """TP4 pads each expert's 32-row slice to 96 zero rows: same result as dropping the padding."""
    w = _w(tiny_cfg, tp=4)
    real = w.inter_real
    assert w.w1_packed.shape[1] == 96 and real == 32
    z = torch.randn(3, tiny_cfg.routed_expert_hidden_size)
    W1, W3, W2 = R.expert_matrices(w, 7)
    assert torch.all(W1[real:] == 0) and torch.all(W3[real:] == 0) and torch.all(W2[:, real:] == 0)
    y = R.expert_forward(z, w, 7, tiny_cfg)
    a = situ_glu(z @ W1[:real].t(), z @ W3[:real].t(), 4.0, 25.0)
    assert rel_err(y, a @ W2[:, :real].t()) < 1e-6


def test_situ_formula():
    g = torch.tensor([-3.0, 0.0, 0.5, 9.0])
    u = torch.tensor([1.0, 2.0, -40.0, 0.25])
    expect = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    assert torch.allclose(situ_glu(g, u, 4.0, 25.0), expect)
    assert torch.allclose(situ_glu(g, u, 4.0, 0.0), 4 * torch.tanh(g / 4) * torch.sigmoid(g) * u)
