"""The fused MoE half (4 CuTe DSL launches): input checks on CPU, correctness on a GPU."""

import re

import pytest
import torch

from kimi_decode.config import KimiK3Config, ShardSpec
from kimi_decode.fused_moe import FusedMoE, check_moe_input
from kimi_decode.support import UnsupportedConfiguration
from kimi_decode.kernels.moe_pipe import AOT_VARIANTS
from kimi_decode.kernels.moe_wide import AOT_WIDE_VARIANTS_TP16
from kimi_decode.weights import make_layer_weights

D = 7168


@pytest.fixture(scope="module")
def meta_weights():
    return make_layer_weights("kda_moe", ShardSpec(tp=8), device="meta")


def test_refuses_dense_layer():
    w = make_layer_weights("dense", ShardSpec(tp=8), device="meta")
    with pytest.raises(UnsupportedConfiguration, match="MoE layers"):
        check_moe_input(w, torch.zeros(1, D, dtype=torch.bfloat16))


def test_refuses_bad_inputs(meta_weights):
    with pytest.raises(ValueError, match=r"\[tokens, 7168\]"):
        check_moe_input(meta_weights, torch.zeros(1, 7000, dtype=torch.bfloat16))
    with pytest.raises(UnsupportedConfiguration, match="1..512"):
        check_moe_input(meta_weights, torch.zeros(513, D, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        check_moe_input(meta_weights, torch.zeros(1, D, dtype=torch.float32))
    with pytest.raises(ValueError, match="CUDA device"):
        check_moe_input(meta_weights, torch.zeros(1, D, dtype=torch.bfloat16))


def test_refuses_other_shapes(tiny_cfg):
    w = make_layer_weights("kda_moe", ShardSpec(tp=2, cfg=tiny_cfg), device="meta")
    with pytest.raises(UnsupportedConfiguration):
        check_moe_input(w, torch.zeros(1, D, dtype=torch.bfloat16))


@pytest.mark.parametrize("tokens", [1, 5])
def test_stock_moe_half_is_fifteen_launches_and_matches_the_reference(tiny_cfg, tokens):
    """The baseline of the fused MoE: the stock schedule's MoE part alone, against the MoE reference."""
    from kimi_decode.accuracy import routing_agreement, within_bf16_rule
    from kimi_decode.moe_bench import moe_input
    from kimi_decode.reference import Storage
    from kimi_decode.reference.moe import moe_block_one_rank
    from kimi_decode.stock.schedule import StockMoEHalf

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = make_layer_weights("kda_moe", ShardSpec(tp=2, cfg=tiny_cfg), seed=5).to(dev)
    x = moe_input(tokens, tiny_cfg.hidden_size, seed=tokens, device=dev)
    ref, _ = moe_block_one_rank(x, w.moe, tiny_cfg)
    ref_bf, _ = moe_block_one_rank(x, w.moe, tiny_cfg, Storage.BF16)
    half = StockMoEHalf(w, x)
    assert len(half.launches()) == 15 and all(l.label.startswith("moe.") for l in half.launches())
    half()
    keep, flips, ties = routing_agreement(half.routing[0], x, w.moe, tiny_cfg)
    assert ties
    ok, err, bound = within_bf16_rule(half.h[keep.to(half.h.device)].float(), ref[keep], ref_bf[keep])
    assert ok, (err, bound)


# ----------------------------------------------------------------------------- GPU


def _weights(tp):
    return make_layer_weights("kda_moe", ShardSpec(tp=tp), seed=3).to("cuda")


@pytest.fixture(scope="module")
def w8():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _weights(8)


def _check(w, x):
    from kimi_decode.moe_bench import check_moe, make_moe_executor
    r = check_moe(make_moe_executor("fused"), w, x)
    assert r["all_written"], r
    assert r["check_ok"], r
    return r


@pytest.mark.gpu
@pytest.mark.parametrize("batch,tokens", [(1, 1), (2, 1), (8, 1), (17, 1), (64, 1), (1, 4), (1, 8), (2, 4),
                                          (8, 8), (16, 4), (17, 3), (17, 4), (17, 8), (64, 4), (64, 8)])
def test_fused_matches_reference_tp8(w8, batch, tokens):
    from kimi_decode.moe_bench import moe_input
    x = moe_input(batch * tokens, D, seed=batch * 100 + tokens, device="cuda")
    _check(w8, x)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["direct", "pipe-up"])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (8, 1), (17, 4), (64, 8)])
def test_other_expert_kernels_match_the_reference_tp8(w8, experts, batch, tokens):
    """The first (direct) expert kernels and the pipelined gate/up with the direct down stay correct: they
    are the comparison points of `kimi-decode moe` (fused-direct, fused-pipeup)."""
    from kimi_decode.moe_bench import check_moe, moe_input
    x = moe_input(batch * tokens, D, seed=batch * 100 + tokens, device="cuda")
    r = check_moe(lambda w, xx: FusedMoE(w, xx, experts=experts), w8, x)
    assert r["all_written"] and r["check_ok"], r


@pytest.mark.gpu
def test_fused_every_token_on_the_same_experts(w8):
    from kimi_decode.moe_bench import moe_input
    x = moe_input(1, D, seed=7, device="cuda").repeat(12, 1)
    r = _check(w8, x)
    assert r["active_experts"] == 16


@pytest.mark.gpu
def test_fused_no_two_tokens_share_an_expert(w8):
    """Router rows aligned with the tokens: token t picks experts 16t..16t+15 alone.

    Own experts get logits near 0.5·|x| (σ ≈ 1); every other router row is scaled down to 1% and the
    selection bias is zero, so no other expert's biased score comes close.
    """
    import dataclasses

    from kimi_decode.moe_bench import moe_input
    n = 8
    x = moe_input(n, D, seed=11, device="cuda")
    gate = (0.01 * w8.moe.gate.float()).to(torch.bfloat16)
    xn = x.float() / x.float().norm(dim=1, keepdim=True)
    gate[: 16 * n] = (0.5 * xn.repeat_interleave(16, 0)).to(torch.bfloat16)
    moe = dataclasses.replace(w8.moe, gate=gate,
                              e_score_correction_bias=torch.zeros_like(w8.moe.e_score_correction_bias))
    w = dataclasses.replace(w8, moe=moe)
    r = _check(w, x)
    assert r["active_experts"] == 16 * n


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_fused_matches_reference_tp16(batch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kimi_decode.moe_bench import moe_input
    _check(_weights(16), moe_input(batch, D, seed=batch, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,kernels", [(4, 4), (8, 4), (16, 5)])
def test_fused_kernel_count_under_a_cuda_graph(w8, tokens, kernels):
    """Four launches while the front kernel routes (up to ROUTE_IN_FRONT_MAX tokens), five beyond."""
    from kimi_decode.bench import time_graph
    from kimi_decode.moe_bench import moe_input
    ex = FusedMoE(w8, moe_input(tokens, D, seed=1, device="cuda"))
    t = time_graph([ex], replays=5)
    assert t.kernels_per_layer == kernels == len(ex.launches())
    assert torch.isfinite(ex.h).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 8, 33])
def test_candidate_routing_equals_the_bitwise_search(w8, tokens):
    """The candidate ranking (default) and the bitwise search alone ('cand0') choose the same experts in the
    same order with the same weights, in the front kernel (up to 8 tokens) and in the routing launch. Both on the
    CUDA-core front ('mma0'): 'cand0' keeps it, and the tensor-core front sums the logits in another order."""
    from kimi_decode.moe_bench import moe_input
    x = moe_input(tokens, D, seed=150 + tokens, device="cuda")
    a, b = FusedMoE(w8, x, variant="mma0"), FusedMoE(w8, x, variant="cand0-mma0")
    assert b.variant.startswith("cand0+")
    a(), b()
    torch.cuda.synchronize()
    assert torch.equal(a.ids, b.ids) and torch.equal(a.wts, b.wts)
    _same_up_to_summation_order(a.h, b.h)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_routing_in_front_and_separate_launch_agree(w8, tokens):
    """Both routing placements run the same selection: identical ids, weights and outputs. On the CUDA-core front
    ('mma0'): the tensor-core front's m_tile (8 routing in it, 64 with the routing launch above 8 tokens) changes
    the order of the logits' sums."""
    from kimi_decode.moe_bench import moe_input
    x = moe_input(tokens, D, seed=40 + tokens, device="cuda")
    a, b = (FusedMoE(w8, x, separate_routing=False, variant="mma0"),
            FusedMoE(w8, x, separate_routing=True, variant="mma0"))
    c = FusedMoE(w8, x, separate_routing=False, variant="fring")  # at one token: the ring front
    a(), b(), c()
    torch.cuda.synchronize()
    assert torch.equal(a.ids, b.ids) and torch.equal(a.wts, b.wts) and torch.equal(c.ids, b.ids)
    _same_up_to_summation_order(a.h, b.h)
    # the ring front sums its logits in another order: the same choice, weights within rounding
    torch.testing.assert_close(c.wts, b.wts, rtol=1e-5, atol=0)


def _a_by_pair(ex):
    """(keys, rows) of a step's moe_up output `a`, sorted by (expert, token): the routing fills each expert's token list
    by shared-memory atomics, so the order of an expert's tokens in `a` can differ from one step to the next."""
    n = int(ex.meta[0])
    expert = torch.repeat_interleave(ex.act[:n].long(), ex.list[:n, 1].long())
    rows = torch.cat([torch.arange(int(o), int(o) + int(c), device=ex.a.device) for o, c in ex.list[:n].tolist()])
    keys = expert * ex.ids.shape[0] + ex.tok[rows].long()
    order = torch.argsort(keys)
    return keys[order], ex.a[rows[order]]


def _wide_input(tokens, same, seed):
    """A step's input: fresh random tokens, or (`same`) one token repeated, so every token picks the same 16 experts."""
    from kimi_decode.moe_bench import moe_input
    if same:
        return moe_input(1, D, seed=seed, device="cuda").repeat(tokens, 1)
    return moe_input(tokens, D, seed=seed + 1 + tokens, device="cuda")


def _run_beside_the_default(w, x, variant):
    """(default, variant) executors of one step on x, each run once with its moe_up output `a` NaN-poisoned."""
    a, b = FusedMoE(w, x), FusedMoE(w, x, variant=variant)
    assert b.variant.endswith(f"wide@{variant}"), b.variant
    for ex in (a, b):
        ex.a.fill_(float("nan"))
    a(), b()
    torch.cuda.synchronize()
    return a, b


def _same_up_to_summation_order(h, g):
    """Equal but for the order in which moe_down's expert-split CTAs add into the fp32 latent partial
    (`red.add`, in arrival order): at most one bf16 rounding step apart."""
    assert torch.isfinite(h).all() and torch.isfinite(g).all()
    torch.testing.assert_close(h.float(), g.float(), rtol=2 ** -7, atol=1e-3)


def _three_steps_rearm_the_counter_and_match(a, b):
    """Three steps of `a` (with dflag's counter): each gives `b`'s output (one step of it) up to summation order, and
    after each the counter's two words of meta are back at 0."""
    from kimi_decode.kernels import moe_pipe as kp
    b()
    for _ in range(3):
        a.h.fill_(float("nan"))
        a()
        torch.cuda.synchronize()
        assert a.meta[kp.DONE_FLAG].item() == 0 and a.meta[kp.PASS_COUNT].item() == 0
        _same_up_to_summation_order(a.h, b.h)


@pytest.mark.gpu
def test_variant_with_a_small_accumulator_refuses_many_tokens(w8):
    """w4r16 keeps 64 latent rows per moe_down CTA: its 48 KB accumulator holds 192 tokens, not 512."""
    from kimi_decode.moe_bench import moe_input
    with pytest.raises(UnsupportedConfiguration, match="1..192"):
        FusedMoE(w8, moe_input(256, D, seed=0, device="cuda"), variant="w4r2-w4r16e2s4", experts="direct")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 33])
def test_programmatic_dependent_launch_changes_nothing_but_timing(w8, tokens):
    """With PDL each kernel starts while the previous one drains; what it reads from that one is read after
    griddepcontrol.wait, so the results equal plain stream order (eagerly and in a CUDA graph), up to the
    order of the expert-split partial sums."""
    from kimi_decode.bench import time_graph
    from kimi_decode.moe_bench import moe_input
    x = moe_input(tokens, D, seed=80 + tokens, device="cuda")
    a, b = FusedMoE(w8, x, pdl=True), FusedMoE(w8, x, pdl=False)
    a(), b()
    torch.cuda.synchronize()
    assert torch.equal(a.ids, b.ids)
    _same_up_to_summation_order(a.h, b.h)
    h_eager = a.h.clone()
    a.h.fill_(float("nan"))
    time_graph([a], replays=3)
    _same_up_to_summation_order(a.h, h_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [2, 3, 4, 5])
def test_fitted_m_tile_builds_match_the_reference(w8, tokens):
    """The front and tail GEMVs at m_tile 2 or 4 (the default since run 49) and at m_tile 8 ('mtfit0') both give
    the reference; at 5 tokens both take the tensor-core m_tile 8 (`MMA_MIN_TOKENS`), so 'mtfit0' changes nothing."""
    from kimi_decode.moe_bench import check_moe, moe_input
    x = moe_input(tokens, D, seed=190 + tokens, device="cuda")
    assert FusedMoE(w8, x, variant="mtfit0").variant.startswith("mtfit0+") == (tokens <= 4)
    assert "mtfit" not in FusedMoE(w8, x).variant
    for variant in (None, "mtfit0"):
        r = check_moe(lambda w, xx: FusedMoE(w, xx, variant=variant), w8, x)
        assert r["all_written"] and r["check_ok"], (variant, r)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 8, 33])
def test_default_launch_order_is_pdl_at_one_token_only(w8, tokens):
    """pdl=None: programmatic dependent launch at PDL_MAX_TOKENS tokens or fewer, plain stream order above; the
    step is correct either way (run 45 timed both at 1-64 tokens)."""
    from kimi_decode.fused_moe import PDL_MAX_TOKENS
    from kimi_decode.moe_bench import check_moe, moe_input
    x = moe_input(tokens, D, seed=170 + tokens, device="cuda")
    assert FusedMoE(w8, x).pdl == (tokens <= PDL_MAX_TOKENS)
    r = check_moe(lambda w, xx: FusedMoE(w, xx), w8, x)
    assert r["all_written"] and r["check_ok"], r


