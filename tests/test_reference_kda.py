"""KDA decode (§4.2) against an independent formulation of the gated delta rule.

The reference runs the recurrence token by token. Here the same T tokens go
through (a) T single-token decode steps, (b) one T-token step, and (c) a
closed-form chunk solution: with the decayed state written out, the new
values u_t = β_t (v_t − S_{t−1} diag(g_t) k_t) solve one lower-triangular
system, and outputs and the final state follow in closed form (fp64). The
short conv is checked against `F.conv1d` over the state + tokens sequence.
"""

import pytest
import torch
import torch.nn.functional as F

from kimi_decode.config import ShardSpec
from kimi_decode.reference import kda as K
from kimi_decode.reference.common import linear
from kimi_decode.state import make_kda_state
from kimi_decode.weights import make_layer_weights

from kimi_decode.accuracy import rel_err


def _setup(cfg, batch=2, seed=0, null=()):
    sh = ShardSpec(tp=2, cfg=cfg)
    w = make_layer_weights("kda_moe", sh, seed=seed).kda
    st = make_kda_state(cfg, sh, batch, seed=seed, layer=1, null_slots=null)
    return w, st


def chunk_delta_rule(S0, q, k, v, alpha, beta):
    """Closed-form gated delta rule over T tokens (one head; fp64).

    S0 [V, K]; q, k [T, K]; v [T, V]; alpha [T, K] log decays; beta [T].
    A_t = Σ_{i<=t} α_i. With M[t, i] = Σ_c k_t[c] k_i[c] exp(A_t[c] − A_i[c]) (i < t):
    u_t = β_t (v_t − S0 (e^{A_t} ⊙ k_t) − Σ_{i<t} M[t, i] u_i)
    o_t = S0 (e^{A_t} ⊙ q_t) + Σ_{i<=t} u_i Σ_c k_i[c] q_t[c] exp(A_t[c] − A_i[c])
    S_T = S0 diag(e^{A_T}) + Σ_i u_i (k_i ⊙ e^{A_T − A_i})ᵀ
    """
    S0, q, k, v, alpha, beta = (t.double() for t in (S0, q, k, v, alpha, beta))
    T = q.shape[0]
    A = alpha.cumsum(0)  # [T, K]
    D = torch.exp(A[:, None, :] - A[None, :, :])  # [t, i, K]
    M = torch.einsum("tc,ic,tic->ti", k, k, D)
    Lm = torch.tril(M, -1)
    rhs = beta[:, None] * (v - (torch.exp(A) * k) @ S0.t())
    sysm = torch.eye(T, dtype=torch.float64) + beta[:, None] * Lm
    U = torch.linalg.solve_triangular(sysm, rhs, upper=False)
    W = torch.tril(torch.einsum("ic,tc,tic->ti", k, q, D))
    O = (torch.exp(A) * q) @ S0.t() + W @ U
    ST = S0 * torch.exp(A[-1])[None, :] + torch.einsum("iv,ic->vc", U, k * torch.exp(A[-1][None] - A))
    return O, ST


@pytest.mark.parametrize("T", [1, 3, 8])
def test_recurrence_equals_chunk_form(tiny_cfg, T):
    cfg = tiny_cfg
    w, st = _setup(cfg, batch=1, seed=T)
    g = torch.Generator().manual_seed(10 + T)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(torch.bfloat16)
    pr = K.project(x, w)
    slot = int(st.slots[0])
    win = st.conv[slot].float()
    S = st.recurrent[slot].clone()
    gs, outs = [], []
    for t in range(T):
        u, win = K.conv_step(win, pr.qkv[t], w.conv1d)
        gt = K.gates(u, pr.g_raw[t], pr.beta_raw[t], w, cfg)
        o, S = K.recurrent_step(S, gt)
        gs.append(gt)
        outs.append(o)
    for h in range(w.heads):
        O, ST = chunk_delta_rule(
            st.recurrent[slot][h], torch.stack([x.q[h] for x in gs]), torch.stack([x.k[h] for x in gs]),
            torch.stack([x.v[h] for x in gs]), torch.stack([x.alpha[h] for x in gs]),
            torch.stack([x.beta[h] for x in gs]))
        assert rel_err(torch.stack([o[h] for o in outs]), O) < 1e-5
        assert rel_err(S[h], ST) < 1e-5


