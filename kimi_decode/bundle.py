"""`kimi-decode build` and `kimi-decode bundle`: ahead-of-time kernels for a GPU host without the compiler.

build:  compile every registered kernel variant (`KernelSpec.aot_keys`) for an
        arch on any machine (no GPU needed), export each with `export_to_c`,
        link it against libcute_dsl_runtime.so + libtvm_ffi.so, write
        `manifest.json` (kernel, key, arch, source hash, toolchain versions).
bundle: build the same, packed as DIR/kernels.tar.xz (one solid xz tar of the
        artifacts folder; DIR/kernels.json is its manifest), plus what the GPU
        host lacks beyond torch: the apache-tvm-ffi wheel for its Python, the
        CuTe runtime library (xz-compressed), a wheel of kimi_decode, the tests
        and scripts, and `run.sh`, which unpacks them into a private folder,
        points KIMI_DECODE_ARTIFACTS at the kernels and runs a command.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import lzma
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import compile as kc

REPO = Path(__file__).resolve().parent.parent
# the device tool carries the working tree and the bundle together, 64 MiB in all (DEVICE_CARRY_MB): the bundle
# may take what the checkout's tree (tracked and untracked, not ignored files) leaves, or BUNDLE_LIMIT_MB where the
# tree cannot be measured (no git)
DEVICE_CARRY_MB = 64
DEVICE_CARRY_MARGIN_MB = 2  # the device tool refused a tree + bundle of 63.9 MiB (as this module sums them)
BUNDLE_LIMIT_MB = 44


def tree_mib(repo: Path = REPO) -> float | None:
    """MiB of the files a device call carries from the checkout (git's tracked and untracked, not ignored
    files); None outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    files = [repo / f for f in out.decode().split("\0") if f]
    return sum(f.stat().st_size for f in files if f.is_file()) / 2**20


def _folder_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def bundle_limit_mib(repo: Path = REPO) -> float:
    """The bundle's size limit: what the device call's 64 MiB (less a margin) leave beside the checkout's tree."""
    tree = tree_mib(repo)
    return BUNDLE_LIMIT_MB if tree is None else DEVICE_CARRY_MB - DEVICE_CARRY_MARGIN_MB - tree


WHEEL_CACHE = REPO / ".whl"


def build_artifacts(
    arch: str,
    out_dir: str | Path,
    kernels: list[str] | None = None,
    tuning: bool = False,
    keys: list | None = None,
    log=print,
    reuse: str | Path | None = None,
) -> dict:
    """Compile, export and link every registered variant for `arch` into `out_dir`; return the manifest.

    `kernels` limits to those kernel names; `keys` replaces the registered key lists. `reuse`: a folder of an earlier
    build (its manifest and `.so` files, e.g. `.bundle/artifacts`): a kernel whose key, kernel sources
    (`compile.source_hash`), arch, toolchain and format match an entry there is copied instead of compiled.
    """
    if not kc.compiler_available():
        raise kc.KernelUnavailable("`build` needs the CuTe DSL compiler: pip install 'kimi_decode[gpu]'")
    arch = kc.resolve_arch(arch)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kd_reuse_") as keep:
        previous = _reusable(reuse, arch, out_dir, Path(keep), log)
        for old in [*out_dir.glob("kd_*.so"), *out_dir.glob("cubin/kd_*.cubin")]:
            old.unlink()
        return _build_into(arch, out_dir, kernels, tuning, keys, log, previous)