@pytest.mark.gpu
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("tied", [20, 48])
@pytest.mark.parametrize("tokens", [6, 1])
def test_routing_ties_go_to_the_lowest_expert_index(w8, separate, tied, tokens):
    """Experts 0..tied-1 get identical router rows (exactly tied scores, zero bias) that beat every other
    expert: the top 16 must be experts 0..15, in index order (torch.topk's order with lowest-index ties).
    20 tied keys are 20 candidates (the candidate ranking); 48 are more than a warp's list holds (the bitwise
    search). At one token the front kernel routes with its keys in shared memory (skeys)."""
    import dataclasses

    from kimi_decode.moe_bench import moe_input
    x = moe_input(tokens, D, seed=12, device="cuda")
    gate = (0.01 * w8.moe.gate.float()).to(torch.bfloat16)
    gate[:tied] = (0.5 * x.float().mean(0) / x.float().mean(0).norm()).to(torch.bfloat16)
    moe = dataclasses.replace(w8.moe, gate=gate,
                              e_score_correction_bias=torch.zeros_like(w8.moe.e_score_correction_bias))
    ex = FusedMoE(dataclasses.replace(w8, moe=moe), x, separate_routing=separate)
    ex()
    torch.cuda.synchronize()
    logits = ex.front[:, :tied]
    assert (logits == logits[:, :1]).all(), "the tied rows must give bit-identical logits"
    want = torch.arange(16, dtype=torch.int32, device="cuda").expand(tokens, 16)
    assert torch.equal(ex.ids, want), ex.ids
    assert torch.allclose(ex.wts.sum(1), torch.full((tokens,), w8.cfg.routed_scaling_factor, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["w8r1-w4r8e2s8", "w4r2-w4r8e2s8", "w8r1-w4r4e4s4"])
@pytest.mark.parametrize("batch", [1, 8])
def test_fused_tuning_variants_match_the_reference(w8, variant, batch):
    """The direct kernels' launch shapes built by default (TUNE_UP_BUILT, TUNE_DOWN_BUILT, each with the other
    kernel's default); the rest are built by `bundle --tuning` (the moe-tune stage)."""
    from kimi_decode.moe_bench import check_moe, moe_input
    x = moe_input(batch, D, seed=60 + batch, device="cuda")
    r = check_moe(lambda w, xx: FusedMoE(w, xx, variant=variant, experts="direct"), w8, x)
    assert r["all_written"] and r["check_ok"], r


@pytest.mark.gpu
def test_fused_refuses_scales_outside_the_decode_range(w8):
    import dataclasses
    from kimi_decode.moe_bench import moe_input
    s = w8.moe.w2_scale.clone()
    s[0, 0, 0] = 200
    w = dataclasses.replace(w8, moe=dataclasses.replace(w8.moe, w2_scale=s))
    with pytest.raises(ValueError, match="scale byte 200"):
        FusedMoE(w, moe_input(1, D, seed=0, device="cuda"))


def test_pipe_variant_names_parse_and_every_one_is_compiled_ahead_of_time():
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    assert kp.parse_pipe_variant("pf0-tail3072") == (dict(prefetch_down=False), dict(prefetch_tail_rows=3072))
    assert kp.parse_pipe_variant("contig") == ({}, dict(balanced=False))
    # run 13's kernels: no merged prologue, every ring slot requested first, contiguous moe_down runs
    assert kp.parse_pipe_variant("pro0-contig-upearly4-downearly3") == (
        dict(prologue=False, early_slots=4), dict(prologue=False, balanced=False, early_slots=3))
    assert kp.parse_pipe_variant("run17") == (dict(prologue=False, epilogue_warp=False, early_slots=1, decode=1,
                                                   pad_rows=False),
                                              dict(prologue=False, producer_warp=False, swap_shared=False,
                                                   pair_extras=False, late_trigger=False, decode=1, ksplit=1,
                                                   flush_warp=False))
    assert kp.parse_pipe_variant("run20") == (dict(decode=1, pad_rows=False),
                                              dict(pair_extras=False, late_trigger=False, decode=1, ksplit=1,
                                                   flush_warp=False))
    assert kp.parse_pipe_variant("run27") == ({}, dict(pair_extras=False, flush_warp=False))
    assert kp.parse_pipe_variant("run35") == ({}, dict(flush_warp=False))
    # run17 is expanded where it stands: what follows it changes it
    assert kp.parse_pipe_variant("run17-swap1")[1]["swap_shared"] is True
    assert kp.parse_pipe_variant("swap1-run17")[1]["swap_shared"] is False
    for bad in ("pf2-tail0", "pf1-tail99999", "", "fast", "pf1-tail0-front1", "contig-", "upearly", "pro2"):
        with pytest.raises(ValueError, match="pf1-tail2048"):
            kp.parse_pipe_variant(bad)
    with pytest.raises(ValueError, match="needs pro0"):  # z is staged in the ring: nothing may fly before it
        kp.parse_pipe_variant("upearly1")
    s = km.shapes_for_tp(8)
    for v in ("uppro0", "downpro0", "run17-swap1", "pro0-contig-upearly4-downearly3"):  # names round-trip
        u, d = kp.parse_pipe_variant(v)
        up, down = kp.MoEUpPipeKey(s, **u), kp.MoEDownPipeKey(s, **d)
        u2, d2 = kp.parse_pipe_variant(kp.pipe_variant_name(up, down))
        assert (kp.MoEUpPipeKey(s, **u2), kp.MoEDownPipeKey(s, **d2)) == (up, down), v
    assert kp.pipe_variant_name(kp.MoEUpPipeKey(s, prologue=False, early_slots=4, prefetch_down=True),
                                kp.MoEDownPipeKey(s, prefetch_tail_rows=2048, balanced=False, early_slots=3,
                                                  prologue=False)) == \
        "pro0-upearly4-pf1-tail2048-contig-downearly3"
    assert kp.pipe_variant_name(kp.MoEUpPipeKey(s), kp.MoEDownPipeKey(s)) == "default"
    up_keys, down_keys = kp.UP_PIPE.aot_keys("sm_90a"), kp.DOWN_PIPE.aot_keys("sm_90a")
    for v in kp.AOT_VARIANTS:  # the comparison runs
        u, d = kp.parse_pipe_variant(v)
        up, down = kp.MoEUpPipeKey(s, **u), kp.MoEDownPipeKey(s, **d)
        assert up in up_keys and down in down_keys, v
        assert kp.pipe_variant_name(up, down) == ("run17" if v == kp.RUN17 else v)
        assert kp.up_pipe_smem_bytes(up) <= kp.SMEM_BUDGET and kp.down_pipe_smem_bytes(down) <= kp.SMEM_BUDGET
    # the options of runs 17-41 (and run 70's slower shup forms): built with `bundle --tuning` only
    up_hist, down_hist = kp.UP_PIPE.tuning_keys("sm_90a"), kp.DOWN_PIPE.tuning_keys("sm_90a")
    for v in kp.HISTORY_VARIANTS:
        u, d = kp.parse_pipe_variant(v)
        up, down = kp.MoEUpPipeKey(s, **u), kp.MoEDownPipeKey(s, **d)
        assert up in up_hist and down in down_hist and kp.pipe_variant_name(up, down) == ("run17" if v == kp.RUN17 else v)
        assert v not in kp.AOT_VARIANTS and (up not in up_keys or down not in down_keys or up == kp.MoEUpPipeKey(s)), v
    # the defaults (run 19's options all on) and their timeline builds
    assert kp.MoEUpPipeKey(s, trace=True) in up_keys and kp.MoEDownPipeKey(s, trace=True) in down_keys
    up = kp.MoEUpPipeKey(s)
    assert up.prologue and up.epilogue_warp and up.early_slots == 0
    down = kp.MoEDownPipeKey(s)
    assert down.prologue and down.producer_warp and down.swap_shared and down.pair_extras


def test_spread_decode_and_z_last_options_compile(compiler):
    """dec3 (the default since run 26) cuts pairs by mask, multiply, mask (`mxfp4_decode.SPREAD`, same bits:
    tests/test_mxfp4.py) in both kernels: integer multiplies instead of most shifts of run 24's dec2, the same mma
    count; zlast stages moe_up's z in the ring's
    last slots and requests the others from the prologue (only with the merged prologue); neither spills."""
    import re

    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    u, d = kp.parse_pipe_variant("dec2-zlast")
    assert (u["decode"], d["decode"], u["z_last"]) == (2, 2, True)
    assert kp.pipe_variant_name(kp.MoEUpPipeKey(s, **u), kp.MoEDownPipeKey(s, **d)) == "dec2-zlast"
    with pytest.raises(ValueError, match="zlast"):
        kp.parse_pipe_variant("pro0-zlast")

    def count(key, what):
        return len(re.findall(re.escape(what), kc.ptx_text(key)))

    up, dec3_up = kp.MoEUpPipeKey(s, decode=2), kp.MoEUpPipeKey(s)  # the run-24 decode; dec3 is the default
    down, dec3_down = kp.MoEDownPipeKey(s, decode=2), kp.MoEDownPipeKey(s)
    assert (dec3_up.decode, dec3_down.decode) == (3, 3)
    u, d = kp.parse_pipe_variant("run24")
    assert (u["decode"], d["decode"]) == (2, 2) and kp.pipe_variant_name(up, down) == "dec2"
    assert kp.pipe_variant_name(kp.MoEUpPipeKey(s, **u), kp.MoEDownPipeKey(s, **d)) == "run24"  # and pair0
    for a, b in ((up, dec3_up), (down, dec3_down)):
        assert count(a, "mul.lo.u32") == 0 < count(b, "mul.lo.u32")
        assert count(b, "shl.b32") < count(a, "shl.b32")
        assert count(b, "mma.sync") == count(a, "mma.sync") and count(b, "mul.rn.bf16x2") == count(a, "mul.rn.bf16x2")
    zl = kp.MoEUpPipeKey(s, z_last=True)
    assert count(zl, "mma.sync") == count(dec3_up, "mma.sync")
    for key in (dec3_up, dec3_down, zl):
        assert kc.resource_usage(key)["STACK"] == 0 and kc.resource_usage(key)["LOCAL"] == 0, key


def test_shared_up_streams_the_shared_rows_through_moe_ups_ring(compiler):
    """shup: the front GEMV stops after the router and latent-down rows, and moe_up streams the shared gate/up rows
    (one gate and one up row an item) ahead of its expert items: their slots and x are requested before
    griddepcontrol.wait (the default requests nothing before it), the expert items keep their mma count, the shared
    rows are summed on CUDA cores (fp32 FMA per bf16 pair) and across lanes by shuffles, in a branch of their own
    (no predicated mma in the SASS); one token by default, two with upmax2; no spills, within the shared-memory
    budget; refused with the options it cannot go with."""
    import re

    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    u, d = kp.parse_pipe_variant("shup")
    assert u == {"shared_up": True, "max_tokens": 1} and d == {}
    assert kp.parse_pipe_variant("upmax2-shup")[0]["max_tokens"] == 2
    assert kp.parse_pipe_variant("shup-upmax2")[0]["max_tokens"] == 2
    for bad in ("shup-zlast", "shup-f16", "shup-bal", "shup-pf1", "shup-merge", "shup-uflag1", "shup-epi0",
                "shup-sfirst", "shup-upw16", "upmax4-shup"):
        with pytest.raises(ValueError, match="shup"):
            kp.parse_pipe_variant(bad)
    one, two = (kp.MoEUpPipeKey(s, **kp.parse_pipe_variant(v)[0]) for v in ("shup", "upmax2-shup"))
    base = kp.MoEUpPipeKey(s)
    for v, key in (("shup", one), ("upmax2-shup", two)):
        assert kp.pipe_variant_name(key, kp.MoEDownPipeKey(s)) == v
        assert kp.up_pipe_smem_bytes(key) <= kp.SMEM_BUDGET

    def ptx(key):
        return kc.ptx_text(key)

    p0, p1, p2 = ptx(base), ptx(one), ptx(two)
    before = [t[:t.index("griddepcontrol.wait")].count("cp.async.bulk.shared") for t in (p0, p1)]
    assert before[0] == 0 and before[1] >= 1 + kp.MoEUpPipeKey.stages * 2, before  # x, then 2 rows a slot
    assert p1.count("mma.sync") == p0.count("mma.sync")  # the expert items as before
    fma = [len(re.findall(r"fma\.rn\.f32", t)) for t in (p0, p1, p2)]
    assert fma[1] - fma[0] >= 2 * 2 * 4 * 2 and fma[2] - fma[1] >= 2 * 2 * 4 * 2, fma  # 2 chunks x 4 words x 2 rows x 2
    assert p1.count("shfl.sync") > p0.count("shfl.sync")
    for key in (one, two):
        assert kc.resource_usage(key)["STACK"] == 0 and kc.resource_usage(key)["LOCAL"] == 0, key
    # a shared item and an expert item run different code, not one predicated stream (run 71: ptxas had if-converted
    # the two branches, so every shared item issued the expert item's decode and mma with the predicate off)
    for key in (one, kp.MoEUpPipeKey(s, **kp.parse_pipe_variant("shupi2")[0])):
        sass = kc.sass_text(key)
        assert "HMMA" in sass and not re.search(r"@!?P\d+\s+HMMA", sass), key
    front = km.front_key_for(s, 1, False, {}, "sm_90a", shared_rows=False)[0]
    assert not front.shared_rows and front in km.FRONT.aot_keys("sm_90a")
    assert kc.resource_usage(front)["LOCAL"] == 0
    with pytest.raises(ValueError, match="shup"):
        km.front_key_for(s, 1, False, {"front_pdl": True}, "sm_90a", shared_rows=False)


def test_interleaved_shared_order_deals_every_item_once():
    """shupiN: each CTA walks its own shared items (bx + k·G) and expert items in the interleaved order, N shared
    first, both lists in their own order, every item of the step exactly once over the CTAs (TP8 and TP16 shared
    counts, 1 to 112 active experts' items), the lead all shared; parse and names round-trip, N = 0 refused."""
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    G = kp.H200_SMS
    for nshi in (km.shapes_for_tp(8).shared, km.shapes_for_tp(16).shared):
        for nexp in (48, 768, 1536, 5376):
            for lead in (1, 2, 3, 4, 9):
                seen = []
                for bx in range(G):
                    ns, ne = (nshi - bx + G - 1) // G, max(0, (nexp - bx + G - 1) // G)
                    seq = [kp.shared_order_item(n, ns, ne, bx, lead, G, nshi) for n in range(ns + ne)]
                    assert [v for v in seq if v < nshi] == [bx + k * G for k in range(ns)]
                    assert [v - nshi for v in seq if v >= nshi] == [bx + k * G for k in range(ne)]
                    assert all(v < nshi for v in seq[:min(lead, ns)])
                    seen += seq
                assert sorted(seen) == list(range(nshi + nexp)), (nshi, nexp, lead)
    assert [kp.shared_order_item(n, 6, 6, 0, 2, G, 768) for n in range(12)] == \
        [0, 132, 768, 264, 900, 396, 1032, 528, 1164, 660, 1296, 1428]  # S S E S E S E S E S E E
    s = km.shapes_for_tp(8)
    for v in ("shupi2", "upmax2-shupi3", "shupi4-l2h"):
        u, d = kp.parse_pipe_variant(v)
        assert u["shared_up"] and kp.pipe_variant_name(kp.MoEUpPipeKey(s, **u), kp.MoEDownPipeKey(s, **d)) == v
    with pytest.raises(ValueError, match="shupiN"):
        kp.parse_pipe_variant("shupi0")


def test_shared_front_keeps_a_share_of_the_shared_rows(compiler):
    """shfrontK: the front GEMV keeps the gate and up rows of the first K shared columns (K a multiple of its rows per
    CTA) and moe_up streams the other S - K as its shared items; parse and names round-trip, refused without shup or
    with K not a multiple of 8; the front keys of the built K are ahead-of-time keys; the builds do not spill; the
    front's and moe_up's PTX differ from the all-in-moe_up build only by the share (a select of the kept up rows'
    offset in the front, the SiTU loop of the kept columns in moe_up)."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    u, d = kp.parse_pipe_variant("shupi2-shfront384")
    assert u == {"shared_up": True, "shared_lead": 2, "shared_front": 384, "max_tokens": 1} and d == {}
    key = kp.MoEUpPipeKey(s, **u)
    assert kp.pipe_variant_name(key, kp.MoEDownPipeKey(s)) == "shupi2-shfront384"
    for bad in ("shfront384", "shupi2-shfront0", "shupi2-shfront100", "l2h-shfront256"):
        with pytest.raises(ValueError, match="shfront"):
            kp.parse_pipe_variant(bad)
    keeps = kp.built_shared_fronts()
    assert keeps and all(0 < k < s.shared for k in keeps)
    fronts = km.FRONT.aot_keys("sm_90a")
    for k in keeps:
        for m in (1, 2):
            f = km.front_key_for(s, m, False, {}, "sm_90a", shared_rows=False, shared_keep=k)[0]
            assert f.shared_keep == k and not f.shared_rows and f in fronts
    f0 = km.front_key_for(s, 1, False, {}, "sm_90a", shared_rows=False)[0]
    fk = km.front_key_for(s, 1, False, {}, "sm_90a", shared_rows=False, shared_keep=384)[0]
    assert f0.shared_keep == 0
    all_in_up = kp.MoEUpPipeKey(s, **kp.parse_pipe_variant("shupi2")[0])
    for k in (fk, key):
        assert kc.resource_usage(k)["LOCAL"] == 0 and kc.resource_usage(k)["STACK"] == 0, k
    assert kp.up_pipe_smem_bytes(key) <= kp.SMEM_BUDGET
    p_all, p_keep = kc.ptx_text(all_in_up), kc.ptx_text(key)
    assert p_keep.count("mma.sync") == p_all.count("mma.sync")
    assert p_keep.count("ex2.approx") > p_all.count("ex2.approx")  # the kept columns' SiTU in the prologue
    assert kc.ptx_text(fk).count("selp") + kc.ptx_text(fk).count("setp") > \
        kc.ptx_text(f0).count("selp") + kc.ptx_text(f0).count("setp")


def test_sixteen_up_warps_balance_the_sub_partitions(compiler):
    """upw16: warps 0..11 take two super-blocks, 12..15 one, so every row's 28 super-blocks are taken once and each
    sub-partition (warps w = s mod 4) has 7 (14 warps: 8, 8, 6, 6); same mma count as the default, no spill."""
    import re

    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    nsb = kp.L // kp.SB

    def per_smsp(warps):
        taken = [w + warps * q for w in range(warps) for q in range(-(-nsb // warps)) if w + warps * q < nsb]
        assert sorted(taken) == list(range(nsb)), warps
        return [sum(1 for w in range(warps) for q in range(-(-nsb // warps)) if w % 4 == p and w + warps * q < nsb)
                for p in range(4)]

    assert per_smsp(16) == [7, 7, 7, 7] and per_smsp(14) == [8, 8, 6, 6]
    u, d = kp.parse_pipe_variant("upw16")
    up = kp.MoEUpPipeKey(s, **u)
    assert up.warps == 16 and kp.pipe_variant_name(up, kp.MoEDownPipeKey(s, **d)) == "upw16"
    ptx = kc.ptx_text(up)
    assert len(re.findall(r"mma\.sync", ptx)) == len(re.findall(r"mma\.sync", kc.ptx_text(kp.MoEUpPipeKey(s))))
    assert kc.resource_usage(up)["STACK"] == 0 and kp.up_pipe_smem_bytes(up) <= kp.SMEM_BUDGET


def test_balanced_halves_cover_each_row_once_with_equal_sub_partitions(compiler):
    """bal (an option, off: slower, run 28): 14 compute warps take consecutive runs of a row's 56 half super-blocks (UP_BALANCED_HALVES), every half
    once; sub-partitions 0, 1 and 3 get 15, 15 and 14 halves, 2 (beside the epilogue warp) 12; 5 halves of 4 mma
    at most per warp (the default: whole super-blocks, 2 per warp); refused with other warp counts or without the
    epilogue warp; no spill."""
    import re

    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    halves = kp.UP_BALANCED_HALVES
    assert len(halves) == kp.MoEUpPipeKey.warps and sum(halves) == 2 * (kp.L // kp.SB)
    assert [sum(h for w, h in enumerate(halves) if w % 4 == p) for p in range(4)] == [15, 15, 12, 14]
    u, d = kp.parse_pipe_variant("bal")
    up, whole = kp.MoEUpPipeKey(s, **u), kp.MoEUpPipeKey(s)  # off by default: measured slower (run 28)
    assert up.balanced and not whole.balanced and kp.pipe_variant_name(up, kp.MoEDownPipeKey(s, **d)) == "bal"
    for bad in ("bal-upw16", "bal-epi0"):
        with pytest.raises(ValueError, match="bal deals"):
            kp.parse_pipe_variant(bad)
    with pytest.raises(ValueError, match="balance deals"):
        _ = kp.MoEUpPipeKey(s, warps=16, balance=True).balanced
    assert len(re.findall(r"mma\.sync", kc.ptx_text(up))) == 4 * max(halves)
    assert len(re.findall(r"mma\.sync", kc.ptx_text(whole))) == 16
    assert kc.resource_usage(up)["STACK"] == 0 and kc.resource_usage(up)["LOCAL"] == 0


def test_prologue_and_extra_warp_options_compile(compiler):
    """'pro' stages with bulk copies (more cp.async.bulk, fewer global loads); the extra warps add threads
    but no arithmetic (the same mma count); no option spills."""
    import re

    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)

    def count(key, what):
        return len(re.findall(re.escape(what), kc.ptx_text(key)))

    base_up = kp.MoEUpPipeKey(s, prologue=False, early_slots=1, epilogue_warp=False)  # run 17's kernels
    base_down = kp.MoEDownPipeKey(s, prologue=False, producer_warp=False, swap_shared=False)
    pro_up = kp.MoEUpPipeKey(s, epilogue_warp=False)
    pro_down = kp.MoEDownPipeKey(s, producer_warp=False, swap_shared=False)
    assert count(pro_up, "cp.async.bulk.shared") > count(base_up, "cp.async.bulk.shared")
    assert count(pro_down, "cp.async.bulk.shared") > count(base_down, "cp.async.bulk.shared")
    assert count(pro_down, "ld.global") < count(base_down, "ld.global")
    epi = kp.MoEUpPipeKey(s, prologue=False, early_slots=1)
    prod = kp.MoEDownPipeKey(s, prologue=False, swap_shared=False)
    assert count(epi, "mma.sync") == count(base_up, "mma.sync")
    assert count(prod, "mma.sync") == count(base_down, "mma.sync")
    assert count(epi, "bar.sync") < count(base_up, "bar.sync")  # one CTA barrier per item instead of two
    for key in (pro_up, pro_down, epi, prod):
        assert kc.resource_usage(key)["STACK"] == 0, key


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [None, *AOT_VARIANTS])
@pytest.mark.parametrize("batch, tokens", [(1, 1), (2, 1), (1, 3), (8, 1), (1, 8)])
def test_fused_prologue_and_extra_warp_variants_match_the_reference(w8, variant, batch, tokens):
    """The defaults (one-round-trip prologues, the extra warps, the reversed shared split) and each of them
    turned off (and run 17's kernels) give the reference, at every token count the pipelined kernels take
    (1..8; z and a staged for each token)."""
    from kimi_decode.kernels.moe_pipe import MoEUpPipeKey, parse_pipe_variant
    from kimi_decode.moe_bench import check_moe, moe_input
    x = moe_input(batch * tokens, D, seed=90 + batch * tokens, device="cuda")
    up_kw, down_kw = parse_pipe_variant(variant) if variant else ({}, {})
    cap = min(up_kw.get("max_tokens", MoEUpPipeKey.max_tokens), down_kw.get("max_tokens", MoEUpPipeKey.max_tokens))
    if batch * tokens > cap:  # a build for fewer tokens refuses more, before any launch
        with pytest.raises(UnsupportedConfiguration, match="expert kernels hold"):
            FusedMoE(w8, x, variant=variant)
        return
    r = check_moe(lambda w, xx: FusedMoE(w, xx, variant=variant), w8, x)
    assert r["all_written"] and r["check_ok"], r


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("variant", ["skeys", "fring", "fring2x6", "fring2x7", "fring2x3c2", "cotail", "tringco",
                                     "tring4x3c2", "tring2x7c2", "tring4x8"])
def test_fused_front_occupancy_builds_match_the_reference(w8, n, variant):
    """'skeys' (the plain front with its routing keys in shared memory, 48 registers), 'fring' and 'fringRxS' (the ring
    front), and 'cotail' (moe_down for one token with the small tail ring beside it)
    give the reference at one token and, where they do not apply (m_tile 2 and 8), leave the step as it is."""
    from kimi_decode.moe_bench import check_moe, moe_input
    x = moe_input(n, D, seed=140 + n, device="cuda")
    ex = FusedMoE(w8, x, variant=variant)
    assert ex.variant.startswith(variant + "+") == (n == 1), ex.variant
    r = check_moe(lambda w, xx: FusedMoE(w, xx, variant=variant), w8, x)
    assert r["all_written"] and r["check_ok"], r


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_tail_ring_equals_the_plain_tail(tp, seed):
    """At one token the tail is the persistent bulk-copy ring (`moe_tail_ring`); 'tring0' keeps the plain GEMV.
    Both give the reference, and the same output up to the order of the sums."""
    from kimi_decode.moe_bench import check_moe, moe_input
    w = _weights(tp)
    x = moe_input(1, D, seed=180 + seed, device="cuda")
    a, b = FusedMoE(w, x), FusedMoE(w, x, variant="tring0")
    assert a.kernels_used.endswith("moe_tail_ring") and b.variant.startswith("tring0+"), (a.kernels_used, b.variant)
    a(), b()
    torch.cuda.synchronize()
    assert not a.h.isnan().any()
    _same_up_to_summation_order(a.h, b.h)
    for variant in (None, "tring0"):
        r = check_moe(lambda ww, xx: FusedMoE(ww, xx, variant=variant), w, x)
        assert r["all_written"] and r["check_ok"], (variant, r)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_routing_keys_in_shared_memory_equal_keys_in_registers(w8, seed):
    """At one token the ring front ('fring'), the plain front (the default) and the plain front with its keys in
    shared memory ('skeys') route alike: the same experts in the same order; the two plain fronts with
    bit-identical weights, the ring (its logits summed in another order) within rounding."""
    from kimi_decode.moe_bench import moe_input
    x = moe_input(1, D, seed=170 + seed, device="cuda")
    a, b, c = FusedMoE(w8, x, variant="fring"), FusedMoE(w8, x), FusedMoE(w8, x, variant="skeys")
    assert a.kernels_used.startswith("moe_front_ring+") and a.variant.startswith("fring+")
    assert b.kernels_used.startswith("moe_front+") and c.variant.startswith("skeys+")
    a(), b(), c()
    torch.cuda.synchronize()
    assert torch.equal(b.ids, c.ids) and torch.equal(b.wts, c.wts)  # the same logits: bit-identical weights
    for o in (b, c):  # the ring sums its logits in another order: the same choice, weights within rounding
        assert torch.equal(a.ids, o.ids)
        torch.testing.assert_close(a.wts, o.wts, rtol=1e-5, atol=0)
        _same_up_to_summation_order(a.h, o.h)


def test_prefetch_variants_compile_with_the_l2_prefetch(compiler):
    """The L2-prefetch variants (off by default) carry the bulk prefetch; the defaults do not."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    for key in (kp.MoEUpPipeKey(s, prefetch_down=True), kp.MoEDownPipeKey(s, prefetch_tail_rows=2048)):
        ptx = kc.ptx_text(key)
        assert "cp.async.bulk.prefetch.L2.global" in ptx, key
        assert kc.resource_usage(key)["STACK"] == 0, key
    assert "prefetch.L2" not in kc.ptx_text(kp.MoEUpPipeKey(s))


def test_variant_names_parse_and_round_trip():
    from kimi_decode.kernels import moe as km
    up, down = km.parse_variant("w8r1-w4r8e2s8")
    assert up == dict(warps=8, rows_per_warp=1)
    assert down == dict(warps=4, rows_per_warp=8, experts_ahead=2, expert_splits=8)
    s = km.shapes_for_tp(8)
    assert km.variant_name(km.MoEUpKey(s, **up), km.MoEDownKey(s, **down)) == "w8r1-w4r8e2s8"
    with pytest.raises(ValueError, match="w4r2-w4r4e4s4"):
        km.parse_variant("fast")
    # the default bundle builds TUNE_UP_BUILT / TUNE_DOWN_BUILT, `bundle --tuning` the rest; each once
    for spec, kind, shapes, built in ((km.UP, "up", km.TUNE_UP, km.TUNE_UP_BUILT),
                                      (km.DOWN, "down", km.TUNE_DOWN, km.TUNE_DOWN_BUILT)):
        aot, tuning = spec.aot_keys("sm_90a"), spec.tuning_keys("sm_90a")
        assert not set(aot) & set(tuning)
        for v in shapes:
            for key in km._tuned_keys(kind, "sm_90a", [v]):
                assert key in (aot if v in built else tuning), (kind, v, key)


@pytest.mark.parametrize("name", ["moe_front", "moe_route", "moe_up", "moe_down", "moe_tail", "moe_up_pipe",
                                  "moe_down_pipe"])
def test_moe_kernels_compile_for_sm90a(compiler, name):
    """Each MoE kernel's TP8 default compiles for sm_90a with its instructions: routing by a bitwise search
    (redux.sync, no arg-max chain), the in-register MXFP4 decode (mul.rn.bf16x2), no local-memory spills."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    key = {"moe_front": km.MoEFrontKey(s), "moe_route": km.MoERouteKey(s), "moe_up": km.MoEUpKey(s),
           "moe_down": km.MoEDownKey(s), "moe_tail": km.MoETailKey(s), "moe_up_pipe": kp.MoEUpPipeKey(s),
           "moe_down_pipe": kp.MoEDownPipeKey(s)}[name]
    ptx = kc.ptx_text(key)
    assert ".target sm_90a" in ptx
    for needle in kc.registry()[name].ptx_checks:
        assert needle in ptx, f"{name}: PTX lacks {needle!r}"
    assert "ld.local" not in ptx and "st.local" not in ptx, f"{name}: local memory in the PTX"
    # ptxas can still spill: a loop-invariant decode hoisted out of moe_up's token loop once left 448 decoded
    # weights live, and the kernel ran at 32 registers with a 2.4 KB stack frame, 11x slower on the H200
    res = kc.resource_usage(key)
    assert res["STACK"] == 0 and res["LOCAL"] == 0, f"{name}: register spills {res}"
    if name in ("moe_front", "moe_route"):
        assert ptx.count("redux.sync.add") >= 32, "routing must use the 32-step bitwise top-k search"
    # programmatic dependent launch: the front lets the next launch start; the dependents wait before reading
    assert ("griddepcontrol.wait" in ptx) == (name != "moe_front")
    assert ("griddepcontrol.launch_dependents" in ptx) == (name != "moe_tail")
    if name.endswith("_pipe"):  # the persistent CTAs' shared memory (ring, accumulators) fits one per SM
        size = kp.up_pipe_smem_bytes(key) if name == "moe_up_pipe" else kp.down_pipe_smem_bytes(key)
        assert size + res["SHARED"] <= 227 * 1024, (name, size)


@pytest.mark.parametrize("name", ["moe_up_pipe", "moe_down_pipe"])
def test_pipelined_expert_kernels_compile_at_tp16_without_spills(compiler, name):
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe_pipe as kp
    from kimi_decode.kernels.moe import shapes_for_tp
    key = (kp.MoEUpPipeKey if name == "moe_up_pipe" else kp.MoEDownPipeKey)(shapes_for_tp(16))
    res = kc.resource_usage(key)
    assert res["STACK"] == 0 and res["LOCAL"] == 0, f"{name} TP16: register spills {res}"


@pytest.mark.parametrize("name", ["moe_front", "moe_route"])
def test_routing_issues_its_score_loads_before_the_sigmoid_slow_paths(compiler, name):
    """The sigmoid's IEEE reciprocal has a slow-path call that ptxas does not move loads across: with the
    logit and bias loads interleaved, routing one token cost 56 dependent L2 round trips (about 19 µs in
    the H200 graph). In the SASS, all 2 × 28 score loads must come before the first such call."""
    import re

    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    s = km.shapes_for_tp(8)
    key = km.MoEFrontKey(s) if name == "moe_front" else km.MoERouteKey(s)
    ops = re.findall(r"\b(LDG\.E(?:\.\w+)*|CALL\.REL\S*)", kc.sass_text(key))
    first_call = next(i for i, op in enumerate(ops) if op.startswith("CALL"))
    scalar_loads_before = sum(op == "LDG.E" for op in ops[:first_call])
    assert scalar_loads_before >= 2 * km.E // 32, ops[: first_call + 3]


def _candidate_topk(keys: torch.Tensor, list_size: int = 32):
    """The kernel's candidate routing for one token, step by step (`kernels.moe.route_tokens`): keys [896]
    int64 laid out as the kernel's lanes hold them (expert lane + 32 j in lane `lane`). Returns (the 16 chosen
    experts in rank order, whether the candidate path was taken)."""
    by_lane = keys.view(-1, 32)  # [j, lane]
    m16 = by_lane.max(0).values.sort(descending=True).values[15]
    cand = (keys >= m16).nonzero().flatten()
    if cand.numel() > list_size:
        return None, False
    k = keys[cand]
    rank = ((k[None, :] > k[:, None]) | ((k[None, :] == k[:, None]) & (cand[None, :] < cand[:, None]))).sum(1)
    chosen = rank < 16
    out = torch.empty(16, dtype=torch.long)
    out[rank[chosen]] = cand[chosen]
    return out, True


def test_candidate_routing_model_equals_topk_with_lowest_index_ties():
    """The 16th largest lane maximum bounds the 16th largest key from below, so ranking the keys at or above it
    gives torch.topk's choice and order (lowest index first among ties), for random scores, heavy ties and
    scores concentrated in a few lanes; more candidates than the list holds go to the bitwise search."""
    gen = torch.Generator().manual_seed(5)
    fast = 0
    for trial in range(3000):
        scale = [0.3, 1.0, 4.0][trial % 3]
        keys = (torch.randn(896, generator=gen) * scale * 1000).round().long()  # rounding makes ties
        if trial % 7 == 0:  # a few lanes hold the largest keys
            keys[torch.arange(0, 896, 32)] += 5000
        if trial % 11 == 0:
            keys[:] = 3  # everything tied
        got, took = _candidate_topk(keys)
        want = torch.topk(keys.double() - torch.arange(896) * 1e-9, 16).indices  # lowest index wins a tie
        if took:
            fast += 1
            assert torch.equal(got, want), (trial, got, want)
    assert 2000 < fast < 3000  # both paths occur


def test_every_built_variant_has_a_build_with_and_without_pdl():
    """FusedMoE launches with PDL at one token and without above (PDL_MAX_TOKENS): every option built ahead of time
    must exist both ways, or its runs above one token find no artifact on a GPU host (run 46: 101 tests)."""
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    up, down = kp.UP_PIPE.aot_keys("sm_90a"), kp.DOWN_PIPE.aot_keys("sm_90a")
    for v in kp.AOT_VARIANTS:
        u, d = kp.parse_pipe_variant(v)
        for p in (True, False):
            assert kp.MoEUpPipeKey(s, pdl=p, **u) in up, (v, p)
            assert kp.MoEDownPipeKey(s, pdl=p, **d) in down, (v, p)
    for tp in (8, 16):
        st = km.shapes_for_tp(tp)
        for p in (True, False):
            assert kp.MoEUpPipeKey(st, pdl=p) in up and kp.MoEDownPipeKey(st, pdl=p) in down
            assert km.MoERouteKey(st, pdl=p) in km.ROUTE.aot_keys("sm_90a")
            for mt in km.M_TILES:
                assert km.MoETailKey(st, m_tile=mt, pdl=p) in km.TAIL.aot_keys("sm_90a")
    for w, r in km.TUNE_UP_BUILT:
        assert km.MoEUpKey(s, warps=w, rows_per_warp=r, pdl=False) in km.UP.aot_keys("sm_90a")
    assert km.MoERouteKey(s, candidates=False, pdl=False) in km.ROUTE.aot_keys("sm_90a")


def test_fitted_m_tile_option_parses_and_is_built_ahead_of_time():
    """The front and tail GEMVs take the smallest m_tile of 1, 2, 4, 8 that holds the step (m_tile 8 computes 8
    token columns and holds 217 / 242 registers); 'mtfit0' keeps m_tile 8 from 2 tokens on. Every tile is built
    ahead of time at TP8 and TP16, with and without routing, and the tail with and without PDL."""
    from kimi_decode.kernels import moe as km
    assert km.split_front_options("mtfit0-cand0") == (dict(m_tile_fit=False, candidates=False), None)
    assert km.split_front_options("mtfit") == (dict(m_tile_fit=True), None)
    assert [km.pick_m_tile(m) for m in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 8]
    assert [km.pick_m_tile(m, km.M8_TILES) for m in (1, 2, 4, 9)] == [1, 8, 8, 8]
    for tp in (8, 16):
        s = km.shapes_for_tp(tp)
        for mt in km.M_TILES:
            for sep in (False, True):
                key = km.front_key_for(s, mt, sep)[0]
                assert key.m_tile == mt and key in km.FRONT.aot_keys("sm_90a"), (tp, mt, sep)
            for p in (True, False):
                assert km.MoETailKey(s, m_tile=mt, pdl=p) in km.TAIL.aot_keys("sm_90a"), (tp, mt, p)
    for mt in km.M_TILES:  # 'cand0' at TP8
        key = km.front_key_for(km.shapes_for_tp(8), mt, False, {"candidates": False})[0]
        assert key in km.FRONT.aot_keys("sm_90a")


def test_tensor_core_front_and_tail_from_five_tokens_are_built_ahead_of_time():
    """From MMA_MIN_TOKENS tokens the front and tail GEMVs run on tensor cores: m_tile 8 up to 8 tokens, 64 above
    (the front at 8 while it routes in its last router CTA); 'mma0' keeps the CUDA-core m_tile 8 and is named in the
    variant; the routing ablations keep the CUDA-core front. Every key a step can ask for is built ahead of time."""
    from kimi_decode.kernels import moe as km
    assert km.split_front_options("mma0-run35") == (dict(tensor_cores=False), "run35")
    assert km.split_front_options("mma") == (dict(tensor_cores=True), None)
    fronts, tails = km.FRONT.aot_keys("sm_90a"), km.TAIL.aot_keys("sm_90a")
    for tp in (8, 16):
        s = km.shapes_for_tp(tp)
        for m in (1, 2, 4, 5, 8, 9, 17, 64, 512):
            for sep in (False, True):
                key, tags = km.front_key_for(s, m, sep)
                want = (8 if m <= 8 or not sep else 64) if m >= km.MMA_MIN_TOKENS else km.pick_m_tile(m)
                assert (key.mma, key.m_tile, tags) == (m >= km.MMA_MIN_TOKENS, want, []), (tp, m, sep)
                assert key in fronts, (tp, m, sep)
                key, tags = km.front_key_for(s, m, sep, {"tensor_cores": False})
                assert (key.mma, key.m_tile, tags) == (False, km.pick_m_tile(m), ["mma0"] if m >= 5 else []), m
                assert key in fronts, (tp, m, sep)
            for pdl in (True, False):
                tail = km.tail_key_for(s, m, pdl)
                assert (tail.mma, tail.m_tile) == ((True, 8 if m <= 8 else 64) if m >= 5 else (False, km.pick_m_tile(m)))
                assert tail in tails and km.tail_key_for(s, m, pdl, {"tensor_cores": False}) in tails, (tp, m, pdl)
    s = km.shapes_for_tp(8)
    assert not km.front_key_for(s, 8, False, {"candidates": False})[0].mma
    assert not km.front_key_for(s, 8, False, {}, route_flag=True)[0].mma
    assert km.tail_key_for(s, 8, False, {"m_tile_fit": False, "tensor_cores": False}).m_tile == 8
    assert km.tail_key_for(s, 3, False, {"m_tile_fit": False}).m_tile == 8


@pytest.mark.parametrize("m_tile", [8, 64])
def test_tensor_core_front_and_tail_compile_without_spills(compiler, m_tile):
    """The tensor-core front (routing in it at 8 tokens) and tail (with and without PDL) compile for sm_90a with
    mma.sync, no local memory; the routing front keeps its bitwise search, the PDL tail waits."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    s = km.shapes_for_tp(8)
    front = km.front_key_for(s, m_tile, m_tile > 8)[0]
    assert front.mma and front.m_tile == m_tile and front.route == (m_tile == 8)
    for key in (front, km.tail_key_for(s, m_tile, True), km.tail_key_for(s, m_tile, False)):
        ptx = kc.ptx_text(key)
        assert "mma.sync.aligned.m16n8k16" in ptx, key
        assert "ld.local" not in ptx and "st.local" not in ptx, key
        res = kc.resource_usage(key)
        assert res["STACK"] == 0 and res["LOCAL"] == 0, (key, res)
        if isinstance(key, km.MoETailKey):
            assert ("griddepcontrol.wait" in ptx) == key.pdl
        else:
            assert (ptx.count("redux.sync.add") >= 32) == front.route


@pytest.mark.gpu
@pytest.mark.parametrize("batch,tokens", [(5, 1), (8, 1), (17, 1), (64, 1), (8, 8)])
def test_tensor_core_front_and_tail_match_the_reference_and_the_cuda_core_ones(w8, batch, tokens):
    """The default (tensor cores from 5 tokens) and 'mma0' (the CUDA-core GEMVs) both give the reference, with the
    routing in the front and as its own launch."""
    from kimi_decode.moe_bench import check_moe, moe_input
    x = moe_input(batch * tokens, D, seed=230 + batch * tokens, device="cuda")
    assert "mma0" not in FusedMoE(w8, x).variant and FusedMoE(w8, x, variant="mma0").variant.startswith("mma0+")
    for variant in (None, "mma0"):
        for sep in (False, True):
            r = check_moe(lambda w, xx: FusedMoE(w, xx, variant=variant, separate_routing=sep), w8, x)
            assert r["all_written"] and r["check_ok"], (variant, sep, r)


def test_front_key_for_picks_tiles_keys_and_occupancy():
    """One token with routing in the front kernel: the plain GEMV; 'fring' takes the ring front (`moe_front_ring`),
    'skeys' the routing keys in shared memory (FRONT_SKEYS_CTAS CTAs per SM), 'foccN' N CTAs per SM, and they are
    named in the tags; above one token (or with a routing launch) they do not apply."""
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels.moe_front_ring import FRONT_RING, MoEFrontRingKey
    s = km.shapes_for_tp(8)
    key, tags = km.front_key_for(s, 1, False, {"front_ring": True})
    assert key == MoEFrontRingKey(s) and tags == ["fring"]
    key, tags = km.front_key_for(s, 1, False)
    assert (key.m_tile, key.route, key.smem_keys, key.min_ctas, tags) == (1, True, False, 0, [])
    key, tags = km.front_key_for(s, 1, False, {"smem_keys": True})
    assert (key.smem_keys, key.min_ctas, tags) == (True, km.FRONT_SKEYS_CTAS, ["skeys"])
    key, tags = km.front_key_for(s, 1, False, {"min_ctas": 12})
    assert (key.smem_keys, key.min_ctas, tags) == (False, 12, ["focc12"])
    key, tags = km.front_key_for(s, 1, True, {"smem_keys": True, "min_ctas": 10, "front_ring": True})
    assert (key.route, key.smem_keys, key.min_ctas, tags) == (False, False, 0, [])
    for m, mt in ((2, 2), (3, 4), (4, 4), (5, 8), (9, 64)):  # tensor cores from 5 tokens (64 with a routing launch)
        key, tags = km.front_key_for(s, m, m > 8, {"smem_keys": True, "min_ctas": 10, "front_ring": True})
        assert (key.m_tile, key.smem_keys, key.min_ctas, key.mma, tags) == (mt, False, 0, m >= 5, []), m
    key, tags = km.front_key_for(s, 2, False, {"m_tile_fit": False, "candidates": False})
    assert (key.m_tile, key.candidates, tags) == (8, False, ["cand0", "mtfit0"])
    built = km.FRONT.aot_keys("sm_90a") + FRONT_RING.aot_keys("sm_90a")
    for o in ({}, {"smem_keys": True}, {"front_ring": True}, {"candidates": False}, {"m_tile_fit": False}):
        for m in range(1, 10):
            assert km.front_key_for(s, m, m > 8, o)[0] in built, (o, m)
    for o in ({}, {"front_ring": True}):
        for m in range(1, 10):
            assert km.front_key_for(km.shapes_for_tp(16), m, m > 8, o)[0] in built, (o, m)
    assert not [k for k in km.FRONT.aot_keys("sm_90a") if not isinstance(k, km.MoEFrontKey)]
    assert km.split_front_options("skeys-fring") == (dict(smem_keys=True, front_ring=True), None)


def test_front_ring_geometry_variants():
    """'fringRxS': the ring front with R rows per slot and S slots; its key, its tag in the variant name, built
    ahead of time at TP8 for each of RING_GEOMETRIES; a geometry the key refuses fails before any build."""
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_front_ring as fr
    s = km.shapes_for_tp(8)
    assert km.split_front_options("fring2x7-cand0") == (
        dict(front_ring=True, front_ring_geometry=(2, 7, 1), candidates=False), None)
    for g in fr.RING_GEOMETRIES:
        r, st, c = (*g, 1)[:3]
        name = f"fring{r}x{st}" + (f"c{c}" if c > 1 else "")
        key, tags = km.front_key_for(s, 1, False, km.split_front_options(name)[0])
        assert (key.rows_per_stage, key.stages, key.ctas_per_sm, tags) == (r, st, c, [name])
        assert key in fr.FRONT_RING.aot_keys("sm_90a") and fr.front_ring_smem_bytes(key) <= fr.SMEM_MAX
        key, tags = km.front_key_for(s, 2, False, km.split_front_options(name)[0])
        assert isinstance(key, km.MoEFrontKey) and tags == [], "above one token the plain GEMV"
    with pytest.raises(ValueError, match="CTAs per SM"):  # two CTAs of 168 KB of slots on one SM
        km.front_key_for(s, 1, False, km.split_front_options("fring4x3c2")[0])
    with pytest.raises(ValueError, match="ctas must be"):
        km.front_key_for(s, 1, False, km.split_front_options("fring2x3c3")[0])
    with pytest.raises(ValueError, match="must divide"):
        km.front_key_for(s, 1, False, km.split_front_options("fring3x4")[0])
    with pytest.raises(ValueError, match="shared memory"):
        km.front_key_for(s, 1, False, km.split_front_options("fring4x4")[0])


def test_tail_ring_geometry_variants():
    """'tringRxS[cN]': the one-token tail ring with R rows per slot, S slots and N CTAs per SM; parsed, tagged in the
    variant name, built ahead of time at TP8 for each of TAIL_RING_GEOMETRIES; refused where two CTAs do not fit
    an SM."""
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_tail_ring as tr
    s = km.shapes_for_tp(8)
    assert km.split_front_options("tring4x3c2") == (dict(tail_ring=True, tail_ring_geometry=(4, 3, 2)), None)
    built = tr.TAIL_RING.aot_keys("sm_90a")
    for g in tr.TAIL_RING_GEOMETRIES:
        key = tr.tail_ring_key(s, g)
        assert key in built and (key.rows_per_stage, key.stages, key.ctas_per_sm) == g
        assert key.geometry_tag == "{}x{}".format(*g) + (f"c{g[2]}" if g[2] > 1 else "")
        assert tr.tail_ring_smem_bytes(key) <= tr.SMEM_MAX
        assert key.ctas_per_sm * (tr.tail_ring_smem_bytes(key) + tr.CTA_RESERVED_SMEM) <= tr.SM_SMEM
    with pytest.raises(ValueError, match="CTAs per SM"):
        tr.tail_ring_key(s, (4, 7, 2))


def test_two_ctas_per_sm_ring_keys_fit_an_sm(compiler):
    """The ring geometries with two CTAs per SM ('tring4x3c2', 'tring2x7c2', 'fring2x3c2') fit two CTAs in the SM's
    registers (ptxas's count, allocated per warp in units of 256) and shared memory, without spilling."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_front_ring as fr
    from kimi_decode.kernels import moe_tail_ring as tr
    s = km.shapes_for_tp(8)
    keys = [(tr.tail_ring_key(s, g), g[0] + 1, tr.tail_ring_smem_bytes) for g in tr.TAIL_RING_GEOMETRIES if g[2] == 2]
    keys += [(fr.front_ring_key(s, g), g[0] + 1 + fr.ROUTE_WARPS, fr.front_ring_smem_bytes)
             for g in fr.RING_GEOMETRIES if len(g) == 3]
    assert len(keys) == 3 and all(k.ctas_per_sm == 2 for k, _, _ in keys)
    for key, warps, smem in keys:
        use = kc.resource_usage(key)
        assert use["LOCAL"] == 0 and use["STACK"] == 0, (key, use)
        per_warp = -(-use["REG"] * 32 // 256) * 256
        assert 2 * warps * per_warp <= tr.SM_REGISTERS, (key.geometry_tag, use["REG"], warps)
        assert 2 * (smem(key) + use["SHARED"] + tr.CTA_RESERVED_SMEM) <= tr.SM_SMEM, key.geometry_tag


@pytest.mark.gpu
def test_tail_ring_geometry_refuses_cotail_before_any_build(w8, monkeypatch):
    from kimi_decode import compile as kc
    from kimi_decode.moe_bench import moe_input
    x = moe_input(1, D, seed=5, device="cuda")
    monkeypatch.setattr(kc, "load", lambda key: pytest.fail(f"built {key} before refusing"))
    for v in ("tring4x3c2-cotail", "tring4x3c2-tringco"):
        with pytest.raises(ValueError, match="cannot go with cotail or tringco"):
            FusedMoE(w8, x, variant=v)


def test_cotail_keys_parse_and_are_built_ahead_of_time():
    """'cotail' (a front option) and 'downmax1' (moe_down staged for one token): parsed, named, compiled ahead of
    time at TP8; moe_down at one token and the cotail tail ring fit one SM's shared memory together."""
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    from kimi_decode.kernels import moe_tail_ring as tr
    s = km.shapes_for_tp(8)
    assert km.split_front_options("cotail-run35") == (dict(co_tail=True), "run35")
    assert km.split_front_options("tringco") == (dict(co_tail_ring_only=True), None)
    assert kp.parse_pipe_variant("downmax1") == ({}, dict(max_tokens=1))
    down = kp.MoEDownPipeKey(s, max_tokens=1)
    assert kp.pipe_variant_name(kp.MoEUpPipeKey(s), down) == "downmax1" and kp.down_pipe_capacity(down) == 1
    assert down in kp.DOWN_PIPE.aot_keys("sm_90a")
    tail = tr.cotail_key(s)
    assert (tail.rows_per_stage, tail.stages, tail.r_packed, tail.pdl) == (2, 8, True, True)
    assert tail in tr.TAIL_RING.aot_keys("sm_90a")
    static = 1024  # each kernel's static shared memory (cuobjdump, test_cotail_fits_beside_moe_down)
    both = kp.down_pipe_smem_bytes(down) + tr.tail_ring_smem_bytes(tail) + 2 * (static + tr.CTA_RESERVED_SMEM)
    assert both <= tr.SM_SMEM, both
    assert kp.down_pipe_smem_bytes(kp.MoEDownPipeKey(s)) + tr.tail_ring_smem_bytes(tail) > tr.SM_SMEM, \
        "moe_down staged for 8 tokens leaves no room: the reason for downmax1"
    with pytest.raises(ValueError, match="pipelined-kernel variant"):
        kp.parse_pipe_variant("downmax9")


def test_cotail_fits_beside_moe_down(compiler):
    """The registers and shared memory of moe_down at one token and of the cotail tail ring, as ptxas built them,
    fit one SM together (65536 registers, allocated per warp in units of 256; 228 KB of shared memory with 1 KB
    kept per CTA), and neither spills; the cotail ring's r stays packed (the plain unpack is hoisted into 112
    fp32 registers)."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    from kimi_decode.kernels import moe_tail_ring as tr
    s = km.shapes_for_tp(8)
    down, tail = kp.MoEDownPipeKey(s, max_tokens=1), tr.cotail_key(s)
    ud, ut = kc.resource_usage(down), kc.resource_usage(tail)
    for u in (ud, ut):
        assert u["LOCAL"] == 0 and u["STACK"] == 0, u
    down_warps = down.warps * down.ksplit + 1 + kp.FLUSH_WARPS  # compute, producer, flush warps
    tail_warps = tail.rows_per_stage + 1

    def per_warp(regs):
        return -(-regs * 32 // 256) * 256

    regs = down_warps * per_warp(ud["REG"]) + tail_warps * per_warp(ut["REG"])
    assert regs <= tr.SM_REGISTERS, (ud, ut, regs)
    assert ut["REG"] < 112, ut
    smem = (kp.down_pipe_smem_bytes(down) + tr.tail_ring_smem_bytes(tail) + ud["SHARED"] + ut["SHARED"]
            + 2 * tr.CTA_RESERVED_SMEM)
    assert smem <= tr.SM_SMEM, smem


@pytest.mark.gpu
def test_cotail_refuses_what_it_cannot_go_with(w8):
    from kimi_decode.moe_bench import moe_input
    x = moe_input(1, D, seed=3, device="cuda")
    for variant, kw in (("cotail-tring0", {}), ("cotail", dict(pdl=False)), ("cotail", dict(experts="pipe-up"))):
        with pytest.raises(ValueError, match="cotail"):
            FusedMoE(w8, x, variant=variant, **kw)


def test_front_ring_key_checks_and_builds(compiler):
    """The one-token ring front (`moe_front_ring`): the consumer warps' x in shared memory (no spills), the ring
    within the SM's shared memory, the routing warps on their own named barrier, the router-row counter's atomic;
    built ahead of time at TP8 and TP16; bad shapes are refused before any build."""
    import re

    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_front_ring as fr
    for tp in (8, 16):
        assert fr.MoEFrontRingKey(km.shapes_for_tp(tp)) in fr.FRONT_RING.aot_keys("sm_90a")
    key = fr.MoEFrontRingKey(km.shapes_for_tp(8))
    assert fr.front_ring_smem_bytes(key) <= fr.SMEM_MAX
    use = kc.resource_usage(key)
    assert use["LOCAL"] == 0 and use["STACK"] == 0, use
    ptx = kc.ptx_text(key)
    assert "cp.async.bulk.shared::cluster.global" in ptx and "mbarrier.try_wait" in ptx
    assert "atom.global.acq_rel.add" in ptx, "the router-row counter"
    assert re.search(rf"bar(?:rier)?\.sync(?:\.aligned)?\s+{fr.ROUTE_BARRIER},", ptx), "the routing warps' barrier"
    with pytest.raises(ValueError, match="must divide"):
        fr.MoEFrontRingKey(km.shapes_for_tp(8), rows_per_stage=3)
    with pytest.raises(ValueError, match="shared memory"):
        fr.MoEFrontRingKey(km.shapes_for_tp(8), stages=4)


def test_tail_ring_key_checks_and_builds(compiler):
    """The one-token tail ring (`moe_tail_ring`): one bulk copy per slot of whole rows, a full and an empty mbarrier
    per slot, r held in registers without spilling, its ring within the SM's shared memory; built ahead of time at
    TP8 and TP16, with and without PDL; bad shapes are refused before any build."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_tail_ring as tr
    for tp in (8, 16):
        for p in (True, False):
            assert tr.MoETailRingKey(km.shapes_for_tp(tp), pdl=p) in tr.TAIL_RING.aot_keys("sm_90a")
    key = tr.MoETailRingKey(km.shapes_for_tp(8))
    assert tr.tail_ring_smem_bytes(key) <= tr.SMEM_MAX
    use = kc.resource_usage(key)
    assert use["LOCAL"] == 0 and use["STACK"] == 0 and use["REG"] <= 255, use
    ptx = kc.ptx_text(key)
    assert "cp.async.bulk.shared::cluster.global" in ptx and "mbarrier.try_wait" in ptx
    assert ptx.count("griddepcontrol.wait") == 1
    with pytest.raises(ValueError, match="must divide"):
        tr.MoETailRingKey(km.shapes_for_tp(8), rows_per_stage=5)
    with pytest.raises(ValueError, match="shared memory"):
        tr.MoETailRingKey(km.shapes_for_tp(8), stages=9)
    assert km.split_front_options("tring0-skeys0") == (dict(tail_ring=False, smem_keys=False), None)


def test_front_occupancy_option_parses_and_refuses_bad_counts():
    from kimi_decode.kernels import moe as km
    from kimi_decode.moe_bench import make_moe_executor
    assert km.split_front_options("focc12-run35") == (dict(min_ctas=12), "run35")
    assert km.split_front_options("cand0-focc8") == (dict(candidates=False, min_ctas=8), None)
    assert km.split_front_options("run35-focc8") == (dict(min_ctas=8), "run35")
    assert km.split_front_options("focc12") == (dict(min_ctas=12), None)
    assert km.split_front_options(None) == ({}, None)
    for bad in ("focc0", "focc17"):
        with pytest.raises(ValueError, match="resident front CTAs"):
            km.split_front_options(bad)
    make_moe_executor("fused@focc12-run35")  # the executor name parses before any GPU work
    with pytest.raises(ValueError):
        make_moe_executor("fused@focc12-nonsense")


def test_front_occupancy_builds_cap_registers_and_are_built_ahead_of_time(compiler):
    """'skeys' (the plain one-token front with its routing keys in shared memory) is built for FRONT_SKEYS_CTAS CTAs
    of 128 threads per SM: the registers fall from 128 (the keys in registers) to 48, the GEMV path (before the
    router counter's atomic) does not spill, and the logit loads are issued before the sigmoids' first call."""
    import re

    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    s = km.shapes_for_tp(8)
    assert kc.resource_usage(km.front_key_for(s, 1, False)[0])["REG"] > 65536 // (5 * 128)
    key = km.front_key_for(s, 1, False, {"smem_keys": True})[0]
    n = km.FRONT_SKEYS_CTAS
    assert key.smem_keys and key.min_ctas == n and key in km.FRONT.aot_keys("sm_90a")
    assert f".minnctapersm {n}" in kc.ptx_text(key)
    regs = kc.resource_usage(key)["REG"]
    assert regs * 128 * n <= 65536, (n, regs)
    ops = re.findall(r"\b(LDG\.E(?:\.\w+)*|CALL\.REL\S*|ATOM\S*|STL\S*|LDL\S*)", kc.sass_text(key))
    first_atom = next(i for i, op in enumerate(ops) if op.startswith("ATOM"))
    assert not [op for op in ops[:first_atom] if op[:3] in ("STL", "LDL")], "the GEMV path spills"
    assert sum(op == "LDG.E.128" for op in ops[:first_atom]) >= 7  # the GEMV's row loads come first
    first_call = next(i for i, op in enumerate(ops) if op.startswith("CALL"))
    assert sum(op == "LDG.E" for op in ops[first_atom:first_call]) >= km.E // 32


def test_moe_down_prologue_arms_one_mbarrier_per_round_trip(compiler):
    """moe_down's prologue has two bulk round trips (routing tables, then a and a_shared) with no CTA barrier
    between: each has its own mbarrier, waited on at phase 0, so that no thread can re-arm a barrier another
    thread has not yet seen complete."""
    import re

    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    key = kp.MoEDownPipeKey(km.shapes_for_tp(8))
    ptx = kc.ptx_text(key)
    assert ptx.count("mbarrier.init") == key.stages + 2
    off = kp.MoEDownPipeKey(km.shapes_for_tp(8), prologue=False)
    assert kc.ptx_text(off).count("mbarrier.init") == off.stages
    assert re.search(r"mbarrier\.try_wait\.parity[^;]*\], 0,", ptx)
    assert not re.search(r"mbarrier\.try_wait\.parity[^;]*\], 1,", ptx)  # no wait on a literal phase 1


def test_config_sizes_match_the_kernels():
    from kimi_decode.kernels import moe as km
    cfg = KimiK3Config()
    assert (km.E, km.L, km.D, km.TOPK) == (cfg.num_experts, cfg.routed_expert_hidden_size, cfg.hidden_size,
                                           cfg.num_experts_per_token)


def test_launch_prefix_runs_the_first_k_launches():
    """The in-graph breakdown times executors cut after their k-th launch."""
    from kimi_decode.moe_bench import _LaunchPrefix
    from kimi_decode.stock.launch import Launch

    ran = []

    class Ex:
        def launches(self):
            return [Launch(f"l{i}", "op", "k", 1, 1, 0, run=lambda i=i: ran.append(i)) for i in range(4)]

    p = _LaunchPrefix(Ex(), 2)
    p()
    assert ran == [0, 1] and [l.label for l in p.launches()] == ["l0", "l1"]


def test_moe_executor_names():
    from kimi_decode.moe_bench import make_moe_executor
    for name in ("stock", "fused", "fused5", "fused-nopdl", "fused-pdl", "fused-direct", "fused-pipeup",
                 "fused-direct@w4r2-w4r4e2s8", "fused@pf0-tail0"):
        assert callable(make_moe_executor(name))
    with pytest.raises(ValueError, match="w4r2-w4r4e4s4"):
        make_moe_executor("fused-direct@fast")
    with pytest.raises(ValueError, match="pf1-tail2048"):
        make_moe_executor("fused@w4r2-w4r4e2s8")
    with pytest.raises(ValueError, match="variants apply to fused-direct"):
        make_moe_executor("fused5@pf0-tail0")
    with pytest.raises(ValueError, match="must be one of"):
        make_moe_executor("marlin")


@pytest.mark.gpu
def test_breakdown_adds_up_to_the_whole_graph(w8):
    from kimi_decode.moe_bench import run_moe_breakdown
    df = run_moe_breakdown(["fused"], 8, [1], replays=20)
    assert list(df.launch) == [1, 2, 3, 4] and df.check_ok.all()
    assert abs(df.added_us.sum() - df.prefix_us.iloc[-1]) < 1e-6
    assert (df.prefix_us > 0).all()


def test_cute_kernel_set_refuses_a_cpu_state(tiny_cfg):
    from kimi_decode.config import DecodeShape
    from kimi_decode.cute_kernels import CuteKernelSet
    from kimi_decode.executors import EXECUTORS, make_executor
    from kimi_decode.state import make_decode_state
    assert "cute-kernels" in EXECUTORS and make_executor("cute-kernels") is CuteKernelSet
    sh = ShardSpec(tp=2, cfg=tiny_cfg)
    w = make_layer_weights("kda_moe", sh, seed=1)
    with pytest.raises(ValueError, match="CUDA device"):
        CuteKernelSet(w, make_decode_state("kda_moe", sh, DecodeShape(1, 1, 5), seed=1))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_cute_kernel_set_matches_torch(batch):
    """Every launch of the profiler's CuTe kernel set computes: the GEMVs against torch.mm in fp32."""
    from kimi_decode.config import DecodeShape
    from kimi_decode.cute_kernels import CuteKernelSet
    from kimi_decode.state import make_decode_state
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    sh = ShardSpec(tp=8)
    w = make_layer_weights("kda_moe", sh, seed=2).to("cuda")
    ks = CuteKernelSet(w, make_decode_state("kda_moe", sh, DecodeShape(batch, 1, 64), seed=2, device="cuda"))
    for x, wt, out in ks.gemv_operands:
        out.fill_(float("nan"))
    ks()
    torch.cuda.synchronize()
    assert len(ks.launches()) == 8
    assert torch.isfinite(ks.y_attn).all() and torch.isfinite(ks.y_mlp).all()
    for x, wt, out in ks.gemv_operands:
        ref = x.float() @ wt.float().t()
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)



