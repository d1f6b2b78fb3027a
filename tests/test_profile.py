"""Profiling as data: backend choice, the per-launch frame, saving and loading (CPU parts)."""

import pandas as pd
import pytest
import torch

from kimi_decode import profile as P
from kimi_decode.cli import main

NCU_VERSION_TEXT = """NVIDIA (R) Nsight Compute Command Line Profiler
Copyright (c) 2018-2025 NVIDIA Corporation
Version 2025.3.1.0 (build 36398880) (public-release)
"""


def test_parse_ncu_version():
    assert P.parse_ncu_version(NCU_VERSION_TEXT) == (2025, 3, 1, 0)
    assert P.parse_ncu_version("no version here") is None
    assert (2025, 3, 1) < P.NSIGHT_PYTHON_MIN_NCU <= (2026, 2, 1)


def test_no_gpu_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(P.ProfilerUnavailable, match="CUDA GPU"):
        P.choose_backend()


def test_no_ncu_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(P.shutil, "which", lambda name: None)
    with pytest.raises(P.ProfilerUnavailable, match="ncu"):
        P.choose_backend()


def test_backend_choice_follows_the_ncu_version(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(P, "_nsight_python_importable", lambda: True)
    monkeypatch.setattr(P, "ncu_version", lambda: (2025, 3, 1, 0))
    assert P.choose_backend() == "ncu-cli"
    with pytest.raises(P.ProfilerUnavailable, match="2026.2.1"):
        P.choose_backend("nsight-python")
    monkeypatch.setattr(P, "ncu_version", lambda: (2026, 2, 1, 0))
    assert P.choose_backend() == "nsight-python"
    assert P.choose_backend("ncu-cli") == "ncu-cli"


def test_ncu_command_pins_clocks_and_names_the_step(tmp_path):
    req = P.ProfileRequest(layer="mla_moe", batch=64, context=32768, metric_set="memory")
    cmd = P.ncu_command(req, tmp_path / "profile")
    assert cmd[cmd.index("--clock-control") + 1] == "none"
    assert "--nvtx" in cmd and cmd[cmd.index("--profile-from-start") + 1] == "off"
    assert cmd[cmd.index("--metrics") + 1] == ",".join(P.METRIC_SETS["memory"])
    assert cmd[-3:-1] == ["-m", "kimi_decode.profile"] and '"batch": 64' in cmd[-1]
    assert P.profile_folder(req, tmp_path) == tmp_path / "stock" / "mla_moe-tp8-b64-ctx32768"
    assert P.ProfileRequest(layer="kda_moe", tokens=4).folder_name() == "kda_moe-tp8-b1-t4"


def test_request_refuses_unsupported():
    with pytest.raises(ValueError, match="batch"):
        P.ProfileRequest(batch=65).check()
    with pytest.raises(ValueError, match="metric set"):
        P.ProfileRequest(metric_set="nope").check()


def test_frame_save_load_round_trip(tmp_path):
    metrics = P.METRIC_SETS["full"]
    rows = [{"label": f"{i:02d} x", "kernel": f"k{i}", **{m: float(i + 1) * 1000 for m in metrics}}
            for i in range(1, 4)]
    df = P.frame_from_rows(rows, "ncu-cli")
    assert list(df.order) == [1, 2, 3]
    assert df.share_of_layer.sum() == pytest.approx(1.0)
    assert df.duration_us.tolist() == [2.0, 3.0, 4.0]
    assert df.dram_GBps.iloc[0] == pytest.approx((2000 + 2000) / 2000)
    folder = P.save_profile(df, tmp_path / "stock" / "kda_moe-tp8-b1", {"gpu": "test"})
    back = P.load_profile(folder)
    pd.testing.assert_frame_equal(back, df, check_dtype=False)
    assert back.attrs["provenance"] == {"gpu": "test"}
    listing = P.saved_profiles(tmp_path)
    assert listing.kernels.tolist() == [3] and listing.total_us.tolist() == [9.0]
    with pytest.raises(FileNotFoundError, match="summary.csv"):
        P.load_profile(tmp_path)


def test_register_metric_set():
    P.register_metric_set("l2", ["lts__t_bytes.sum"], {"lts__t_bytes.sum": "l2_bytes"})
    assert P.METRIC_SETS["l2"] == ["gpu__time_duration.sum", "lts__t_bytes.sum"]
    assert P.COLUMNS["lts__t_bytes.sum"] == "l2_bytes"
    with pytest.raises(ValueError):
        P.register_metric_set("bad", [])


def test_cli_profile_without_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["profile", "--layer", "kda_moe"]) == 3
    assert "CUDA GPU" in capsys.readouterr().err
    assert main(["profile", "--layer", "kda_moe", "--batch", "65"]) == 2


