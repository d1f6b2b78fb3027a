"""Decode context parallelism in the stock MLA kernels: each DCP rank attends over its own cache rows
for every rank's heads, and the exact log-sum-exp merge of the ranks' partials equals the attention
over the whole cache (Triton interpreter on CPU; a GPU runs them compiled)."""

import pytest
import torch

from kimi_decode.accuracy import all_written, rel_err
from kimi_decode.dcp import owned_positions, shard_cache
from kimi_decode.stock import triton_mla as tm

from test_stock_triton_mla import DEV, LAT, PE, _nan, make_case, reference_o_lat, run_three


def _rank_partials(case, gathered, ctx, T, D, r, S):
    """Rank r: its share of the cache (context rows copied, the step's rows it owns inserted), then
    split-KV over its rows for all D·HS gathered heads and the combine with log-sum-exp."""
    N, H = gathered.shape[1], gathered.shape[0] * gathered.shape[2]
    local = shard_cache(case["cache"], ctx, T, D, r)
    slot = local.slot_mapping(T)
    owned = [(c + t) % D == r for c in ctx for t in range(T)]
    assert [bool(s >= 0) for s in slot.tolist()] == owned
    scratch = _nan(N, gathered.shape[2], LAT + PE, dtype=torch.bfloat16)
    q_lat = case["q_lat"][r * gathered.shape[2]:(r + 1) * gathered.shape[2]]
    q_pe = case["q_pe"][:, r * gathered.shape[2]:(r + 1) * gathered.shape[2]]
    tm.mla_q_concat_cache_insert(scratch, q_lat, q_pe, local.kv, case["c"], case["k_pe"], slot)
    o_part, lse_part = tm.split_kv_scratch(N, H, S, DEV)
    o_part.fill_(float("nan"))
    lse_part.fill_(float("nan"))
    tm.mla_decode_split_kv(o_part, lse_part, gathered, local.kv, local.block_table, local.context_lens, T,
                           tm.SCALE, S, dcp=D, dcp_rank=r)
    o_all = _nan(H, N, LAT, dtype=torch.bfloat16)
    lse_all = _nan(H, N)
    tm.mla_decode_combine(o_all, o_part, lse_part, lse_out=lse_all)
    assert all_written(o_all) and not torch.isnan(lse_all).any()
    return local, o_all, lse_all


