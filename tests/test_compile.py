"""CI compile check: every registered kernel compiles for sm_90a on a CPU machine, and its PTX keeps its promises.

Needs the `gpu` extra (nvidia-cutlass-dsl, apache-tvm-ffi). Without it these
tests FAIL (CI installs the extra); the bundle runner sets
KIMI_DECODE_AOT_ONLY=1 on the GPU host, where only the ahead-of-time kernels exist.
"""

import json
import os
import re

import pytest

from kimi_decode import compile as kc

ARCH = "sm_90a"
AOT_ONLY = os.environ.get("KIMI_DECODE_AOT_ONLY") == "1"




def _ptx_ops(ptx: str) -> dict[str, int]:
    ops: dict[str, int] = {}
    for op in re.findall(r"^\s*((?:ld|st)\.global[.\w:]*)", ptx, re.M):
        ops[op] = ops.get(op, 0) + 1
    return ops


def _representatives(spec):
    """A few variants per kernel: first, last and the most demanding (largest key) of the AOT list."""
    keys = spec.aot_keys(ARCH)
    picks = {keys[0], keys[-1], max(keys, key=lambda k: len(kc.key_json(k)) + sum(map(ord, kc.key_json(k))))}
    return sorted(picks, key=kc.key_json)


def test_registry_lists_the_kernels():
    names = set(kc.registry())
    assert {"gemv", "attn_res"} <= names
    for spec in kc.registry().values():
        assert spec.aot_keys(ARCH), spec.name
        assert all(k.arch == ARCH for k in spec.aot_keys(ARCH))


@pytest.mark.parametrize("name", ["gemv", "attn_res"])
def test_kernel_compiles_for_sm90a_and_uses_128bit_loads(compiler, name):
    spec = kc.registry()[name]
    for key in _representatives(spec):
        ptx = kc.ptx_text(key)
        assert ".target sm_90a" in ptx, f"{key}: compiled for another arch"
        for needle in spec.ptx_checks:
            assert needle in ptx, f"{key}: PTX lacks {needle!r}; global ops: {_ptx_ops(ptx)}"
        scalar_loads = [op for op in _ptx_ops(ptx) if op.startswith("ld.global") and ".v4" not in op]
        # only the epilogue's per-element gate/residual reads may be scalar
        assert not scalar_loads or key.__class__.__name__ == "GemvKey" and (key.gate or key.residual), (
            f"{key}: scalar global loads {scalar_loads} in a memory-bound kernel"
        )


def test_attn_res_uses_cluster_exchange(compiler):
    from kimi_decode.kernels.attn_res import AttnResKey

    ptx = kc.ptx_text(AttnResKey(n=4, arch=ARCH))
    assert "st.shared::cluster" in ptx and "barrier.cluster.wait" in ptx


def test_arch_is_required_without_gpu(monkeypatch):
    monkeypatch.setattr(kc, "current_arch", lambda: None)
    with pytest.raises(ValueError, match="sm_100a"):
        kc.resolve_arch(None)
    assert kc.resolve_arch("sm_90a") == "sm_90a"
    with pytest.raises(ValueError):
        kc.resolve_arch("90a")


def test_keys_hash_stably():
    from kimi_decode.kernels.gemv import GemvKey

    a, b = GemvKey(n=2112, k=7168), GemvKey(n=2112, k=7168)
    assert kc.symbol_name(a) == kc.symbol_name(b)
    assert kc.symbol_name(a) != kc.symbol_name(GemvKey(n=2112, k=7168, m_tile=8))
    assert kc.symbol_name(a) != kc.symbol_name(GemvKey(n=2112, k=7168, arch="sm_100a"))


# ---------------------------------------------------------------- ahead-of-time artifacts


@pytest.fixture(scope="module")
def built(compiler, tmp_path_factory):
    """One kernel built, exported and linked like `kimi-decode build` does."""
    from kimi_decode.bundle import build_artifacts
    from kimi_decode.kernels.gemv import GemvKey

    out = tmp_path_factory.mktemp("artifacts")
    key = GemvKey(n=896, k=7168, out_fp32=True, arch=ARCH)
    manifest = build_artifacts(ARCH, out, keys=[key], log=lambda *a: None)
    return out, key, manifest


