"""Nsight Compute profiles of one decode step, as pandas DataFrames.

One row per kernel launch, in launch order: the schedule's label for it, the
kernel name, duration, DRAM bytes read and written, achieved DRAM bandwidth,
SM and memory throughput (% of peak), registers per thread, shared memory,
achieved occupancy and the launch's share of the layer time.

Backends (chosen automatically, reported in the result):
- ``nsight-python`` in-process, where its Nsight Compute requirement is met
  (nsight-python >= 1.0 needs ncu >= 2026.2.1);
- ``ncu-cli``: the ``ncu`` command line run on this module in a subprocess
  (``python -m kimi_decode.profile STEP_JSON``), with NVTX ranges naming each
  launch, read back through Nsight Compute's ``ncu_report`` module. This is the
  backend on the project's H200 (ncu 2025.3.1), from scripts and notebooks alike.

Clocks are never locked (``--clock-control none``). Each run is saved to
``profiles/<executor>/<layer>-tp<T>-b<B>[-t<N>][-ctx<C>]/`` (report, summary CSV,
provenance) and `load_profile` turns any saved folder back into the DataFrame.

Run on the H200 (ncu 2025.3.1, ncu-cli backend): the committed profiles under
`profiles/` come from it; `docs/profiling.md` compares their kernel sums with
graph-replay timings.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

NSIGHT_PYTHON_MIN_NCU = (2026, 2, 1)

METRIC_SETS: dict[str, list[str]] = {
    "time": ["gpu__time_duration.sum"],
}
METRIC_SETS["memory"] = METRIC_SETS["time"] + [
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
]
METRIC_SETS["full"] = METRIC_SETS["memory"] + [
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_static",
    "launch__shared_mem_per_block_dynamic",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__grid_size",
    "launch__block_size",
]

# why warps did not issue (ncu's warp-state reasons), in warp-cycles per issued instruction: where a kernel's
# time goes when it is bound by neither bytes nor issue slots (latency chains, barriers, shared memory)
STALL_REASONS = ("barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle", "long_scoreboard",
                 "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction", "not_selected", "selected",
                 "short_scoreboard", "sleeping", "tex_throttle", "wait")
METRIC_SETS["stalls"] = METRIC_SETS["time"] + [
    f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio" for r in STALL_REASONS] + [
    "smsp__average_warp_latency_per_inst_issued.ratio",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed.sum",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
]

# metric -> column of the result frame
COLUMNS = {
    **{f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio": f"stall_{r}" for r in STALL_REASONS},
    "smsp__average_warp_latency_per_inst_issued.ratio": "warp_cycles_per_issue",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "smsp__inst_executed.sum": "warp_instructions",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pipe_active_pct",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": "smem_ld_wavefronts",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": "smem_ld_bank_conflicts",
    "gpu__time_duration.sum": "duration_ns",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory_throughput_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_throughput_pct",
    "launch__registers_per_thread": "registers_per_thread",
    "launch__shared_mem_per_block_static": "smem_static_bytes",
    "launch__shared_mem_per_block_dynamic": "smem_dynamic_bytes",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "launch__grid_size": "grid_size",
    "launch__block_size": "block_size",
}


class ProfilerUnavailable(RuntimeError):
    """No way to profile here: the message names what is missing."""


def register_metric_set(name: str, metrics: list[str], columns: dict[str, str] | None = None) -> None:
    """Add a named metric set (user-extendable); `columns` names the frame column of new metrics."""
    if not metrics or not all(isinstance(m, str) and m for m in metrics):
        raise ValueError("a metric set is a non-empty list of Nsight Compute metric names")
    METRIC_SETS[name] = list(dict.fromkeys(["gpu__time_duration.sum", *metrics]))
    for m in metrics:
        COLUMNS.setdefault(m, (columns or {}).get(m, m.replace(".", "_")))


@dataclass(frozen=True)
class ProfileRequest:
    executor: str = "stock"  # stock | compile
    layer: str = "kda_moe"
    tp: int = 8
    batch: int = 1
    tokens: int = 1
    context: int = 8192
    metric_set: str = "full"
    seed: int = 0

    def folder_name(self) -> str:
        name = f"{self.layer}-tp{self.tp}-b{self.batch}"
        if self.metric_set not in ("time", "memory", "full"):  # (their subsets of one layout share a folder)
            name = f"{self.metric_set}/{name}"  # e.g. a stall profile does not replace the full one
        if self.tokens != 1:
            name += f"-t{self.tokens}"
        if self.layer == "mla_moe":
            name += f"-ctx{self.context}"
        return name

    def check(self) -> None:
        from .support import check_supported

        check_supported(layer=self.layer, tp=self.tp, batch=self.batch, tokens_per_seq=self.tokens,
                        context=self.context)
        from .executors import check_executor_name
        check_executor_name(self.executor)
        if self.metric_set not in METRIC_SETS:
            raise ValueError(f"unknown metric set {self.metric_set!r}; known: {sorted(METRIC_SETS)}")


def profiles_root() -> Path:
    return Path(os.environ.get("KIMI_DECODE_PROFILES", Path(__file__).resolve().parents[1] / "profiles"))


def profile_folder(req: ProfileRequest, root: Path | None = None) -> Path:
    """profiles/<executor>/<configuration>/; a variant's '@' becomes '.' (fused-moe@fring -> fused-moe.fring)."""
    return (root or profiles_root()) / req.executor.replace("@", ".") / req.folder_name()


