"""The mma.sync rate microbenchmark (kernels/mma_rate.py, kimi-decode mma-rate): keys, builds, refusals."""

import pytest
import torch

from kimi_decode.cli import main
from kimi_decode.kernels import mma_rate as km


def test_keys_refuse_what_cannot_launch():
    with pytest.raises(ValueError, match="multiple of 4"):
        km.MmaRateKey(warps=6)
    with pytest.raises(ValueError, match="multiple of 4"):
        km.MmaRateKey(warps=36)
    with pytest.raises(ValueError, match="chains"):
        km.MmaRateKey(chains=3)
    assert km.MmaRateKey(16, 2).mmas_per_warp == km.MMA_RATE_OUTER * km.MMA_RATE_DEPTH * 2


def test_ahead_of_time_builds_do_not_spill_and_keep_every_mma(compiler):
    """Every configuration built ahead of time keeps its chains apart (no common subexpressions: at least
    depth × chains mmas in the loop) and fits its registers (no stack)."""
    import re

    from kimi_decode import compile as kc
    keys = km.rate_keys("sm_90a")
    assert {(k.warps, k.chains) for k in keys if not k.decode} == {(w, c) for w in km.MMA_RATE_WARPS
                                                                 for c in km.MMA_RATE_CHAINS}
    for key in keys:
        sass = kc.sass_text(key)
        assert len(re.findall(r"\bHMMA\.16816", sass)) >= km.MMA_RATE_DEPTH * key.chains, key
        assert kc.resource_usage(key)["STACK"] == 0, key
        lop3 = len(re.findall(r"\bLOP3", sass))  # the decode: 2 logic ops per pair, 4 pairs per mma
        assert lop3 >= 8 * km.MMA_RATE_DEPTH * key.chains if key.decode else lop3 < 8, (key, lop3)


def test_runner_refuses_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["mma-rate", "--no-progress"]) == 3
    assert "needs one" in capsys.readouterr().err


@pytest.mark.gpu
def test_rate_is_measured_on_the_gpu():
    from kimi_decode.mma_rate import run_mma_rate
    df = run_mma_rate([km.MmaRateKey(8, 1), km.MmaRateKey(8, 2, True)], outer=8, repeats=2, progress=False)
    assert len(df) == 2 and (df.cycles_per_mma > 0.5).all() and (df.clock_GHz > 0.3).all()
    assert (df.clock_GHz < 3.0).all()


def test_default_bundle_holds_the_gpu_tests_keys_and_the_runner_refuses_a_partial_set(monkeypatch):
    """The default bundle builds the two configurations of the GPU test; the whole set needs `bundle --tuning`, and
    without a compiler a run that lacks any of them is refused before a launch, saying so."""
    from kimi_decode import compile as kc
    smoke, full = km.smoke_keys("sm_90a"), km.rate_keys("sm_90a")
    assert km.MMA_RATE.aot_keys("sm_90a") == smoke and set(smoke) <= set(full)
    assert km.MMA_RATE.tuning_keys("sm_90a") == full
    monkeypatch.setattr(kc, "compiler_available", lambda: False)
    monkeypatch.setattr(kc, "find_artifact", lambda key: ("here", {}) if key in smoke else None)
    kc.require_available(smoke, "unused")
    with pytest.raises(kc.KernelUnavailable, match=r"13 of 15 kernels .*bundle --tuning"):
        kc.require_available(full, "the whole set is built by `kimi-decode bundle --tuning`")