def test_pipelined_kernels_fit_in_shared_memory_at_tp8_and_tp16():
    from kimi_decode.kernels import moe_pipe as kp
    from kimi_decode.kernels.moe import shapes_for_tp
    for tp in (8, 16):
        s = shapes_for_tp(tp)
        assert kp.up_pipe_smem_bytes(kp.MoEUpPipeKey(s)) <= kp.SMEM_BUDGET
        assert kp.down_pipe_smem_bytes(kp.MoEDownPipeKey(s)) <= kp.SMEM_BUDGET


def test_expert_kernels_are_chosen_by_token_count_and_mode():
    """Up to 8 tokens the pipelined expert kernels, above the wide ones; 'pipe-up' keeps the direct down;
    'direct' everywhere; variants only for the direct kernels; too many tokens for a variant refused."""
    from kimi_decode.fused_moe import expert_kernel_keys
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)

    def kinds(n, **kw):
        up, down, name = expert_kernel_keys(s, n, **kw)
        return type(up).__name__, type(down).__name__, name

    assert kinds(1) == ("MoEUpPipeKey", "MoEDownPipeKey", "pipe")
    assert kinds(kp.PIPE_MAX_M) == ("MoEUpPipeKey", "MoEDownPipeKey", "pipe")
    assert kinds(kp.PIPE_MAX_M + 1) == ("MoEUpWideKey", "MoEDownWideKey", "wide")
    assert kinds(km.MAX_M) == ("MoEUpWideKey", "MoEDownWideKey", "wide")
    assert kinds(km.MAX_M, experts="direct")[:2] == ("MoEUpKey", "MoEDownKey")
    assert kinds(4, experts="pipe-up") == ("MoEUpPipeKey", "MoEDownKey", "pipe-up")
    assert kinds(1, experts="direct")[:2] == ("MoEUpKey", "MoEDownKey")
    assert kinds(1, experts="direct", variant="w4r2-w4r8e2s8")[2] == "w4r2-w4r8e2s8"
    with pytest.raises(ValueError, match="experts must be one of"):
        expert_kernel_keys(s, 1, experts="fast")
    with pytest.raises(ValueError, match="pf1-tail2048"):  # a direct launch shape given to the pipelined kernels
        expert_kernel_keys(s, 1, variant="w4r2-w4r8e2s8")
    with pytest.raises(ValueError, match="variants apply to"):
        expert_kernel_keys(s, 1, experts="pipe-up", variant="pf0-tail0")
    up, down, name = expert_kernel_keys(s, 1, variant="pf1-tail1024")
    assert (up.prefetch_down, down.prefetch_tail_rows, name) == (True, 1024, "pipe@pf1-tail1024")
    assert kinds(kp.PIPE_MAX_M + 1, variant="pf0-tail0")[:2] == ("MoEUpWideKey", "MoEDownWideKey")  # pipelined only
    with pytest.raises(UnsupportedConfiguration, match="1..192"):
        expert_kernel_keys(s, 256, experts="direct", variant="w4r2-w4r16e2s4")


