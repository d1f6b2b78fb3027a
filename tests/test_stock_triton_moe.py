"""Stock MXFP4 MoE Triton kernels (`kimi_decode.stock.triton_moe`): align → GEMM1 → SiTU → GEMM2 → top-k sum
against the reference MoE math on dequantised weights. CPU tensors run under the Triton interpreter."""

import pytest
import torch

from kimi_decode import mxfp4
from kimi_decode.accuracy import all_written, rel_err
from kimi_decode.config import KimiK3Config, ShardSpec
from kimi_decode.reference import moe as ref_moe
from kimi_decode.reference.common import situ_and_mul
from kimi_decode.stock import triton_moe as T
from kimi_decode.weights import make_layer_weights

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16_TOL = 6e-3  # bf16 output rounding (~2^-9 relative) plus bf16 intermediates


def _nan(*shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEV)


def _align(ids, E, bm):
    N, k = ids.shape
    bufs = T.align_buffers(N, k, E, bm, DEV)
    for b in bufs:
        b.fill_(-7)  # poison: everything must be written
    T.moe_align_block_size(*bufs, ids.to(DEV), bm, E)
    return bufs


def _check_align(ids, E, bm, st, ei, nt):
    N, k = ids.shape
    nk = N * k
    flat = ids.reshape(-1).long().cpu()
    st, ei, ntpp = st.cpu().long(), ei.cpu().long(), int(nt.cpu()[0])
    nb = T.max_num_blocks(N, k, E, bm)
    assert st.numel() == nb * bm and ei.numel() == nb
    counts = torch.bincount(flat, minlength=E)
    used_blocks = int(((counts + bm - 1) // bm).sum())
    assert ntpp == used_blocks * bm
    real = st[st != nk]
    assert sorted(real.tolist()) == list(range(nk)), "not a permutation of all (token, slot) pairs"
    assert bool((st[ntpp:] == nk).all()), "tail past num_tokens_post_pad must be the sentinel"
    assert bool((ei[used_blocks:] == -1).all()) and bool((ei[:used_blocks] >= 0).all())
    assert ei[:used_blocks].unique().numel() == used_blocks or True  # an expert may own several blocks
    seen = []
    for b in range(used_blocks):
        blk = st[b * bm:(b + 1) * bm]
        r = blk[blk != nk]
        assert r.numel() > 0, "a used block holds no pair"
        assert bool((flat[r] == ei[b]).all()), f"block {b} mixes experts"
        # padding only at the end of an expert's last block
        assert bool((blk[:r.numel()] != nk).all())
        seen.append(int(ei[b]))
    # each expert's blocks are contiguous, and its group is exactly its pairs (stable order)
    for e in set(seen):
        bs = [b for b, x in enumerate(seen) if x == e]
        assert bs == list(range(bs[0], bs[-1] + 1))
        grp = st[bs[0] * bm:(bs[-1] + 1) * bm]
        assert grp[grp != nk].tolist() == (flat == e).nonzero().flatten().tolist()


def _ids_disjoint(N, k, E, gen):
    perm = torch.randperm(E, generator=gen)[:N * k]
    return perm.view(N, k).to(torch.int32)


def _ids_shared(N, k, E, gen):
    pool = torch.randperm(E, generator=gen)[:k]  # every token picks the same k experts, shuffled
    return torch.stack([pool[torch.randperm(k, generator=gen)] for _ in range(N)]).to(torch.int32)


def _ids_random(N, k, E, gen):
    return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)]).to(torch.int64)


@pytest.mark.parametrize("N,k,E,bm,kind", [
    (1, 4, 32, 16, "random"), (3, 2, 8, 16, "shared"), (17, 4, 32, 16, "random"),
    (17, 3, 8, 16, "shared"), (6, 4, 32, 32, "disjoint"), (40, 2, 4, 16, "random"),
])
def test_align(N, k, E, bm, kind):
    gen = torch.Generator().manual_seed(N * 100 + k)
    ids = {"random": _ids_random, "shared": _ids_shared, "disjoint": _ids_disjoint}[kind](N, k, E, gen)
    _check_align(ids, E, bm, *_align(ids, E, bm))


def test_buffer_bound_is_tight_enough():
    # every expert distinct with one pair: N·k blocks; all pairs on one expert: ceil(N·k/bm)
    assert T.max_num_blocks(1, 16, 896, 16) == 16
    assert T.max_num_blocks(512, 16, 896, 16) == (8192 + 896 * 15) // 16
    assert T.choose_block_m(1, 16, 896) == 16 and T.choose_block_m(64, 16, 896) == 16


def _moe_chain(z, w13p, w13s, w2p, w2s, ids, wts, cfg, bm):
    N, k = ids.shape
    E, L = w13p.shape[0], z.shape[1]
    I = w2p.shape[2] * 2
    st, ei, nt = _align(ids, E, bm)
    h = _nan(N * k, 2 * I)
    T.mxfp4_moe_gemm1(h, z, w13p, w13s, st, ei, nt, k, bm)
    assert all_written(h)
    a = situ_and_mul(h, cfg.situ_beta, cfg.situ_linear_beta).to(torch.bfloat16)
    y = _nan(N * k, L)
    T.mxfp4_moe_gemm2(y, a, w2p, w2s, wts, st, ei, nt, bm)
    assert all_written(y)
    out = _nan(N, L)
    T.moe_topk_sum(out, y)
    assert all_written(out)
    return h, a, y, out