# ------------------------------------------------------------------ backends


def ncu_path() -> str | None:
    return shutil.which("ncu")


def parse_ncu_version(text: str) -> tuple[int, ...] | None:
    """'... Version 2025.3.1.0 (build 36398880) ...' -> (2025, 3, 1, 0)."""
    m = re.search(r"Version\s+(\d+(?:\.\d+)+)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def ncu_version() -> tuple[int, ...] | None:
    exe = ncu_path()
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_ncu_version(out)


def _nsight_python_importable() -> bool:
    try:
        import nsight  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def choose_backend(prefer: str | None = None) -> str:
    """'nsight-python' or 'ncu-cli'; raises ProfilerUnavailable naming what is missing."""
    import torch

    if not torch.cuda.is_available():
        raise ProfilerUnavailable("profiling needs a CUDA GPU and none is visible here; on a CPU machine "
                                  "load saved profiles with kimi_decode.profile.load_profile(folder)")
    version = ncu_version()
    if version is None:
        raise ProfilerUnavailable("Nsight Compute's `ncu` is not on PATH (both backends need it)")
    nsight_ok = _nsight_python_importable() and version[:3] >= NSIGHT_PYTHON_MIN_NCU
    if prefer == "nsight-python" and not nsight_ok:
        raise ProfilerUnavailable(
            "nsight-python backend unavailable: it needs `nsight-python` importable and ncu >= "
            f"{'.'.join(map(str, NSIGHT_PYTHON_MIN_NCU))}; found ncu {'.'.join(map(str, version))}")
    if prefer in (None, "nsight-python") and nsight_ok:
        return "nsight-python"
    if prefer not in (None, "ncu-cli", "nsight-python"):
        raise ValueError(f"backend must be 'nsight-python' or 'ncu-cli', got {prefer!r}")
    return "ncu-cli"


# ------------------------------------------------------------- the profiled step


def _build(req: ProfileRequest):
    """The executor for `req` on the GPU, warmed up (Triton compiled, cuBLAS handles created)."""
    import torch

    from .config import DecodeShape, ShardSpec
    from .state import make_decode_state
    from .weights import make_layer_weights

    shard = ShardSpec(tp=req.tp)
    shape = DecodeShape(req.batch, req.tokens, req.context)
    w = make_layer_weights(req.layer, shard, seed=req.seed).to("cuda")
    st = make_decode_state(req.layer, shard, shape, seed=req.seed, device="cuda")
    from .executors import make_executor
    ex = make_executor(req.executor)(w, st)
    for _ in range(2):
        ex()
    torch.cuda.synchronize()
    return ex


def labelled_launches(ex) -> list[tuple[str, object]]:
    """(label, run) for each launch of a stock layer; one unlabelled step for other executors."""
    if hasattr(ex, "launches") and ex.launches():
        return [(f"{i + 1:02d} {l.label}", l.run) for i, l in enumerate(ex.launches())]
    return [("step", ex)]


def _run_step_under_ncu(req: ProfileRequest) -> None:
    """Entry point of the ncu-cli subprocess: one decode step between cudaProfilerStart/Stop."""
    import torch

    ex = _build(req)
    launches = labelled_launches(ex)
    torch.cuda.cudart().cudaProfilerStart()
    for label, run in launches:
        torch.cuda.nvtx.range_push(label)
        run()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def ncu_command(req: ProfileRequest, report_base: Path) -> list[str]:
    exe = ncu_path() or "ncu"
    return [exe, "--profile-from-start", "off", "--clock-control", "none", "--nvtx",
            "--metrics", ",".join(METRIC_SETS[req.metric_set]), "-f", "-o", str(report_base),
            sys.executable, "-m", "kimi_decode.profile", json.dumps(asdict(req))]


def _ncu_env() -> dict:
    """The environment of the ncu subprocess: NVLink multicast off, this checkout's package importable."""
    from .distributed import multicast_off_env
    return dict(multicast_off_env(), PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))