def test_build_writes_manifest_and_shared_object(built):
    out, key, manifest = built
    (entry,) = manifest["kernels"]
    assert entry["kernel"] == "gemv" and entry["arch"] == ARCH
    assert entry["source_hash"] == kc.source_hash(kc.spec_for(key))
    assert entry["toolchain"]["nvidia-cutlass-dsl"]
    assert (out / entry["file"]).exists()
    assert (out / "cubin" / (entry["symbol"] + ".cubin")).exists()
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["kernels"][0]["key"] == kc.key_dict(key)


def test_build_reuses_unchanged_kernels_and_recompiles_changed_ones(built, tmp_path):
    """--reuse: a kernel whose key and sources match the earlier manifest is copied (byte-identical, no compile);
    one whose recorded source hash differs, or an earlier build for another toolchain, is compiled again; reusing
    the output folder itself works (its files are kept aside before the build clears it)."""
    import shutil

    from kimi_decode.bundle import build_artifacts
    out, key, manifest = built
    logs = []
    again = tmp_path / "again"
    m2 = build_artifacts(ARCH, again, keys=[key], log=logs.append, reuse=out)
    (e,) = m2["kernels"]
    assert (again / e["file"]).read_bytes() == (out / e["file"]).read_bytes()
    assert any("reused" in line for line in logs) and "1 of 1 kernels reused, 0 compiled" in logs[-1]
    assert not (again / "cubin" / (e["symbol"] + ".cubin")).exists()  # nothing compiled
    logs.clear()
    m3 = build_artifacts(ARCH, again, keys=[key], log=logs.append, reuse=again)  # the folder itself
    assert (again / e["file"]).exists() and "1 of 1 kernels reused, 0 compiled" in logs[-1]
    assert m3["kernels"][0]["source_hash"] == e["source_hash"]
    stale = tmp_path / "stale"
    shutil.copytree(out, stale)
    _rewrite(stale, source_hash="0" * 16)
    logs.clear()
    build_artifacts(ARCH, tmp_path / "fresh", keys=[key], log=logs.append, reuse=stale)
    assert "0 of 1 kernels reused, 1 compiled" in logs[-1]
    other = json.loads((stale / "manifest.json").read_text())
    other["toolchain"] = {"nvidia-cutlass-dsl": "0.0"}
    (stale / "manifest.json").write_text(json.dumps(other))
    logs.clear()
    build_artifacts(ARCH, tmp_path / "fresh2", keys=[key], log=logs.append, reuse=stale)
    assert any("nothing to reuse" in line for line in logs) and not any("reused" in line for line in logs)


def test_bundle_packs_its_kernels_and_reuses_them_from_the_archive(built, tmp_path):
    """A bundle carries its artifacts folder as one solid xz tar (`bundle.pack_kernels`): unpacked, every file comes
    back byte-identical under artifacts/, a member outside it is refused, and `--reuse` of a bundle folder reads the
    kernels from its archive."""
    import io
    import lzma
    import tarfile

    from kimi_decode.bundle import KERNEL_ARCHIVE, build_artifacts, pack_kernels, unpack_kernels
    out, key, _ = built
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    pack_kernels(out, bundle / KERNEL_ARCHIVE)
    back = unpack_kernels(bundle / KERNEL_ARCHIVE, tmp_path / "unpacked")
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(back) for p in back.rglob("*") if p.is_file())
    assert all((back / f).read_bytes() == (out / f).read_bytes() for f in files)
    logs = []
    m = build_artifacts(ARCH, tmp_path / "again", keys=[key], log=logs.append, reuse=bundle)
    assert "1 of 1 kernels reused, 0 compiled" in logs[-1] and len(m["kernels"]) == 1
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("elsewhere/x")
        tar.addfile(info, io.BytesIO(b""))
    (tmp_path / "bad.tar.xz").write_bytes(lzma.compress(buf.getvalue()))
    with pytest.raises(ValueError, match="unexpected member"):
        unpack_kernels(tmp_path / "bad.tar.xz", tmp_path / "bad")