def _reusable(reuse, arch: str, out_dir: Path, keep: Path, log) -> dict:
    """{file name: (manifest entry, path)} of an earlier build's kernels that may be reused (same arch, toolchain and
    format); files inside out_dir are first copied to `keep`, since the build clears out_dir."""
    if reuse is None:
        return {}
    folder = Path(reuse)
    if (folder / "artifacts" / kc.MANIFEST).exists():
        folder = folder / "artifacts"
    elif (folder / KERNEL_ARCHIVE).exists():  # a bundle: its kernels packed (make_bundle)
        unpack_kernels(folder / KERNEL_ARCHIVE, keep / "unpacked")
        folder = keep / "unpacked" / "artifacts"
    path = folder / kc.MANIFEST
    if not path.exists():
        log(f"  nothing to reuse: no {kc.MANIFEST} in {Path(reuse)}")
        return {}
    man = json.loads(path.read_text())
    if (man.get("arch"), man.get("toolchain"), man.get("format")) != (arch, kc.toolchain_versions(), kc.FORMAT_VERSION):
        log(f"  nothing to reuse from {folder}: built for {man.get('arch')} with {man.get('toolchain')}")
        return {}
    out = {}
    for e in man.get("kernels", []):
        src = folder / e["file"]
        if not src.exists():
            continue
        if folder.resolve() == out_dir.resolve():
            src = Path(shutil.copy2(src, keep / e["file"]))
        out[e["file"]] = (e, src)
    return out


def _build_into(arch, out_dir: Path, kernels, tuning, keys, log, previous: dict) -> dict:
    entries = []
    specs = kc.registry()
    todo = []
    for name in kernels or sorted(specs):
        if name not in specs:
            raise KeyError(f"unknown kernel {name!r}; registered: {sorted(specs)}")
        todo += [k for k in specs[name].aot_keys(arch) if k not in todo]
        if tuning and specs[name].tuning_keys is not None:
            todo += [k for k in specs[name].tuning_keys(arch) if k not in todo]
    if keys is not None:
        todo = list(keys)
    reused, hashes = 0, {}
    for key in todo:
        if key.arch != arch:
            raise ValueError(f"{key} is not for {arch}")
        t0 = time.perf_counter()
        name = kc.symbol_name(key) + ".so"
        old = previous.get(name)
        spec = kc.spec_for(key)
        if spec.name not in hashes:
            hashes[spec.name] = kc.source_hash(spec)
        if old is not None and old[0].get("key") == kc.key_dict(key) and old[0].get("source_hash") == hashes[spec.name]:
            so = Path(shutil.copy2(old[1], out_dir / name))
            reused += 1
            entries.append(old[0])  # the same entry manifest_entry would write: key, sources, toolchain all match
            log(f"  {so.name}  reused")
        else:
            so = kc.export_shared(key, out_dir, cubin_dir=out_dir / "cubin")
            entries.append(kc.manifest_entry(key, so.name))
            log(f"  {so.name}  {kc.key_json(key)}  {time.perf_counter() - t0:.1f}s")
    if previous:
        log(f"  {reused} of {len(todo)} kernels reused, {len(todo) - reused} compiled")
    manifest = {
        "format": kc.FORMAT_VERSION,
        "arch": arch,
        "toolchain": kc.toolchain_versions(),
        "source_hashes": {name: kc.source_hash(specs[name]) for name in sorted(specs)},
        "built_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "kernels": entries,
    }
    (out_dir / kc.MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


KERNEL_ARCHIVE = "kernels.tar.xz"  # a bundle's artifacts folder (manifest, .so, cubin), packed by make_bundle
KERNEL_INDEX = "kernels.json"  # a copy of its manifest beside the archive (which kernels, from which sources)


def pack_kernels(folder: Path, archive: Path) -> None:
    """`folder` (an artifacts folder) as one solid xz tar whose member paths start with 'artifacts/': the kernels'
    .so files are alike (the same runtime glue around different cubins), so solid compression takes the 22 MB
    of 2026-12-07's 269 kernels to about 1 MB (the x86 branch filter as for the runtime)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(folder.rglob("*")):
            tar.add(path, arcname=str(Path("artifacts") / path.relative_to(folder)), recursive=False)
    filters = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
    archive.write_bytes(lzma.compress(buf.getvalue(), format=lzma.FORMAT_XZ, filters=filters))


def unpack_kernels(archive: Path, dest: Path) -> Path:
    """Unpack a bundle's kernel archive into dest (dest/artifacts: manifest, .so, cubin); returns that folder."""
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    with lzma.open(archive) as f, tarfile.open(fileobj=f, mode="r|") as tar:
        for member in tar:
            if not member.name.startswith("artifacts") or ".." in Path(member.name).parts:
                raise ValueError(f"{archive}: unexpected member {member.name}")
            tar.extract(member, dest, filter="data")
    return dest / "artifacts"


def runtime_library() -> Path:
    return Path(next(p for p in kc.runtime_libraries() if Path(p).name == kc.RUNTIME_LIB))


def xz_file(src: Path, dst: Path) -> None:
    # the x86 branch filter before LZMA2 at its strongest: the CuTe runtime in 12.4 MiB instead of 13.0 (preset 6),
    # room for kernels under the device call's carry limit; lzma.open reads the filter chain from the file
    filters = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
    with open(src, "rb") as fin, lzma.open(dst, "wb", format=lzma.FORMAT_XZ, filters=filters) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)


