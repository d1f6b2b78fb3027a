"""The Kimi K3 decoder layer in plain PyTorch with fp32 math: the correctness oracle.

Runs on CPU or GPU tensors. `Storage.BF16` rounds at the stock kernels' bf16
storage points (the "bf16 PyTorch" baseline of the accuracy rule).
"""

from .attn_res import attn_res
from .dense import dense_partial
from .kda import kda_decode
from .layer import LayerOutput, decoder_layer
from .mla import mla_decode, mla_decode_unabsorbed
from .moe import moe_dense_masked, moe_partials, moe_tail, route
from .precision import Storage

__all__ = [
    "Storage", "attn_res", "kda_decode", "mla_decode", "mla_decode_unabsorbed",
    "route", "moe_partials", "moe_tail", "moe_dense_masked", "dense_partial",
    "decoder_layer", "LayerOutput",
]