@pytest.mark.parametrize("D,HS,T,ctx,S", [
    (2, 4, 1, [0, 37, 130], 2),  # an empty context: rank 1 sees nothing for the first sequence
    (4, 3, 3, [5, 66], 2),  # speculative verify: causal within the step across ranks; a page boundary
    (2, 12, 2, [70, 3], 2),  # 24 gathered heads: two head groups per program row block
    (8, 1, 1, [3, 90], 1),  # more ranks than context rows for the first sequence
    (8, 12, 1, [70], 1),  # TP8 ranks' 12 heads at DCP 8: 96 gathered heads in 6 groups of 16
])
def test_dcp_ranks_merge_to_the_whole_attention(D, HS, T, ctx, S):
    H = D * HS
    case = make_case(H, T, ctx, seed=D * 1000 + HS * 10 + T)
    N = len(ctx) * T
    kv_full, mqa_q, _, _, o_full = run_three(case, H, T, 1)
    ref = reference_o_lat(mqa_q, type(case["cache"])(kv_full, case["cache"].block_table,
                                                      case["cache"].context_lens), T, tm.SCALE)
    # the DCP all-gather of the queries: slot r holds rank r's HS heads
    gathered = mqa_q.view(N, D, HS, LAT + PE).permute(1, 0, 2, 3).contiguous()
    parts = [_rank_partials(case, gathered, ctx, T, D, r, S) for r in range(D)]
    for r in range(D):
        # rank r's cache holds exactly its positions, in order
        local = parts[r][0]
        for b, c in enumerate(ctx):
            pos = owned_positions(c + T, D, r, device=kv_full.device)
            if pos.numel():
                want = kv_full.view(-1, LAT + PE)[case["cache"].block_table[b, pos // 64] * 64 + pos % 64]
                assert torch.equal(local.gather(b, pos.numel()), want)
        # the all-to-all: every rank's partial for rank r's heads, then the merge
        heads = slice(r * HS, (r + 1) * HS)
        o_ranks = torch.stack([p[1][heads] for p in parts])
        lse_ranks = torch.stack([p[2][heads] for p in parts])
        o_lat = _nan(HS, N, LAT, dtype=torch.bfloat16)
        tm.mla_dcp_merge(o_lat, o_ranks, lse_ranks)
        assert all_written(o_lat)
        assert rel_err(o_lat.float().cpu(), ref[:, heads].transpose(0, 1)) < 1e-2
        assert rel_err(o_lat.float(), o_full[heads].float()) < 1e-2


def test_merge_ignores_a_rank_that_saw_nothing():
    o = torch.randn(3, 2, 1, LAT, device=DEV)
    lse = torch.tensor([[[0.5], [1.0]], [[float("-inf")], [float("-inf")]], [[0.5], [3.0]]], device=DEV)
    o[1] = float("nan")  # never read: weight 0
    out = _nan(2, 1, LAT, dtype=torch.bfloat16)
    tm.mla_dcp_merge(out, o, lse)
    w = torch.softmax(lse, 0)
    want = (w[0, :, :, None] * o[0] + w[2, :, :, None] * o[2])
    assert rel_err(out.float(), want) < 1e-2


def test_dcp_bad_inputs_raise():
    case = make_case(2, 1, [3], seed=1)
    o_part, lse_part = tm.split_kv_scratch(1, 2, 1, DEV)
    q = torch.zeros(1, 2, LAT + PE, dtype=torch.bfloat16, device=DEV)
    c = case["cache"]
    with pytest.raises(ValueError, match="dcp_rank"):
        tm.mla_decode_split_kv(o_part, lse_part, q, c.kv, c.block_table, c.context_lens, 1, dcp=2, dcp_rank=2)
    with pytest.raises(ValueError, match="expected dcp=4"):
        tm.mla_decode_split_kv(o_part, lse_part, q.view(2, 1, 1, LAT + PE), c.kv, c.block_table, c.context_lens, 1,
                               dcp=4, dcp_rank=0)
    with pytest.raises(ValueError, match="o_ranks"):
        tm.mla_dcp_merge(_nan(2, 1, LAT, dtype=torch.bfloat16), torch.zeros(2, 2, LAT, device=DEV),
                         torch.zeros(2, 2, 1, device=DEV))
    with pytest.raises(ValueError, match="outside"):
        shard_cache(c, [3], 1, 2, 2)
    with pytest.raises(ValueError, match="already sharded"):
        shard_cache(shard_cache(c, [3], 1, 2, 1), [3], 1, 2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("dcp,rank,shape", [
    (2, 0, (2, 1, (3, 70))),
    (2, 1, (2, 2, (0, 45))),  # DCP rank 1 (TP rank 1): its slots in the gathered queries and the exchange
])
def test_stock_mla_layer_with_emulated_dcp_matches_reference(tiny_cfg, dcp, rank, shape):
    """The whole MLA+MoE layer on one rank with DCP emulated (the peers' partials computed from the
    step's queries) equals the reference, and launches the three DCP steps."""
    from kimi_decode.config import DecodeShape

    from test_stock_schedule import _check
    layer = _check(tiny_cfg, "mla_moe", DecodeShape(*shape), tp=2, dcp=dcp, rank=rank)
    labels = [l.label for l in layer.launches()]
    for step in ("mla.dcp_q_allgather", "mla.dcp_exchange", "mla.dcp_merge"):
        assert labels.count(step) == 1
    assert layer.mla_cache.dcp == dcp and layer.mla_cache.dcp_rank == rank


def test_dcp_inventory_adds_three_launches():
    from kimi_decode.config import DecodeShape, ShardSpec
    from kimi_decode.state import make_decode_state
    from kimi_decode.stock.schedule import StockLayer
    from kimi_decode.weights import make_layer_weights

    shape = DecodeShape(4, 1, 8192)
    n = {}
    for dcp in (1, 8):
        sh = ShardSpec(tp=8, dcp=dcp)
        layer = StockLayer(make_layer_weights("mla_moe", sh, device="meta"),
                           make_decode_state("mla_moe", sh, shape).to("meta"))
        n[dcp] = layer.launches()
        kv = [l for l in n[dcp] if l.label == "mla.decode"][0]
        # the KV bytes fall by the DCP size; the gathered queries grow by it
        n[(dcp, "bytes")] = kv.bytes_read
    assert len(n[8]) == len(n[1]) + 3
    assert n[(8, "bytes")] < n[(1, "bytes")] / 6
