"""The stock-vLLM stand-in Triton kernels (`kimi_decode.stock.triton_small`) against fp32 torch / the reference.

On CPU the kernels run through Triton's interpreter (tests/conftest.py), whose fp32 -> bf16
casts truncate instead of rounding to nearest even, so a bf16 output carries up to one bf16
ulp (2^-8 relative) of error there; on a GPU the casts round to nearest. TOL covers both.
"""

from __future__ import annotations

import pytest
import torch

from kimi_decode.accuracy import all_written, rel_err
from kimi_decode.reference.attn_res import attn_res as ref_attn_res
from kimi_decode.reference.common import rms_norm, situ_and_mul as ref_situ_and_mul
from kimi_decode.stock import triton_small as ts

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF = torch.bfloat16
TOL = 6e-3 if DEV == "cpu" else 4e-3  # one bf16 rounding (truncation on the interpreter)


def nan(*shape, dtype=BF):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def rnd(*shape, dtype=BF, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def weight(d):
    return (1.0 + 0.2 * torch.randn(d, device=DEV)).to(BF)


def one_ulp_close(a, b):
    """Equal up to one bf16 ulp (the interpreter truncates, the reference rounds)."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= b.abs() * 2.0 ** -7 + 1e-30).all())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --------------------------------------------------------------------------- attn_res


def _run_attn_res(N, d, S, n, j, delta_dtype, norm, strided=False, wq_scale=0.05):
    if strided:  # row-strided views of larger buffers
        p = rnd(N, d + 24)[:, :d]
        delta = rnd(N, d + 8, dtype=delta_dtype)[:, 8:] if delta_dtype else None
        blocks = rnd(N, S + 1, d + 16)[:, 1:, :d]
        y = nan(N, d + 40)[:, 16:16 + d]
    else:
        p = rnd(N, d)
        delta = rnd(N, d, dtype=delta_dtype) if delta_dtype else None
        blocks = rnd(N, S, d)
        y = nan(N, d)
    w_n, w_q = weight(d), rnd(d, scale=wq_scale)
    w_o = weight(d) if norm else None
    p0, b0 = p.clone(), blocks.clone()
    out = ts.attn_res(y, p, delta, blocks, n, j, w_n, w_q, w_o, 1e-5, 1e-5)
    assert out is y and all_written(y)
    # step 1: p in place (same bf16 value up to the interpreter's rounding mode)
    p_ref = (p0.float() + delta.float()).to(BF) if delta is not None else p0
    if delta is None:
        assert torch.equal(p, p0)
    else:
        assert one_ulp_close(p, p_ref)
    # step 2: only slot j changes, to the new p
    b_ref = b0.clone()
    if j >= 0:
        b_ref[:, j] = p
    assert torch.equal(blocks, b_ref)
    # steps 3-4, from the kernel's p (isolates the softmax/norm from step 1's rounding)
    y_ref, _, _ = ref_attn_res(p.clone(), None, b_ref, n, -1, w_n, w_q, w_o)
    assert rel_err(y, y_ref) < TOL
    # and end to end from the inputs
    y_ref2, _, _ = ref_attn_res(p0, delta, b0, n, j, w_n, w_q, w_o)
    assert rel_err(y, y_ref2) < 3 * TOL


@pytest.mark.parametrize("N,d,n,j,delta_dtype,norm", [
    (1, 200, 0, -1, BF, True),
    (3, 200, 3, -1, BF, True),
    (3, 200, 3, 3, BF, True),  # block write into the slot after the sources (the bw layer)
    (3, 200, 4, 1, torch.float32, True),  # j < n: the source B[j] is the new p
    (2, 200, 2, 0, None, False),
    (3, 136, 8, -1, BF, False),  # final AR: all 8 blocks, no output norm
    (1, 7168, 8, -1, BF, True),  # real size, one token
])
def test_attn_res(N, d, n, j, delta_dtype, norm):
    _run_attn_res(N, d, 8, n, j, delta_dtype, norm)


def test_attn_res_strided():
    _run_attn_res(3, 200, 8, 5, 5, BF, True, strided=True)


def test_attn_res_peaked_softmax():
    # large logits (unscaled random w_q): the online max must keep exp() in range
    N, d, S = 2, 200, 8
    p, blocks = rnd(N, d), rnd(N, S, d)
    w_n, w_q, w_o = weight(d), rnd(d, scale=20.0), weight(d)
    y = nan(N, d)
    ts.attn_res(y, p, None, blocks, 6, -1, w_n, w_q, w_o)
    y_ref, _, _ = ref_attn_res(p, None, blocks, 6, -1, w_n, w_q, w_o)
    assert all_written(y) and rel_err(y, y_ref) < TOL


def test_attn_res_bad_inputs():
    N, d, S = 2, 64, 8
    p, blocks, y = rnd(N, d), rnd(N, S, d), nan(N, d)
    w = weight(d)
    with pytest.raises(TypeError, match="p must be"):
        ts.attn_res(y, p.float(), None, blocks, 1, -1, w, w, w)
    with pytest.raises(TypeError, match="delta"):
        ts.attn_res(y, p, p.half(), blocks, 1, -1, w, w, w)
    with pytest.raises(ValueError, match="blocks"):
        ts.attn_res(y, p, None, rnd(N, S, d + 1), 1, -1, w, w, w)
    with pytest.raises(ValueError, match="y must have shape"):
        ts.attn_res(nan(N + 1, d), p, None, blocks, 1, -1, w, w, w)
    with pytest.raises(ValueError, match="w_o"):
        ts.attn_res(y, p, None, blocks, 1, -1, w, w, weight(d + 1))
    with pytest.raises(ValueError, match="n must be"):
        ts.attn_res(y, p, None, blocks, S + 1, -1, w, w, w)
    with pytest.raises(ValueError, match="j must be"):
        ts.attn_res(y, p, None, blocks, 1, S, w, w, w)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        ts.attn_res(y, rnd(d, N).t(), None, blocks, 1, -1, w, w, w)
    assert all(torch.isnan(y).flatten())  # nothing was launched


# --------------------------------------------------------------------------- situ_and_mul


@pytest.mark.parametrize("M,I,beta_lin,strided", [
    (1, 200, 25.0, False),
    (3, 384, 25.0, True),
    (2, 4224, 25.0, False),  # dense-MLP width: several programs per row
    (3, 136, 0.0, True),  # beta_lin <= 0: up unchanged
])
def test_situ_and_mul(M, I, beta_lin, strided):
    # scale 6 reaches the tanh saturation of β = 4
    x = rnd(M, 2 * I + 48, scale=6.0)[:, 16:16 + 2 * I] if strided else rnd(M, 2 * I, scale=6.0)
    out = nan(M, I)
    assert ts.situ_and_mul(out, x, 4.0, beta_lin) is out
    assert all_written(out)
    assert rel_err(out, ref_situ_and_mul(x, 4.0, beta_lin)) < TOL


def test_situ_and_mul_large_up():
    # |up| well past β_lin = 25 exercises the linear-branch tanh
    x = torch.cat([rnd(2, 64, scale=3.0), rnd(2, 64, scale=60.0)], 1)
    out = nan(2, 64)
    ts.situ_and_mul(out, x, 4.0, 25.0)
    assert rel_err(out, ref_situ_and_mul(x, 4.0, 25.0)) < TOL


def test_situ_and_mul_bad_inputs():
    x, out = rnd(2, 64), nan(2, 32)
    with pytest.raises(TypeError, match="x must be"):
        ts.situ_and_mul(out, x.float(), 4.0, 25.0)
    with pytest.raises(TypeError, match="out must be"):
        ts.situ_and_mul(out.float(), x, 4.0, 25.0)
    with pytest.raises(ValueError, match="out must have shape"):
        ts.situ_and_mul(nan(2, 64), x, 4.0, 25.0)
    with pytest.raises(ValueError, match="odd"):
        ts.situ_and_mul(out, rnd(2, 63), 4.0, 25.0)
    with pytest.raises(ValueError, match="contiguous"):
        ts.situ_and_mul(out, rnd(64, 2).t(), 4.0, 25.0)
    assert all(torch.isnan(out).flatten())


# --------------------------------------------------------------------------- sigmoid_gate_mul


@pytest.mark.parametrize("N,H,V,layout", [
    (1, 12, 128, "bmm"),  # TP8 shapes, o straight from bmm over heads ([H, N, V] contiguous)
    (3, 12, 128, "transposed"),  # a [N, H, V] buffer viewed as [H, N, V]
    (3, 3, 40, "bmm"),  # awkward sizes
    (2, 5, 24, "transposed"),
])
def test_sigmoid_gate_mul(N, H, V, layout):
    o = rnd(H, N, V) if layout == "bmm" else rnd(N, H, V).transpose(0, 1)
    g = rnd(N, H * V + 32, scale=3.0)[:, 32:]  # row-strided view
    out = nan(N, H * V)
    assert ts.sigmoid_gate_mul(out, o, g) is out
    assert all_written(out)
    ref = o.float().transpose(0, 1).reshape(N, H * V) * torch.sigmoid(g.float())
    assert rel_err(out, ref) < TOL


def test_sigmoid_gate_mul_bad_inputs():
    N, H, V = 2, 4, 16
    o, g, out = rnd(H, N, V), rnd(N, H * V), nan(N, H * V)
    with pytest.raises(TypeError, match="o must be"):
        ts.sigmoid_gate_mul(out, o.float(), g)
    with pytest.raises(ValueError, match="o must be"):
        ts.sigmoid_gate_mul(out, o.reshape(H, N * V), g)
    with pytest.raises(ValueError, match="g must have shape"):
        ts.sigmoid_gate_mul(out, o, rnd(N, H * V + 1))
    with pytest.raises(TypeError, match="g must be"):
        ts.sigmoid_gate_mul(out, o, g.half())
    with pytest.raises(ValueError, match="out must have shape"):
        ts.sigmoid_gate_mul(nan(N + 1, H * V), o, g)
    assert all(torch.isnan(out).flatten())


# --------------------------------------------------------------------------- fused_q_kv_rmsnorm


@pytest.mark.parametrize("N,dq,dkv,extra", [
    (1, 1536, 512, 64),  # real layout: views into the [N, 2112] fused_qkv_a output
    (3, 1536, 512, 64),
    (3, 200, 72, 5),  # awkward sizes, odd row stride
])
def test_fused_q_kv_rmsnorm(N, dq, dkv, extra):
    a = rnd(N, dq + dkv + extra, scale=3.0)
    q_in, kv_in = a[:, :dq], a[:, dq:dq + dkv]
    w_q, w_kv = weight(dq), weight(dkv)
    q_out, kv_out = nan(N, dq), nan(N, dkv)
    r = ts.fused_q_kv_rmsnorm(q_out, kv_out, q_in, kv_in, w_q, w_kv, 1e-5)
    assert r[0] is q_out and r[1] is kv_out
    assert all_written(q_out) and all_written(kv_out)
    assert rel_err(q_out, rms_norm(q_in, w_q, 1e-5)) < TOL
    assert rel_err(kv_out, rms_norm(kv_in, w_kv, 1e-5)) < TOL


def test_fused_q_kv_rmsnorm_bad_inputs():
    N = 2
    a = rnd(N, 2112)
    q_in, kv_in = a[:, :1536], a[:, 1536:2048]
    w_q, w_kv = weight(1536), weight(512)
    q_out, kv_out = nan(N, 1536), nan(N, 512)
    with pytest.raises(TypeError, match="q_in must be"):
        ts.fused_q_kv_rmsnorm(q_out, kv_out, q_in.float(), kv_in, w_q, w_kv)
    with pytest.raises(ValueError, match="kv_in must have"):
        ts.fused_q_kv_rmsnorm(q_out, kv_out, q_in, kv_in[:1], w_q, w_kv)
    with pytest.raises(ValueError, match="w_kv must have shape"):
        ts.fused_q_kv_rmsnorm(q_out, kv_out, q_in, kv_in, w_q, w_q)
    with pytest.raises(ValueError, match="q_out must have shape"):
        ts.fused_q_kv_rmsnorm(kv_out, kv_out, q_in, kv_in, w_q, w_kv)
    with pytest.raises(TypeError, match="kv_out must be"):
        ts.fused_q_kv_rmsnorm(q_out, kv_out.float(), q_in, kv_in, w_q, w_kv)
    assert all(torch.isnan(q_out).flatten()) and all(torch.isnan(kv_out).flatten())


# --------------------------------------------------------------------------- grouped_topk


def _route_ref(logits, bias, k, renormalize, scaling):
    """`kimi_decode.reference.moe.route` after its router GEMM."""
    s = torch.sigmoid(logits)
    ids = torch.topk(s + bias, k, dim=-1).indices
    w = s.gather(-1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w * scaling


@pytest.mark.parametrize("N,E,k,renormalize,scaling,strided", [
    (1, 896, 16, True, 1.0, False),
    (3, 896, 16, True, 1.0, True),
    (5, 896, 16, False, 2.5, False),
    (3, 100, 5, True, 1.5, True),  # awkward sizes
])
def test_grouped_topk(N, E, k, renormalize, scaling, strided):
    logits = (torch.randn(N, E + 8, device=DEV) * 2.0)[:, 8:] if strided else torch.randn(N, E, device=DEV) * 2.0
    bias = torch.randn(E, device=DEV) * 0.5
    ids = torch.full((N, k), -1, dtype=torch.int32, device=DEV)
    wts = torch.full((N, k), float("nan"), device=DEV)
    r = ts.grouped_topk(ids, wts, logits, bias, renormalize, scaling)
    assert r[0] is ids and r[1] is wts
    assert all_written(wts) and bool((ids >= 0).all()) and bool((ids < E).all())
    ref_ids, ref_w = _route_ref(logits, bias, k, renormalize, scaling)
    # the same set as torch.topk on s + bias
    assert torch.equal(ids.long().sort(-1).values, ref_ids.sort(-1).values)
    # weights consistent with ids: compare after ordering both by expert id
    o, ro = ids.long().argsort(-1), ref_ids.argsort(-1)
    torch.testing.assert_close(wts.gather(-1, o), ref_w.gather(-1, ro), rtol=1e-5, atol=1e-6)
    if renormalize:
        torch.testing.assert_close(wts.sum(-1), torch.full((N,), scaling, device=DEV), rtol=1e-5, atol=0)


def test_grouped_topk_ties_deterministic():
    # heavy ties: every score equal; picks must be k distinct experts, same on every call
    N, E, k = 2, 896, 16
    logits, bias = torch.zeros(N, E, device=DEV), torch.zeros(E, device=DEV)
    ids = torch.empty(N, k, dtype=torch.int32, device=DEV)
    wts = torch.empty(N, k, device=DEV)
    ts.grouped_topk(ids, wts, logits, bias)
    first = ids.clone()
    ts.grouped_topk(ids, wts, logits, bias)
    assert torch.equal(ids, first)
    assert all(len(set(r)) == k for r in ids.tolist())
    torch.testing.assert_close(wts, torch.full((N, k), 1.0 / k, device=DEV))


def test_grouped_topk_bad_inputs():
    N, E, k = 2, 64, 4
    logits, bias = torch.randn(N, E, device=DEV), torch.randn(E, device=DEV)
    ids = torch.full((N, k), -1, dtype=torch.int32, device=DEV)
    wts = torch.full((N, k), float("nan"), device=DEV)
    with pytest.raises(TypeError, match="logits must be"):
        ts.grouped_topk(ids, wts, logits.to(BF), bias)
    with pytest.raises(TypeError, match="topk_ids must be"):
        ts.grouped_topk(ids.long(), wts, logits, bias)
    with pytest.raises(ValueError, match="bias must have shape"):
        ts.grouped_topk(ids, wts, logits, bias[:-1])
    with pytest.raises(ValueError, match="topk_weights must have shape"):
        ts.grouped_topk(ids, wts[:, :-1], logits, bias)
    with pytest.raises(ValueError, match="k = "):
        ts.grouped_topk(torch.zeros(N, E + 1, dtype=torch.int32, device=DEV),
                        torch.zeros(N, E + 1, device=DEV), logits, bias)
    assert bool((ids == -1).all()) and all(torch.isnan(wts).flatten())


# --------------------------------------------------------------------------- all-reduce stand-ins


def _bufs(tp, N, d, strided):
    return rnd(tp, N + 1, d + 24)[:, 1:, 8:8 + d] if strided else rnd(tp, N, d)


@pytest.mark.parametrize("tp,N,d,strided", [
    (1, 1, 200, False),
    (8, 1, 7168, False),  # TP8, one token, the hidden size
    (4, 3, 200, True),
    (8, 3, 1000, True),
])
def test_allreduce_emulated(tp, N, d, strided):
    bufs = _bufs(tp, N, d, strided)
    coef = torch.rand(tp, device=DEV) + 0.5
    out = nan(N, d)
    assert ts.allreduce_emulated(out, bufs, coef) is out
    assert all_written(out)
    ref = (coef[:, None, None] * bufs.float()).sum(0)
    assert rel_err(out, ref) < TOL
    # the stand-in's own use: coef = [1, 0, ...] gives the rank's partial back bit-exactly
    one = torch.zeros(tp, device=DEV)
    one[0] = 1.0
    ts.allreduce_emulated(out, bufs, one)
    assert torch.equal(out, bufs[0])


def test_allreduce_reads_every_peer():
    # a NaN in a peer buffer poisons the output even with coef 0: every buffer is really read
    tp, N, d = 4, 2, 200
    bufs = rnd(tp, N, d)
    bufs[3, 1, 7] = float("nan")
    coef = torch.tensor([1.0, 0.0, 0.0, 0.0], device=DEV)
    out = rnd(N, d)
    ts.allreduce_emulated(out, bufs, coef)
    assert torch.isnan(out[1, 7]) and int(torch.isnan(out).sum()) == 1


@pytest.mark.parametrize("tp,N,d,strided", [
    (8, 1, 3584, False),  # the MoE latent at TP8
    (8, 3, 3584, True),
    (2, 3, 200, False),
    (1, 1, 136, True),
])
def test_allreduce_rmsnorm_emulated(tp, N, d, strided):
    bufs = _bufs(tp, N, d, strided)
    coef = torch.rand(tp, device=DEV) + 0.5
    w = weight(d)
    out = nan(N, d)
    assert ts.allreduce_rmsnorm_emulated(out, bufs, coef, w, 1e-5) is out
    assert all_written(out)
    ref = rms_norm((coef[:, None, None] * bufs.float()).sum(0), w, 1e-5)
    assert rel_err(out, ref) < TOL


def test_allreduce_bad_inputs():
    tp, N, d = 4, 2, 64
    bufs, coef, w, out = rnd(tp, N, d), torch.ones(tp, device=DEV), weight(d), nan(N, d)
    for fn, extra in ((ts.allreduce_emulated, ()), (ts.allreduce_rmsnorm_emulated, (w,))):
        with pytest.raises(TypeError, match="bufs must be"):
            fn(out, bufs.float(), coef, *extra)
        with pytest.raises(ValueError, match="bufs must be 3-D"):
            fn(out, bufs[0], coef, *extra)
        with pytest.raises(TypeError, match="coef must be"):
            fn(out, bufs, coef.to(BF), *extra)
        with pytest.raises(ValueError, match="coef must have shape"):
            fn(out, bufs, coef[:-1], *extra)
        with pytest.raises(ValueError, match="out must have shape"):
            fn(nan(N, d + 1), bufs, coef, *extra)
    with pytest.raises(ValueError, match="w must have shape"):
        ts.allreduce_rmsnorm_emulated(out, bufs, coef, weight(d + 1))
    with pytest.raises(TypeError, match="w must be"):
        ts.allreduce_rmsnorm_emulated(out, bufs, coef, w.float())
    assert all(torch.isnan(out).flatten())


# --------------------------------------------------------------------------- GPU: real sizes under a CUDA graph


@pytest.mark.gpu
def test_all_kernels_capture_in_cuda_graph():
    """Every function at its TP8 decode shape, captured once and replayed: outputs match eager."""
    N, d = 1, 7168
    p, delta, blocks = rnd(N, d), rnd(N, d), rnd(N, 8, d)
    w_n, w_q, w_o = weight(d), rnd(d, scale=0.05), weight(d)
    x = rnd(N, 2 * 768, scale=4.0)
    o, g = rnd(12, N, 128), rnd(N, 1536)
    qkv = rnd(N, 2112)
    w_qa, w_kva = weight(1536), weight(512)
    logits, bias = torch.randn(N, 896, device=DEV), torch.randn(896, device=DEV) * 0.1
    bufs, lat = rnd(8, N, d), rnd(8, N, 3584)
    coef = torch.zeros(8, device=DEV)
    coef[0] = 1.0
    w_l = weight(3584)
    outs = dict(y=nan(N, d), sm=nan(N, 768), gm=nan(N, 1536), qo=nan(N, 1536), kvo=nan(N, 512),
                ids=torch.zeros(N, 16, dtype=torch.int32, device=DEV),
                tw=torch.zeros(N, 16, device=DEV), ar=nan(N, d), arn=nan(N, 3584))
    p_keep = p.clone()

    def step():
        p.copy_(p_keep)
        ts.attn_res(outs["y"], p, delta, blocks, 4, 4, w_n, w_q, w_o)
        ts.situ_and_mul(outs["sm"], x, 4.0, 25.0)
        ts.sigmoid_gate_mul(outs["gm"], o, g)
        ts.fused_q_kv_rmsnorm(outs["qo"], outs["kvo"], qkv[:, :1536], qkv[:, 1536:2048], w_qa, w_kva)
        ts.grouped_topk(outs["ids"], outs["tw"], logits, bias)
        ts.allreduce_emulated(outs["ar"], bufs, coef)
        ts.allreduce_rmsnorm_emulated(outs["arn"], lat, coef, w_l)

    step()  # compile + eager result
    torch.cuda.synchronize()
    eager = {k: v.clone() for k, v in outs.items()}
    for v in outs.values():
        v.fill_(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    for k in outs:
        assert torch.equal(outs[k], eager[k]), k
    y_ref, _, _ = ref_attn_res(p_keep, delta, blocks, 4, 4, w_n, w_q, w_o)
    assert rel_err(outs["y"], y_ref) < TOL
    assert torch.equal(outs["ar"], bufs[0])
