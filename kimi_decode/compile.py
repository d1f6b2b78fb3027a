"""Compile cache for the CuTe DSL kernels in `kimi_decode.kernels`.

A kernel variant is named by a *compile key*: a frozen dataclass of picklable
values (static sizes, flags, the GPU arch) whose class names its kernel. From
a key, `load(key)` returns a callable that takes torch tensors:

1. in-memory cache (one compiled callable per key and process);
2. with the CuTe DSL compiler importable (`pip install .[gpu]`): the on-disk
   cache of linked shared objects, keyed by a digest of the key, the kernel's
   sources and the toolchain versions; on a miss the kernel is compiled against
   fake tensors (symbolic batch size, `--enable-tvm-ffi`, TVM-FFI environment
   stream), exported with `export_to_c`, linked and stored;
3. without the compiler (the GPU host): ahead-of-time artifacts written by
   `kimi-decode build` (`manifest.json` + one `.so` per key). An artifact whose
   sources or arch do not match this checkout is refused (`StaleArtifact`).

Every kernel takes the caller's CUDA stream through the TVM-FFI environment
stream, so its launches follow `torch.cuda.current_stream()` and are captured
by `torch.cuda.graph`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

FORMAT_VERSION = 1  # bump when the artifact layout or the calling convention changes
MANIFEST = "manifest.json"
RUNTIME_LIB = "libcute_dsl_runtime.so"
TOOLCHAIN_PACKAGES = ("nvidia-cutlass-dsl", "apache-tvm-ffi")
ENV_ARTIFACTS = "KIMI_DECODE_ARTIFACTS"  # folder holding manifest.json (set by the bundle runner)
ENV_CACHE = "KIMI_DECODE_KERNEL_CACHE"  # on-disk JIT cache folder
ENV_RUNTIME = "KIMI_DECODE_CUTE_RUNTIME"  # path of libcute_dsl_runtime.so where no compiler is installed

_PACKAGE_DIR = Path(__file__).resolve().parent
_REPO_DIR = _PACKAGE_DIR.parent


class KernelUnavailable(RuntimeError):
    """No way to obtain the kernel here: no compiler and no matching artifact."""


class StaleArtifact(RuntimeError):
    """An ahead-of-time artifact exists but was built from other sources or for another arch."""


# ---------------------------------------------------------------------------
# registry


@dataclass(frozen=True)
class KernelSpec:
    """One kernel file: how to build it from a key, and which keys `build` exports.

    `build(key)` imports cutlass, and returns `(jit_function, compile_args)`:
    the `@cute.jit` host function and its fake arguments (the stream last).
    `aot_keys(arch)` lists the variants the package uses at decode shapes.
    `ptx_checks` are substrings every variant's PTX must contain.
    `tuning_keys(arch)` lists extra variants (other tilings) for benchmarks.
    """

    name: str
    module: str
    key_type: type
    build: Callable[[Any], tuple[Callable, tuple]]
    aot_keys: Callable[[str], list]
    ptx_checks: tuple[str, ...] = ()
    tuning_keys: Callable[[str], list] | None = None  # extra variants built with `build --tuning`


_REGISTRY: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    _REGISTRY[spec.name] = spec
    return spec


def registry() -> dict[str, KernelSpec]:
    """All registered kernels (importing `kimi_decode.kernels` registers them)."""
    importlib.import_module("kimi_decode.kernels")
    return dict(_REGISTRY)


def spec_for(key) -> KernelSpec:
    for spec in registry().values():
        if isinstance(key, spec.key_type):
            return spec
    raise KeyError(f"no kernel registered for key type {type(key).__name__}")


# ---------------------------------------------------------------------------
# keys, hashes, versions


def key_dict(key) -> dict:
    return dataclasses.asdict(key)


def key_json(key) -> str:
    return json.dumps({"kernel": spec_for(key).name, **key_dict(key)}, sort_keys=True)


def _package_imports(path: Path, package_dir: Path) -> set[Path]:
    """The modules of `package_dir` that the module at `path` imports relatively (`from .x import y`, also
    inside functions, where the kernels import their helpers)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            for name in names:
                f = package_dir / f"{name.split('.')[0]}.py"
                if f.is_file():
                    found.add(f.resolve())
    return found


