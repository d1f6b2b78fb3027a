"""Stock MLA decode stand-ins (`kimi_decode.stock.triton_mla`): insert → split-KV → combine
against the fp32 math of `kimi_decode.reference.mla` (Triton interpreter on CPU; a GPU runs
them compiled)."""

import math

import pytest
import torch

from kimi_decode.accuracy import all_written, rel_err, within_bf16_rule
from kimi_decode.config import DecodeShape, KimiK3Config, ShardSpec
from kimi_decode.reference.mla import _gate_and_project, mla_decode, query_and_latent
from kimi_decode.reference.precision import Storage
from kimi_decode.state import MLAKVCache, make_mla_cache
from kimi_decode.stock import triton_mla as tm
from kimi_decode.weights import make_layer_weights

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 64
LAT, PE = 512, 64
NAN = float("nan")


def _nan(*shape, dtype=torch.float32):
    return torch.full(shape, NAN, dtype=dtype, device=DEV)


def make_case(H: int, T: int, ctx: list[int], seed: int):
    """Random real-layout (512 + 64) inputs in the producers' layouts, a scattered paged cache.

    Rows past each sequence's step rows, and a spare block that unused block-table entries
    point to, hold NaN: reading anything the kernels must not read poisons the output.
    """
    g = torch.Generator().manual_seed(seed)
    B, N = len(ctx), len(ctx) * T
    need = [-(-(c + T) // PAGE) for c in ctx]
    total = sum(need) + 2
    perm = torch.randperm(total, generator=g)
    poison = int(perm[-1])
    table = torch.full((B, max(need) + 1), poison, dtype=torch.int64)
    off = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[off:off + n]
        off += n
    kv = torch.randn(total, PAGE, LAT + PE, generator=g).to(torch.bfloat16)
    kv[poison] = NAN
    for b, c in enumerate(ctx):
        for p in range(c + T, need[b] * PAGE):
            kv[table[b, p // PAGE], p % PAGE] = NAN
    cache = MLAKVCache(kv=kv, block_table=table, context_lens=torch.tensor(ctx, dtype=torch.int64))
    q_lat = torch.randn(H, N, LAT, generator=g).to(torch.bfloat16)  # bmm output [H, N, 512]
    q_b = torch.randn(N, H * 192, generator=g).to(torch.bfloat16)  # q_b GEMM output
    q_pe = q_b.view(N, H, 192)[..., 128:]
    c = torch.randn(N, LAT, generator=g).to(torch.bfloat16)
    qkv_a = torch.randn(N, 1536 + LAT + PE, generator=g).to(torch.bfloat16)  # fused_qkv_a output
    k_pe = qkv_a[:, 1536 + LAT:]
    to = lambda t: t.to(DEV)  # noqa: E731
    return dict(cache=cache.to(DEV), q_lat=to(q_lat), q_pe=to(q_pe), c=to(c), k_pe=to(k_pe),
                slot=to(cache.slot_mapping(T)))


def reference_o_lat(mqa_q: torch.Tensor, cache: MLAKVCache, T: int, scale: float) -> torch.Tensor:
    """§5.2 eq. 6 in fp32 (as in reference.mla.mla_decode): [N, H, 512]."""
    N, H, _ = mqa_q.shape
    out = torch.empty(N, H, LAT, dtype=torch.float32)
    q = mqa_q.float().cpu()
    for b in range(cache.block_table.shape[0]):
        ctx = int(cache.context_lens[b])
        rows = cache.gather(b, ctx + T).float().cpu()
        for t in range(T):
            L = ctx + t + 1
            p = torch.softmax(scale * (q[b * T + t] @ rows[:L].t()), -1)
            out[b * T + t] = p @ rows[:L, :LAT]
    return out


def run_three(case, H: int, T: int, num_splits: int, o_lat=None):
    cache = case["cache"]
    N = cache.block_table.shape[0] * T
    kv = cache.kv.clone()
    mqa_q = _nan(N, H, LAT + PE, dtype=torch.bfloat16)
    tm.mla_q_concat_cache_insert(mqa_q, case["q_lat"], case["q_pe"], kv, case["c"], case["k_pe"], case["slot"])
    o_part, lse_part = tm.split_kv_scratch(N, H, num_splits, DEV)
    o_part.fill_(NAN)
    lse_part.fill_(NAN)
    tm.mla_decode_split_kv(o_part, lse_part, mqa_q, kv, cache.block_table, cache.context_lens, T,
                           tm.SCALE, num_splits)
    if o_lat is None:
        o_lat = _nan(H, N, LAT, dtype=torch.bfloat16)
    tm.mla_decode_combine(o_lat, o_part, lse_part)
    return kv, mqa_q, o_part, lse_part, o_lat


CASES = [  # H, T, context per sequence, num_splits
    (2, 1, [0, 37, 130], 1),  # empty context, not multiples of 64, one split
    (3, 1, [0, 37, 130], 4),  # splits beyond the short sequences' ends (empty splits)
    (4, 3, [5, 64, 127], 3),  # T = 3: causal within the step; a page boundary at 64
    (6, 3, [0, 100], 5),  # 6 heads: 2 step tokens per program, the last group partial
    (2, 2, [200, 1], 16),  # more splits than tiles: most are empty
]


@pytest.mark.parametrize("H,T,ctx,S", CASES)
def test_three_launches_match_reference(H, T, ctx, S):
    case = make_case(H, T, ctx, seed=H * 100 + T * 10 + S)
    cache = case["cache"]
    kv, mqa_q, o_part, lse_part, o_lat = run_three(case, H, T, S)
    N = len(ctx) * T

    # launch 1: q concat exact, cache rows at slot_mapping exact, every other row untouched
    assert torch.equal(mqa_q[..., :LAT], case["q_lat"].transpose(0, 1))
    assert torch.equal(mqa_q[..., LAT:], case["q_pe"])
    want = cache.kv.clone()
    want.view(-1, LAT + PE)[case["slot"]] = torch.cat([case["c"], case["k_pe"]], -1)
    torch.testing.assert_close(kv, want, rtol=0, atol=0, equal_nan=True)

    # launch 2: every (token, head, split) written; empty splits are (0, -inf)
    assert all_written(o_part) and all_written(lse_part)
    empty = torch.isneginf(lse_part)
    assert torch.all(o_part[empty] == 0)
    assert not torch.isposinf(lse_part).any()
    if T == 1:  # a split that starts past the sequence's last position is empty
        for b, c in enumerate(ctx):
            chunk = -(-(-(-(c + 1) // S)) // tm.DECODE_BLOCK_N) * tm.DECODE_BLOCK_N
            for s in range(S):
                if s * chunk >= c + 1:
                    assert empty[b, :, s].all()
    if S > 1 and min(ctx) < 64:
        assert empty.any()

    # launch 3 against the fp32 reference (bf16 P and output rounding only)
    new = MLAKVCache(kv=kv, block_table=cache.block_table, context_lens=cache.context_lens)
    ref = reference_o_lat(mqa_q, new, T, tm.SCALE)
    assert all_written(o_lat)
    assert rel_err(o_lat.transpose(0, 1), ref) < 6e-3
    assert o_lat.shape == (H, N, LAT)


def test_splits_agree_and_any_output_layout():
    H, T, ctx = 3, 2, [90, 3]
    case = make_case(H, T, ctx, seed=7)
    N = len(ctx) * T
    *_, o1 = run_three(case, H, T, 1)
    # [N, H, 512] storage seen as [H, N, 512], and a non-unit last stride
    o_nh = _nan(N, H, LAT, dtype=torch.bfloat16).transpose(0, 1)
    *_, o2 = run_three(case, H, T, 3, o_lat=o_nh)
    wide = _nan(H, N, 2 * LAT, dtype=torch.bfloat16)
    *_, o3 = run_three(case, H, T, 6, o_lat=wide[..., ::2])
    assert all_written(o2) and all_written(o3)
    assert torch.isnan(wide[..., 1::2]).all()  # the gaps are not written
    assert rel_err(o2, o1) < 5e-3 and rel_err(o3, o1) < 5e-3


def test_combine_matches_logsumexp():
    g = torch.Generator().manual_seed(3)
    N, H, S = 3, 2, 5
    o_part = torch.randn(N, H, S, LAT, generator=g)
    lse = 3 * torch.randn(N, H, S, generator=g)
    lse[0, :, 1:] = -math.inf  # one non-empty split
    lse[1, 1, ::2] = -math.inf
    o_part[torch.isneginf(lse)] = NAN  # empty splits are never read
    w = torch.softmax(lse, -1).nan_to_num(0.0)
    ref = torch.einsum("nhs,nhsd->hnd", w, o_part.nan_to_num(0.0))
    o_lat = _nan(H, N, LAT, dtype=torch.bfloat16)
    tm.mla_decode_combine(o_lat, o_part.to(DEV), lse.to(DEV))
    assert all_written(o_lat)
    assert rel_err(o_lat, ref) < 4e-3


def test_negative_slot_skips_cache_write():
    H, T, ctx = 2, 1, [10, 20]
    case = make_case(H, T, ctx, seed=11)
    kv = case["cache"].kv.clone()
    slot = case["slot"].clone()
    slot[0] = -1
    mqa_q = _nan(2, H, LAT + PE, dtype=torch.bfloat16)
    tm.mla_q_concat_cache_insert(mqa_q, case["q_lat"], case["q_pe"], kv, case["c"], case["k_pe"], slot)
    want = case["cache"].kv.clone()
    want.view(-1, LAT + PE)[slot[1:]] = torch.cat([case["c"][1:], case["k_pe"][1:]], -1)
    torch.testing.assert_close(kv, want, rtol=0, atol=0, equal_nan=True)
    assert all_written(mqa_q)


def test_tiny_config_end_to_end_matches_reference_mla_decode():
    """Drive the three launches from reference.mla's own intermediates (tiny config, latent 32 + 8)."""
    cfg = KimiK3Config.tiny()
    shard = ShardSpec(tp=2, cfg=cfg)
    w = make_layer_weights("mla_moe", shard).mla
    shape = DecodeShape(batch=2, tokens_per_seq=2, context_lens=(3, 70))
    cache = make_mla_cache(cfg, shape, seed=1)
    T, N, H, kl = 2, 4, w.heads, cfg.kv_lora_rank
    x = torch.randn(N, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    ref32, _ = mla_decode(x, w, cache, T, cfg, Storage.FP32)
    ref16, ref_cache = mla_decode(x, w, cache, T, cfg, Storage.BF16)

    bf = Storage.BF16
    q = query_and_latent(x, w, cfg, bf)
    q_b_out = torch.cat([q.q_nope, q.q_pe], -1).reshape(N, -1).to(torch.bfloat16).to(DEV)
    q_pe = q_b_out.view(N, H, -1)[..., w.nope_dim:]  # strided view of the q_b output
    q_lat = torch.einsum("nhd,hdl->hnl", q.q_nope, w.W_UK_T.float()).to(torch.bfloat16).to(DEV)
    qkv_a = torch.cat([torch.zeros(N, cfg.q_lora_rank), q.new_rows], -1).to(torch.bfloat16).to(DEV)
    c, k_pe = qkv_a[:, cfg.q_lora_rank:cfg.q_lora_rank + kl], qkv_a[:, cfg.q_lora_rank + kl:]

    dcache = cache.to(DEV)
    kv = dcache.kv.clone()
    mqa_q = _nan(N, H, kl + cfg.qk_rope_head_dim, dtype=torch.bfloat16)
    tm.mla_q_concat_cache_insert(mqa_q, q_lat, q_pe, kv, c, k_pe, dcache.slot_mapping(T))
    assert torch.equal(kv.cpu(), ref_cache.kv)
    S = 3
    o_part, lse_part = tm.split_kv_scratch(N, H, S, DEV, d_lat=kl)
    tm.mla_decode_split_kv(o_part, lse_part, mqa_q, kv, dcache.block_table, dcache.context_lens, T,
                           cfg.mla_softmax_scale, S)
    o_lat = _nan(H, N, kl, dtype=torch.bfloat16)
    tm.mla_decode_combine(o_lat, o_part, lse_part)
    o = bf.store(torch.einsum("hnl,hlv->nhv", o_lat.float().cpu(), w.W_UV.float()))
    out = _gate_and_project(o, x, w, bf)
    ok, err, bound = within_bf16_rule(out, ref32, ref16)
    assert ok, (err, bound)


def _bad_input_cases():
    H, T, ctx, S = 2, 1, [10, 70], 2
    case = make_case(H, T, ctx, seed=13)
    cache = case["cache"]
    N = len(ctx)
    kv = cache.kv
    bt, cl = cache.block_table, cache.context_lens
    q = torch.randn(N, H, LAT + PE).to(torch.bfloat16).to(DEV)
    ok_ins = dict(q_lat=case["q_lat"], q_pe=case["q_pe"], kv_cache=kv, c=case["c"], k_pe=case["k_pe"],
                  slot_mapping=case["slot"])
    ins = [
        ("mqa_q", dict(mqa_q=_nan(N, H, LAT + PE))),  # fp32 output
        ("q_lat", dict(q_lat=case["q_lat"][:, :1])),  # wrong N
        ("q_pe", dict(q_pe=case["q_pe"].transpose(1, 2).contiguous().transpose(1, 2))),  # strided last dim
        ("slot_mapping", dict(slot_mapping=case["slot"].float())),
        ("c", dict(c=case["c"].to("meta"))),
        ("kv_cache", dict(kv_cache=kv[..., :LAT])),
        ("k_pe", dict(k_pe=case["k_pe"][:1])),
    ]
    dec = [
        ("o_part", dict(o_part=_nan(N, H, S, LAT, dtype=torch.bfloat16))),
        ("num_splits", dict(num_splits=S + 1)),
        ("tokens", dict(tokens_per_seq=2)),
        ("block_table", dict(block_table=bt.float())),
        ("context_lens", dict(context_lens=cl[:1])),
        ("scale", dict(scale=-1.0)),
        ("mqa_q", dict(mqa_q=q[:, :, :LAT])),
        ("block_size", dict(kv_cache=kv.view(-1, 16, LAT + PE))),
    ]
    comb = [
        ("o_lat", dict(o_lat=_nan(H, N, LAT))),
        ("lse_part", dict(lse_part=_nan(N, H, S + 1))),
        ("o_part", dict(o_part=_nan(N, H, S, LAT).to(torch.float16))),
    ]
    out = []
    for name, bad in ins:
        args = dict(mqa_q=_nan(N, H, LAT + PE, dtype=torch.bfloat16), **ok_ins)
        args.update(bad)
        out.append((f"insert-{name}", tm.mla_q_concat_cache_insert, args, args["mqa_q"]))
    for name, bad in dec:
        o_part, lse_part = _nan(N, H, S, LAT), _nan(N, H, S)
        args = dict(o_part=o_part, lse_part=lse_part, mqa_q=q, kv_cache=kv, block_table=bt,
                    context_lens=cl, tokens_per_seq=T, scale=tm.SCALE, num_splits=S)
        args.update(bad)
        out.append((f"decode-{name}", tm.mla_decode_split_kv, args, args["lse_part"]))
    for name, bad in comb:
        args = dict(o_lat=_nan(H, N, LAT, dtype=torch.bfloat16), o_part=torch.zeros(N, H, S, LAT, device=DEV),
                    lse_part=torch.zeros(N, H, S, device=DEV))
        args.update(bad)
        out.append((f"combine-{name}", tm.mla_decode_combine, args, args["o_lat"]))
    return out


def test_bad_inputs_raise_before_launch():
    for name, fn, args, watched in _bad_input_cases():
        kv_before = args.get("kv_cache")
        kv_before = kv_before.clone() if kv_before is not None and kv_before.device.type != "meta" else None
        with pytest.raises(ValueError):
            fn(**args)
        assert torch.isnan(watched).all(), f"{name}: output written although the inputs were rejected"
        if kv_before is not None:
            torch.testing.assert_close(args["kv_cache"], kv_before, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("batch,T,ctx", [(1, 1, 8192), (1, 1, 32768), (4, 1, 16384), (64, 1, 4096),
                                         (8, 4, 4096), (1, 1, 0), (1, 1, 100)])
def test_choose_num_splits(batch, T, ctx):
    S = tm.choose_num_splits(batch, T, ctx)
    assert isinstance(S, int) and 1 <= S <= tm.MAX_SPLITS
    assert S <= max(1, -(-(ctx + T) // tm.MIN_SPLIT_TOKENS))  # no split shorter than a page
    if ctx >= 8192:  # long context fills the SMs (one page per split at most)
        assert batch * T * S >= min(132, (ctx + T) // tm.MIN_SPLIT_TOKENS)
    if batch * T >= 132 * tm.PROGRAMS_PER_SM:
        assert S == 1
    with pytest.raises(ValueError):
        tm.choose_num_splits(0, T, ctx)


# ------------------------------------------------------------------------------------------
# H200: compiled correctness at the real shapes and cache bandwidth under a CUDA graph


@pytest.mark.gpu
@pytest.mark.parametrize("H,B,T,ctx", [(12, 1, 1, 32768), (12, 1, 1, 8192), (6, 1, 1, 32768),
                                       (12, 8, 1, 8192), (12, 64, 1, 2048), (12, 4, 3, 4096)])
def test_gpu_decode_bandwidth(H, B, T, ctx):
    """Insert → split-KV → combine at real shapes; µs and cache TB/s over 8 layers' caches (> L2)."""
    torch.manual_seed(0)
    N, S, layers = B * T, tm.choose_num_splits(B, T, ctx), 8
    nblk = B * -(-(ctx + T) // PAGE)
    kv = torch.randn(layers, nblk, PAGE, LAT + PE, device=DEV).to(torch.bfloat16)
    table = torch.randperm(nblk, device=DEV).view(B, -1)
    lens = torch.full((B,), ctx, dtype=torch.int64, device=DEV)
    cache0 = MLAKVCache(kv=kv[0], block_table=table, context_lens=lens)
    slot = cache0.slot_mapping(T)
    q_lat = torch.randn(H, N, LAT, device=DEV).to(torch.bfloat16)
    q_pe = torch.randn(N, H, 192, device=DEV).to(torch.bfloat16)[..., 128:]
    c = torch.randn(N, LAT, device=DEV).to(torch.bfloat16)
    k_pe = torch.randn(N, 700, device=DEV).to(torch.bfloat16)[:, 600:664]
    mqa_q = torch.empty(N, H, LAT + PE, dtype=torch.bfloat16, device=DEV)
    o_part, lse_part = tm.split_kv_scratch(N, H, S, DEV)
    o_lat = torch.empty(H, N, LAT, dtype=torch.bfloat16, device=DEV)

    def step(layer, decode_only=False):
        if not decode_only:
            tm.mla_q_concat_cache_insert(mqa_q, q_lat, q_pe, kv[layer], c, k_pe, slot)
        tm.mla_decode_split_kv(o_part, lse_part, mqa_q, kv[layer], table, lens, T, tm.SCALE, S)
        if not decode_only:
            tm.mla_decode_combine(o_lat, o_part, lse_part)

    step(0)
    torch.cuda.synchronize()
    if N * H <= 64:  # fp32 reference on a few tokens
        ref = reference_o_lat(mqa_q, cache0, T, tm.SCALE)
        assert rel_err(o_lat.transpose(0, 1), ref) < 6e-3

    def timed(decode_only):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for layer in range(layers):
                step(layer, decode_only)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for layer in range(layers):
                step(layer, decode_only)
        g.replay()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        t0.record()
        for _ in range(reps):
            g.replay()
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) * 1e3 / (reps * layers)  # µs per layer

    us_all, us_dec = timed(False), timed(True)
    cache_bytes = B * (ctx + T) * (LAT + PE) * 2
    print(f"\nMLA decode H={H} B={B} T={T} ctx={ctx} splits={S}: 3 launches {us_all:.1f} us "
          f"({cache_bytes / us_all / 1e6:.2f} TB/s), split-KV alone {us_dec:.1f} us "
          f"({cache_bytes / us_dec / 1e6:.2f} TB/s)")
    assert cache_bytes / us_dec / 1e6 > 0.5  # a floor against regressions, not the target
