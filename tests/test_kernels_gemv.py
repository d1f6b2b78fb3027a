"""Decode GEMV kernel (`kimi_decode.kernels.gemv`): key and input checks on CPU; correctness on a GPU."""

import pytest
import torch

from kimi_decode.kernels import gemv as G

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_key_rejects_unaligned_k():
    with pytest.raises(ValueError, match="multiple of 8"):
        G.GemvKey(n=64, k=100)


def test_m_tile_choice():
    assert [G.pick_m_tile(m) for m in (1, 2, 8, 9, 64)] == [1, 8, 8, 8, 8]


def test_aot_keys_cover_decode_shapes():
    keys = G.aot_keys("sm_90a")
    for k, n in G.DECODE_SHAPES:
        for mt in G.AOT_M_TILES:
            assert G.GemvKey(n=n, k=k, m_tile=mt) in keys
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("m", [0, 65])
def test_batch_outside_support_is_refused(m):
    x = torch.zeros(max(m, 1), 64, dtype=torch.bfloat16)[:m]
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside the supported 1..64"):
        G.gemv(x, w)


@pytest.mark.parametrize("kw,match", [
    (dict(m_tile=4), "m_tile in"),
    (dict(gate=True), "no epilogue options"),
    (dict(out_fp32=True), "no epilogue options"),
    (dict(n=200), "multiple of rows=16"),
    (dict(k=3584 + 32), "multiple of 32 x warps=4"),
    (dict(k=3584 + 128, mma_loop=True), "multiple of 32 x warps=8"),
    (dict(mma=False, mma_loop=True), "option of the tensor-core GEMV"),
])
def test_mma_key_refuses_what_the_tensor_core_gemv_cannot_do(kw, match):
    base = dict(n=224, k=3584, m_tile=8, mma=True)
    with pytest.raises(ValueError, match=match):
        G.GemvKey(**{**base, **kw})


def test_mma_tiling_and_m_tiles():
    assert G.GemvKey(n=224, k=3584, m_tile=8, mma=True).rows == 16
    assert G.GemvKey(n=224, k=3584, m_tile=64, mma=True).rows == 32  # two m16 tiles share each token's x
    assert [G.pick_m_tile(m, mma=True) for m in (1, 8, 9, 64)] == [8, 8, 64, 64]
    for k, n in G.DECODE_SHAPES + [G.TEST_SHAPE_MMA]:
        assert G.mma_built(k, n, 8, loop=True)
    for k, n in G.MMA_SHAPES_64 + [G.TEST_SHAPE_MMA]:
        assert G.mma_built(k, n, 64, loop=True)
    for k, n in G.MMA_UNROLLED_SHAPES + [G.TEST_SHAPE_MMA]:
        assert G.mma_built(k, n, 8, loop=False)
    assert G.mma_built(*G.TEST_SHAPE_MMA, 64, loop=False) and not G.mma_built(7168, 3584, 8, loop=False)
    assert G.GemvKey(n=224, k=3328, m_tile=8, mma=True, mma_loop=True).warps == 8


