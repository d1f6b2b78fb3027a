"""The command line: demo, bytes, check, matrix, --help on each."""

import json
import subprocess
import sys

import pytest
import torch

from kimi_decode.cli import build_parser, main
from kimi_decode.config import DecodeShape
from kimi_decode.demo import format_demo, run_demo


def test_help_for_every_command(capsys):
    ap = build_parser()
    sub = next(a for a in ap._actions if a.dest == "command")
    for name in sub.choices:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        assert "usage: kimi-decode " + name in capsys.readouterr().out


def test_bytes_json(capsys):
    assert main(["bytes", "--layer", "mla_moe", "--tp", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["weights_streamed"] == 268_372_480 and d["floor_us_h200"] > 60


def test_bytes_table(capsys):
    assert main(["bytes", "--layer", "dense", "--tp", "16", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "148,270,360" in out and "batch 4" in out


def test_matrix(capsys):
    assert main(["matrix"]) == 0
    out = capsys.readouterr().out
    assert "1..64" in out and "sm_90a" in out


@pytest.mark.slow
def test_demo_real_shapes():
    shape = DecodeShape(1, 1, 4096)
    df = run_demo(tp=8, shape=shape, progress=False)
    assert list(df.layer) == ["dense", "kda_moe", "mla_moe"]
    assert list(df.weight_bytes_streamed) == [294_390_064, 296_465_200, 268_372_480]
    assert (df.h200_floor_us > 60).all() and (df.reference_step_s > 0).all()
    text = format_demo(df, 8, shape)
    assert "H200 floor" in text and "296,465,200" in text


def test_console_script_check():
    r = subprocess.run([sys.executable, "-m", "kimi_decode.cli", "check", "--tp", "4"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unsupported tp: 4" in r.stderr


def test_moe_refuses_a_malformed_executor_before_any_work(capsys):
    with pytest.raises(SystemExit) as e:
        main(["moe", "--executors", "stock,fused@bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "fused@bogus" in err and "got 'bogus'" in err and "fgemm / tgemm" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("argv", [["moe", "--executors", "stock,fused@fgemm-tgemm"], ["moe", "--breakdown"],
                                  ["moe", "--trace", "--executors", "fused"],
                                  ["sweep", "--executor", "stock", "--out", "unused.csv"]])
def test_gpu_commands_say_they_need_a_gpu_without_a_traceback(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "Traceback" not in err


def test_results_lists_names_and_suggests_the_closest_for_a_typo(capsys):
    assert main(["results", "--list", "moe_half_h200_*"]) == 0
    assert "moe_half_h200_tp8" in capsys.readouterr().out.split()
    assert main(["results", "moe_half_h200_tp9"]) == 2
    err = capsys.readouterr().err
    assert "closest available: moe_half_h200_tp8" in err and "Traceback" not in err
    assert main(["results"]) == 2 and "--list" in capsys.readouterr().err