def source_command(req: ProfileRequest, report_base: Path, kernels: str) -> list[str]:
    """ncu collecting per-instruction warp-state samples (the SourceCounters section, densest sampling) of the
    kernels whose names match the regular expression `kernels`, in one decode step."""
    exe = ncu_path() or "ncu"
    return [exe, "--profile-from-start", "off", "--clock-control", "none", "--nvtx",
            "--kernel-name", f"regex:{kernels}", "--section", "SourceCounters", "--section", "WarpStateStats",
            "--warp-sampling-interval", "0", "--import-source", "no", "-f", "-o", str(report_base),
            sys.executable, "-m", "kimi_decode.profile", json.dumps(asdict(req))]


def source_page(req: ProfileRequest, kernels: str, root: Path | None = None) -> Path:
    """Per-SASS-instruction stall samples of the matching kernels of one decode step: runs `source_command`, then
    writes ncu's source page as xz-compressed CSV (`SOURCE_FILE`: every instruction with its sampled warp states;
    `read_source_page`, `stall_hotspots`) next to the compressed report, in the profile folder's `source/`.
    Returns that folder."""
    if not kernels:
        raise ValueError("name the kernels to sample with a regular expression, e.g. 'up_kernel|down_kernel'")
    re.compile(kernels)
    req.check()
    choose_backend("ncu-cli")  # a GPU and the ncu command line, or ProfilerUnavailable naming what is missing
    folder = profile_folder(req, root) / "source"
    folder.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(source_command(req, folder / "profile", kernels), capture_output=True, text=True,
                         env=_ncu_env())
    log = res.stdout + res.stderr
    if res.returncode == 0:
        page = subprocess.run([ncu_path() or "ncu", "-i", str(folder / "profile.ncu-rep"), "--page", "source",
                               "--csv", "--print-source", "sass"], capture_output=True, text=True)
        import lzma
        with lzma.open(folder / SOURCE_FILE, "wt") as f:
            f.write(page.stdout)
        log += page.stderr
        res = page
    (folder / "ncu.log").write_text(log)
    if res.returncode != 0:
        raise RuntimeError(f"ncu failed with exit code {res.returncode}; see {folder / 'ncu.log'}")
    compress_report(folder)
    from .bench import provenance
    (folder / "provenance.json").write_text(json.dumps(
        {**provenance(), "request": asdict(req), "kernels": kernels, "ncu": ".".join(map(str, ncu_version() or ()))},
        indent=2, sort_keys=True))
    return folder


