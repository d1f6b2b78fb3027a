"""Measured evidence files load, carry provenance, and plot."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from kimi_decode import measured, plots  # noqa: E402

REQUIRED = ("gpu", "driver", "torch", "git_commit")


@pytest.mark.parametrize("name", sorted(p.stem for p in measured.measured_dir().glob("*.csv")))
def test_every_measured_csv_has_provenance(name):
    df = measured.load(name)
    assert len(df) > 0
    if name.startswith("kernels_sass"):  # static SASS facts, tied to kernel keys
        assert "key" in df.columns
        return
    for col in REQUIRED:
        assert col in df.columns and df[col].notna().all(), (name, col)


def test_gemv_evidence_plots_and_beats_cublas_at_m1():
    df = measured.load("kernels_gemv")
    ax = plots.plot_gemv_vs_cublas(df, M=1)
    assert len(ax.patches) == 12
    m1 = df[df.M == 1].pivot_table(index=["K", "N"], columns="impl", values="us_median")
    assert len(m1) == 6 and (m1["cute_gemv"] < m1["torch.mm"]).all()


def test_names_lists_what_load_takes(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_DECODE_DATA", str(tmp_path))
    (tmp_path / "measured").mkdir()
    for f in ("stock_dcp_h100_tp8.csv", "stock_dcp_h200_tp8.csv", "stock_h200_tp8.csv", "moe_trace_h200_tp8.csv.xz"):
        (tmp_path / "measured" / f).write_text("a\n1\n")
    assert measured.names("stock_dcp_*_tp8") == ["stock_dcp_h100_tp8", "stock_dcp_h200_tp8"]
    assert measured.names() == ["stock_dcp_h100_tp8", "stock_dcp_h200_tp8", "stock_h200_tp8"]
    assert all(len(measured.load(n)) == 1 for n in measured.names())


def test_missing_file_error_names_what_exists():
    with pytest.raises(FileNotFoundError, match="available"):
        measured.load("no_such_file")


def test_markdown_table_formats_what_it_is_given():
    import pandas as pd

    from kimi_decode.measured import markdown_table
    df = pd.DataFrame({"executor": ["stock", "fused", "x"], "us_median": [101.234, float("nan"), 0.4567], "other": [1, 2, 3]})
    md = markdown_table(df, ["executor", "us_median", "missing"])
    assert md.splitlines() == ["| executor | us_median |", "|---|---|", "| stock | 101.2 |", "| fused |  |",
                               "| x | 0.46 |"]


def test_saved_profiles_agree_with_graph_replay_within_the_documented_overhead():
    """The committed H200 profiles: summed kernel time vs the graph-replay median of the same configuration."""
    from kimi_decode.measured import PROFILE_OVERHEAD_BOUNDS, profile_vs_graph
    df = profile_vs_graph()
    assert len(df) >= 9 and {"stock", "stock-moe", "fused-moe"} <= set(df.executor)
    lo, hi = PROFILE_OVERHEAD_BOUNDS
    assert df.ratio.between(lo, hi).all(), df


def test_breakdown_csv_prints_its_own_columns():
    from kimi_decode.measured import results_markdown
    md = results_markdown("moe_breakdown_h200_tp8")
    assert md.startswith("| executor | batch | launch | label | prefix_us |") and "moe.front" in md


def test_mma_rate_csv_prints_its_own_columns_and_a_wrong_kind_is_refused():
    import pytest

    from kimi_decode.measured import results_markdown
    md = results_markdown("mma_rate_h200")
    assert md.startswith("| warps | chains | decode | cycles_per_mma |") and "NVIDIA H200" in md
    with pytest.raises(ValueError, match="none of the breakdown table's columns"):
        results_markdown("mma_rate_h200", kind="breakdown")
    with pytest.raises(ValueError, match="kind must be one of"):
        results_markdown("mma_rate_h200", kind="nope")


def test_kernel_bench_csv_prints_its_own_columns():
    from kimi_decode.measured import results_markdown
    md = results_markdown("kernels_gemv_mma_h100")
    assert md.startswith("| impl | M | K | N | us_median |") and "cute_gemv_mma" in md and "H100" in md


def test_provenance_names_the_bundle_compiler_without_one_installed(tmp_path, monkeypatch):
    """On a GPU host that runs the offline bundle (no CuTe DSL compiler), `provenance()` records the
    nvidia-cutlass-dsl version that compiled the bundle's kernels, from its manifest, marked '(aot)'."""
    import json

    from kimi_decode import bench
    (tmp_path / "manifest.json").write_text(json.dumps({"toolchain": {"nvidia-cutlass-dsl": "9.9.9"}}))
    monkeypatch.setenv("KIMI_DECODE_ARTIFACTS", str(tmp_path))
    assert bench.bundle_compiler_version() == "9.9.9 (aot)"
    (tmp_path / "manifest.json").write_text("not json")
    assert bench.bundle_compiler_version() == ""
    monkeypatch.delenv("KIMI_DECODE_ARTIFACTS")
    assert bench.bundle_compiler_version() == ""


def test_bundle_limit_is_what_the_device_call_leaves_beside_the_tree(tmp_path):
    """The offline bundle may take the device call's 64 MiB, less a margin and the checkout's carried files (git's
    tracked and untracked, not ignored); outside a git checkout the fixed fallback."""
    import subprocess

    from kimi_decode import bundle as b
    assert b.bundle_limit_mib(tmp_path) == b.BUNDLE_LIMIT_MB  # no git here
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "a.bin").write_bytes(b"x" * 2**20)
    (tmp_path / ".gitignore").write_text("ignored.bin\n")
    (tmp_path / "ignored.bin").write_bytes(b"x" * 3 * 2**20)
    tree = b.tree_mib(tmp_path)
    assert 1.0 < tree < 1.01, tree
    assert abs(b.bundle_limit_mib(tmp_path) - (b.DEVICE_CARRY_MB - b.DEVICE_CARRY_MARGIN_MB - tree)) < 1e-9
