"""The stock-vLLM schedule: its launch inventory (§9) and its output against the reference."""

import pytest
import torch

from kimi_decode.accuracy import all_written, routing_agreement, within_bf16_rule
from kimi_decode.cli import main
from kimi_decode.config import DecodeShape, ShardSpec
from kimi_decode.inventory import inventory
from kimi_decode.reference import Storage, decoder_layer
from kimi_decode.state import make_decode_state
from kimi_decode.stock.schedule import StockLayer
from kimi_decode.weights import make_layer_weights

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU the Triton kernels run compiled, not interpreted

# launches per layer, explained in docs/stock_schedule.md (§9: about 22 / 28 / 11 at TP8)
EXPECTED = {("kda_moe", 8): 22, ("mla_moe", 8): 29, ("dense", 8): 11,
            ("kda_moe", 16): 25, ("mla_moe", 16): 29, ("dense", 16): 14}


@pytest.mark.parametrize("layer,tp", sorted(EXPECTED))
def test_inventory_counts(layer, tp):
    df = inventory(layer, tp, DecodeShape(1, 1, 1024))
    assert len(df) == EXPECTED[(layer, tp)]
    assert df.label.is_unique and (df.bytes_read > 0).all()
    assert all(df.vllm_op.str.len() > 0)
    if layer != "dense":
        assert (df.label == "moe.experts_gemm1").sum() == 1


def test_inventory_bytes_cover_the_weights():
    """Every weight byte a layer must stream is read by some launch (GEMMs, experts, norms)."""
    from kimi_decode.byte_counts import layer_bytes
    for layer in ("dense", "kda_moe", "mla_moe"):
        df = inventory(layer, 8, DecodeShape(1, 1, 1024))
        assert df.bytes_read.sum() >= layer_bytes(layer, ShardSpec(tp=8)).weights_streamed


def test_inventory_cli(capsys):
    assert main(["inventory", "--layer", "kda_moe", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "total: 22 launches" in out and "fused_kda_decode" in out
    assert main(["inventory", "--layer", "kda_moe", "--tp", "4"]) == 2


def _check(cfg, kind, shape, kda_fused=None, tp=2, dcp=1, rank=0):
    sh = ShardSpec(tp=tp, rank=rank, dcp=dcp, cfg=cfg)
    w = make_layer_weights(kind, sh, seed=2).to(DEV)
    st = make_decode_state(kind, sh, shape, seed=2, device=DEV)
    ref = decoder_layer(w, st.clone())
    ref_bf = decoder_layer(w, st.clone(), storage=Storage.BF16)
    st2 = st.clone()
    layer = StockLayer(w, st2, kda_fused=kda_fused)
    layer()
    assert all_written(layer.h)
    keep = torch.ones(shape.num_tokens, dtype=torch.bool, device=DEV)
    if w.moe is not None:  # near-tied router scores may swap an expert: compare the other tokens
        keep, flips, flips_are_ties = routing_agreement(layer.routing[0], ref.x_mlp, w.moe, cfg)
        assert flips_are_ties and flips <= max(1, shape.num_tokens // 8)
    ok, err, bound = within_bf16_rule(layer.h[keep].float(), ref.h[keep], ref_bf.h[keep])
    assert ok, (err, bound)
    if st.kda is not None:
        ok, err, bound = within_bf16_rule(st2.kda.recurrent, ref.states[0].kda.recurrent,
                                          ref_bf.states[0].kda.recurrent)
        assert ok, ("recurrent state", err, bound)
    return layer


@pytest.mark.slow
@pytest.mark.parametrize("kind,fused", [("dense", True), ("kda_moe", True), ("kda_moe", False), ("mla_moe", None)])
def test_stock_matches_reference_tiny(tiny_cfg, kind, fused):
    _check(tiny_cfg, kind, DecodeShape(2, 1, (3, 70)), kda_fused=fused)


@pytest.mark.slow
@pytest.mark.parametrize("batch,tokens", [(1, 1), (8, 1), (64, 1), (2, 3), (3, 8)])
@pytest.mark.parametrize("kind", ["kda_moe", "mla_moe"])
def test_stock_batches_and_speculative_tokens_tiny(tiny_cfg, kind, batch, tokens):
    ctx = tuple((7 * b) % 90 for b in range(batch))
    _check(tiny_cfg, kind, DecodeShape(batch, tokens, ctx), kda_fused=True)


@pytest.mark.slow
def test_stock_real_shapes_tp8_batch1():
    """One TP8 rank of a KDA+MoE layer at real shapes through the stock schedule (Triton interpreter on CPU)."""
    from kimi_decode.config import KimiK3Config
    _check(KimiK3Config(), "kda_moe", DecodeShape(1, 1, 0), tp=8)