SOURCE_FILE = "source_sass.csv.xz"  # ncu's source page of the sampled kernels, as source_page leaves it


def read_source_page(path: str | Path) -> dict[str, pd.DataFrame]:
    """ncu's source page (CSV, one block per kernel, each opened by a "Kernel Name" line; plain or .xz) ->
    {kernel name: one row per SASS instruction, with its opcode (`op`, predicate and modifiers dropped)}."""
    import io
    import lzma

    path = Path(path)
    text = lzma.open(path, "rt").read() if path.suffix == ".xz" else path.read_text()
    out: dict[str, pd.DataFrame] = {}
    for block in re.split(r'^"Kernel Name",', text, flags=re.M)[1:]:
        name, _, rest = block.partition("\n")
        df = pd.read_csv(io.StringIO(rest))
        if "Source" not in df.columns:
            raise ValueError(f"{path}: a kernel block without a Source column: not ncu's source page")
        df["op"] = (df["Source"].astype(str).str.strip().str.replace(r"^@!?U?P\w+\s+", "", regex=True)
                    .str.split().str[0].str.split(".").str[0])
        out[name.strip().strip('",')] = df
    if not out:
        raise ValueError(f"{path} holds no kernel block: not ncu's source page (--page source --csv)")
    return out


def stall_hotspots(page: pd.DataFrame, top: int = 12) -> pd.DataFrame:
    """Where one kernel's warps were sampled, by opcode: share of all samples, instructions executed, and
    the sampled warp states (ncu's stall_* columns over all samples; the "Not Issued" ones are left out) of the
    `top` opcodes, busiest first."""
    samples = "Warp Stall Sampling (All Samples)"
    stalls = [c for c in page.columns if c.startswith("stall_") and "Not Issued" not in c]
    g = page.groupby("op")[[samples, "Instructions Executed", *stalls]].sum()
    g.insert(0, "share", g[samples] / max(float(g[samples].sum()), 1.0))
    g = g.sort_values(samples, ascending=False).head(top)
    return g.rename(columns={samples: "samples", "Instructions Executed": "instructions"})


def _import_ncu_report():
    try:
        import ncu_report  # the PyPI `ncu-report` package, or Nsight Compute's extras/python
        return ncu_report
    except ImportError:
        for extras in _ncu_extras_candidates():
            if (extras / "ncu_report.py").is_file():
                sys.path.insert(0, str(extras))
                import ncu_report
                return ncu_report
    raise ProfilerUnavailable("cannot import Nsight Compute's `ncu_report` module (pip install ncu-report, "
                              "or keep ncu's extras/python next to the ncu binary)")


def _ncu_extras_candidates() -> list[Path]:
    """Folders that may hold Nsight Compute's `ncu_report.py` (next to the ncu binary, or in the
    install tree it links into, or the usual install roots)."""
    import glob

    out: list[Path] = []
    exe = ncu_path()
    if exe:
        for base in (Path(exe).parent, Path(os.path.realpath(exe)).parent):
            out += [base / "extras" / "python", base.parent / "extras" / "python"]
            out += [Path(p) for p in sorted(glob.glob(str(base.parent / "nsight-compute*" / "extras" / "python")))]
    for pattern in ("/opt/nvidia/nsight-compute/*/extras/python", "/usr/local/cuda*/nsight-compute*/extras/python"):
        out += [Path(p) for p in sorted(glob.glob(pattern), reverse=True)]
    return out


def read_report(path: str | Path, metrics: list[str]) -> list[dict]:
    """Rows (label, kernel, metric values) from a .ncu-rep, in the order the kernels ran."""
    ncu_report = _import_ncu_report()
    ctx = ncu_report.load_report(str(path))
    rows = []
    for ri in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(ri)
        for ai in range(rng.num_actions()):
            action = rng.action_by_idx(ai)
            label = ""
            state = action.nvtx_state()
            for dom in state.domains():
                ranges = list(state.domain_by_id(dom).push_pop_ranges())
                if ranges:
                    label = ranges[-1]
            row = {"label": label, "kernel": action.name()}
            names = set(action.metric_names())
            for m in metrics:
                row[m] = action.metric_by_name(m).as_double() if m in names else float("nan")
            rows.append(row)
    return rows


