"""AttnRes (§3.2) against its formula written out by hand on tiny inputs."""

import math

import torch

from kimi_decode.reference.attn_res import attn_res


def _bf(x):
    return torch.tensor(x, dtype=torch.bfloat16)


def test_by_hand_two_blocks_with_delta_and_norm():
    # d = 2, one token, n = 2 block sources + p
    p, delta = _bf([[1.0, 2.0]]), _bf([[0.5, -1.0]])
    blocks = _bf([[[2.0, 0.0], [0.0, -1.0], [9.0, 9.0]]])
    w_n, w_q, w_o = _bf([1.0, 0.5]), _bf([2.0, 1.0]), _bf([1.0, 2.0])
    eps = 1e-5
    y, p_new, b_new = attn_res(p, delta, blocks, n=2, j=-1, w_n=w_n, w_q=w_q, w_o=w_o, eps=eps, eps_o=eps)
    pv = [1.5, 1.0]
    assert p_new.tolist() == [pv]
    assert torch.equal(b_new, blocks)
    srcs = [[2.0, 0.0], [0.0, -1.0], pv]
    logits = []
    for v in srcs:
        dot = v[0] * 1.0 * 2.0 + v[1] * 0.5 * 1.0
        logits.append(dot / math.sqrt((v[0] ** 2 + v[1] ** 2) / 2 + eps))
    mx = max(logits)
    e = [math.exp(l - mx) for l in logits]
    a = [x / sum(e) for x in e]
    m = [sum(a[i] * srcs[i][c] for i in range(3)) for c in range(2)]
    r = 1 / math.sqrt((m[0] ** 2 + m[1] ** 2) / 2 + eps)
    expect = [m[0] * r * 1.0, m[1] * r * 2.0]
    assert torch.allclose(y[0], torch.tensor(expect), atol=1e-6)


def test_by_hand_block_write_no_sources_no_norm():
    p = _bf([[3.0, -4.0]])
    blocks = _bf([[[1.0, 1.0], [2.0, 2.0]]])
    y, p_new, b_new = attn_res(p, None, blocks, n=0, j=1, w_n=_bf([1, 1]), w_q=_bf([1, 1]), w_o=None)
    assert y.tolist() == [[3.0, -4.0]]  # n = 0: m = p; no output norm
    assert b_new[0, 1].tolist() == [3.0, -4.0] and b_new[0, 0].tolist() == [1.0, 1.0]
    assert torch.equal(blocks[0, 1], _bf([2.0, 2.0]))  # input not modified


def test_prefix_add_rounds_to_bf16():
    p = _bf([[1.0, 0.0]])
    delta = _bf([[2 ** -9, 0.0]])  # below bf16 resolution at 1.0
    _, p_new, _ = attn_res(p, delta, _bf([[[0.0, 0.0]]]), n=0, j=-1, w_n=_bf([1, 1]), w_q=_bf([1, 1]), w_o=None)
    assert p_new.dtype == torch.bfloat16 and p_new.tolist() == [[1.0, 0.0]]


def test_uniform_logits_average_sources():
    # w_q = 0 gives equal logits: m is the plain mean of the sources
    T, S, d = 3, 4, 8
    g = torch.Generator().manual_seed(0)
    p = torch.randn(T, d, generator=g).to(torch.bfloat16)
    blocks = torch.randn(T, S, d, generator=g).to(torch.bfloat16)
    y, _, _ = attn_res(p, None, blocks, n=3, j=-1, w_n=torch.ones(d), w_q=torch.zeros(d), w_o=None)
    mean = torch.cat([blocks[:, :3].float(), p.float()[:, None]], 1).mean(1)
    assert torch.allclose(y, mean, atol=1e-6)
