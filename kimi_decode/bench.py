"""Timing one decode step of a layer under CUDA graphs (the field's standard).

- `copies` instances of the layer, each with its own weights, state and buffers,
  are captured back to back in one CUDA graph, so consecutive layers never find
  each other's bytes in the 60 MB L2 (the copies together stream many times L2).
- The graph is replayed after a warm-up; each replay is timed with CUDA events;
  the per-layer time is replay time / copies; median, p10 and p90 over replays.
- Kernels per layer are counted from the captured graph itself (kernel nodes in
  the `cudaGraph_t`, read through the CUDA driver API), not from the inventory.
- Achieved bandwidth is the bytes the step must move (`byte_counts.layer_bytes`,
  with the active experts of the actual routing) over the median time; the floor
  is the same bytes at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import ctypes
import datetime
import math
import os
import platform
import re
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

# CUgraphNodeType (cuda.h)
_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
               6: "wait_event", 7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait",
               10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}


def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def _graph_nodes(graph: torch.cuda.CUDAGraph) -> list[int]:
    lib = _libcuda()
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    rc = lib.cuGraphGetNodes(handle, None, ctypes.byref(n))
    if rc != 0:
        raise RuntimeError(f"cuGraphGetNodes failed with CUresult {rc}")
    nodes = (ctypes.c_void_p * n.value)()
    rc = lib.cuGraphGetNodes(handle, nodes, ctypes.byref(n))
    if rc != 0:
        raise RuntimeError(f"cuGraphGetNodes failed with CUresult {rc}")
    return list(nodes)


def _node_type(lib, node) -> str:
    t = ctypes.c_int(0)
    rc = lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t))
    if rc != 0:
        raise RuntimeError(f"cuGraphNodeGetType failed with CUresult {rc}")
    return _NODE_TYPES.get(t.value, f"type{t.value}")


def graph_node_counts(graph: torch.cuda.CUDAGraph) -> dict[str, int]:
    """Node types of a captured graph (needs `CUDAGraph(keep_graph=True)`), e.g. {'kernel': 22, 'empty': 4}."""
    lib = _libcuda()
    counts: dict[str, int] = {}
    for node in _graph_nodes(graph):
        name = _node_type(lib, node)
        counts[name] = counts.get(name, 0) + 1
    return counts


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h, CUDA 12+)."""
    _fields_ = [("func", ctypes.c_void_p),
                ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def graph_kernel_names(graph: torch.cuda.CUDAGraph) -> list[str]:
    """The (mangled) function name of every kernel node of a captured graph, in the graph's node order.

    Read with cuGraphKernelNodeGetParams_v2 and cuFuncGetName (or cuKernelGetName for a library kernel);
    a node whose name the driver does not give back is listed as '?'."""
    lib = _libcuda()
    names = []
    for node in _graph_nodes(graph):
        if _node_type(lib, node) != "kernel":
            continue
        p = KernelNodeParams()
        rc = lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(p))
        if rc != 0:
            raise RuntimeError(f"cuGraphKernelNodeGetParams_v2 failed with CUresult {rc}")
        name = ctypes.c_char_p()
        ok = False
        if p.func:
            ok = lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(p.func)) == 0
        if not ok and p.kern:
            ok = lib.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(p.kern)) == 0
        names.append(name.value.decode(errors="replace") if ok and name.value else "?")
    return names


def short_kernel_name(name: str) -> str:
    """The kernel's own identifier from a mangled or demangled name: '_Z19splitKreduce_kernelILi32E...'
    -> 'splitKreduce_kernel', 'void cutlass::Kernel2<...>(...)' -> 'Kernel2', 'triton_kernel' -> itself."""
    if name.startswith("_Z"):
        s = name[2:].removeprefix("L")  # internal linkage
        if s.startswith("N"):  # nested name: take the last source name before 'E' / template args
            s, last = s[1:].lstrip("rVK"), ""  # cv-qualifiers of a member function
            while s and s[0].isdigit():
                m = re.match(r"(\d+)", s)
                k = int(m.group(1))
                last, s = s[len(m.group(1)):len(m.group(1)) + k], s[len(m.group(1)) + k:]
                if s.startswith("I"):  # template args of a component: stop at the first
                    break
            return last or name
        m = re.match(r"(\d+)", s)
        if m:
            return s[len(m.group(1)):len(m.group(1)) + int(m.group(1))]
        return name
    base = name.split("(")[0].split("<")[0].strip()
    return base.split()[-1].split("::")[-1] if base else name


def is_library_helper(name: str) -> bool:
    """True for a kernel that a library launches as part of one logical op rather than an op of its own:
    cuBLAS's split-K reduction, which follows a GEMM that cuBLAS chose to split along K. The inventory
    counts that GEMM once (one launch per vLLM op, as the layer contract's section 9 does)."""
    return "splitkreduce" in name.lower()


def measure_copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (median of `repeats`)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