def test_artifact_loads_without_compiler(built, monkeypatch):
    """The .so opens through TVM-FFI (no GPU needed to load it)."""
    out, key, _ = built
    runtime = next(p for p in kc.runtime_libraries() if p.endswith(kc.RUNTIME_LIB))
    monkeypatch.setenv(kc.ENV_ARTIFACTS, str(out))
    monkeypatch.setenv(kc.ENV_RUNTIME, runtime)
    monkeypatch.setattr(kc, "compiler_available", lambda: False)
    fn = kc._obtain(key)
    assert callable(fn)


def _rewrite(out, **changes):
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["kernels"][0].update(changes)
    (out / "manifest.json").write_text(json.dumps(manifest))


def test_stale_artifact_is_refused(built, monkeypatch, tmp_path):
    import shutil

    out, key, _ = built
    copy = tmp_path / "stale"
    shutil.copytree(out, copy)
    _rewrite(copy, source_hash="0" * 16)
    monkeypatch.setenv(kc.ENV_ARTIFACTS, str(copy))
    monkeypatch.setattr(kc, "compiler_available", lambda: False)
    with pytest.raises(kc.StaleArtifact, match="kimi-decode build"):
        kc._obtain(key)


def test_wrong_format_artifact_is_refused(built, monkeypatch, tmp_path):
    import shutil

    out, key, _ = built
    copy = tmp_path / "old"
    shutil.copytree(out, copy)
    _rewrite(copy, format=kc.FORMAT_VERSION + 1)
    monkeypatch.setenv(kc.ENV_ARTIFACTS, str(copy))
    monkeypatch.setattr(kc, "compiler_available", lambda: False)
    with pytest.raises(kc.StaleArtifact, match="format"):
        kc._obtain(key)


def test_missing_artifact_says_how_to_build(monkeypatch, tmp_path):
    from kimi_decode.kernels.gemv import GemvKey

    monkeypatch.setenv(kc.ENV_ARTIFACTS, str(tmp_path))
    monkeypatch.setattr(kc, "artifact_dirs", lambda: [tmp_path])
    monkeypatch.setattr(kc, "compiler_available", lambda: False)
    with pytest.raises(kc.KernelUnavailable, match="kimi-decode build --arch sm_90a"):
        kc._obtain(GemvKey(n=64, k=64, arch="sm_90a"))


def test_cli_parsers_register():
    import argparse

    from kimi_decode.bundle import add_build_parser, add_bundle_parser

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_build_parser(sub)
    add_bundle_parser(sub)
    args = parser.parse_args(["build", "--arch", "sm_90a", "--out", "x"])
    assert callable(args.func) and args.arch == "sm_90a"
    args = parser.parse_args(["bundle", "--arch", "sm_90a"])
    assert callable(args.func) and args.python == "3.12"


def test_jit_path_fills_and_reuses_the_disk_cache(compiler, monkeypatch, tmp_path):
    from kimi_decode.kernels.gemv import GemvKey

    key = GemvKey(n=896, k=7168, out_fp32=True, arch=ARCH)
    monkeypatch.setenv(kc.ENV_CACHE, str(tmp_path))
    kc.clear_memory_cache()
    try:
        assert callable(kc.load(key))
        assert (tmp_path / f"{kc.cache_digest(key)}.so").exists()
        kc.clear_memory_cache()

        def no_compile(*a, **k):
            raise AssertionError("compiled again although the disk cache holds the kernel")

        monkeypatch.setattr(kc, "compile_key", no_compile)
        assert callable(kc.load(key))
    finally:
        kc.clear_memory_cache()


def test_source_hash_covers_the_helper_modules_a_kernel_imports():
    """An artifact must go stale when a helper it is built from changes, not only its own file."""
    from kimi_decode import compile as kc

    reg = kc.registry()
    names = {n: [p.name for p in kc.source_files(s)] for n, s in reg.items()}
    assert {"moe.py", "ptx_ops.py", "mxfp4_decode.py", "gemv.py"} <= set(names["moe_up_pipe"])
    assert names["moe_up_pipe"][0] == "moe_pipe.py" and names["moe_up_pipe"][-1] == "compile.py"
    assert names["attn_res"] == ["attn_res.py", "compile.py"]