def frame_from_rows(rows: list[dict], backend: str) -> pd.DataFrame:
    """The per-launch DataFrame from raw metric rows (names from METRIC_SETS), with derived columns."""
    df = pd.DataFrame(rows).rename(columns=COLUMNS)
    if df.empty:
        raise RuntimeError("the profile holds no kernels: was the step run between cudaProfilerStart/Stop?")
    df.insert(0, "order", range(1, len(df) + 1))
    df["duration_us"] = df["duration_ns"] / 1e3
    if {"dram_read_bytes", "dram_write_bytes"} <= set(df.columns):
        df["dram_GBps"] = (df.dram_read_bytes + df.dram_write_bytes) / df.duration_ns
    if {"smem_static_bytes", "smem_dynamic_bytes"} <= set(df.columns):
        df["smem_bytes"] = df.smem_static_bytes + df.smem_dynamic_bytes
    df["share_of_layer"] = df.duration_ns / df.duration_ns.sum()
    df["backend"] = backend
    return df


# ---------------------------------------------------------------- save / load


def compress_report(folder: Path) -> Path | None:
    """Replace `profile.ncu-rep` by `profile.ncu-rep.xz` (Nsight reports of a layer are ~10 MB and
    compress ~25×, which keeps `profiles/` small enough to commit and to carry to a GPU host)."""
    import lzma

    raw = Path(folder) / "profile.ncu-rep"
    if not raw.exists():
        return None
    out = raw.with_name(raw.name + ".xz")
    with open(raw, "rb") as f, lzma.open(out, "wb", preset=6) as g:
        shutil.copyfileobj(f, g)
    raw.unlink()
    return out


def report_file(folder: str | Path) -> Path:
    """The folder's Nsight Compute report as a `.ncu-rep` file (decompressed next to the `.xz` on
    first use), e.g. to open in the Nsight Compute GUI or `ncu --import`."""
    import lzma

    folder = Path(folder)
    raw = folder / "profile.ncu-rep"
    if raw.exists():
        return raw
    xz = folder / "profile.ncu-rep.xz"
    if not xz.exists():
        raise FileNotFoundError(f"{folder} holds no Nsight Compute report (profile.ncu-rep[.xz])")
    with lzma.open(xz, "rb") as f, open(raw, "wb") as g:
        shutil.copyfileobj(f, g)
    return raw