def test_conv_step_equals_conv1d(tiny_cfg):
    cfg = tiny_cfg
    w, st = _setup(cfg, batch=1)
    T = 5
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(T, w.in_proj_sections()["qkv"].stop, generator=g).to(torch.bfloat16).float()
    win = st.conv[1].float()
    us = []
    for t in range(T):
        u, win = K.conv_step(win, xs[t], w.conv1d)
        us.append(u)
    seq = torch.cat([st.conv[1].float(), xs.to(torch.bfloat16).float()], 0).t()[None]  # [1, C, 3+T]
    ref = F.silu(F.conv1d(seq, w.conv1d[:, None, :], groups=seq.shape[1]))[0].t()  # [T, C]
    assert rel_err(torch.stack(us), ref) < 1e-6
    assert torch.equal(win.to(torch.bfloat16), xs[-3:].to(torch.bfloat16))


def test_single_token_steps_equal_one_multi_token_step(tiny_cfg):
    cfg = tiny_cfg
    B, T = 3, 4
    w, st = _setup(cfg, batch=B, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(B * T, cfg.hidden_size, generator=g).to(torch.bfloat16)
    out_multi, st_multi = K.kda_decode(x, w, st, T, cfg)
    cur = st
    outs = []
    for t in range(T):
        o, cur = K.kda_decode(x.view(B, T, -1)[:, t], w, cur, 1, cfg)
        outs.append(o)
    out_steps = torch.stack(outs, 1).reshape(B * T, -1)
    assert rel_err(out_steps, out_multi) < 1e-6
    assert torch.equal(cur.conv, st_multi.conv)
    assert rel_err(cur.recurrent, st_multi.recurrent) < 1e-6


def test_null_slot_gives_zero_and_keeps_state(tiny_cfg):
    cfg = tiny_cfg
    w, st = _setup(cfg, batch=3, null=(1,))
    x = torch.randn(3, cfg.hidden_size).to(torch.bfloat16)
    out, new = K.kda_decode(x, w, st, 1, cfg)
    assert torch.all(out[1] == 0) and out[0].abs().sum() > 0 and out[2].abs().sum() > 0
    assert torch.equal(new.recurrent[0], st.recurrent[0]) and torch.equal(new.conv[0], st.conv[0])
    touched = [int(s) for s in st.slots if s > 0]
    for s in touched:
        assert not torch.equal(new.recurrent[s], st.recurrent[s])


def test_gate_bounds(tiny_cfg):
    cfg = tiny_cfg
    w, st = _setup(cfg, batch=1)
    x = torch.randn(1, cfg.hidden_size).to(torch.bfloat16)
    pr = K.project(x, w)
    u, _ = K.conv_step(st.conv[1].float(), pr.qkv[0], w.conv1d)
    gt = K.gates(u, pr.g_raw[0], pr.beta_raw[0], w, cfg)
    assert torch.all(gt.alpha <= 0) and torch.all(gt.alpha >= cfg.gate_lower_bound)
    assert gt.alpha.std() > 0.3  # weights keep the gate away from saturation
    assert torch.allclose(gt.k.norm(dim=-1), torch.ones(w.heads), atol=1e-4)
    assert torch.allclose(gt.q.norm(dim=-1), torch.full((w.heads,), w.head_dim ** -0.5), atol=1e-4)
    # f_b reads the f_a section of in_proj
    z = linear(x, w.in_proj)
    assert torch.allclose(pr.g_raw, linear(z[:, w.in_proj_sections()["f_a"]], w.f_b))
