"""Each layer type at real TP8/TP16 rank shapes through the reference; fp32 vs bf16 storage."""

import pytest
import torch

from kimi_decode.accuracy import rel_err
from kimi_decode.config import DecodeShape, ShardSpec
from kimi_decode.reference import Storage, decoder_layer
from kimi_decode.state import make_decode_state
from kimi_decode.weights import make_layer_weights


@pytest.mark.slow
@pytest.mark.parametrize("kind,tp,shape", [
    ("dense", 8, DecodeShape(2, 1, 0)),
    ("kda_moe", 16, DecodeShape(2, 2, 0)),
    ("mla_moe", 8, DecodeShape(2, 2, (100, 700))),
])
def test_real_shapes(kind, tp, shape):
    sh = ShardSpec(tp=tp)
    w = make_layer_weights(kind, sh, seed=1)
    st = make_decode_state(kind, sh, shape, seed=1)
    out = decoder_layer(w, st)
    bf = decoder_layer(w, st, storage=Storage.BF16)
    d = sh.cfg.hidden_size
    assert out.h.shape == (shape.num_tokens, d) and torch.isfinite(out.h).all()
    assert out.h.abs().mean() > 1e-3 and out.x_attn.abs().mean() > 0.1
    # rounding at the bf16 storage points moves the result by bf16-sized amounts, not more
    e = rel_err(bf.h, out.h)
    assert 1e-4 < e < 3e-2, e
    if kind != "mla_moe":
        assert st.kda.recurrent.dtype == torch.float32 and st.kda.conv.dtype == torch.bfloat16
        assert st.kda.recurrent.shape[1:] == (sh.kda_heads, 128, 128)
