"""AttnRes + RMSNorm kernel (`kimi_decode.kernels.attn_res`) against `reference.attn_res` (§3.2)."""

import pytest
import torch

from kimi_decode.kernels import attn_res as A
from kimi_decode.reference.attn_res import attn_res
from kimi_decode.reference.precision import Storage

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
D, S = 7168, 8


def test_key_checks_thread_split():
    with pytest.raises(ValueError, match="threads"):
        A.AttnResKey(n=1, d=7000)
    with pytest.raises(ValueError, match="outside"):
        A.AttnResKey(n=9)


def test_aot_keys_cover_the_layer_schedule():
    keys = A.aot_keys("sm_90a")
    assert A.AttnResKey(n=0, delta=False, write_block=True) in keys  # layer 0, before attention
    assert A.AttnResKey(n=8, delta=True, norm_out=False) in keys  # after layer 92
    assert all(k.d == D and k.slots == S for k in keys)
    assert len(set(keys)) == len(keys)


def _cpu(T=2, n=1):
    p = torch.zeros(T, D, dtype=torch.bfloat16)
    b = torch.zeros(T, S, D, dtype=torch.bfloat16)
    w = torch.ones(D, dtype=torch.bfloat16)
    return p, b, w


def test_batch_outside_support_is_refused():
    p, b, w = _cpu(T=65)
    with pytest.raises(ValueError, match="1..64"):
        A.attn_res_fused(p, None, b, 1, -1, w, w, w)


@pytest.mark.parametrize("n,j", [(9, -1), (1, 8), (1, -2)])
def test_n_and_j_are_checked(n, j):
    p, b, w = _cpu()
    with pytest.raises(ValueError):
        A.attn_res_fused(p, None, b, n, j, w, w, w)


def test_cpu_tensors_are_refused_before_launch():
    p, b, w = _cpu()
    with pytest.raises(ValueError, match="CUDA device"):
        A.attn_res_fused(p, None, b, 1, -1, w, w, w)


# ---------------------------------------------------------------- GPU


def _inputs(T, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale + shift).to(torch.bfloat16)

    return dict(
        p=r(T, D),
        delta=r(T, D, scale=0.5),
        blocks=r(T, S, D),
        w_n=r(D, scale=0.1, shift=1.0),
        w_q=r(D, scale=0.05),
        w_o=r(D, scale=0.1, shift=1.0),
    )


def _check_against_reference(inp, y, p_after, blocks_after, n, j, use_delta, use_wo):
    args = (inp["p"], inp["delta"] if use_delta else None, inp["blocks"], n, j, inp["w_n"], inp["w_q"])
    wo = inp["w_o"] if use_wo else None
    y_ref, p_ref, b_ref = attn_res(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], wo.cpu() if use_wo else None)
    y_bf, _, _ = attn_res(
        *[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], wo.cpu() if use_wo else None, storage=Storage.BF16
    )
    assert torch.equal(p_after.cpu(), p_ref), "p + delta (bf16, in place) differs from the reference"
    assert torch.equal(blocks_after.cpu(), b_ref), "block stack differs from the reference"
    y = y.float().cpu()
    assert torch.isfinite(y).all(), "NaN in y: an output element was not written"
    err = (y - y_ref).abs().max().item()
    err_bf = (y_bf - y_ref).abs().max().item()
    scale = y_ref.abs().max().item()
    assert err <= 2 * err_bf + 1e-3 * scale, f"max err {err:.3g} vs bf16 reference {err_bf:.3g} (|y| {scale:.3g})"


CASES = [  # (n, delta, j, w_o): all compiled ahead of time (A.aot_keys)
    (0, False, 0, True),  # layer 0 before attention: B[0] <- p, m = p
    (1, True, -1, True),
    (2, True, 2, True),  # block boundary: write B[2], read B[0..1] + p
    (5, False, -1, True),
    (8, True, -1, False),  # after layer 92: no output norm
    (8, False, -1, True),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("n,use_delta,j,use_wo", CASES)
def test_attn_res_matches_reference(T, n, use_delta, j, use_wo):
    inp = _inputs(T, seed=T * 100 + n)
    p, blocks = inp["p"].clone(), inp["blocks"].clone()
    y = torch.full((T, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    A.attn_res_fused(
        p, inp["delta"] if use_delta else None, blocks, n, j, inp["w_n"], inp["w_q"], inp["w_o"] if use_wo else None, out=y
    )
    torch.cuda.synchronize()
    _check_against_reference(inp, y, p, blocks, n, j, use_delta, use_wo)


@pytest.mark.gpu
@needs_cuda
def test_attn_res_bad_inputs_are_refused_on_gpu():
    inp = _inputs(2, seed=1)
    with pytest.raises(TypeError, match="bfloat16"):
        A.attn_res_fused(inp["p"].float(), None, inp["blocks"], 1, -1, inp["w_n"], inp["w_q"], inp["w_o"])
    with pytest.raises(ValueError, match="shape"):
        A.attn_res_fused(inp["p"], inp["delta"][:1], inp["blocks"], 1, -1, inp["w_n"], inp["w_q"], inp["w_o"])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 64])
def test_attn_res_cuda_graph_capture_and_replay(T):
    n, j = 3, 3  # block boundary before attention (layer 36): write B[3], read B[0..2] + p
    inp = _inputs(T, seed=5)
    p, blocks = inp["p"].clone(), inp["blocks"].clone()
    delta = inp["delta"].clone()
    y = torch.empty((T, D), dtype=torch.bfloat16, device="cuda")

    def step():
        A.attn_res_fused(p, delta, blocks, n, j, inp["w_n"], inp["w_q"], inp["w_o"], out=y)

    step()  # load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        fresh = _inputs(T, seed=50 + seed)
        p.copy_(fresh["p"])
        blocks.copy_(fresh["blocks"])
        delta.copy_(fresh["delta"])
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_inp = dict(inp, p=fresh["p"], blocks=fresh["blocks"], delta=fresh["delta"])
        _check_against_reference(ref_inp, y, p, blocks, n, j, True, True)