@pytest.mark.parametrize("tp,N,kind", [(1, 1, "route"), (2, 3, "route"), (2, 17, "route"),
                                       (2, 3, "shared"), (1, 5, "disjoint")])
def test_chain_against_reference(tp, N, kind):
    cfg = KimiK3Config.tiny()
    sh = ShardSpec(tp=tp, cfg=cfg)
    w = make_layer_weights("kda_moe", sh).moe  # tp=2: I_loc = 96 with 32 zero padding rows
    E, k = cfg.num_experts, cfg.num_experts_per_token
    gen = torch.Generator().manual_seed(tp * 1000 + N)
    x = torch.randn(N, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    r = ref_moe.route(x, w, cfg)
    ids = {"route": lambda: r.ids.to(torch.int32),
           "shared": lambda: _ids_shared(N, k, E, gen),
           "disjoint": lambda: _ids_disjoint(N, k, E, gen)}[kind]()
    wts = r.weights.float().contiguous()
    z = torch.randn(N, cfg.routed_expert_hidden_size, generator=gen).to(torch.bfloat16)
    w13p, w13s = T.fuse_w13(w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale)
    bm = T.choose_block_m(N, k, E)
    h, a, y, out = _moe_chain(z.to(DEV), w13p.to(DEV), w13s.to(DEV), w.w2_packed.to(DEV), w.w2_scale.to(DEV),
                              ids.to(DEV), wts.to(DEV), cfg, bm)
    # reference: per (token, slot) on dequantised weights, fp32 (the bf16 storage points as in the kernels)
    W13 = mxfp4.unpack(w13p, w13s)  # [E, 2I, L]
    W2 = mxfp4.unpack(w.w2_packed, w.w2_scale)
    flat = ids.reshape(-1).long()
    zf = z.float()
    h_ref = torch.stack([zf[p // k] @ W13[flat[p]].t() for p in range(N * k)])
    assert rel_err(h.cpu(), h_ref) < BF16_TOL
    a_cpu = a.cpu().float()
    y_ref = torch.stack([wts.view(-1)[p] * (a_cpu[p] @ W2[flat[p]].t()) for p in range(N * k)])
    assert rel_err(y.cpu(), y_ref) < BF16_TOL
    assert rel_err(out.cpu(), y.cpu().float().view(N, k, -1).sum(1)) < BF16_TOL
    # end to end against the reference module's expert math (fp32 throughout)
    acc = torch.zeros(N, z.shape[1])
    for e in torch.unique(flat).tolist():
        tok, slot = (ids.long() == e).nonzero(as_tuple=True)
        acc.index_add_(0, tok, wts[tok, slot, None] * ref_moe.expert_forward(zf[tok], w, e, cfg))
    assert rel_err(out.cpu(), acc) < 1.5e-2  # bf16 h and a storage points on top of the output rounding
    if tp == 2:  # zero padding rows of w1/w3 give exact zeros in h
        I, pad = w.w1_packed.shape[1], w.w1_packed.shape[1] - w.inter_real
        assert bool((h.cpu()[:, I - pad:I] == 0).all()) and bool((h.cpu()[:, 2 * I - pad:] == 0).all())


@pytest.mark.parametrize("swap_ab", [False, True])
def test_expert_with_more_pairs_than_block_m(swap_ab):
    # 20 tokens all on the same 2 experts: each expert spans 2 blocks of 16 (weights read per block)
    E, k, N, L, I = 8, 2, 20, 64, 64
    gen = torch.Generator().manual_seed(7)
    ids = torch.tensor([[3, 5]] * N, dtype=torch.int32)
    w13p, w13s = mxfp4.random_packed(2 * I, L, gen, -3, leading=(E,))
    w2p, w2s = mxfp4.random_packed(L, I, gen, -3, leading=(E,))
    z = torch.randn(N, L, generator=gen).to(torch.bfloat16)
    st, ei, nt = _align(ids, E, 16)
    h = _nan(N * k, 2 * I)
    T.mxfp4_moe_gemm1(h, z.to(DEV), w13p.to(DEV), w13s.to(DEV), st, ei, nt, k, 16,
                      block_n=64, block_k=64, swap_ab=swap_ab)
    W13 = mxfp4.unpack(w13p, w13s)
    h_ref = torch.stack([z[p // k].float() @ W13[ids.view(-1)[p]].t() for p in range(N * k)])
    assert all_written(h) and rel_err(h.cpu(), h_ref) < BF16_TOL


def test_dequant_extremes():
    # every code and a wide scale range (s = 20..240: normal results, exact), one token on expert 0, z = one-hot columns
    E, L, I = 1, 32, 32
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).repeat(2 * I, 1)
    packed = mxfp4.pack_codes(codes)[None]
    scale = torch.linspace(20, 240, 2 * I).round().to(torch.uint8)[None, :, None]
    z = torch.zeros(32, L, dtype=torch.bfloat16)
    z[torch.arange(32), torch.arange(32)] = 1.0  # token t reads column t
    ids = torch.zeros(32, 1, dtype=torch.int32)
    st, ei, nt = _align(ids, E, 32)
    h = _nan(32, 2 * I)
    T.mxfp4_moe_gemm1(h, z.to(DEV), packed.to(DEV), scale.to(DEV), st, ei, nt, 1, 32)
    ref = mxfp4.unpack(packed, scale)[0].t()  # [L, 2I]: row t = column t of W
    assert torch.equal(h.cpu().float(), ref.to(torch.bfloat16).float())


# ---------------------------------------------------------------- input checks (raise before launch)


def _good():
    N, k, E, L, I, bm = 2, 2, 4, 64, 64, 16
    ids = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    st, ei, nt = T.align_buffers(N, k, E, bm, "cpu")
    return dict(N=N, k=k, E=E, L=L, I=I, bm=bm, ids=ids, st=st, ei=ei, nt=nt,
                z=torch.zeros(N, L, dtype=torch.bfloat16),
                w13p=torch.zeros(E, 2 * I, L // 2, dtype=torch.uint8),
                w13s=torch.zeros(E, 2 * I, L // 32, dtype=torch.uint8),
                h=torch.zeros(N * k, 2 * I, dtype=torch.bfloat16),
                a=torch.zeros(N * k, I, dtype=torch.bfloat16),
                w2p=torch.zeros(E, L, I // 2, dtype=torch.uint8),
                w2s=torch.zeros(E, L, I // 32, dtype=torch.uint8),
                tw=torch.zeros(N, k, dtype=torch.float32),
                y=torch.zeros(N * k, L, dtype=torch.bfloat16),
                out=torch.zeros(N, L, dtype=torch.bfloat16))


def _g1(g, **o):
    g = {**g, **o}
    T.mxfp4_moe_gemm1(g["h"], g["z"], g["w13p"], g["w13s"], g["st"], g["ei"], g["nt"], g["k"], g["bm"])


def _g2(g, **o):
    g = {**g, **o}
    T.mxfp4_moe_gemm2(g["y"], g["a"], g["w2p"], g["w2s"], g["tw"], g["st"], g["ei"], g["nt"], g["bm"])


@pytest.mark.parametrize("call,override,exc,match", [
    ("align", dict(ids=torch.zeros(2, 2, dtype=torch.float32)), TypeError, "topk_ids"),
    ("align", dict(st=torch.zeros(5, dtype=torch.int32)), ValueError, "sorted_token_ids"),
    ("align", dict(bm=12), ValueError, "power of two"),
    ("g1", dict(z=torch.zeros(2, 64, dtype=torch.float32)), TypeError, "z must be"),
    ("g1", dict(w13p=torch.zeros(4, 128, 31, dtype=torch.uint8)), ValueError, "w13_packed"),
    ("g1", dict(w13s=torch.zeros(4, 128, 3, dtype=torch.uint8)), ValueError, "w13_scale"),
    ("g1", dict(h=torch.zeros(4, 100, dtype=torch.bfloat16)), ValueError, "out must have shape"),
    ("g1", dict(h=torch.zeros(128, 4, dtype=torch.bfloat16).t()), ValueError, "contiguous"),
    ("g1", dict(ei=torch.zeros(3, dtype=torch.int32)), ValueError, "sorted_token_ids"),
    ("g1", dict(bm=8), ValueError, "block_m"),
    ("g2", dict(tw=torch.zeros(2, 2, dtype=torch.bfloat16)), TypeError, "topk_weights"),
    ("g2", dict(a=torch.zeros(3, 64, dtype=torch.bfloat16)), ValueError, "a must be"),
    ("g2", dict(w2s=torch.zeros(4, 64, 2, dtype=torch.int8)), TypeError, "w2_scale"),
    ("g2", dict(y=torch.zeros(4, 64, dtype=torch.float32)), TypeError, "out must be"),
    ("sum", dict(y=torch.zeros(5, 64, dtype=torch.bfloat16)), ValueError, "y must be"),
])
def test_bad_inputs_raise_before_launch(call, override, exc, match):
    g = _good()
    with pytest.raises(exc, match=match):
        if call == "align":
            g = {**g, **override}
            T.moe_align_block_size(g["st"], g["ei"], g["nt"], g["ids"], g["bm"], g["E"])
        elif call == "g1":
            _g1(g, **override)
        elif call == "g2":
            _g2(g, **override)
        else:
            g = {**g, **override}
            T.moe_topk_sum(g["out"], g["y"])


def test_mixed_devices_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device")
    g = _good()
    with pytest.raises(ValueError, match="device"):
        _g1(g, z=g["z"].cuda())
