"""The torch.compile peer computes the layer: within the bf16 accuracy rule of the fp32 reference."""

import pytest
import torch

from kimi_decode.accuracy import within_bf16_rule
from kimi_decode.compile_peer import CompilePeer
from kimi_decode.config import DecodeShape, ShardSpec
from kimi_decode.reference import Storage, decoder_layer
from kimi_decode.state import make_decode_state
from kimi_decode.weights import make_layer_weights

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kind", ["dense", "kda_moe", "mla_moe"])
@pytest.mark.parametrize("shape", [DecodeShape(1, 1, 5), DecodeShape(3, 4, (0, 9, 70))])
def test_peer_matches_reference(tiny_cfg, kind, shape):
    sh = ShardSpec(tp=2, cfg=tiny_cfg)
    w = make_layer_weights(kind, sh, seed=4).to(DEV)
    st = make_decode_state(kind, sh, shape, seed=4, device=DEV)
    ref = decoder_layer(w, st.clone())
    ref_bf = decoder_layer(w, st.clone(), storage=Storage.BF16)
    st2 = st.clone()
    peer = CompilePeer(w, st2, compile=False)
    peer()
    ok, err, bound = within_bf16_rule(peer.h.float(), ref.h, ref_bf.h)
    assert ok, (err, bound)
    if kind != "mla_moe":
        ok, err, bound = within_bf16_rule(st2.kda.recurrent, ref.states[0].kda.recurrent,
                                          ref_bf.states[0].kda.recurrent)
        assert ok, ("state", err, bound)
    else:
        assert (st2.mla.kv != st.mla.kv).any()  # the step's rows were inserted


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kda_moe", "mla_moe"])
def test_peer_compiles_as_one_graph(tiny_cfg, kind):
    """torch.compile(fullgraph=True) traces the whole layer (no graph break, no host sync) and stays correct."""
    sh = ShardSpec(tp=2, cfg=tiny_cfg)
    shape = DecodeShape(2, 2, (5, 40))
    w = make_layer_weights(kind, sh, seed=1).to(DEV)
    st = make_decode_state(kind, sh, shape, seed=1, device=DEV)
    ref = decoder_layer(w, st.clone())
    ref_bf = decoder_layer(w, st.clone(), storage=Storage.BF16)
    st2 = st.clone()
    peer = CompilePeer(w, st2, compile=True, mode="default")
    peer()
    ok, err, bound = within_bf16_rule(peer.h.float(), ref.h, ref_bf.h)
    assert ok, (err, bound)
    if kind == "kda_moe":  # the in-place state update survives compilation
        ok, err, bound = within_bf16_rule(st2.kda.recurrent, ref.states[0].kda.recurrent,
                                          ref_bf.states[0].kda.recurrent)
        assert ok, ("state", err, bound)
    else:
        assert (st2.mla.kv != st.mla.kv).any()


def test_peer_raises_the_recompile_limit_for_sweeps(tiny_cfg):
    """A sweep builds one CompilePeer per (layer, shape, weight copy), all compiling the same `_forward`:
    Dynamo's default limit of 8 recompilations refused every configuration after the eighth on the H200
    (FailOnRecompileLimitHit), so constructing a compiled peer must lift it."""
    import torch._dynamo

    from kimi_decode.compile_peer import RECOMPILE_LIMIT
    old = torch._dynamo.config.recompile_limit
    try:
        torch._dynamo.config.recompile_limit = 8
        sh = ShardSpec(tp=2, cfg=tiny_cfg)
        CompilePeer(make_layer_weights("dense", sh, seed=1),
                    make_decode_state("dense", sh, DecodeShape(1, 1, 5), seed=1), compile=True)
        assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT
    finally:
        torch._dynamo.config.recompile_limit = old
