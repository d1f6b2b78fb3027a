"""The support matrix refuses every axis outside mission.md, with the axis named."""

import pytest
import torch

from kimi_decode.cli import main
from kimi_decode.config import DecodeShape, KimiK3Config, ShardSpec
from kimi_decode.support import UnsupportedConfiguration, check_supported


def _refused(axis, **kw):
    with pytest.raises(UnsupportedConfiguration) as e:
        check_supported(**kw)
    assert e.value.axis == axis
    assert axis in str(e.value) and "supported" in str(e.value)
    return e.value


def test_supported_corners():
    for tp in (8, 16):
        for dcp in (1, 2, 4, 8):
            check_supported(layer="mla_moe", shard=ShardSpec(tp=tp, dcp=dcp),
                            shape=DecodeShape(64, 8, 128 * 1024 - 8), dtype=torch.bfloat16, arch="sm_90a")
    check_supported(layer="dense", shape=DecodeShape(1, 1, 0))


@pytest.mark.parametrize("batch", [0, 65, -1])
def test_batch_refused(batch):
    e = _refused("batch", batch=batch)
    assert "1..64" in str(e)


def test_batch_refused_via_shape():
    _refused("batch", shape=DecodeShape(batch=65, context_lens=10))


@pytest.mark.parametrize("tp", [1, 2, 4, 32])
def test_tp_refused(tp):
    _refused("tp", tp=tp)


def test_tp_refused_via_shard():
    _refused("tp", shard=ShardSpec(tp=4))


@pytest.mark.parametrize("dcp", [0, 3, 16])
def test_dcp_refused(dcp):
    _refused("dcp", dcp=dcp)


@pytest.mark.parametrize("tokens", [0, 9])
def test_tokens_refused(tokens):
    _refused("tokens per sequence", tokens_per_seq=tokens)


def test_context_refused():
    _refused("context", context=128 * 1024)  # plus the step's token goes over
    _refused("context", context=-1)
    _refused("context", shape=DecodeShape(2, 8, (10, 128 * 1024 - 7)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, "float8_e4m3fn"])
def test_dtype_refused(dtype):
    _refused("activation dtype", dtype=dtype)


def test_arch_refused():
    _refused("gpu arch", arch="sm_100a")
    _refused("gpu arch", arch="sm_80")


def test_layer_refused():
    _refused("layer", layer="mamba")


def test_model_refused():
    _refused("model", cfg=KimiK3Config.tiny())


def test_cli_check(capsys):
    assert main(["check"]) == 0
    assert capsys.readouterr().out.startswith("supported: kda_moe layer, TP8")
    for argv, axis in ([["--batch", "65"], "batch"], [["--tp", "4"], "tp"], [["--dcp", "3"], "dcp"],
                       [["--tokens", "9"], "tokens per sequence"], [["--dtype", "float16"], "activation dtype"],
                       [["--context", "200000"], "context"], [["--layer", "x"], "layer"]):
        assert main(["check", *argv]) == 2
        assert f"unsupported {axis}" in capsys.readouterr().err


def test_cli_entry_points_refuse(capsys):
    assert main(["bytes", "--layer", "kda_moe", "--tp", "4"]) == 2
    assert "unsupported tp" in capsys.readouterr().err
    assert main(["demo", "--batch", "0"]) == 2
    assert "unsupported batch" in capsys.readouterr().err
