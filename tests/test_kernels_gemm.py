"""The shared-memory GEMM for steps above 64 tokens (`kimi_decode.kernels.gemm`): key and input checks on CPU, the
build for sm_90a, and correctness against fp32 on a GPU."""

import pytest
import torch

from kimi_decode.kernels import gemm as G

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kw,match", [
    (dict(bm=32), "bm must be 64 or 128"),
    (dict(bn=64), "bn must be 128"),
    (dict(bk=48), "bk must be"),
    (dict(n=200), "multiple of bn=128"),
    (dict(k=7168 + 32), "multiple of bk=64"),
    (dict(stages=1), "stages must be 2..8"),
    (dict(stages=7), "shared memory"),
    (dict(tail_tp=4), "tail_tp must be 0"),
])
def test_key_refuses_what_the_kernel_cannot_do(kw, match):
    with pytest.raises(ValueError, match=match):
        G.GemmKey(**{**dict(n=6016, k=7168), **kw})


def test_shared_memory_and_ahead_of_time_keys():
    big, small = G.GemmKey(n=6016, k=7168), G.GemmKey(n=6016, k=7168, bm=64)
    assert G.slot_bytes(big) == 256 * 144 and G.gemm_smem_bytes(big) <= 227 * 1024
    assert 2 * G.gemm_smem_bytes(small) <= 228 * 1024 - 2 * 1024  # two CTAs an SM at bm = 64
    keys = G.aot_keys("sm_90a")
    for k, n in G.MOE_SHAPES + [G.TEST_SHAPE]:
        for bm in (64, 128):
            assert G.GemmKey(n=n, k=k, bm=bm) in keys
    for tp in (8, 16):
        for bm in (64, 128):
            key = G.tail_key(tp, bm)
            assert key in keys and (key.k, key.n) == G.TAIL_SHAPE and key.tail_tp == tp
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("m", [64, 513])
def test_token_counts_outside_its_range_are_refused(m):
    x = torch.zeros(m, 64, dtype=torch.bfloat16)
    w = torch.zeros(128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M=65..512"):
        G.gemm(x, w)


def test_cpu_tensors_and_wrong_dtypes_are_refused_before_any_launch():
    w = torch.zeros(128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA device"):
        G.gemm(torch.zeros(65, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        G.gemm(torch.zeros(65, 64, 1, dtype=torch.bfloat16), w)
    with pytest.raises(TypeError, match="torch tensors"):
        G.gemm([[0.0]], w)


def test_tail_gemm_refuses_cpu_tensors_before_any_launch():
    x = torch.zeros(65, 3584, dtype=torch.bfloat16)
    w = torch.zeros(7168, 3584, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="tail_gemm runs on a CUDA device"):
        G.tail_gemm(x, w, torch.zeros(65), torch.zeros(8, 65, 7168, dtype=torch.bfloat16), torch.zeros(8))
    with pytest.raises(ValueError, match="M=65..512"):
        G.tail_gemm(x[:64], w, torch.zeros(64), torch.zeros(8, 64, 7168, dtype=torch.bfloat16), torch.zeros(8))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tp", [0, 4])
def test_tail_gemm_refuses_other_buffer_counts_before_any_launch(tp):
    x = torch.zeros(65, 3584, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(7168, 3584, dtype=torch.bfloat16, device="cuda")
    sh = torch.zeros(tp, 65, 7168, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="8 or 16 all-reduce buffers"):
        G.tail_gemm(x, w, torch.zeros(65, device="cuda"), sh, torch.zeros(tp, device="cuda"))


def test_gemm_builds_for_sm90_without_spills(compiler):
    from kimi_decode import compile as kc
    for key in (G.GemmKey(n=6016, k=7168), G.GemmKey(n=6016, k=7168, bm=64), G.GemmKey(n=7168, k=3584),
                G.tail_key(8, 128), G.tail_key(16, 64)):
        ptx = kc.ptx_text(key)
        for needle in G.SPEC.ptx_checks:
            assert needle in ptx, (key, needle)
        res = kc.resource_usage(key)
        assert res["STACK"] == 0 and res["LOCAL"] == 0, (key, res)
        # a slot's K slice: 2 row tiles × bm/16 token tiles × bk/16 steps of mma.sync per compute warp
        assert kc.sass_text(key).count("HMMA") == 2 * (key.bm // 16) * (key.bk // 16), key


def _inputs(m, k, n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    return x, w


def _assert_matches_fp32(out, x, w):
    ref = x.float() @ w.float().T
    assert torch.isfinite(out).all(), "NaN in the output: a poisoned element was not written"
    err = (out - ref).abs().max().item()
    scale = ref.abs().max().item()
    # fp32 sums of exact bf16 products in another order: a few ulps of the row's magnitude; a misplaced fragment or
    # slice is off by the order of the values themselves
    assert err <= 1e-4 * scale, f"max err {err:.3g} against |ref| {scale:.3g}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bm", [64, 128])
@pytest.mark.parametrize("m", [65, 128, 200, 512])
def test_gemm_matches_fp32_on_the_test_shape(m, bm):
    k, n = G.TEST_SHAPE  # 23 K slices: the ring wraps with a partial last round
    x, w = _inputs(m, k, n, seed=m + bm)
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device="cuda")
    G.gemm(x, w, out=out, bm=bm)
    torch.cuda.synchronize()
    _assert_matches_fp32(out, x, w)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k,n", G.MOE_SHAPES)
@pytest.mark.parametrize("m", [100, 512])
def test_gemm_matches_fp32_on_the_moe_front_and_tail_shapes(k, n, m):
    x, w = _inputs(m, k, n, seed=k + n + m)
    for bm in (64, 128):
        out = torch.full((m, n), float("nan"), dtype=torch.float32, device="cuda")
        G.gemm(x, w, out=out, bm=bm)
        torch.cuda.synchronize()
        _assert_matches_fp32(out, x, w)


def _tail_inputs(m, k, n, tp, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, w = _inputs(m, k, n, seed)
    ssq = torch.rand(m, device="cuda", generator=g) * k + 0.5 * k  # Σ r² of unit-scale rows: rsqrt near 1
    sh = torch.randn(tp, m, n, device="cuda", generator=g).to(torch.bfloat16)
    coef = torch.rand(tp, device="cuda", generator=g)  # every buffer weighted, so a misread one shows
    return x, w, ssq, sh, coef


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tp,bm,k,n", [(8, 64, *G.TEST_SHAPE), (8, 64, *G.TAIL_SHAPE), (8, 128, *G.TAIL_SHAPE),
                                       (16, 64, *G.TAIL_SHAPE), (16, 128, *G.TAIL_SHAPE)])
@pytest.mark.parametrize("m", [65, 200, 512])
def test_tail_gemm_matches_its_fp32_epilogue(m, tp, bm, k, n):
    """The MoE tail's epilogue (RMSNorm scale, tp shared buffers with their weights, bf16) against the same
    arithmetic in fp32 by torch, every element written."""
    x, w, ssq, sh, coef = _tail_inputs(m, k, n, tp, seed=m + tp + bm + k)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    G.tail_gemm(x, w, ssq, sh, coef, out=out, bm=bm)
    torch.cuda.synchronize()
    ref = (x.float() @ w.float().T) * torch.rsqrt(ssq / k + 1e-5)[:, None] + torch.einsum("p,pmn->mn", coef, sh.float())
    assert torch.isfinite(out).all(), "NaN in the output: a poisoned element was not written"
    err = (out.float() - ref).abs()
    # one bf16 rounding of the result (2^-8 relative) on top of the fp32 sums' few ulps
    assert (err <= 2 ** -8 * ref.abs() + 1e-3).all(), f"max err {err.max().item():.3g}"