def tvm_ffi_wheel(python: str, dest: Path) -> Path:
    """The apache-tvm-ffi wheel (same version as here) for CPython `python` on manylinux x86_64."""
    version = kc.toolchain_versions()["apache-tvm-ffi"]
    tag = "cp" + python.replace(".", "")
    cache = WHEEL_CACHE / tag
    found = sorted(cache.glob(f"apache_tvm_ffi-{version}-*{tag}*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", python, "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64", "-d", str(cache), f"apache-tvm-ffi=={version}",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        found = sorted(cache.glob(f"apache_tvm_ffi-{version}-*{tag}*.whl"))
    if not found:
        raise FileNotFoundError(f"no apache-tvm-ffi {version} wheel for {tag} in {cache}")
    dest.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy2(found[-1], dest))


def package_wheel(dest: Path) -> Path:
    """A wheel of kimi_decode built from a copy of this checkout (pure Python; the checkout is untouched)."""
    import tempfile

    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kd_wheel_") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(REPO / "kimi_decode", src / "kimi_decode", ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            if (REPO / name).exists():
                shutil.copy2(REPO / name, src / name)
        if not (src / "README.md").exists():
            (src / "README.md").write_text("kimi_decode\n")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest), str(src)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return next(dest.glob("kimi_decode-*.whl"))


RUNNER = r"""#!/usr/bin/env bash
# kimi_decode offline GPU bundle runner. Usage: bash run.sh COMMAND [ARGS...]
# Unpacks the wheels and the CuTe runtime into a private folder (once), points
# kimi_decode at the ahead-of-time kernels of this bundle, and runs COMMAND.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
PRIV="${KIMI_DECODE_PRIVATE:-$HERE/.private}"
STAMP="$PRIV/.ready-$(cat "$HERE/BUNDLE_ID")"
if [ ! -f "$STAMP" ]; then
  rm -rf "$PRIV"; mkdir -p "$PRIV/site" "$PRIV/lib"
  "$PY" - "$HERE" "$PRIV" <<'EOF'
import lzma, shutil, sys, tarfile, zipfile
from pathlib import Path
here, priv = Path(sys.argv[1]), Path(sys.argv[2])
for whl in sorted((here / "wheels").glob("*.whl")):
    zipfile.ZipFile(whl).extractall(priv / "site")
with lzma.open(here / "lib" / "libcute_dsl_runtime.so.xz") as f, open(priv / "lib" / "libcute_dsl_runtime.so", "wb") as g:
    shutil.copyfileobj(f, g)
with lzma.open(here / "kernels.tar.xz") as f, tarfile.open(fileobj=f, mode="r|") as tar:
    for member in tar:  # artifacts/: manifest.json, the kernels' .so, cubin/
        if not member.name.startswith("artifacts") or ".." in Path(member.name).parts:
            sys.exit(f"kernels.tar.xz: unexpected member {member.name}")
        tar.extract(member, priv, filter="data")
for so in [*(priv / "site").rglob("*.so"), *(priv / "artifacts").glob("*.so")]:
    so.chmod(0o755)
EOF
  touch "$STAMP"
fi
export PYTHONPATH="$PRIV/site${PYTHONPATH:+:$PYTHONPATH}"
export KIMI_DECODE_ARTIFACTS="$PRIV/artifacts"
export KIMI_DECODE_CUTE_RUNTIME="$PRIV/lib/libcute_dsl_runtime.so"
export KIMI_DECODE_AOT_ONLY=1
exec "$@"
"""


