"""The support matrix (`mission.md`), checked fail-closed.

`check_supported` is the one check every entry point calls before it builds
weights, compiles or launches anything. Anything outside the matrix raises
`UnsupportedConfiguration`, naming the axis, the value given and what is
supported.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import LAYER_KINDS, DecodeShape, KimiK3Config, ShardSpec

SUPPORTED_ARCHS = ("sm_90a",)
SUPPORTED_TP = (8, 16)
SUPPORTED_DCP = (1, 2, 4, 8)
BATCH_RANGE = (1, 64)
TOKENS_PER_SEQ_RANGE = (1, 8)  # 1 = plain decode, 2..8 = speculative verify
MAX_CONTEXT = 128 * 1024  # tokens per sequence, MLA layers, after the step's tokens
ACTIVATION_DTYPES = ("bfloat16",)


class UnsupportedConfiguration(ValueError):
    """A request outside the support matrix. `axis`, `value`, `supported` say which."""

    def __init__(self, axis: str, value, supported: str):
        self.axis = axis
        self.value = value
        self.supported = supported
        super().__init__(f"unsupported {axis}: {value!r} (supported: {supported})")


class GPURequired(RuntimeError):
    """A measurement asked for on a machine without a CUDA GPU (the message says what needs one and where to look
    instead); the command line prints it without a traceback."""


@dataclass(frozen=True)
class SupportMatrixRow:
    axis: str
    supported: str


def support_matrix() -> list[SupportMatrixRow]:
    """The matrix as rows, for docs, the CLI and the evidence pack."""
    return [
        SupportMatrixRow("model", "Kimi K3 as published (config.json values of kimi_k3_layer.md §1)"),
        SupportMatrixRow("layer", ", ".join(LAYER_KINDS)),
        SupportMatrixRow("gpu arch", ", ".join(SUPPORTED_ARCHS) + " (H100/H200)"),
        SupportMatrixRow("tp", ", ".join(map(str, SUPPORTED_TP)) + " (one GPU runs one rank's shard)"),
        SupportMatrixRow("batch", f"{BATCH_RANGE[0]}..{BATCH_RANGE[1]} sequences"),
        SupportMatrixRow("tokens per sequence", "1 (decode) or 2..8 (speculative verify)"),
        SupportMatrixRow("dcp", ", ".join(map(str, SUPPORTED_DCP)) + " (MLA layers; KDA layers keep per-sequence state)"),
        SupportMatrixRow("context", f"0..{MAX_CONTEXT} tokens per sequence including the step's tokens"),
        SupportMatrixRow("activation dtype", "bfloat16 (routed experts MXFP4, KDA state fp32, MLA KV bf16)"),
    ]


def _dtype_name(dtype) -> str:
    s = str(dtype)
    return s.split(".")[-1]


def check_supported(
    *,
    layer: str | None = None,
    shard: ShardSpec | None = None,
    tp: int | None = None,
    dcp: int | None = None,
    shape: DecodeShape | None = None,
    batch: int | None = None,
    tokens_per_seq: int | None = None,
    context: int | None = None,
    dtype=None,
    arch: str | None = None,
    cfg: KimiK3Config | None = None,
) -> None:
    """Raise `UnsupportedConfiguration` for the first axis outside the matrix.

    Axes that are not given are not checked. `shard` supplies tp and dcp,
    `shape` supplies batch, tokens per sequence and context lengths; explicit
    keyword values are checked too.
    """
    if cfg is None and shard is not None:
        cfg = shard.cfg
    if cfg is not None and not cfg.is_published:
        raise UnsupportedConfiguration(
            "model", "a modified KimiK3Config", "the published Kimi K3 configuration only"
        )
    if layer is not None and layer not in LAYER_KINDS:
        raise UnsupportedConfiguration("layer", layer, ", ".join(LAYER_KINDS))
    if arch is not None and arch not in SUPPORTED_ARCHS:
        raise UnsupportedConfiguration("gpu arch", arch, ", ".join(SUPPORTED_ARCHS))

    tps = [t for t in (tp, shard.tp if shard else None) if t is not None]
    for t in tps:
        if t not in SUPPORTED_TP:
            raise UnsupportedConfiguration("tp", t, ", ".join(f"TP{x}" for x in SUPPORTED_TP))
    dcps = [d for d in (dcp, shard.dcp if shard else None) if d is not None]
    for d in dcps:
        if d not in SUPPORTED_DCP:
            raise UnsupportedConfiguration("dcp", d, ", ".join(map(str, SUPPORTED_DCP)))

    batches = [b for b in (batch, shape.batch if shape else None) if b is not None]
    for b in batches:
        if not isinstance(b, int) or not BATCH_RANGE[0] <= b <= BATCH_RANGE[1]:
            raise UnsupportedConfiguration("batch", b, f"{BATCH_RANGE[0]}..{BATCH_RANGE[1]}")
    toks = [t for t in (tokens_per_seq, shape.tokens_per_seq if shape else None) if t is not None]
    for t in toks:
        if not isinstance(t, int) or not TOKENS_PER_SEQ_RANGE[0] <= t <= TOKENS_PER_SEQ_RANGE[1]:
            raise UnsupportedConfiguration(
                "tokens per sequence", t, "1 (decode) or 2..8 (speculative verify)"
            )
    step = max(toks) if toks else 1
    ctxs = []
    if context is not None:
        ctxs.append(context)
    if shape is not None:
        ctxs.extend(shape.context_per_seq)
    for c in ctxs:
        if not isinstance(c, int) or c < 0 or c + step > MAX_CONTEXT:
            raise UnsupportedConfiguration(
                "context", c,
                f"0..{MAX_CONTEXT - step} cached tokens per sequence "
                f"({MAX_CONTEXT} including the step's {step} token(s))",
            )
    if dtype is not None and _dtype_name(dtype) not in ACTIVATION_DTYPES:
        raise UnsupportedConfiguration("activation dtype", _dtype_name(dtype), ", ".join(ACTIVATION_DTYPES))


def describe_supported(layer: str, shard: ShardSpec, shape: DecodeShape) -> str:
    """One line for a supported request (used by `kimi-decode check`)."""
    return (
        f"supported: {layer} layer, {shard.describe()}, {shape.describe()}"
    )