def test_late_trigger_and_async_flush_options(compiler):
    """'late' moves moe_down's launch_dependents after its staging (the same instructions otherwise); 'aflush'
    flushes row blocks on the producer warp (a bar.arrive on barrier 1 that the compute warps sync on, the same
    mma count, its own r² buffer) and needs that warp."""
    import re

    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    with pytest.raises(ValueError, match="producer warp"):
        kp.parse_pipe_variant("aflush-prod0")
    assert kp.MoEDownPipeKey.late_trigger and not kp.MoEDownPipeKey.async_flush  # the defaults since run 22
    for v, name in (("late0", "late0"), ("aflush", "aflush"), ("late0-aflush", "late0-aflush"),
                    ("late1-aflush0", "default")):
        u, d = kp.parse_pipe_variant(v)
        down = kp.MoEDownPipeKey(s, **d)
        assert kp.pipe_variant_name(kp.MoEUpPipeKey(s, **u), down) == name
    base, late, afl = (kp.MoEDownPipeKey(s, late_trigger=False, flush_warp=False), kp.MoEDownPipeKey(s),
                       kp.MoEDownPipeKey(s, late_trigger=False, async_flush=True, flush_warp=False))
    assert kp.down_pipe_smem_bytes(afl) == kp.down_pipe_smem_bytes(base) + 4 * kp.PIPE_MAX_M * base.rows_per_item

    def ptx(key):
        return kc.ptx_text(key)

    def count(text, what):
        return len(re.findall(re.escape(what), text))

    pb, pl, pa = ptx(base), ptx(late), ptx(afl)
    assert count(pl, "griddepcontrol.launch_dependents") == count(pb, "griddepcontrol.launch_dependents") == 1
    assert pb.index("griddepcontrol.launch_dependents") < pb.index("griddepcontrol.wait")
    assert pl.index("griddepcontrol.launch_dependents") > pl.index("griddepcontrol.wait")
    assert count(pa, "mma.sync") == count(pb, "mma.sync")
    assert count(pa, "barrier.arrive") + count(pa, "bar.arrive") >= 1 and count(pb, "bar.arrive") == 0
    for key in (late, afl):
        assert kc.resource_usage(key)["STACK"] == 0, key