def make_bundle(arch: str, out_dir: str | Path, python: str = "3.12", tuning: bool = False, log=print,
                reuse: str | Path | None = None) -> Path:
    """Write the offline bundle into `out_dir` and return it; refuses to exceed the size limit. `reuse`: an earlier
    bundle (or artifact folder), possibly `out_dir` itself, whose unchanged kernels are copied (`build_artifacts`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kd_bundle_") as tmp:
        log(f"building kernels for {arch} into {out / KERNEL_ARCHIVE}")
        # (the previous bundle's kernels are read for reuse before its files are replaced)
        manifest = build_artifacts(arch, Path(tmp) / "artifacts", tuning=tuning, log=log, reuse=reuse)
        for sub in ("wheels", "lib", "src", ".private", "artifacts"):
            shutil.rmtree(out / sub, ignore_errors=True)
        pack_kernels(Path(tmp) / "artifacts", out / KERNEL_ARCHIVE)
        shutil.copy2(Path(tmp) / "artifacts" / kc.MANIFEST, out / KERNEL_INDEX)
    (out / "lib").mkdir()
    xz_file(runtime_library(), out / "lib" / (kc.RUNTIME_LIB + ".xz"))
    tvm_ffi_wheel(python, out / "wheels")
    package_wheel(out / "wheels")
    for folder in ("tests", "scripts"):
        if (REPO / folder).is_dir():
            shutil.copytree(REPO / folder, out / "src" / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (out / "BUNDLE_ID").write_text(manifest["built_utc"].replace(":", "") + "\n")
    (out / "run.sh").write_text(RUNNER)
    (out / "run.sh").chmod(0o755)
    size = _folder_mib(out)
    log(f"bundle {out}: {len(manifest['kernels'])} kernels, {size:.1f} MiB")
    limit = bundle_limit_mib()
    if size > limit:
        raise RuntimeError(f"bundle is {size:.1f} MiB, over the {limit:.1f} MiB that the device call's "
                           f"{DEVICE_CARRY_MB} MiB leave beside the checkout's tree")
    return out


def _build_cmd(args) -> int:
    manifest = build_artifacts(args.arch, args.out, kernels=args.kernel or None, tuning=args.tuning, reuse=args.reuse)
    print(f"{len(manifest['kernels'])} kernels for {manifest['arch']} in {args.out}")
    return 0


def _bundle_cmd(args) -> int:
    make_bundle(args.arch, args.out, python=args.python, tuning=args.tuning, reuse=args.reuse)
    print(f"run on the GPU host: bash {args.out}/run.sh python -m pytest -m gpu tests")
    return 0


def add_build_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("build", help="compile every kernel ahead of time (no GPU needed)")
    p.add_argument("--arch", required=True, help="target GPU arch, e.g. sm_90a")
    p.add_argument("--out", default=str(REPO / ".bundle" / "artifacts"), help="artifact folder")
    p.add_argument("--kernel", action="append", help="only this kernel (repeatable)")
    p.add_argument("--tuning", action="store_true", help="also build the benchmark-only tiling variants")
    p.add_argument("--reuse", help="an earlier artifact folder or bundle: copy its kernels whose key and sources match")
    p.set_defaults(func=_build_cmd)
    return p


def add_bundle_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bundle", help="artifacts + wheels + runner for an offline GPU host")
    p.add_argument("--arch", required=True, help="target GPU arch, e.g. sm_90a")
    p.add_argument("--out", default=str(REPO / ".bundle"), help="bundle folder")
    p.add_argument("--python", default="3.12", help="Python version of the GPU host")
    p.add_argument("--tuning", action="store_true", help="also build the benchmark-only tiling variants")
    p.add_argument("--reuse", help="an earlier bundle (e.g. the --out folder itself): copy its kernels whose key and "
                                   "sources match instead of compiling them")
    p.set_defaults(func=_bundle_cmd)
    return p


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m kimi_decode.bundle build|bundle ...`)."""
    parser = argparse.ArgumentParser(prog="python -m kimi_decode.bundle")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_build_parser(sub)
    add_bundle_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