def source_files(spec: KernelSpec) -> list[Path]:
    """The files whose text decides the compiled code: the kernel file, the modules of its own package it imports
    relatively (`from .x import`, directly or through another; e.g. moe_pipe.py's helpers in moe.py, ptx_ops.py
    and mxfp4_decode.py), and this one. Modules outside the kernels package (e.g. `..config`, read for shapes
    that are part of every key) are not hashed."""
    mod = importlib.import_module(spec.module)
    first = Path(mod.__file__).resolve()
    seen, todo = {first}, [first]
    while todo:
        for f in _package_imports(todo.pop(), first.parent):
            if f not in seen:
                seen.add(f)
                todo.append(f)
    return [first, *sorted(seen - {first}), Path(__file__).resolve()]


def source_hash(spec: KernelSpec) -> str:
    h = hashlib.sha256(f"format={FORMAT_VERSION}".encode())
    for path in source_files(spec):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def toolchain_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in TOOLCHAIN_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def symbol_name(key) -> str:
    """The exported function name: kernel name plus a digest of the key."""
    digest = hashlib.sha256(key_json(key).encode()).hexdigest()[:12]
    return f"kd_{spec_for(key).name}_{digest}"


def cache_digest(key) -> str:
    spec = spec_for(key)
    h = hashlib.sha256(key_json(key).encode())
    h.update(source_hash(spec).encode())
    h.update(json.dumps(toolchain_versions(), sort_keys=True).encode())
    return h.hexdigest()[:24]


def compiler_available() -> bool:
    try:
        importlib.import_module("cutlass.cute")
        importlib.import_module("tvm_ffi")
    except Exception:  # ImportError, or a broken install
        return False
    return True


# ---------------------------------------------------------------------------
# arch


def _arch_of(major: int, minor: int) -> str:
    suffix = "a" if major >= 9 else ""
    return f"sm_{major}{minor}{suffix}"


def current_arch() -> str | None:
    """The arch of the current CUDA device (`sm_90a` on H100/H200), or None without a GPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return _arch_of(*torch.cuda.get_device_capability())
    except Exception:
        return None


def resolve_arch(arch: str | None) -> str:
    """`arch` as given, else the current GPU's; refuse to guess on a machine without a GPU."""
    if arch:
        if not arch.startswith("sm_"):
            raise ValueError(f"arch must look like 'sm_90a', got {arch!r}")
        return arch
    found = current_arch()
    if found is None:
        raise ValueError(
            "no CUDA GPU here to take the arch from: name it (arch='sm_90a'). "
            "Without it the CuTe DSL compiler would silently target sm_100a."
        )
    return found


# ---------------------------------------------------------------------------
# compile, export, link


def compile_options(arch: str, dump_dir: str | None = None, keep: tuple[str, ...] = ("ptx",)) -> str:
    opts = f"--enable-tvm-ffi --gpu-arch {arch}"
    if dump_dir is not None:
        opts += "".join(f" --keep-{what}" for what in keep) + f" --dump-dir {dump_dir}"
    return opts


def compile_key(key, dump_dir: str | None = None, keep: tuple[str, ...] = ("ptx",)):
    """Run the CuTe DSL compiler for `key` (no GPU needed). Returns the compiled function.

    With `dump_dir`, the artifacts named in `keep` ("ptx", "cubin") are kept
    (the folder is created); read them as `compiled.__ptx__` / `compiled.__cubin__`.
    """
    import cutlass.cute as cute

    spec = spec_for(key)
    jit_fn, args = spec.build(key)
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
    return cute.compile(jit_fn, *args, options=compile_options(key.arch, dump_dir, keep))


def ptx_text(key) -> str:
    """Compile `key` and return its PTX text (used by the CI compile check)."""
    with tempfile.TemporaryDirectory(prefix="kd_ptx_") as tmp:
        compiled = compile_key(key, dump_dir=tmp)
        ptx = compiled.__ptx__  # a path, or (from the compiler's own cache) the text
        if ptx and ".entry" in ptx:
            return ptx
        if not ptx or not os.path.exists(ptx):
            raise RuntimeError(f"the compiler wrote no PTX for {key} (got {str(ptx)[:200]!r})")
        return Path(ptx).read_text()


def _cuobjdump() -> str:
    """cuobjdump from PATH, or the one Triton ships (Triton is a dependency of the test environment)."""
    import shutil

    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    try:
        import triton
        exe = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if exe.is_file():
            return str(exe)
    except ImportError:
        pass
    raise RuntimeError("cuobjdump not found: put the CUDA toolkit's bin on PATH or install triton")