def test_item_rate_options(compiler):
    """upwN gives moe_up N compute warps (28: one super-block each), dec2 the pair decode with fewer integer-ALU
    shifts (same bits, tests/test_mxfp4.py), pad one bulk copy per ring row, downk2 splits moe_down's K over two
    warps per row group (dec2, pad and downk2 are the defaults since run 23; run20 turns them off); each parses,
    names itself back, fits the shared memory, keeps the mma count per item and does not spill."""
    import re

    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    for bad in ("upw5", "downk3", "dec4"):
        with pytest.raises(ValueError, match="pipelined-kernel variant"):
            kp.parse_pipe_variant(bad)
    u, d = kp.parse_pipe_variant("upw28")
    up, down = kp.MoEUpPipeKey(s, **u), kp.MoEDownPipeKey(s, **d)
    assert (up.warps, up.decode, up.pad_rows, down.decode, down.ksplit) == (28, 3, True, 3, 2)
    assert kp.pipe_variant_name(up, down) == "upw28"
    u, d = kp.parse_pipe_variant("run20-upw28")
    assert kp.pipe_variant_name(kp.MoEUpPipeKey(s, **u), kp.MoEDownPipeKey(s, **d)) == "upw28-dec1-pad0-pair0-late0-downk1-fwarp0"
    assert kp.up_pipe_smem_bytes(up) <= kp.SMEM_BUDGET and kp.down_pipe_smem_bytes(down) <= kp.SMEM_BUDGET

    def count(key, what):
        return len(re.findall(re.escape(what), kc.ptx_text(key)))

    base_up = kp.MoEUpPipeKey(s, decode=1, pad_rows=False)  # the run-20 kernels
    base_down = kp.MoEDownPipeKey(s, decode=1, ksplit=1, late_trigger=False)
    down = kp.MoEDownPipeKey(s)
    assert count(up, "mma.sync") * 2 == count(base_up, "mma.sync")  # one super-block per warp instead of two
    assert count(down, "mma.sync") == count(base_down, "mma.sync")  # the two K halves' code paths
    assert re.search(r"bar(rier)?\.sync(\.aligned)?\s+2,", kc.ptx_text(down))  # the K halves meet on barrier 2
    pad = kp.MoEUpPipeKey(s, decode=1)  # a bulk copy per ring row: 8 each for W1 and W3 instead of 1
    extra = count(pad, "cp.async.bulk.shared") - count(base_up, "cp.async.bulk.shared")  # 14 more at each issue site
    assert extra > 0 and extra % (2 * kp.RB_UP - 2) == 0
    assert kp.up_pipe_smem_bytes(pad) == kp.up_pipe_smem_bytes(base_up) + base_up.stages * 2 * kp.RB_UP * kp.UP_ROW_PAD * 4
    dec = kp.MoEUpPipeKey(s, pad_rows=False)
    assert count(dec, "shr.b32") < count(base_up, "shr.b32") and count(dec, "mma.sync") == count(base_up, "mma.sync")
    for key in (up, down, dec, pad):
        assert kc.resource_usage(key)["STACK"] == 0, key


def test_f16_option_compiles_with_native_f16_mma(compiler):
    """f16 (an option, off): moe_up's codes placed as E4M3 (no packed multiplies), unpacked to f16 pairs by cvt and fed
    to f16 mma.sync m16n8k16, two chained per 32-code group (2 super-blocks × 4 groups × 2 per warp), the scale applied
    per group by FFMA; z staged in f16; it needs the merged prologue and whole super-blocks; the SASS has f16 HMMA and
    no emulated fp8 mma; no spill; the shared memory fits."""
    import re

    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    u, d = kp.parse_pipe_variant("f16")
    up = kp.MoEUpPipeKey(s, **u)
    assert up.fp16 and kp.pipe_variant_name(up, kp.MoEDownPipeKey(s, **d)) == "f16"
    assert up.row_pad == kp.UP_ROW_PAD_F16 and kp.MoEUpPipeKey(s).row_pad == kp.UP_ROW_PAD
    for bad in ("f16-pro0", "f16-bal"):
        with pytest.raises(ValueError, match="f16"):
            kp.parse_pipe_variant(bad)
    ptx = kc.ptx_text(up)
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16", ptx)) == 2 * 4 * 2
    assert "mul.rn.bf16x2" not in ptx and "e4m3.e4m3" not in ptx
    assert len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)) == 2 * 4 * 4 * 2
    sass = kc._cuobjdump_of(up, "-sass")
    assert len(re.findall(r"HMMA\.16816\.F32 ", sass)) == 2 * 4 * 2
    res = kc.resource_usage(up)
    assert res["STACK"] == 0 and res["LOCAL"] == 0
    assert kp.up_pipe_smem_bytes(up) + res["SHARED"] <= 227 * 1024


def test_paired_extras_split_covers_every_item_once(compiler):
    """pair (the default since run 35): moe_down's balanced split gives the expert extras to CTAs 0..R_e - 1 and the shared
    extras to the CTAs after them, so that no CTA takes both while another takes neither (batch 1: at most 7 items
    a CTA instead of 8); the split (`paired_split`, which the kernel mirrors) covers each item once; no spill."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    G = kp.MoEDownPipeKey(s).ctas
    for ne, nsh in ((448, 448), (3052, 448), (896, 448), (28, 224), (0, 448)):
        runs = [kp.paired_split(bx, ne, nsh, G) for bx in range(G)]
        e = sorted(r[0] for r in runs)
        sh = sorted(r[1] for r in runs)
        for spans, total in ((e, ne), (sh, nsh)):
            assert spans[0][0] == 0 and spans[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        both = sum(1 for (a, b) in runs if a[1] - a[0] > ne // G and b[1] - b[0] > nsh // G)
        assert both == max(0, ne % G + nsh % G - G), (ne, nsh, both)
    assert max(sum(r[1] - r[0] for r in kp.paired_split(bx, 448, 448, G)) for bx in range(G)) == 7
    down, old = kp.MoEDownPipeKey(s), kp.MoEDownPipeKey(s, **kp.parse_pipe_variant("pair0-fwarp0")[1])
    assert down.pair_extras and not old.pair_extras  # the default since run 35
    assert kp.pipe_variant_name(kp.MoEUpPipeKey(s), old) == "run27"
    assert kc.resource_usage(down)["STACK"] == 0


def test_lazy_flush_option_compiles(compiler):
    """lazy (an option, off): moe_down's row-block flush keeps its red.adds at the row block's end and defers the
    fence, the counter's atomic and the all-reduce read to after the next item (or the CTA's last), with the
    all-reduce's r² in its own scratch; it does not go with aflush; no spill; the shared memory fits."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    u, d = kp.parse_pipe_variant("lazy")
    down = kp.MoEDownPipeKey(s, **d)
    assert down.lazy_flush and down.pair_extras and kp.pipe_variant_name(kp.MoEUpPipeKey(s, **u), down) == "lazy"
    ptx, base = kc.ptx_text(down), kc.ptx_text(kp.MoEDownPipeKey(s, flush_warp=False))
    # the counter's atomic where a flush completes: after an expert item, after a shared item, after the last item
    assert ptx.count("atom.global.acq_rel.add") == 3 and base.count("atom.global.acq_rel.add") == 1
    res = kc.resource_usage(down)
    assert res["STACK"] == 0 and res["LOCAL"] == 0
    assert kp.down_pipe_smem_bytes(down) + res["SHARED"] <= 227 * 1024


def test_flush_warp_option_compiles_with_its_own_barriers(compiler):
    """fwarp (the default since run 39): moe_down gets FLUSH_WARPS more warps that flush the finished row blocks and do their
    all-reduce reads; the other warps meet on named barrier 3 (not the CTA-wide barrier 0, which the flush warps
    no longer reach after the staging) and hand row blocks over on barriers 4/5 (arrive) and take the emptied
    half back on 6/7, by parity; the row-block sum is double-buffered; lazy and aflush turn it off and refuse it
    spelled out; no spill; the shared memory fits, at TP8 and TP16."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    u, d = kp.parse_pipe_variant("fwarp")
    assert u == {} and d == dict(flush_warp=True) and kp.MoEDownPipeKey.flush_warp
    for bad in ("fwarp-lazy", "fwarp-aflush"):
        with pytest.raises(ValueError, match="fwarp"):
            kp.parse_pipe_variant(bad)
    assert kp.parse_pipe_variant("lazy")[1] == dict(lazy_flush=True, flush_warp=False)
    for tp in (8, 16):
        s = km.shapes_for_tp(tp)
        down, base = kp.MoEDownPipeKey(s, **d), kp.MoEDownPipeKey(s, flush_warp=False)
        assert kp.pipe_variant_name(kp.MoEUpPipeKey(s), down) == "default"
        assert kp.pipe_variant_name(kp.MoEUpPipeKey(s), base) == "run35"
        ptx = kc.ptx_text(down)
        threads = 32 * (2 * base.warps + 1)  # compute warps (K split in two) and the producer warp
        assert re.search(rf"bar\.sync\s+3, {threads};", ptx)
        for bar, how in ((4, "arrive"), (5, "arrive"), (6, "sync"), (7, "sync")):  # the other warps' side
            assert re.search(rf"bar\.{how}\s+{bar}, {threads + 32 * kp.FLUSH_WARPS};", ptx), (tp, bar)
        for bar, how in ((4, "sync"), (5, "sync"), (6, "arrive"), (7, "arrive")):  # the flush warp's side
            assert re.search(rf"bar\.{how}\s+{bar}, {threads + 32 * kp.FLUSH_WARPS};", ptx), (tp, bar)
        assert ptx.count("atom.global.acq_rel.add") == 1  # one counter atomic, now on the flush warps
        assert kp.down_pipe_smem_bytes(down) - kp.down_pipe_smem_bytes(base) == 4 * kp.PIPE_MAX_M * down.rows_per_item
        res = kc.resource_usage(down)
        assert res["STACK"] == 0 and res["LOCAL"] == 0
        assert kp.down_pipe_smem_bytes(down) + res["SHARED"] <= 227 * 1024


@pytest.mark.parametrize("nact", [1, 16, 32, 109, 128])
def test_flush_warp_row_blocks_add_up_to_every_expert_once(nact):
    """The flush warp's row blocks and item counts (`row_block_flushes`, the device's arithmetic): over the CTAs
    of the paired split, each row block's counts add up to its active experts, so exactly one CTA completes it;
    the flush warp takes as many row blocks as the other warps hand over (one per row-block end in the run)."""
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    nbd = km.L // kp.MoEDownPipeKey(km.shapes_for_tp(8)).rows_per_item
    ne, nsh, g = nbd * nact, km.D // 16, kp.H200_SMS
    got = [0] * nbd
    for bx in range(g):
        (lo, hi), _ = kp.paired_split(bx, ne, nsh, g)
        fl = kp.row_block_flushes(lo, hi, nact)
        ends = sum(1 for k in range(lo, hi) if k + 1 == hi or (k + 1) // nact != k // nact)
        assert len(fl) == ends
        for rb, mine in fl:
            assert mine >= 1
            got[rb] += mine
    assert got == [nact] * nbd


def test_spin_option_polls_the_slot_mbarriers(compiler):
    """spin (an option, off): the compute warps of moe_up and moe_down wait for their slots with a
    mbarrier.test_wait loop (no suspend) instead of try_wait; upspin / downspin one kernel only; no spill."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    assert kp.parse_pipe_variant("spin") == (dict(spin_wait=True), dict(spin_wait=True))
    for v in ("spin", "upspin", "downspin"):
        u, d = kp.parse_pipe_variant(v)
        assert kp.pipe_variant_name(kp.MoEUpPipeKey(s, **u), kp.MoEDownPipeKey(s, **d)) == v
    for make in (kp.MoEUpPipeKey, kp.MoEDownPipeKey):
        assert "mbarrier.test_wait" not in kc.ptx_text(make(s))
        key = make(s, spin_wait=True)
        assert "mbarrier.test_wait.parity.shared::cta.b64" in kc.ptx_text(key)
        assert kc.resource_usage(key)["STACK"] == 0