def test_mma_gemv_refuses_unsupported_options_before_launch():
    x = torch.zeros(2, 3584, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA device"):
        G.gemv(x, torch.zeros(224, 3584, dtype=torch.bfloat16), mma=True)


@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("m_tile", G.MMA_AOT_M_TILES)
def test_mma_gemv_compiles_to_tensor_core_steps_without_spills(compiler, m_tile, loop):
    import kimi_decode.compile as kc

    k, n = G.TEST_SHAPE_MMA
    key = G.GemvKey(n=n, k=k, m_tile=m_tile, mma=True, mma_loop=loop, arch="sm_90a")
    ptx = kc.ptx_text(key)
    tiles = (key.rows // 16) * (m_tile // 8)
    # two mma.sync per 32-wide block of K, per (m16, n8) tile; every block of the warp's share unrolled
    blocks = k // 32 // key.warps
    if loop:  # one round of the ring in the loop's body, the last partial round after it
        blocks = key.unroll + blocks % key.unroll
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 2 * tiles * blocks
    assert kc.resource_usage(key)["LOCAL"] == 0


def test_cpu_tensors_are_refused_before_launch():
    with pytest.raises(ValueError, match="CUDA device"):
        G.gemv(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16))


# ---------------------------------------------------------------- GPU


def _ref(x, w, gate=None, residual=None):
    y = x.float() @ w.float().T
    if gate is not None:
        y = y * torch.sigmoid(gate.float())
    if residual is not None:
        y = y + residual.float()
    return y


def _bf16_torch(x, w, gate=None, residual=None):
    """The same computation as plain PyTorch would do it in bf16 (the accuracy yardstick)."""
    y = x @ w.T
    if gate is not None:
        y = y * torch.sigmoid(gate)
    if residual is not None:
        y = y + residual
    return y.float()


def _assert_close(got, x, w, gate=None, residual=None):
    ref = _ref(x, w, gate, residual)
    assert torch.isfinite(got).all(), "NaN/inf in the output (a poisoned element was not written)"
    err = (got.float() - ref).abs().max().item()
    err_bf16 = (_bf16_torch(x, w, gate, residual) - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 2 * err_bf16 + 1e-3 * scale, f"max err {err:.3g} vs bf16 torch {err_bf16:.3g} (|ref| {scale:.3g})"


def _inputs(m, k, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    return x, w


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k,n", G.DECODE_SHAPES)
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_decode_shapes(m, k, n):
    x, w = _inputs(m, k, n, seed=m + k + n)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    G.gemv(x, w, out=out)
    torch.cuda.synchronize()
    _assert_close(out, x, w)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_gemv_awkward_shape(m):
    k, n = G.TEST_SHAPE  # K = 7160: last chunk partial, chunks split unevenly over warps
    x, w = _inputs(m, k, n, seed=7 + m)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    G.gemv(x, w, out=out)
    torch.cuda.synchronize()
    _assert_close(out, x, w)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [2, 5, 13, 64])
def test_gemv_batch_sizes(m):
    k, n = 7168, 2112
    x, w = _inputs(m, k, n, seed=m)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    G.gemv(x, w, out=out)
    torch.cuda.synchronize()
    _assert_close(out, x, w)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_gate_epilogue(m):
    x, w = _inputs(m, 7168, 3584, seed=11)
    gate = torch.randn(m, 3584, device="cuda").to(torch.bfloat16)
    out = torch.full((m, 3584), float("nan"), dtype=torch.bfloat16, device="cuda")
    G.gemv(x, w, gate=gate, out=out)
    torch.cuda.synchronize()
    _assert_close(out, x, w, gate=gate)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_residual_epilogue(m):
    x, w = _inputs(m, 12288, 7168, seed=12)
    res = torch.randn(m, 7168, device="cuda").to(torch.bfloat16)
    out = torch.full((m, 7168), float("nan"), dtype=torch.bfloat16, device="cuda")
    G.gemv(x, w, residual=res, out=out)
    torch.cuda.synchronize()
    _assert_close(out, x, w, residual=res)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 16])
def test_gemv_router_fp32_out(m):
    x, w = _inputs(m, 7168, 896, seed=13)
    out = torch.full((m, 896), float("nan"), dtype=torch.float32, device="cuda")
    G.gemv(x, w, out_fp32=True, out=out)
    torch.cuda.synchronize()
    ref = _ref(x, w)
    err = (out - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), err


@pytest.mark.gpu
@needs_cuda
def test_gemv_bad_inputs_are_refused_on_gpu():
    x, w = _inputs(2, 7168, 2112)
    with pytest.raises(TypeError, match="bfloat16"):
        G.gemv(x.float(), w)
    with pytest.raises(ValueError, match="shape"):
        G.gemv(x, w, residual=torch.zeros(2, 5, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        G.gemv(x, w.T.contiguous().T)
    with pytest.raises(ValueError, match="aligned"):
        G.gemv(torch.zeros(2 * 7168 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(2, 7168), w)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_cuda_graph_capture_and_replay(m):
    k, n = 7168, 3584
    x, w = _inputs(m, k, n, seed=21)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    G.gemv(x, w, out=out)  # load the kernel outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        G.gemv(x, w, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.gemv(x, w, out=out)
    for seed in range(3):
        xn, _ = _inputs(m, k, n, seed=100 + seed)
        x.copy_(xn)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, x, w)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m,k,n,loop", [  # every token count at the test shape, both forms; a decode shape where built
    (m, k, n, loop) for (k, n) in (G.TEST_SHAPE_MMA, (7168, 12288)) for m in (1, 5, 8, 9, 33, 64)
    for loop in (False, True)
    if G.mma_built(k, n, G.pick_m_tile(m, mma=True), loop)])
def test_gemv_mma_matches_reference(m, k, n, loop):
    """The tensor-core GEMV (unrolled, and as a loop over a register ring) against the fp32 reference,
    NaN-poisoned output, fresh inputs per shape."""
    x, w = _inputs(m, k, n, seed=31 + m + k + loop)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    G.gemv(x, w, out=out, mma=True, mma_loop=loop)
    torch.cuda.synchronize()
    _assert_close(out, x, w)


@pytest.mark.gpu
@needs_cuda
def test_gemv_mma_refuses_a_shape_outside_its_tiles_on_gpu():
    x, w = _inputs(9, 7168, 2112 + 16)  # N a multiple of 16 but not of the 32 rows of the 64-token tile
    with pytest.raises(ValueError, match="multiple of rows=32"):
        G.gemv(x, w, mma=True)