@dataclass
class GraphTiming:
    us_median: float  # per layer
    us_p10: float
    us_p90: float
    replays: int
    copies: int
    kernels_per_layer: float  # every kernel node of the graph / copies
    node_counts: dict
    helper_kernels_per_layer: float = float("nan")  # of which library helpers (cuBLAS split-K reduce) / copies
    kernel_names: tuple = ()  # short names of the first copy's kernels, in node order
    # median of the first FIRST_REPLAYS timed replays (per layer): far above us_median, the warm-up was too short
    us_first: float = float("nan")
    warmup_replays: int = 0  # replays run before timing (at least `warmup`, more to fill `warmup_ms`)

    @property
    def copy_nodes_per_layer(self) -> float:
        """Memcpy and memset nodes per layer: a torch copy_ or fill between contiguous device tensors is
        captured as one of these instead of a kernel (e.g. KDA's copy into core_attn_out at TP16)."""
        return (self.node_counts.get("memcpy", 0) + self.node_counts.get("memset", 0)) / self.copies

    def count_columns(self) -> dict:
        """The kernel-count columns of a benchmark row: raw kernels, library helpers, copy nodes, launches as the
        inventory counts them, and the first layer copy's kernel sequence."""
        return dict(kernels_measured=self.kernels_per_layer, library_helpers_measured=self.helper_kernels_per_layer,
                    copy_nodes_measured=self.copy_nodes_per_layer, launches_measured=self.launches_per_layer,
                    kernel_sequence=";".join(self.kernel_names))

    @property
    def launches_per_layer(self) -> float:
        """The ops the stream ran per layer, as the inventory counts them: kernels, with each library helper
        counted as part of the op it finishes, plus memcpy / memset nodes."""
        return self.kernels_per_layer - self.helper_kernels_per_layer + self.copy_nodes_per_layer


FIRST_REPLAYS = 10  # GraphTiming.us_first: the median of this many of the first timed replays


def time_graph(step_fns: list[Callable[[], None]], replays: int = 100, warmup: int = 5,
               progress: bool = False, warmup_ms: float = 25.0) -> GraphTiming:
    """Capture `step_fns` (one per layer copy) in one CUDA graph; time its replays. Before timing it replays the
    graph `warmup` times and then, at that pace, as many more as fill `warmup_ms` of GPU time: in most MoE tables
    up to run 69 the executor timed right after the stock schedule had a tail of slow replays (p90 4-5 µs above
    its median on the H200, about 9 µs on the H100; under 1.5 µs for the other executors and for the same one
    timed first) after 5 warm-up replays of a few hundred microseconds each."""
    copies = len(step_fns)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the graph (Triton compiles, cuBLAS handles)
        for f in step_fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        for f in step_fns:
            f()
    counts = graph_node_counts(g)
    try:
        names = graph_kernel_names(g)
    except (AttributeError, RuntimeError):  # a driver without these entry points: counts only
        names = None
    g.instantiate()
    w0, w1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    w0.record()
    for _ in range(warmup):
        g.replay()
    w1.record()
    w1.synchronize()
    done = warmup
    if warmup > 0 and warmup_ms > 0:
        spent = w0.elapsed_time(w1)  # ms
        per = spent / warmup
        more = min(10_000, math.ceil((warmup_ms - spent) / per)) if per > 0 and spent < warmup_ms else 0
        for _ in range(more):
            g.replay()
        done += more
    torch.cuda.synchronize()
    times = []
    it = range(replays)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="graph replays", leave=False)
    for _ in it:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / copies)
    first = statistics.median(times[:FIRST_REPLAYS]) if times else float("nan")
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]
    per_copy = len(names) // copies if names else 0
    return GraphTiming(us_median=statistics.median(times), us_p10=q(0.1), us_p90=q(0.9), replays=replays,
                       copies=copies, kernels_per_layer=counts.get("kernel", 0) / copies, node_counts=counts,
                       helper_kernels_per_layer=(sum(map(is_library_helper, names)) / copies
                                                 if names is not None else float("nan")),
                       kernel_names=tuple(short_kernel_name(n) for n in (names or [])[:per_copy]),
                       us_first=first, warmup_replays=done)


def provenance() -> dict:
    """GPU, driver, CUDA, torch, Triton, cutlass-dsl, git commit, UTC time, host."""
    info = {"utc_time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "host": platform.node()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm=f"{p.major}{p.minor}", sms=p.multi_processor_count, driver=driver_version())
    for mod, key in (("triton", "triton"), ("cutlass", "cutlass_dsl")):
        try:
            info[key] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional packages
            info[key] = ""
    if not info.get("cutlass_dsl"):
        try:
            from importlib.metadata import version
            info["cutlass_dsl"] = version("nvidia-cutlass-dsl")
        except Exception:  # noqa: BLE001
            info["cutlass_dsl"] = bundle_compiler_version()
    info["git_commit"] = git_commit()
    return info


def bundle_compiler_version() -> str:
    """On a GPU host without the CuTe DSL compiler, the nvidia-cutlass-dsl version that compiled the offline
    bundle's kernels (`KIMI_DECODE_ARTIFACTS`/manifest.json, written by `kimi-decode bundle`), marked '(aot)';
    '' where there is no bundle or its manifest does not say."""
    import json

    folder = os.environ.get("KIMI_DECODE_ARTIFACTS")
    if not folder:
        return ""
    try:
        manifest = json.loads((Path(folder) / "manifest.json").read_text())
        found = (manifest.get("toolchain") or {}).get("nvidia-cutlass-dsl")
    except (OSError, ValueError, AttributeError):
        return ""
    return f"{found} (aot)" if found else ""


def driver_version() -> str:
    """The NVIDIA driver version from nvidia-smi, or '' where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0] if out else ""


def git_commit() -> str:
    """`$KIMI_DECODE_GIT_COMMIT` (set where the tree travels without .git), else this checkout's HEAD."""
    if os.environ.get("KIMI_DECODE_GIT_COMMIT"):
        return os.environ["KIMI_DECODE_GIT_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