def test_fewer_token_build_makes_room_for_a_fifth_moe_up_slot(compiler):
    """upst5-upmax4 (an option): moe_up staged for at most 4 tokens has room for 5 ring slots (with 8 tokens 5 do
    not fit); the executor refuses more tokens than the build holds, before any launch; no spill."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    u, d = kp.parse_pipe_variant("upst5-upmax4")
    assert u == dict(stages=5, max_tokens=4) and d == {}
    key = kp.MoEUpPipeKey(s, **u)
    assert kp.pipe_variant_name(key, kp.MoEDownPipeKey(s)) == "upst5-upmax4"
    assert kp.up_pipe_smem_bytes(key) <= kp.SMEM_BUDGET < kp.up_pipe_smem_bytes(kp.MoEUpPipeKey(s, stages=5))
    assert kc.resource_usage(key)["STACK"] == 0
    from kimi_decode.fused_moe import expert_kernel_keys
    assert expert_kernel_keys(s, 4, variant="upst5-upmax4")[0] == key
    with pytest.raises(UnsupportedConfiguration, match="expert kernels hold"):
        expert_kernel_keys(s, 5, variant="upst5-upmax4")


def test_proxy_fence_option_drops_only_the_refill_fences(compiler):
    """fence0 (an option): no fence.proxy.async (ptxas: MEMBAR.ALL.CTA, which waits for the issuing thread's own
    global stores) before moe_up's and moe_down's ring refills; upfence0 / downfence0 one kernel only."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    assert kp.parse_pipe_variant("fence0") == (dict(proxy_fence=False), dict(proxy_fence=False))
    assert kp.parse_pipe_variant("downfence0") == ({}, dict(proxy_fence=False))
    for v in ("fence0", "upfence0", "downfence0"):
        u, d = kp.parse_pipe_variant(v)
        assert kp.pipe_variant_name(kp.MoEUpPipeKey(s, **u), kp.MoEDownPipeKey(s, **d)) == v
    for make in (kp.MoEUpPipeKey, kp.MoEDownPipeKey):
        assert "fence.proxy.async" in kc.ptx_text(make(s))
        assert "fence.proxy.async" not in kc.ptx_text(make(s, proxy_fence=False))


def test_z_swizzle_puts_a_quarter_warps_b_loads_on_distinct_banks(compiler):
    """zswz (an option, off): moe_up's 16-byte B loads (lane (g, c) of a quarter warp reads chunk 16 sb + 4c + bb of
    its token's z row) hit 32 distinct banks with the swizzled chunks and 4-word row padding, for one token or two;
    unswizzled they share banks 2 ways (one token) and 4 ways (two tokens). The staging and the loads use the same
    `z_chunk`; it refuses f16 and pro0; no spill; the shared memory fits."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp

    def worst_conflict(swizzle, tokens):
        row = kp.L // 2 + (kp.Z_SWIZZLE_PAD if swizzle else 0)
        worst = 1
        for sb in range(kp.L // kp.SB):
            for bb in range(4):
                for q in range(4):  # the quarter warps: lanes 8q .. 8q + 7, rows g = 2q, 2q + 1
                    banks = {}
                    for lane in range(8 * q, 8 * q + 8):
                        g, c = lane // 4, lane % 4
                        t = min(g, tokens - 1)
                        start = t * row + 4 * kp.z_chunk(16 * sb + 4 * c + bb, swizzle)
                        for w in range(start, start + 4):
                            banks.setdefault(w % 32, set()).add(w)
                    worst = max(worst, max(len(v) for v in banks.values()))
        return worst

    assert (worst_conflict(False, 1), worst_conflict(False, 8)) == (2, 4)
    assert (worst_conflict(True, 1), worst_conflict(True, 8)) == (1, 1)
    for j in range(kp.L // 8):  # a permutation of the chunks
        assert kp.z_chunk(kp.z_chunk(j, True), True) == j and kp.z_chunk(j, True) < kp.L // 8
    s = km.shapes_for_tp(8)
    for bad in ("zswz-f16", "zswz-pro0"):
        with pytest.raises(ValueError, match="zswz"):
            kp.parse_pipe_variant(bad)
    u, d = kp.parse_pipe_variant("zswz")
    up = kp.MoEUpPipeKey(s, **u)
    assert up.z_swizzle and kp.pipe_variant_name(up, kp.MoEDownPipeKey(s, **d)) == "zswz"
    res = kc.resource_usage(up)
    assert res["STACK"] == 0 and res["LOCAL"] == 0
    assert kp.up_pipe_smem_bytes(up) + res["SHARED"] <= 227 * 1024


def test_dflag_handshake_parses_names_and_compiles(compiler):
    """'dflag': moe_up's CTAs count themselves done (a gpu-scope fence, then a release add on meta[DONE_FLAG]) and
    moe_down's thread 0 polls that counter with acquire loads instead of griddepcontrol.wait, then orders its bulk
    copies of a after it (fence.proxy.async); the last CTA past it re-arms both words. Parsed into both keys,
    named, built ahead of time with and without PDL, no spills."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    assert kp.parse_pipe_variant("dflag") == (dict(done_flag=1), dict(flag_wait=True))
    assert kp.parse_pipe_variant("dflagt") == (dict(done_flag=2), dict(flag_wait=True))
    assert kp.parse_pipe_variant("dflag0") == (dict(done_flag=0), dict(flag_wait=False))
    down = kp.MoEDownPipeKey(s, flag_wait=True)
    for mode, name in ((1, "dflag"), (2, "dflagt")):
        up = kp.MoEUpPipeKey(s, done_flag=mode)
        assert kp.pipe_variant_name(up, down) == name and kp.parse_pipe_variant(name)[0]["done_flag"] == mode
        for p in (True, False):
            assert kp.MoEUpPipeKey(s, done_flag=mode, pdl=p) in kp.UP_PIPE.aot_keys("sm_90a")
        up_ptx = kc.ptx_text(up)
        assert up_ptx.count("atom.global.release.add.u32") == 1 and up_ptx.count("fence.acq_rel.gpu") == 1
        res = kc.resource_usage(up)
        assert res["STACK"] == 0 and res["LOCAL"] == 0, (up, res)
    for p in (True, False):
        assert kp.MoEDownPipeKey(s, flag_wait=True, pdl=p) in kp.DOWN_PIPE.aot_keys("sm_90a")
    # dflagt: thread 0 alone fences, after the CTA barrier (the fence sits under the tid == 0 branch)
    t_ptx = kc.ptx_text(kp.MoEUpPipeKey(s, done_flag=2))
    tail = t_ptx[t_ptx.rindex("bar.sync"):]
    assert "fence.acq_rel.gpu" in tail and "atom.global.release.add.u32" in tail
    f_ptx = kc.ptx_text(kp.MoEUpPipeKey(s, done_flag=1))
    assert "fence.acq_rel.gpu" not in f_ptx[f_ptx.rindex("bar.sync"):]
    up, down_ptx = kp.MoEUpPipeKey(s, done_flag=1), kc.ptx_text(down)
    assert "atom.global.release" not in kc.ptx_text(kp.MoEUpPipeKey(s))
    assert "ld.acquire.gpu.global.b32" in down_ptx and "fence.proxy.async.global" in down_ptx
    assert "griddepcontrol.wait" not in down_ptx and "griddepcontrol.wait" in kc.ptx_text(kp.MoEDownPipeKey(s))
    res = kc.resource_usage(down)
    assert res["STACK"] == 0 and res["LOCAL"] == 0, (down, res)


def test_dflag_needs_both_pipelined_kernels():
    """The handshake is one option of both kernels: the parser cannot set one side alone, and the executor
    refuses moe_up and moe_down keys that disagree or differ in CTA count (before any launch)."""
    from kimi_decode.fused_moe import check_flag_handshake
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    check_flag_handshake(kp.MoEUpPipeKey(s, done_flag=1), kp.MoEDownPipeKey(s, flag_wait=True))
    check_flag_handshake(kp.MoEUpPipeKey(s), kp.MoEDownPipeKey(s))
    with pytest.raises(ValueError, match="dflag"):
        check_flag_handshake(kp.MoEUpPipeKey(s), kp.MoEDownPipeKey(s, flag_wait=True))
    with pytest.raises(ValueError, match="dflag"):
        check_flag_handshake(kp.MoEUpPipeKey(s, done_flag=2, ctas=66), kp.MoEDownPipeKey(s, flag_wait=True))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dflag", "dflagt"])
@pytest.mark.parametrize("n", [1, 8])
def test_dflag_steps_rearm_the_counter_and_match_the_default(w8, n, variant):
    """Three steps in a row with 'dflag': each gives the default's output up to summation order, and after
    each the handshake's two words of meta are back at 0 (re-armed by the last moe_down CTA)."""
    from kimi_decode.moe_bench import moe_input
    x = moe_input(n, D, seed=200 + n, device="cuda")
    a, b = FusedMoE(w8, x, variant=variant), FusedMoE(w8, x)
    assert variant in a.variant, a.variant
    _three_steps_rearm_the_counter_and_match(a, b)


def test_sfirst_runs_shared_items_before_the_wait(compiler):
    """'sfirst': moe_down computes a_shared from the front's fp32 output (tanh of the SiTU in its prologue), requests
    its whole ring and runs its shared items before waiting for moe_up; the wait (and a fallback for a CTA without
    expert items or the flush warps) comes at its first expert item, and a_shared is no longer bulk-copied.
    Parsed, named, built ahead of time with and without PDL (and as a timeline build), no spills."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    assert kp.parse_pipe_variant("sfirst") == ({}, dict(shared_first=1))
    assert kp.parse_pipe_variant("sfirst2") == ({}, dict(shared_first=2))
    key = kp.MoEDownPipeKey(s, shared_first=1)
    assert kp.pipe_variant_name(kp.MoEUpPipeKey(s), key) == "sfirst"
    assert kp.pipe_variant_name(kp.MoEUpPipeKey(s), kp.MoEDownPipeKey(s, shared_first=2)) == "sfirst2"
    for mode in (1, 2):
        for p in (True, False):
            assert kp.MoEDownPipeKey(s, shared_first=mode, pdl=p) in kp.DOWN_PIPE.aot_keys("sm_90a")
    # sfirst2: one ring slot before a_shared's SiTU (as the default), a's copy issued once (by the first flush warp)
    ptx, base, two = (kc.ptx_text(k) for k in (key, kp.MoEDownPipeKey(s), kp.MoEDownPipeKey(s, shared_first=2)))
    assert two.count("griddepcontrol.wait") == 2
    assert two.count("cp.async.bulk.shared::cluster.global") == base.count("cp.async.bulk.shared::cluster.global") - 1
    assert ptx.count("griddepcontrol.wait") == 2 and base.count("griddepcontrol.wait") == 1
    assert "tanh.approx" in ptx or "ex2.approx" in ptx  # the SiTU, computed here
    # the bulk copies of the prologue: a_shared's is gone (a and the routing tables remain)
    assert ptx.count("cp.async.bulk.shared::cluster.global") == base.count("cp.async.bulk.shared::cluster.global") - 1
    res = kc.resource_usage(key)
    assert res["STACK"] == 0 and res["LOCAL"] == 0, res
    with pytest.raises(AssertionError, match="sfirst"):
        kc.ptx_text(kp.MoEDownPipeKey(s, shared_first=2, flush_warp=False))


def test_uflag_and_fpdl_parse_name_and_compile(compiler):
    """'uflagN': the front's routing CTA sets meta[ROUTED_FLAG] after a CTA barrier and a gpu-scope fence (release
    store); moe_up's thread 0 polls it with acquire loads before griddepcontrol.wait and requests up to N ring slots
    (z in the last, as zlast); moe_down clears it after its wait. 'fpdl': the one-token front loads its weight rows
    before griddepcontrol.wait (launched as a programmatic dependent) and the tail ring triggers its dependents at
    its start. Parsed, named, built ahead of time (the front at every m_tile with the flag), no spills."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    from kimi_decode.kernels.moe_tail_ring import TAIL_RING, tail_ring_key
    s = km.shapes_for_tp(8)
    assert kp.parse_pipe_variant("uflag1") == (dict(route_early=1, z_last=True), dict(route_reset=True))
    assert kp.parse_pipe_variant("uflag3")[0]["route_early"] == 3
    up, down = kp.MoEUpPipeKey(s, route_early=1, z_last=True), kp.MoEDownPipeKey(s, route_reset=True)
    assert kp.pipe_variant_name(up, down) == "uflag1"
    assert km.split_front_options("fpdl-uflag1") == ({"front_pdl": True}, "uflag1")
    for p in (True, False):
        assert kp.MoEUpPipeKey(s, route_early=3, z_last=True, pdl=p) in kp.UP_PIPE.aot_keys("sm_90a")
        assert kp.MoEDownPipeKey(s, route_reset=True, pdl=p) in kp.DOWN_PIPE.aot_keys("sm_90a")
        assert kp.MoEUpPipeKey(s, route_early=1, z_last=True, pdl=p, trace=True) in kp.UP_PIPE.aot_keys("sm_90a")
    fronts = km.FRONT.aot_keys("sm_90a")
    for m in (1, 2, 3, 8):
        assert km.front_key_for(s, m, False, {}, route_flag=True)[0] in fronts, m
    fpdl, tags = km.front_key_for(s, 1, False, {"front_pdl": True}, route_flag=True)
    assert fpdl.pdl and fpdl.route_flag and tags == ["fpdl"] and fpdl in fronts
    assert not km.front_key_for(s, 2, False, {"front_pdl": True})[0].pdl  # one token only
    assert tail_ring_key(s, trigger=True) in TAIL_RING.aot_keys("sm_90a")
    with pytest.raises(ValueError, match="uflag"):
        km.front_key_for(s, 1, True, {}, route_flag=True)
    with pytest.raises(ValueError, match="uflag"):
        km.front_key_for(s, 1, False, {"front_ring": True}, route_flag=True)
    # the front: the flag after the routing's last barrier, behind a fence; with fpdl a wait after the row's loads
    base, flagged = kc.ptx_text(km.front_key_for(s, 1, False, {})[0]), kc.ptx_text(fpdl)
    assert "st.release.gpu" not in base and "griddepcontrol.wait" not in base
    tail = flagged[flagged.rindex("bar.sync"):]
    assert "fence.acq_rel.gpu" in tail and "st.release.gpu.global.b32" in tail
    wait = flagged.index("griddepcontrol.wait")
    assert flagged[:wait].count("ld.global") >= 7  # the CTA's weight row (7 chunks a lane) before the wait
    # moe_up: the acquire poll and the early slots' bulk copies before the wait; moe_down: the clear after it
    u_ptx = kc.ptx_text(up)
    wait = u_ptx.index("griddepcontrol.wait")
    assert "ld.acquire.gpu" in u_ptx[:wait] and "cp.async.bulk.shared::cluster.global" in u_ptx[:wait]
    assert "ld.acquire.gpu" not in kc.ptx_text(kp.MoEUpPipeKey(s, z_last=True))
    d_ptx, d_base = kc.ptx_text(down), kc.ptx_text(kp.MoEDownPipeKey(s))
    assert d_ptx.count("st.global.b32") == d_base.count("st.global.b32") + 1
    t_ptx, t_base = kc.ptx_text(tail_ring_key(s, trigger=True)), kc.ptx_text(tail_ring_key(s))
    assert "griddepcontrol.launch_dependents" in t_ptx and "griddepcontrol.launch_dependents" not in t_base
    for key in (fpdl, up, down, tail_ring_key(s, trigger=True)):
        res = kc.resource_usage(key)
        assert res["STACK"] == 0 and res["LOCAL"] == 0, (key, res)
    with pytest.raises(AssertionError, match="zlast"):
        kc.ptx_text(kp.MoEUpPipeKey(s, route_early=1))


def test_uflag_needs_both_pipelined_kernels():
    """moe_up polling the routing flag without moe_down clearing it (or the reverse) is refused before any launch:
    a flag never cleared lets the next step's moe_up read the previous routing."""
    from kimi_decode.fused_moe import check_flag_handshake
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    check_flag_handshake(kp.MoEUpPipeKey(s, route_early=1, z_last=True), kp.MoEDownPipeKey(s, route_reset=True))
    with pytest.raises(ValueError, match="uflag"):
        check_flag_handshake(kp.MoEUpPipeKey(s, route_early=1, z_last=True), kp.MoEDownPipeKey(s))
    with pytest.raises(ValueError, match="uflag"):
        check_flag_handshake(kp.MoEUpPipeKey(s), kp.MoEDownPipeKey(s, route_reset=True))
    with pytest.raises(ValueError, match="same word"):  # meta[2] is dflag's counter or uflag's flag
        check_flag_handshake(kp.MoEUpPipeKey(s, route_early=1, z_last=True, done_flag=2),
                             kp.MoEDownPipeKey(s, route_reset=True, flag_wait=True))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["uflag1", "uflag3", "fpdl", "fpdl-uflag1"])
@pytest.mark.parametrize("n", [1, 8])
def test_uflag_and_fpdl_steps_match_the_default_and_clear_the_flag(w8, n, variant):
    """Three steps in a row with 'uflagN' / 'fpdl': each gives the default's output up to summation order, and
    after each the routing flag is back at 0 (cleared by moe_down); fpdl applies at one token only."""
    from kimi_decode.kernels import moe as km
    from kimi_decode.moe_bench import moe_input
    x = moe_input(n, D, seed=210 + n, device="cuda")
    a, b = FusedMoE(w8, x, variant=variant), FusedMoE(w8, x)
    assert ("fpdl+" in a.variant) == ("fpdl" in variant and n == 1), a.variant
    b()
    for _ in range(3):
        a.h.fill_(float("nan"))
        a()
        torch.cuda.synchronize()
        assert a.meta[km.ROUTED_FLAG].item() == 0
        _same_up_to_summation_order(a.h, b.h)