def save_profile(df: pd.DataFrame, folder: Path, provenance: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    df.to_csv(folder / "summary.csv", index=False)
    (folder / "provenance.json").write_text(json.dumps(provenance, indent=2, sort_keys=True))
    return folder


def load_profile(folder: str | Path) -> pd.DataFrame:
    """A saved profile folder back into the same DataFrame; provenance in `df.attrs`."""
    folder = Path(folder)
    summary = folder / "summary.csv"
    if not summary.exists():
        raise FileNotFoundError(f"{folder} holds no summary.csv: not a saved kimi_decode profile")
    df = pd.read_csv(summary)
    prov = folder / "provenance.json"
    df.attrs["provenance"] = json.loads(prov.read_text()) if prov.exists() else {}
    df.attrs["folder"] = str(folder)
    return df


def saved_profiles(root: Path | None = None) -> pd.DataFrame:
    """Every saved profile folder under `profiles/`: executor, configuration, kernels, total µs."""
    root = root or profiles_root()
    rows = []
    for summary in sorted(root.glob("*/*/summary.csv")):
        df = pd.read_csv(summary)
        rows.append({"executor": summary.parent.parent.name, "config": summary.parent.name,
                     "kernels": len(df), "total_us": float(df.duration_us.sum()), "folder": str(summary.parent)})
    return pd.DataFrame(rows, columns=["executor", "config", "kernels", "total_us", "folder"])


# ---------------------------------------------------------------- the entry


def profile(req: ProfileRequest, backend: str | None = None, save: bool = True,
            root: Path | None = None, graph: bool = True) -> pd.DataFrame:
    """Profile one decode step of `req` on this GPU; returns (and by default saves) the frame. With `graph`,
    the saved provenance also holds the step's CUDA-graph time measured right after (`graph_time`)."""
    from .bench import provenance

    req.check()
    chosen = choose_backend(backend)
    folder = profile_folder(req, root)
    folder.mkdir(parents=True, exist_ok=True)
    metrics = METRIC_SETS[req.metric_set]
    cmd: list[str] = []
    if chosen == "ncu-cli":
        cmd = ncu_command(req, folder / "profile")
        res = subprocess.run(cmd, capture_output=True, text=True, env=_ncu_env())
        (folder / "ncu.log").write_text(res.stdout + res.stderr)
        if res.returncode != 0:
            raise RuntimeError(f"ncu failed with exit code {res.returncode}; see {folder / 'ncu.log'}")
        rows = read_report(folder / "profile.ncu-rep", metrics)
        compress_report(folder)
    else:
        rows = _profile_nsight_python(req, metrics)
    df = frame_from_rows(rows, chosen)
    if save:
        prov = provenance()
        prov.update(request=asdict(req), backend=chosen, ncu=".".join(map(str, ncu_version() or ())),
                    command=" ".join(cmd) if cmd else "nsight-python in-process")
        if graph:
            t = graph_time(req)
            prov.update(graph_us_median=t.us_median, graph_us_p10=t.us_p10, graph_us_p90=t.us_p90,
                        graph_copies=t.copies, graph_kernels_per_step=t.kernels_per_layer)
        save_profile(df, folder, prov)
    return df


def graph_time(req: ProfileRequest, replays: int = 100):
    """The same step timed as the benchmarks time it (CUDA graph of several weight copies, so nothing is
    L2-hot; median of replays), in the profiling run itself: the profile's kernel sum is compared with this
    (`measured.profile_vs_graph`), same code, same machine, same hour."""
    import torch

    from .bench import time_graph
    from .config import DecodeShape, ShardSpec
    from .executors import make_executor
    from .sweeps import choose_copies, copies_of_step
    from .weights import make_layer_weights

    shard = ShardSpec(tp=req.tp)
    shape = DecodeShape(req.batch, req.tokens, req.context)
    w = make_layer_weights(req.layer, shard, seed=req.seed).to("cuda")
    execs = copies_of_step(make_executor(req.executor), req.layer, shard, shape, w, choose_copies(w.nbytes()),
                           req.seed, "cuda")
    t = time_graph(execs, replays=replays)
    del execs, w
    torch.cuda.empty_cache()
    return t


def _profile_nsight_python(req: ProfileRequest, metrics: list[str]) -> list[dict]:
    """In-process collection through nsight-python (one annotation per launch)."""
    import nsight

    ex = _build(req)
    launches = labelled_launches(ex)

    @nsight.analyze.kernel(configs=[(0,)], runs=1, metrics=metrics, combine_kernel_metrics=lambda a, b: a + b)
    def step(_):
        for label, run in launches:
            with nsight.annotate(label):
                run()

    res = step().to_dataframe()
    wide = res.pivot_table(index="Annotation", columns="Metric", values="AvgValue", aggfunc="first")
    order = [label for label, _ in launches]
    return [{"label": a, "kernel": a, **{m: float(wide.loc[a, m]) for m in metrics if m in wide.columns}}
            for a in order if a in wide.index]


if __name__ == "__main__":  # the ncu-cli subprocess
    _run_step_under_ncu(ProfileRequest(**json.loads(sys.argv[1])))