def _cuobjdump_of(key, flag: str) -> str:
    """Compile `key` to a cubin (no GPU needed) and return `cuobjdump FLAG` of it."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="kd_cubin_") as tmp:
        compile_key(key, dump_dir=tmp, keep=("cubin",))
        cubins = sorted(Path(tmp).glob("*.cubin"))
        if not cubins:
            raise RuntimeError(f"the compiler wrote no cubin for {key}")
        return subprocess.run([_cuobjdump(), flag, str(cubins[0])], capture_output=True, text=True,
                              check=True).stdout


def resource_usage(key) -> dict[str, int]:
    """Compile `key` to a cubin (no GPU needed) and read its kernel's resources with `cuobjdump -res-usage`:
    registers per thread (REG), stack frame and local memory bytes (STACK, LOCAL: non-zero means spills),
    static shared memory (SHARED)."""
    import re

    out = _cuobjdump_of(key, "-res-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        raise RuntimeError(f"no resource line in cuobjdump's output for {key}: {out[:300]!r}")
    return dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, m.groups())))


def sass_text(key) -> str:
    """Compile `key` to a cubin and return its SASS (`cuobjdump -sass`): what ptxas made of the PTX."""
    return _cuobjdump_of(key, "-sass")


def runtime_libraries() -> list[str]:
    """libcute_dsl_runtime.so and libtvm_ffi.so of the installed toolchain (compile machine)."""
    from cutlass.cute.runtime import find_runtime_libraries

    libs = find_runtime_libraries(enable_tvm_ffi=True)
    if not any(Path(p).name == RUNTIME_LIB for p in libs):
        raise KernelUnavailable(f"{RUNTIME_LIB} not found in the nvidia-cutlass-dsl install: {libs}")
    return libs


def link_shared(objects: list[str], out_path: str) -> None:
    """Link exported objects into a shared library that finds its runtime next to itself."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelUnavailable("no C compiler (cc/gcc) to link the exported kernel objects")
    libs = runtime_libraries()
    cmd = [cc, "-shared", "-o", out_path, *objects]
    for lib in libs:
        cmd += [f"-L{Path(lib).parent}", f"-l:{Path(lib).name}"]
    cmd += ["-Wl,-rpath,$ORIGIN"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def export_shared(key, out_dir: str | Path, cubin_dir: str | Path | None = None) -> Path:
    """Compile `key`, export its object with `export_to_c` and link `<symbol>.so` in `out_dir`.

    With `cubin_dir`, the device code is also written there as `<symbol>.cubin`
    (for SASS inspection with cuobjdump/nvdisasm where a CUDA toolkit exists).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sym = symbol_name(key)
    if cubin_dir is None:
        compiled = compile_key(key)
    else:
        with tempfile.TemporaryDirectory(prefix="kd_cubin_") as tmp:
            compiled = compile_key(key, dump_dir=tmp, keep=("cubin",))
            cubin = compiled.__cubin__
            if isinstance(cubin, str) and os.path.exists(cubin):
                cubin = Path(cubin).read_bytes()
            if isinstance(cubin, (bytes, bytearray)):
                Path(cubin_dir).mkdir(parents=True, exist_ok=True)
                (Path(cubin_dir) / f"{sym}.cubin").write_bytes(cubin)
    obj = out_dir / f"{sym}.o"
    so = out_dir / f"{sym}.so"
    compiled.export_to_c(object_file_path=str(obj), function_name=sym)
    link_shared([str(obj)], str(so))
    obj.unlink()
    return so


# ---------------------------------------------------------------------------
# loading


_preloaded: dict[str, ctypes.CDLL] = {}


def _preload(path: str) -> None:
    if path not in _preloaded:
        _preloaded[path] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def _find_runtime_near(folder: Path) -> str | None:
    env = os.environ.get(ENV_RUNTIME)
    for cand in [env, folder / RUNTIME_LIB]:
        if cand and Path(cand).exists():
            return str(cand)
    if compiler_available():
        return next(p for p in runtime_libraries() if Path(p).name == RUNTIME_LIB)
    return None


def load_shared(so_path: str | Path, symbol: str):
    """Load one exported kernel; the CuTe runtime is looked for beside it, in
    $KIMI_DECODE_CUTE_RUNTIME, or in the installed compiler."""
    import tvm_ffi

    so_path = Path(so_path)
    runtime = _find_runtime_near(so_path.parent)
    if runtime is None:
        raise KernelUnavailable(
            f"{RUNTIME_LIB} not found beside {so_path} nor in ${ENV_RUNTIME}; "
            "the bundle runner unpacks it (see docs/toolchain.md)"
        )
    _preload(runtime)
    _preload(tvm_ffi.libinfo.find_libtvm_ffi())
    module = tvm_ffi.load_module(str(so_path))
    fn = getattr(module, symbol)
    return _Loaded(fn, module)


class _Loaded:
    """A loaded kernel; keeps its module alive."""

    __slots__ = ("fn", "module")

    def __init__(self, fn, module):
        self.fn = fn
        self.module = module

    def __call__(self, *args):
        return self.fn(*args)


def cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kimi_decode" / "kernels"


def artifact_dirs() -> list[Path]:
    """Where ahead-of-time artifacts are looked for, in order."""
    dirs = []
    env = os.environ.get(ENV_ARTIFACTS)
    if env:
        dirs.append(Path(env))
    dirs.append(_REPO_DIR / ".bundle" / "artifacts")
    return dirs


def read_manifest(folder: Path) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())


def check_entry(entry: dict, key, folder: Path) -> None:
    """Refuse an artifact built from other sources, for another arch or in another format."""
    spec = spec_for(key)
    where = folder / entry["file"]
    if entry.get("format") != FORMAT_VERSION:
        raise StaleArtifact(
            f"{where}: artifact format {entry.get('format')} but this package reads format "
            f"{FORMAT_VERSION}; rebuild with `kimi-decode build --arch {key.arch}`"
        )
    if entry["arch"] != key.arch:
        raise StaleArtifact(f"{where}: built for {entry['arch']}, asked for {key.arch}")
    current = source_hash(spec)
    if entry["source_hash"] != current:
        raise StaleArtifact(
            f"{where}: built from {spec.name} sources {entry['source_hash']} but this checkout "
            f"has {current} (a kernel file changed since `kimi-decode build`); rebuild the "
            f"artifacts with `kimi-decode build --arch {key.arch}` (or `kimi-decode bundle`)"
        )


def find_artifact(key) -> tuple[Path, dict] | None:
    """The manifest entry for `key` in the first artifact folder that has one (checked)."""
    spec = spec_for(key)
    want = key_dict(key)
    for folder in artifact_dirs():
        manifest = read_manifest(folder)
        if manifest is None:
            continue
        for entry in manifest["kernels"]:
            if entry["kernel"] == spec.name and entry["key"] == want:
                check_entry(entry, key, folder)
                return folder, entry
    return None


_memory: dict[Any, Any] = {}
_lock = threading.Lock()


def require_available(keys, where: str) -> None:
    """Refuse (KernelUnavailable), before any launch, a set of keys of which some can be neither compiled here
    nor found among the ahead-of-time artifacts; `where` says how to build them (e.g. `bundle --tuning`)."""
    if compiler_available():
        return
    missing = [k for k in keys if find_artifact(k) is None]
    if missing:
        raise KernelUnavailable(f"{len(missing)} of {len(keys)} kernels are not among the ahead-of-time artifacts "
                                f"in {[str(d) for d in artifact_dirs()]} (first: {key_json(missing[0])}); {where}")


def load(key):
    """The callable for `key`: memory, then JIT (disk cache), then ahead-of-time artifacts."""
    fn = _memory.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _memory.get(key)
        if fn is None:
            fn = _obtain(key)
            _memory[key] = fn
    return fn


def _obtain(key):
    if compiler_available():
        return _jit(key)
    found = find_artifact(key)
    if found is None:
        raise KernelUnavailable(
            f"the CuTe DSL compiler is not importable here and no ahead-of-time artifact matches "
            f"{key_json(key)} in {[str(d) for d in artifact_dirs()]}; build them on any machine "
            f"with `kimi-decode build --arch {key.arch}` (or install the `gpu` extra)"
        )
    folder, entry = found
    return load_shared(folder / entry["file"], entry["symbol"])


def _jit(key):
    folder = cache_dir()
    digest = cache_digest(key)
    so = folder / f"{digest}.so"
    sym = symbol_name(key)
    if so.exists():
        return load_shared(so, sym)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            built = export_shared(key, tmp)
            os.replace(built, so)  # atomic: concurrent processes never see half a file
        return load_shared(so, sym)
    except (KernelUnavailable, subprocess.CalledProcessError, OSError):
        # no linker or read-only cache: run the in-process compiled function
        return compile_key(key)


def clear_memory_cache() -> None:
    _memory.clear()


def manifest_entry(key, file: str) -> dict:
    spec = spec_for(key)
    return {
        "kernel": spec.name,
        "key": key_dict(key),
        "arch": key.arch,
        "symbol": symbol_name(key),
        "file": file,
        "source_hash": source_hash(spec),
        "toolchain": toolchain_versions(),
        "format": FORMAT_VERSION,
    }