def test_merge_parses_names_and_builds_one_launch(compiler):
    """'merge': moe_up and moe_down as two phases of one persistent launch (`MoEExpertsPipeKey`), met on dflagt's
    counter. Parsed, named, built ahead of time at TP8 with and without PDL; the kernel holds both phases' mma and
    bulk copies, retires moe_up's ring and prologue mbarriers, waits on the counter with an acquire poll instead of a
    second griddepcontrol.wait, and lets the tail be scheduled only after that wait; one CTA per SM fits (registers
    at moe_down's 672 threads, shared memory the larger phase's), no spills."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    assert kp.parse_pipe_variant("merge") == (dict(done_flag=2), dict(flag_wait=True, merged=True))
    up_kw, down_kw = kp.parse_pipe_variant("merge-downearly3")
    up, down = kp.MoEUpPipeKey(s, **up_kw), kp.MoEDownPipeKey(s, **down_kw)
    assert kp.pipe_variant_name(up, down) == "merge-downearly3"
    key = kp.MoEExpertsPipeKey(up, down)
    assert key in kp.EXPERTS_PIPE.aot_keys("sm_90a") and len(kp.EXPERTS_PIPE.aot_keys("sm_90a")) == \
        2 * len(kp.MERGE_VARIANTS) + 2  # with and without PDL; merge's 2 timeline builds
    tail = kp.parse_pipe_variant("merge-tail2048")[1]  # run 69's other prefetch forms: built with --tuning only
    assert tail["prefetch_tail_rows"] == 2048 and kp.MoEExpertsPipeKey(
        kp.MoEUpPipeKey(s, **up_kw), kp.MoEDownPipeKey(s, **tail)) in kp.EXPERTS_PIPE.tuning_keys("sm_90a")
    assert not set(kp.EXPERTS_PIPE.tuning_keys("sm_90a")) & set(kp.EXPERTS_PIPE.aot_keys("sm_90a"))
    assert len(kp.EXPERTS_PIPE.tuning_keys("sm_90a")) == 2 * len(kp.MERGE_HISTORY_VARIANTS)
    assert kp.MoEDownPipeKey(s, prefetch_tail_rows=2048) in kp.DOWN_PIPE.aot_keys("sm_90a")
    assert key.up_phase.merged_threads == down.threads == 32 * (16 + 1 + kp.FLUSH_WARPS)
    assert kp.experts_pipe_smem_bytes(key) == max(kp.up_pipe_smem_bytes(up), kp.down_pipe_smem_bytes(down))
    assert kp.experts_pipe_smem_bytes(key) <= kp.SMEM_BUDGET
    ptx = kc.ptx_text(key)
    sep_up, sep_down = kc.ptx_text(kp.MoEUpPipeKey(s, done_flag=2)), kc.ptx_text(kp.MoEDownPipeKey(s, flag_wait=True))
    for what in ("mma.sync", "cp.async.bulk.shared::cluster.global"):
        assert ptx.count(what) == sep_up.count(what) + sep_down.count(what) - (
            4 if what.startswith("cp.async") else 0), what  # moe_down's phase keeps the tables moe_up staged (4 copies)
    assert ptx.count("mbarrier.inval") == up.stages + 1  # moe_up's ring and its prologue's mbarrier
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    assert ptx.index("atom.global.release.add") < ptx.index("ld.acquire.gpu") < \
        ptx.index("griddepcontrol.launch_dependents")  # the tail only once every CTA has counted itself
    assert "griddepcontrol" not in kc.ptx_text(kp.MoEExpertsPipeKey(kp.MoEUpPipeKey(s, pdl=False, **up_kw),
                                                                      kp.MoEDownPipeKey(s, pdl=False, **down_kw)))
    res = kc.resource_usage(key)
    assert res["STACK"] == 0 and res["LOCAL"] == 0, res
    assert (down.threads // 32) * -(-res["REG"] * 32 // 256) * 256 <= 65536, res


def test_l2_hints_put_priorities_on_the_ring_copies_and_the_tail_prefetch(compiler):
    """'l2h': every weight copy of both rings carries an evict_first policy and the tail's prefetch (tailN) evict_last;
    the routing tables, z and a stay plain (every CTA reads them). The same copies as without it, no spills, and the
    options parse, name themselves and are built ahead of time (plain and merged)."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    for v in ("l2h", "tail2048-l2h", "tail3584-l2h", "merge-tail3584-l2h"):
        up_kw, down_kw = kp.parse_pipe_variant(v)
        assert up_kw["l2_hints"] and down_kw["l2_hints"]
        assert kp.pipe_variant_name(kp.MoEUpPipeKey(s, **up_kw), kp.MoEDownPipeKey(s, **down_kw)) == v
        assert v in kp.AOT_VARIANTS + kp.MERGE_VARIANTS
    copy, first, last = "cp.async.bulk.shared::cluster.global", "L2::evict_first", "L2::evict_last"
    hinted_copy = "complete_tx::bytes.L2::cache_hint"
    for plain_key, key in ((kp.MoEUpPipeKey(s), kp.MoEUpPipeKey(s, l2_hints=True)),
                           (kp.MoEDownPipeKey(s, prefetch_tail_rows=2048),
                            kp.MoEDownPipeKey(s, prefetch_tail_rows=2048, l2_hints=True))):
        plain, ptx = kc.ptx_text(plain_key), kc.ptx_text(key)
        assert ptx.count(copy) == plain.count(copy) and "cache_hint" not in plain
        hinted = ptx.count(hinted_copy)
        assert hinted == ptx.count(first) > 0, (hinted, ptx.count(first))  # one policy per hinted copy
        assert ptx.count(copy) - hinted >= 4  # the tables' copies (and z's, a's) stay plain
        if isinstance(key, kp.MoEDownPipeKey):
            assert ptx.count(last) == 1 and ptx.count("cp.async.bulk.prefetch.L2.global.L2::cache_hint") == 1
            assert ptx.count("cp.async.bulk.prefetch.L2.global [") == 0  # no unhinted prefetch left
        else:
            assert ptx.count(last) == 0
        res, plain_res = kc.resource_usage(key), kc.resource_usage(plain_key)
        assert res["STACK"] == 0 and res["LOCAL"] == 0 and res["REG"] <= plain_res["REG"] + 8, (res, plain_res)
    assert "evict_last" not in kc.ptx_text(kp.MoEDownPipeKey(s, l2_hints=True))  # no tailN: nothing to keep


def test_down_argument_names_cover_the_stand_ins(compiler):
    """The merged kernel picks moe_down's arguments by name: one name per stand-in (the stream last), and the picks
    are the routing weights, all-reduce coefficients, counters, r, shared buffers, norm weight, W_up and timeline."""
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    assert len(km.expert_down_args(s, 28)) == len(km.DOWN_ARG_NAMES) + 1
    args = kp.down_pipe_args(s, 28)
    assert len(args) == len(kp.DOWN_PIPE_ARG_NAMES) + 1
    assert len(set(kp.DOWN_PIPE_ARG_NAMES)) == len(kp.DOWN_PIPE_ARG_NAMES)
    picked = [args[kp.DOWN_PIPE_ARG_NAMES.index(n)] for n in kp.MERGED_DOWN_ARGS]
    assert [a.shape[-1] for a in picked[4:7]] == [km.D, km.L, km.L]  # sh [tp, m, D], norm [1, L], W_up [D, L]
    assert picked[-1] is args[-2]  # the timeline buffer, just before the stream


def test_merged_key_refuses_phases_that_do_not_meet():
    """The merged key needs dflagt's counter on both sides and phases that agree (refused when the key is made,
    before any build); a moe_down phase without the counter's wait is refused when built."""
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    up, down = kp.MoEUpPipeKey(s, done_flag=2), kp.MoEDownPipeKey(s, flag_wait=True, merged=True)
    kp.MoEExpertsPipeKey(up, down)
    with pytest.raises(ValueError, match="dflagt"):
        kp.MoEExpertsPipeKey(kp.MoEUpPipeKey(s, done_flag=1), down)
    with pytest.raises(ValueError, match="dflagt"):
        kp.MoEExpertsPipeKey(up, kp.MoEDownPipeKey(s, flag_wait=True))
    with pytest.raises(ValueError, match="agree"):
        kp.MoEExpertsPipeKey(kp.MoEUpPipeKey(s, done_flag=2, pdl=False), down)
    with pytest.raises(ValueError, match="agree"):
        kp.MoEExpertsPipeKey(kp.MoEUpPipeKey(s, done_flag=2, max_tokens=4), down)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["merge", "merge-downearly3", "merge-tail3584-l2h"])
@pytest.mark.parametrize("batch, tokens", [(1, 1), (2, 1), (1, 3), (8, 1), (1, 8)])
def test_merged_expert_kernel_matches_the_reference(w8, variant, batch, tokens):
    """The merged expert kernel gives the reference at every token count the pipelined kernels take, in three
    launches (front, experts, tail), every output element written."""
    from kimi_decode.moe_bench import check_moe, moe_input
    x = moe_input(batch * tokens, D, seed=300 + batch * tokens, device="cuda")
    r = check_moe(lambda w, xx: FusedMoE(w, xx, variant=variant), w8, x)
    assert r["all_written"] and r["check_ok"], r
    ex = FusedMoE(w8, x, variant=variant)
    assert [lc.label for lc in ex.launches()] == ["moe.front", "moe.experts", "moe.tail"]
    assert "moe_experts_pipe" in ex.kernels_used and "moe_up_pipe" not in ex.kernels_used


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["same", "disjoint"])
def test_merged_expert_kernel_with_shared_and_disjoint_experts(w8, routing):
    """Every token on the same 16 experts, and 8 tokens on 128 experts none of them share."""
    import dataclasses

    from kimi_decode.moe_bench import check_moe, moe_input
    if routing == "same":
        x, w = moe_input(1, D, seed=7, device="cuda").repeat(8, 1), w8
    else:
        x = moe_input(8, D, seed=11, device="cuda")
        gate = (0.01 * w8.moe.gate.float()).to(torch.bfloat16)
        xn = x.float() / x.float().norm(dim=1, keepdim=True)
        gate[:128] = (0.5 * xn.repeat_interleave(16, 0)).to(torch.bfloat16)
        w = dataclasses.replace(w8, moe=dataclasses.replace(
            w8.moe, gate=gate, e_score_correction_bias=torch.zeros_like(w8.moe.e_score_correction_bias)))
    r = check_moe(lambda ww, xx: FusedMoE(ww, xx, variant="merge"), w, x)
    assert r["all_written"] and r["check_ok"], r
    assert r["active_experts"] == (16 if routing == "same" else 128)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8])
def test_merged_steps_rearm_the_counter_and_match_the_default(w8, n):
    """Three merged steps in a row (also under a CUDA graph): each gives the default's output up to summation order,
    and after each the counter's two words of meta are back at 0 (re-armed by the last CTA past it)."""
    from kimi_decode.bench import time_graph
    from kimi_decode.kernels import moe_pipe as kp
    from kimi_decode.moe_bench import moe_input
    x = moe_input(n, D, seed=320 + n, device="cuda")
    a, b = FusedMoE(w8, x, variant="merge"), FusedMoE(w8, x)
    _three_steps_rearm_the_counter_and_match(a, b)
    a.h.fill_(float("nan"))
    t = time_graph([a], replays=5)
    assert t.kernels_per_layer == 3
    assert a.meta[kp.DONE_FLAG].item() == 0 and a.meta[kp.PASS_COUNT].item() == 0
    _same_up_to_summation_order(a.h, b.h)


@pytest.mark.gpu
def test_merged_expert_kernel_refuses_a_device_with_fewer_sms(w8, monkeypatch):
    """Its CTAs wait for each other on the counter: on fewer SMs than CTAs some would never start (a hang), so the
    executor refuses before loading or launching anything."""
    import types

    from kimi_decode import compile as kc
    from kimi_decode.moe_bench import moe_input
    x = moe_input(1, D, seed=5, device="cuda")
    real = torch.cuda.get_device_properties(x.device)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: types.SimpleNamespace(multi_processor_count=114, name=real.name,
                                                             major=real.major, minor=real.minor))
    monkeypatch.setattr(kc, "load", lambda key: pytest.fail(f"loaded {key} before refusing"))
    with pytest.raises(UnsupportedConfiguration, match="SMs for the merged expert kernel"):
        FusedMoE(w8, x, variant="merge")


def test_merged_expert_kernel_has_a_timeline_build(compiler):
    """'merge' with trace: both phases record their checkpoints (moe_up's into trace_up, moe_down's into trace_down),
    built ahead of time with and without PDL, no spills; phases that disagree on trace are refused."""
    import dataclasses

    from kimi_decode import compile as kc
    from kimi_decode.fused_moe import expert_kernel_keys
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    s = km.shapes_for_tp(8)
    up, down, name = expert_kernel_keys(s, 1, variant="merge", trace=True)
    assert down.merged and up.done_flag == 2 and up.trace and down.trace and name == "pipe@merge"
    key = kp.MoEExpertsPipeKey(up, down)
    assert key in kp.EXPERTS_PIPE.aot_keys("sm_90a")
    plain = kp.MoEExpertsPipeKey(kp.MoEUpPipeKey(s, done_flag=2), dataclasses.replace(down, trace=False))
    ptx, plain = kc.ptx_text(key), kc.ptx_text(plain)
    assert ptx.count("%globaltimer") > 0 and "%globaltimer" not in plain
    res = kc.resource_usage(key)
    assert res["STACK"] == 0 and res["LOCAL"] == 0, res
    with pytest.raises(ValueError, match="trace"):
        kp.MoEExpertsPipeKey(kp.MoEUpPipeKey(s, done_flag=2), down)


def test_wide_expert_kernels_are_chosen_above_eight_tokens_and_built_ahead_of_time():
    """Above PIPE_MAX_M tokens the default step takes the rings of `kernels/moe_wide.py` (items of up to 8 of an
    expert's tokens), up to MAX_M tokens; experts='direct' keeps the direct kernels. Every key a step can ask for is
    built ahead of time, and its shared memory fits a CTA."""
    from kimi_decode.fused_moe import expert_kernel_keys
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_pipe as kp
    from kimi_decode.kernels import moe_wide as mw
    built = mw.DOWN_WIDE.aot_keys("sm_90a") + mw.UP_WIDE.aot_keys("sm_90a")
    for tp in (8, 16):
        s = km.shapes_for_tp(tp)
        for m in (1, 8, 9, 17, 64, 512):
            for pdl in (True, False):
                up, down, name = expert_kernel_keys(s, m, pdl=pdl)
                if m <= kp.PIPE_MAX_M:
                    assert isinstance(down, kp.MoEDownPipeKey) and isinstance(up, kp.MoEUpPipeKey), m
                else:
                    assert (up, down, name) == (mw.MoEUpWideKey(s, pdl=pdl), mw.MoEDownWideKey(s, pdl=pdl), "wide")
                    # the kernel run 80 checked and timed at both TPs
                    assert (down.rows, down.stages, down.prefetch_ids, down.shared_tokens) == (256, 2, False, 16)
                    assert up in built and down in built, (tp, m, pdl)
                    assert mw.down_wide_smem_bytes(down) <= kp.SMEM_BUDGET
                    assert mw.up_wide_smem_bytes(up) <= kp.SMEM_BUDGET
                    assert km.L % down.rows_per_item == 0
                up, down, _ = expert_kernel_keys(s, m, experts="direct", pdl=pdl)
                assert isinstance(up, km.MoEUpKey) and isinstance(down, km.MoEDownKey)
    with pytest.raises(UnsupportedConfiguration):
        expert_kernel_keys(km.shapes_for_tp(8), km.MAX_M + 1)
    assert mw.MAX_CHUNKS == km.E + km.TOPK * km.MAX_M // mw.CHUNK