def test_reports_are_kept_compressed_and_restored(tmp_path):
    from kimi_decode.profile import compress_report, report_file
    data = b"NVIDIA Nsight Compute report " * 1000
    (tmp_path / "profile.ncu-rep").write_bytes(data)
    xz = compress_report(tmp_path)
    assert xz.name == "profile.ncu-rep.xz" and not (tmp_path / "profile.ncu-rep").exists()
    assert xz.stat().st_size < len(data) / 10
    assert report_file(tmp_path).read_bytes() == data


def test_stall_metric_set_has_columns_and_its_own_folder(tmp_path):
    stalls = P.METRIC_SETS["stalls"]
    assert stalls[0] == "gpu__time_duration.sum" and len(stalls) == len(set(stalls))
    assert all(P.COLUMNS.get(m, "").startswith("stall_") for m in stalls if "_issue_stalled_" in m)
    assert sum("_issue_stalled_" in m for m in stalls) == len(P.STALL_REASONS)
    req = P.ProfileRequest(executor="fused-moe", metric_set="stalls")
    assert P.profile_folder(req, tmp_path) == tmp_path / "fused-moe" / "stalls" / "kda_moe-tp8-b1"
    df = P.frame_from_rows([{"label": "a", "kernel": "k", "gpu__time_duration.sum": 2000.0,
                             "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": 3.5}], "ncu-cli")
    assert df.stall_barrier.iloc[0] == 3.5 and df.duration_us.iloc[0] == 2.0


def test_source_command_samples_only_the_named_kernels(tmp_path):
    req = P.ProfileRequest(executor="fused-moe", batch=8)
    cmd = P.source_command(req, tmp_path / "profile", "up_kernel|down_kernel")
    assert cmd[cmd.index("--kernel-name") + 1] == "regex:up_kernel|down_kernel"
    assert "SourceCounters" in cmd and cmd[cmd.index("--warp-sampling-interval") + 1] == "0"
    assert cmd[cmd.index("--clock-control") + 1] == "none" and '"batch": 8' in cmd[-1]
    with pytest.raises(ValueError, match="regular expression"):
        P.source_page(req, "")


def test_cli_refuses_a_bad_source_pattern(capsys):
    assert main(["profile", "--executor", "fused-moe", "--layer", "kda_moe", "--source", "up_kernel("]) == 2
    assert "regular expression" in capsys.readouterr().err


def test_source_page_is_read_per_kernel_and_summed_by_opcode(tmp_path):
    import lzma

    cols = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_math","stall_wait",' \
           '"stall_math (Not Issued)"'
    text = "\n".join([
        '"Kernel Name","kernel_a_0",', cols,
        '"0x10","LOP3.LUT R1, R2, 0x3, RZ, 0xc0, !PT ;","6","100","4","2","4"',
        '"0x20","@!P0 LOP3.LUT R1, R2, 0x3, RZ, 0xc0, !PT ;","2","50","1","1","1"',
        '"0x30","HMMA.16816.F32.BF16 R8, R8, R24, RZ ;","2","10","0","2","0"',
        '"Kernel Name","kernel_b_0",', cols,
        '"0x10","BRA 0x10 ;","5","5","0","0","0"', ""])
    path = tmp_path / "source_sass.csv.xz"
    with lzma.open(path, "wt") as f:
        f.write(text)
    pages = P.read_source_page(path)
    assert list(pages) == ["kernel_a_0", "kernel_b_0"]
    hot = P.stall_hotspots(pages["kernel_a_0"])
    assert list(hot.index) == ["LOP3", "HMMA"] and hot.loc["LOP3", "samples"] == 8
    assert hot.loc["LOP3", "instructions"] == 150 and hot.loc["LOP3", "stall_math"] == 5
    assert abs(hot.share.sum() - 1.0) < 1e-9 and "stall_math (Not Issued)" not in hot.columns
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="source page"):
        P.read_source_page(tmp_path / "bad.csv")


def test_fused_variants_are_profiled_in_their_own_folder(tmp_path):
    """fused-moe@VARIANT: checked before any GPU work, saved beside the default under fused-moe.VARIANT/."""
    from kimi_decode.executors import check_executor_name
    req = P.ProfileRequest(executor="fused-moe@fring", layer="kda_moe", batch=1)
    req.check()
    assert P.profile_folder(req, tmp_path) == tmp_path / "fused-moe.fring" / "kda_moe-tp8-b1"
    for bad, why in (("stock@fring", "optionally with @VARIANT"), ("fused-moe@nonsense", "variant"),
                     ("fused@fring", "executor must be one of")):
        with pytest.raises(ValueError, match=why):
            check_executor_name(bad)