@pytest.mark.parametrize("tp", [8, 16])
def test_wide_expert_kernels_compile_without_spills(compiler, tp):
    """Both wide kernels compile for sm_90a: bulk copies into their rings, the MXFP4 decode into mma.sync, the chunk
    table's warp scan, moe_down's red.add into the latent partial; no local memory; their shared memory fits one CTA
    per SM."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_wide as mw
    for pdl in (False, True):
        for key, spec, size in ((mw.MoEDownWideKey(km.shapes_for_tp(tp), pdl=pdl), mw.DOWN_WIDE, mw.down_wide_smem_bytes),
                                (mw.MoEUpWideKey(km.shapes_for_tp(tp), pdl=pdl), mw.UP_WIDE, mw.up_wide_smem_bytes)):
            ptx = kc.ptx_text(key)
            for needle in spec.ptx_checks:
                assert needle in ptx, (key, needle)
            assert ("griddepcontrol.wait" in ptx) == pdl
            res = kc.resource_usage(key)
            assert res["STACK"] == 0 and res["LOCAL"] == 0, (key, res)
            assert size(key) + res["SHARED"] <= 227 * 1024


def test_wide_options_parse_name_and_are_built_ahead_of_time(compiler):
    """'wsync', 'wstN', 'wupstN', 'wdownstN' set the wide kernels' keys above 8 tokens (the rest of the variant goes to
    the pipelined kernels), round-trip through the variant name, and every AOT_WIDE_VARIANTS key is built; a ring
    that does not fit is refused before any build. The synchronous forms compile too."""
    from kimi_decode import compile as kc
    from kimi_decode.fused_moe import expert_kernel_keys
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_wide as mw
    assert mw.parse_wide_options("wsync-wupst4-pf1") == (dict(decoupled=False, stages=4), dict(decoupled=False), "pf1")
    assert mw.parse_wide_options("wdownc16") == ({}, dict(chunk=16), None)
    assert mw.parse_wide_options("wupc16") == (dict(chunk=16, stages=2), {}, None)  # its z takes a slot's room
    assert mw.parse_wide_options("wupc16-wdownc16") == (dict(chunk=16, stages=2), dict(chunk=16), None)
    with pytest.raises(ValueError, match="shared memory"):
        mw.parse_wide_options("wupc16-wupst3")
    with pytest.raises(ValueError, match="wzpar"):
        mw.parse_wide_options("wupc16-wzpar")
    with pytest.raises(ValueError, match="8 or 16"):
        mw.check_up_key(mw.MoEUpWideKey(km.shapes_for_tp(8), chunk=32, stages=2))
    assert mw.parse_wide_options("wdownr256") == ({}, dict(rows=256, stages=2), None)
    assert mw.parse_wide_options("wdownr128") == ({}, dict(rows=128, stages=3), None)
    assert mw.parse_wide_options("wdownr128-wdownst4-wdownsh8") == ({}, dict(rows=128, stages=4, shared_tokens=8), None)
    with pytest.raises(ValueError, match="shared memory"):  # 16-token shared items need more of a slot
        mw.parse_wide_options("wdownr128-wdownst4")
    assert (mw.MoEDownWideKey.rows, mw.MoEDownWideKey.stages) == (256, 2)
    assert mw.parse_wide_options("wdownpf-wdownpf0") == ({}, dict(prefetch_ids=False), None)
    assert mw.parse_wide_options("wzpar") == (dict(z_parallel=True), {}, None)
    assert mw.parse_wide_options("wzpar-wzpar0-pf1") == (dict(z_parallel=False), {}, "pf1")
    assert mw.MoEUpWideKey.z_parallel is False  # the row-by-row staging stays the default (run 79: 'wzpar' slower)
    assert mw.parse_wide_options("wdownsh8") == ({}, dict(shared_tokens=8), None)
    assert mw.parse_wide_options("wdownsh8-wdownsh16") == ({}, dict(shared_tokens=16), None)
    assert mw.MoEDownWideKey.shared_tokens == 16
    with pytest.raises(ValueError, match="tokens per shared item"):
        mw.check_key(mw.MoEDownWideKey(km.shapes_for_tp(8), shared_tokens=32))
    s16 = km.shapes_for_tp(16)
    for v in mw.AOT_WIDE_VARIANTS_TP16:  # built at TP16, and named back the same
        up16, down16, name16 = expert_kernel_keys(s16, 64, variant=v, pdl=False)
        assert name16 == f"wide@{v}" and down16 in mw.DOWN_WIDE.aot_keys("sm_90a"), (v, name16)
        assert up16 in mw.UP_WIDE.aot_keys("sm_90a"), (v, name16)
    assert mw.MoEDownWideKey(km.shapes_for_tp(8), rows=256).rows_per_item == 256
    assert mw.parse_wide_options(None) == ({}, {}, None)
    with pytest.raises(ValueError, match="shared memory"):
        mw.parse_wide_options("wdownst5")
    s = km.shapes_for_tp(8)
    built = mw.UP_WIDE.aot_keys("sm_90a") + mw.DOWN_WIDE.aot_keys("sm_90a")
    for v in mw.AOT_WIDE_VARIANTS:
        up, down, name = expert_kernel_keys(s, 64, variant=v, pdl=False)
        assert name == f"wide@{v}" and up in built and down in built, (v, name)
        assert mw.parse_wide_options(name.split("@")[1])[:2] == mw.parse_wide_options(v)[:2]
        assert expert_kernel_keys(s, 8, variant=v)[2] == "pipe"  # they apply above 8 tokens only
    for key in (mw.MoEUpWideKey(s, decoupled=False), mw.MoEDownWideKey(s, decoupled=False)):
        res = kc.resource_usage(key)
        assert res["STACK"] == 0 and res["LOCAL"] == 0, (key, res)
        assert "bar.arrive" not in kc.ptx_text(key)
    for key in (mw.MoEUpWideKey(s), mw.MoEDownWideKey(s)):  # the decoupled hand-over: named barriers' bar.arrive
        assert "bar.arrive" in kc.ptx_text(key)
    zpar = mw.MoEUpWideKey(s, z_parallel=True)  # all of a chunk's z loads in registers at once: no spills
    res = kc.resource_usage(zpar)
    assert res["STACK"] == 0 and res["LOCAL"] == 0, res
    # 'wupc16': an item's two super-blocks a warp against one column tile (16 mma) or, in a chunk of more than 8
    # tokens, two tiles from the same decode (32 mma, the decode's multiplies by the scales not doubled); no spills
    for tp in (8, 16):
        c16, c8 = mw.MoEUpWideKey(km.shapes_for_tp(tp), chunk=16, stages=2), mw.MoEUpWideKey(km.shapes_for_tp(tp))
        res = kc.resource_usage(c16)
        assert res["STACK"] == 0 and res["LOCAL"] == 0, res
        sass, sass8 = kc.sass_text(c16), kc.sass_text(c8)
        assert sass.count("HMMA") == 3 * sass8.count("HMMA") == 48
        assert sass.count("HMUL2") == 2 * sass8.count("HMUL2")
    res = kc.resource_usage(mw.MoEUpWideKey(s, chunk=16, stages=2, decoupled=False))  # 'wsync-wupc16' builds too
    assert res["STACK"] == 0 and res["LOCAL"] == 0, res


def test_wide_expert_kernels_refuse_bad_keys():
    from kimi_decode.kernels import moe as km
    from kimi_decode.kernels import moe_wide as mw
    s = km.shapes_for_tp(8)
    for check, make in ((mw.check_key, mw.MoEDownWideKey), (mw.check_up_key, mw.MoEUpWideKey)):
        with pytest.raises(ValueError, match="stages"):
            check(make(s, stages=1))
        with pytest.raises(ValueError, match="shared memory"):
            check(make(s, stages=6))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,same", [(9, False), (17, False), (64, False), (256, False), (512, False), (64, True),
                                         (512, True)])
def test_wide_expert_kernels_match_the_reference_and_the_direct_ones(w8, tokens, same):
    """The wide expert kernels (the default above 8 tokens) and the direct ones both give the reference; with every
    token on the same 16 experts (`same`) each expert has up to 64 chunks of 8 tokens, each reading the expert's rows
    again."""
    from kimi_decode.moe_bench import check_moe, moe_input
    if same:
        x = moe_input(1, D, seed=300, device="cuda").repeat(tokens, 1)
    else:
        x = moe_input(tokens, D, seed=310 + tokens, device="cuda")
    ex = FusedMoE(w8, x)
    assert ex.variant.endswith("wide") and "moe_up_wide+moe_down_wide" in ex.kernels_used, (ex.variant, ex.kernels_used)
    for experts in ("pipe", "direct"):
        r = check_moe(lambda w, xx: FusedMoE(w, xx, experts=experts), w8, x)
        assert r["all_written"] and r["check_ok"], (experts, r)
        if same:
            assert r["active_experts"] == 16, r


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["wsync", "wupst4", "wdownc16", "wdownr128-wdownsh8", "wdownsh8-wdownpf", "wdownpf",
                                     "wzpar", "wdownsh8", "wupc16", "wupc16-wdownc16"])
@pytest.mark.parametrize("tokens", [9, 64, 512])
def test_wide_options_match_the_reference(w8, variant, tokens):
    """The synchronous hand-over ('wsync'), moe_up's deeper ring ('wupst4'), moe_down's 16-token items ('wdownc16'), its
    128-row items with 8-token shared items ('wdownr128-wdownsh8', run 77's kernel), the next item's token ids and
    weights read ahead ('wdownpf', with 8-token shared items run 78's kernel), moe_up's z staged with its loads in
    flight ('wzpar'), moe_down's 8-token shared items ('wdownsh8', run 80's default) and moe_up's 16-token chunks
    ('wupc16', alone and with moe_down's) give the reference too."""
    from kimi_decode.moe_bench import check_moe, moe_input
    x = moe_input(tokens, D, seed=340 + tokens, device="cuda")
    assert FusedMoE(w8, x, variant=variant).variant.endswith(f"wide@{variant}")
    r = check_moe(lambda w, xx: FusedMoE(w, xx, variant=variant), w8, x)
    assert r["all_written"] and r["check_ok"], (variant, r)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,same", [(9, False), (64, False), (512, False), (64, True), (512, True)])
def test_wide_z_staged_in_parallel_gives_the_same_activations(w8, tokens, same):
    """moe_up (wide) staging each chunk's z with all its loads in flight ('wzpar') stages the same bf16 values in the
    same places for the chunk's tokens, so its output a (every (expert, token) pair's SiTU) equals the default's bit
    for bit, also where an expert has many chunks (`same`: every token on the same 16 experts) and with chunks of
    fewer than 8 tokens (9 tokens)."""
    a, b = _run_beside_the_default(w8, _wide_input(tokens, same, seed=360), "wzpar")
    ka, ra = _a_by_pair(a)
    kb, rb = _a_by_pair(b)
    assert torch.equal(ka, kb) and torch.isfinite(ra).all() and torch.equal(ra, rb)
    assert torch.equal(a.a_sh, b.a_sh)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,same", [(9, False), (64, False), (300, False), (512, False), (9, True), (20, True),
                                         (512, True)])
def test_wide_up_chunks_of_16_tokens_give_the_same_activations(w8, tokens, same):
    """moe_up (wide) with chunks of up to 16 tokens ('wupc16': one decode of an item's codes for two column tiles, the
    second only in a chunk of more than 8 tokens) computes every (expert, token) pair's SiTU with the same mma
    sequence as the 8-token chunks, so its a equals the default's bit for bit: with chunks of 1-16 tokens (random
    routings), of exactly 9 and 16 (every token on the same 16 experts: 9 tokens, 20 = 16 + 4, 512 = 32 × 16)."""
    a, b = _run_beside_the_default(w8, _wide_input(tokens, same, seed=365), "wupc16")  # a poisoned: all written
    counts = b.list[:int(b.meta[0]), 1]
    if tokens >= 300:  # distinct tokens in chunks of 9-16: the second tile's columns are the chunk's tokens 8..15
        assert ((counts > 8) & (counts <= 16)).any(), counts
    ka, ra = _a_by_pair(a)
    kb, rb = _a_by_pair(b)
    assert torch.equal(ka, kb) and torch.isfinite(ra).all() and torch.equal(ra, rb)
    assert torch.equal(a.a_sh, b.a_sh)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [9, 17, 64, 100, 512])
def test_wide_shared_items_of_16_tokens_give_the_same_shared_partial(w8, tokens):
    """moe_down (wide) with 16 tokens per shared item (the default since run 81: one A fragment against two token
    tiles) writes the rank's shared partial bit for bit as the 8-token items ('wdownsh8') do (each token's sum runs
    over the same warps in the same K order), at token counts that leave a short last tile (9, 17, 100) and at 512."""
    from kimi_decode.moe_bench import moe_input
    x = moe_input(tokens, D, seed=370 + tokens, device="cuda")
    a, b = FusedMoE(w8, x), FusedMoE(w8, x, variant="wdownsh8")
    assert b.variant.endswith("wide@wdownsh8") and a.variant.endswith("wide"), (a.variant, b.variant)
    for ex in (a, b):  # poisoned: every element must be written
        ex.sh[0].fill_(float("nan"))
    a(), b()
    torch.cuda.synchronize()
    assert torch.isfinite(a.sh[0][:tokens]).all() and torch.equal(a.sh[0][:tokens], b.sh[0][:tokens])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [17, 64])
def test_wide_expert_kernels_match_the_reference_tp16(tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kimi_decode.moe_bench import moe_input
    r = _check(_weights(16), moe_input(tokens, D, seed=320 + tokens, device="cuda"))
    assert r["all_written"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", AOT_WIDE_VARIANTS_TP16)
@pytest.mark.parametrize("tokens", [17, 64, 512])
def test_wide_options_match_the_reference_tp16(variant, tokens):
    """At TP16 the options built there (run 80's default, 8-token shared items with the read-ahead; moe_up's 16-token
    chunks) give the reference too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kimi_decode.moe_bench import check_moe, moe_input
    x = moe_input(tokens, D, seed=380 + tokens, device="cuda")
    w16 = _weights(16)
    assert FusedMoE(w16, x, variant=variant).variant.endswith(f"wide@{variant}")
    r = check_moe(lambda w, xx: FusedMoE(w, xx, variant=variant), w16, x)
    assert r["all_written"] and r["check_ok"], (variant, r)


@pytest.mark.gpu
def test_wide_expert_kernels_repeat_exactly(w8):
    """moe_down's counters re-arm: three steps in a row give the same output up to the red.adds' summation order."""
    from kimi_decode.moe_bench import moe_input
    ex = FusedMoE(w8, moe_input(64, D, seed=330, device="cuda"))
    ex()
    torch.cuda.synchronize()
    first = ex.h.clone()
    for _ in range(3):
        ex.h.fill_(float("nan"))
        ex()
        torch.cuda.synchronize()
        assert torch.isfinite(ex.h).all()
        _same_up_to_summation_order(first, ex.h)
    assert int(ex.cnt.abs().sum()) == 0


def test_spread_routing_is_the_default_parses_and_is_built_ahead_of_time(compiler):
    """Above 8 tokens the routing launch is spread over one CTA per 16 tokens (`MoERouteKey.spread`); 'rspread0'
    keeps the single CTA of before. Both are built ahead of time at TP8 (with and without PDL), the spread one at
    TP16 too, and the spread kernel holds its registers without spilling."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import moe as km
    assert km.MoERouteKey.spread is True
    assert km.split_front_options("rspread0") == (dict(route_spread=False), None)
    assert km.split_front_options("rspread-wsync") == (dict(route_spread=True), "wsync")
    keys = km.ROUTE.aot_keys("sm_90a")
    for p in (True, False):
        assert km.MoERouteKey(km.shapes_for_tp(8), spread=False, pdl=p) in keys
        for tp in (8, 16):
            assert km.MoERouteKey(km.shapes_for_tp(tp), pdl=p) in keys
    res = kc.resource_usage(km.MoERouteKey(km.shapes_for_tp(8)))
    assert res["STACK"] == 0 and res["LOCAL"] == 0, res


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [9, 33, 64, 512])
def test_spread_routing_equals_the_single_cta_routing_and_rearms(w8, tokens):
    """The spread routing launch (the default above 8 tokens) chooses what the single-CTA one ('rspread0') chooses:
    identical ids, weights, active experts and (offset, count) lists, the same tokens in each expert's list (their
    order within an expert is arrival order), and the same output up to summation order. Over three steps its
    per-expert counts and its CTA counter are back at zero after each."""
    from kimi_decode.moe_bench import moe_input
    x = moe_input(tokens, D, seed=360 + tokens, device="cuda")
    a, b = FusedMoE(w8, x), FusedMoE(w8, x, variant="rspread0")
    assert b.variant.startswith("rspread0+") and "rspread" not in a.variant, (a.variant, b.variant)
    b()
    for _ in range(3):
        a.h.fill_(float("nan"))
        a.tok.fill_(-1)
        a()
        torch.cuda.synchronize()
        assert int(a.route_cnt.abs().sum()) == 0 and int(a.meta[1]) == 0
        assert torch.equal(a.ids, b.ids) and torch.equal(a.wts, b.wts)
        n = int(a.meta[0])
        assert n == int(b.meta[0]) and torch.equal(a.act[:n], b.act[:n]) and torch.equal(a.list[:n], b.list[:n])
        for off, cnt in a.list[:n].tolist():
            assert torch.equal(a.tok[off:off + cnt].sort().values, b.tok[off:off + cnt].sort().values)
        _same_up_to_summation_order(a.h, b.h)


def test_mma_rows_option_parses_refuses_bad_tilings_and_is_built(compiler):
    """'mrowsR[wW]': the tensor-core front and tail at 64 tokens with R rows a CTA over W warps; only the 64-token
    tile takes it, rows must be a multiple of 16 dividing the GEMV's rows, and the built tilings compile without
    spills at TP8."""
    from kimi_decode import compile as kc
    from kimi_decode.kernels import gemv
    from kimi_decode.kernels import moe as km
    s = km.shapes_for_tp(8)
    assert km.split_front_options("mrows64w8-rspread0") == (dict(mma_rows=(64, 8), route_spread=False), None)
    front, tags = km.front_key_for(s, 64, True, {"mma_rows": (64, 8)})
    assert (front.mma_rows, front.mma_warps, tags) == (64, 8, ["mrows64w8"])
    assert km.front_key_for(s, 8, False, {"mma_rows": (64, 8)})[0].mma_rows == 0  # the 8-token tile keeps its tiling
    assert km.tail_key_for(s, 64, True, {"mma_rows": (64, 0)}).mma_rows == 64
    assert km.tail_key_for(s, 8, True, {"mma_rows": (64, 0)}).mma_rows == 0
    assert gemv.mma_tiling(64, True, 64, 8) == (64, 8, 1)
    with pytest.raises(ValueError, match="multiple of 16"):
        gemv.mma_tiling(64, True, 40)
    with pytest.raises(ValueError, match="m_tile above 16"):
        gemv.mma_tiling(8, True, 64)
    fronts, tails = km.FRONT.aot_keys("sm_90a"), km.TAIL.aot_keys("sm_90a")
    for rw in km.MMA_ROWS_BUILT:
        assert km.front_key_for(s, 64, True, {"mma_rows": rw})[0] in fronts
        for p in (True, False):
            assert km.tail_key_for(s, 64, p, {"mma_rows": rw}) in tails
    for key in (km.front_key_for(s, 64, True, {"mma_rows": (64, 8)})[0], km.tail_key_for(s, 64, True, {"mma_rows": (64, 8)})):
        res = kc.resource_usage(key)
        assert res["STACK"] == 0 and res["LOCAL"] == 0, (key, res)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["mrows64", "mrows64w8"])
@pytest.mark.parametrize("tokens", [9, 64])
def test_mma_rows_tilings_match_the_reference(w8, variant, tokens):
    from kimi_decode.moe_bench import check_moe, moe_input
    x = moe_input(tokens, D, seed=380 + tokens, device="cuda")
    assert FusedMoE(w8, x, variant=variant).variant.startswith(variant + "+")
    r = check_moe(lambda w, xx: FusedMoE(w, xx, variant=variant), w8, x)
    assert r["all_written"] and r["check_ok"], (variant, r)


def test_gemm_options_parse_and_their_kernels_are_built_ahead_of_time():
    """'fgemm' and 'tgemm' (the front / the tail as the shared-memory GEMM of kernels/gemm.py from 65 tokens) come out
    of a variant before the other options; the benchmark accepts them; their GEMMs are built at the front's and the
    tail's TP8 and TP16 shapes, at both CTA widths FusedMoE takes."""
    from kimi_decode import fused_moe as fm
    from kimi_decode.kernels import gemm as GM
    from kimi_decode.kernels import moe as km
    from kimi_decode.moe_bench import make_moe_executor
    assert fm.split_gemm_options("fgemm") == (True, False, None)
    assert fm.split_gemm_options("tgemm") == (False, True, None)
    assert fm.split_gemm_options("wdownsh8-fgemm-rspread0-tgemm") == (True, True, "wdownsh8-rspread0")
    assert fm.split_gemm_options("wzpar") == (False, False, "wzpar")
    assert fm.split_gemm_options(None) == (False, False, None)
    assert [fm.gemm_bm(n) for n in (65, fm.GEMM_BM128_ABOVE, fm.GEMM_BM128_ABOVE + 1, 512)] == [64, 64, 128, 128]
    for name in ("fused@fgemm", "fused@fgemm-wdownsh8", "fused@tgemm", "fused@fgemm-tgemm"):
        make_moe_executor(name)
    built = GM.aot_keys("sm_90a")
    for tp in (8, 16):
        s = km.shapes_for_tp(tp)
        for bm in (64, 128):
            assert GM.GemmKey(n=s.ncat, k=km.D, bm=bm) in built, (tp, bm)
            key = GM.tail_key(tp, bm, eps=s.eps)
            assert key in built and (key.k, key.n) == (km.L, km.D), (tp, bm)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fgemm", "tgemm", "fgemm-tgemm"])
@pytest.mark.parametrize("tokens", [64, 65, 100, 256, 257, 512])
def test_gemm_options_match_the_reference(w8, tokens, variant):
    """The MoE half with the front ('fgemm') and/or the tail ('tgemm') as the shared-memory GEMM (from 65 tokens; 64
    tokens a CTA up to 256, 128 above) gives the reference; at 64 tokens the options do not apply (the tensor-core
    GEMVs run, neither name in the variant)."""
    from kimi_decode.moe_bench import check_moe, moe_input
    x = moe_input(tokens, D, seed=390 + tokens, device="cuda")
    ex = FusedMoE(w8, x, variant=variant)
    applies = tokens >= 65
    used = ex.kernels_used.split("+")
    for part, at in (("fgemm", 0), ("tgemm", -1)):
        if part in variant:
            assert (part in ex.variant) == applies and (used[at] == "gemm") == applies, (ex.variant, used)
    r = check_moe(lambda w, xx: FusedMoE(w, xx, variant=variant), w8, x)
    assert r["all_written"] and r["check_ok"], r


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [65, 512])
def test_gemm_options_match_the_reference_at_tp16(tokens):
    """'fgemm-tgemm' at TP16: the front's 5248 rows, and the tail's epilogue reads 16 shared buffers."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kimi_decode.moe_bench import check_moe, moe_input
    w16 = _weights(16)
    x = moe_input(tokens, D, seed=395 + tokens, device="cuda")
    used = FusedMoE(w16, x, variant="fgemm-tgemm").kernels_used.split("+")
    assert used[0] == used[-1] == "gemm", used
    r = check_moe(lambda w, xx: FusedMoE(w, xx, variant="fgemm-tgemm"), w16, x)
    assert r["all_written"] and r["check_ok"], r
