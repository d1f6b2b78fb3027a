"""Time the fused kernels on a GPU under CUDA graphs and write CSV with provenance.

    python scripts/bench_kernels.py --out DIR        (on the GPU host: bash .bundle/run.sh python ...)

GEMV: each decode shape (M×K×N) against torch.mm (cuBLAS) in the same run;
weights rotated across enough copies that the working set exceeds the 60 MB
L2 many times. Each graph holds one launch per copy; a replay is timed with
CUDA events; the figure is the median per launch over many replays.
AttnRes: batch 1/8/64 over rotated (p, δ, B) copies; bytes = reads + writes. Every kernel is checked against the
fp32 reference (outputs NaN-poisoned) before it is timed.
GEMM (`--only gemm`, M above 64): the shared-memory GEMM at the MoE front and tail shapes against torch.mm, each
checked against the fp32 reference first; TFLOP/s beside GB/s. Then the MoE tail with its epilogue: the tensor-core
tail GEMV that `fused` runs above 64 tokens against the GEMM with the tail's epilogue ('tgemm').
"""

import argparse
import csv
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kimi_decode import compile as kc  # noqa: E402
from kimi_decode.bench import driver_version, git_commit  # noqa: E402
from kimi_decode.kernels import attn_res as A  # noqa: E402
from kimi_decode.kernels import gemm as GM  # noqa: E402
from kimi_decode.kernels import gemv as G  # noqa: E402

PEAK_GBS = 4270.0  # measured device-to-device copy on the H200 (gpu_facts.md)
L2_BYTES = 60e6
ROTATE_BYTES = 12 * L2_BYTES


def provenance() -> dict:
    manifest = None
    for d in kc.artifact_dirs():
        manifest = kc.read_manifest(d)
        if manifest:
            break
    tc = kc.toolchain_versions()
    if manifest and not tc.get("nvidia-cutlass-dsl"):
        tc["nvidia-cutlass-dsl"] = manifest["toolchain"].get("nvidia-cutlass-dsl") + " (build host)"
    commit = git_commit()
    return {
        "gpu": torch.cuda.get_device_name(),
        "driver": driver_version() or "unknown",
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cutlass_dsl": tc.get("nvidia-cutlass-dsl"),
        "tvm_ffi": tc.get("apache-tvm-ffi"),
        "git_commit": commit or "uncommitted",
        "kernel_sources": json.dumps(manifest["source_hashes"]) if manifest else "",
        "utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def time_graph(launches, replays: int, warmup: int = 3) -> list[float]:
    """Capture `launches` (callables) into one graph; µs per launch for each timed replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in launches:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in launches:
            f()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(launches))
    return times


def summarize(times):
    s = sorted(times)
    return statistics.median(s), s[len(s) // 10], s[(9 * len(s)) // 10]


def rotated_weights(n: int, k: int) -> tuple[int, list[torch.Tensor]]:
    """(copies, weights): enough copies of a random [n, k] bf16 weight that rotating through them keeps L2 cold."""
    copies = max(3, math.ceil(ROTATE_BYTES / (n * k * 2)))
    return copies, [(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(copies)]


def timed_row(launches, replays: int, moved: int, **fields) -> tuple[dict, float]:
    """(CSV row, median µs): `fields` (kernel, impl, shape, ...) then the medians and p10/p90 of the graph of
    `launches`, the bytes each launch must move and the GB/s that makes against the copy bandwidth."""
    med, p10, p90 = summarize(time_graph(launches, replays))
    return dict(**fields, us_median=round(med, 3), us_p10=round(p10, 3), us_p90=round(p90, 3), bytes=moved,
                gbs=round(moved / med / 1e3, 1), frac_of_peak=round(moved / med / 1e3 / PEAK_GBS, 3)), med


def bench_gemv(rows, m_list, replays):
    for k, n in G.DECODE_SHAPES:
        wbytes = n * k * 2
        copies, ws = rotated_weights(n, k)
        for m in m_list:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            out_t = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            out_c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            impls = {
                "cute_gemv": [lambda w=w: G.gemv(x, w, out=out) for w in ws],
                "torch.mm": [lambda w=w: torch.mm(x, w.T, out=out_t) for w in ws],
            }
            for loop in (False, True):  # the tensor-core GEMV (GemvKey.mma) in each form built at this shape,
                # checked against the fp32 reference before it is timed
                if m > 1 and G.mma_built(k, n, G.pick_m_tile(m, mma=True), loop):
                    check_mma_gemv(x, ws[0], out_c, loop)
                    impls["cute_gemv_mma_loop" if loop else "cute_gemv_mma"] = [
                        lambda w=w, loop=loop: G.gemv(x, w, out=out_c, mma=True, mma_loop=loop) for w in ws]
            for impl, launches in impls.items():
                moved = wbytes + m * k * 2 + m * n * 2
                row, med = timed_row(launches, replays, moved, kernel="gemv", impl=impl, M=m, K=k, N=n, params="",
                                     copies=copies)
                rows.append(row)
                print(f"gemv {impl:9s} {m:2d}x{k}x{n}: {med:7.2f} us  {moved / med / 1e3:7.0f} GB/s", flush=True)
            # correctness spot check in the same run: each CuTe GEMV's output against torch.mm's
            G.gemv(x, ws[0], out=out)
            torch.mm(x, ws[0].T, out=out_t)
            torch.cuda.synchronize()
            diff = {"cute_gemv": (out.float() - out_t.float()).abs().max().item()}
            for loop in [lp for lp in (False, True) if ("cute_gemv_mma_loop" if lp else "cute_gemv_mma") in impls]:
                G.gemv(x, ws[0], out=out_c, mma=True, mma_loop=loop)
                torch.cuda.synchronize()
                name = "cute_gemv_mma_loop" if loop else "cute_gemv_mma"
                diff[name] = (out_c.float() - out_t.float()).abs().max().item()
            for r in rows[-len(impls):]:
                r["max_abs_diff_vs_torch"] = diff.get(r["impl"], diff["cute_gemv"])
        del ws
        torch.cuda.empty_cache()


def bench_gemm(rows, m_list, replays):
    for k, n in GM.MOE_SHAPES:
        wbytes = n * k * 2
        copies, ws = rotated_weights(n, k)
        for m in m_list:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = x.float() @ ws[0].float().T
            outs = {bm: torch.full((m, n), float("nan"), device="cuda") for bm in (64, 128)}
            out_t = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            impls = {"torch.mm": [lambda w=w: torch.mm(x, w.T, out=out_t) for w in ws]}
            diff = {}
            for bm, o in outs.items():  # the fp32 check before any timing
                GM.gemm(x, ws[0], out=o, bm=bm)
                torch.cuda.synchronize()
                if not torch.isfinite(o).all():
                    raise SystemExit(f"gemm bm={bm} {m}x{k}x{n}: NaN left in the output")
                diff[f"cute_gemm_bm{bm}"] = (o - ref).abs().max().item() / ref.abs().max().item()
                impls[f"cute_gemm_bm{bm}"] = [lambda w=w, o=o, bm=bm: GM.gemm(x, w, out=o, bm=bm) for w in ws]
            for impl, launches in impls.items():
                moved = wbytes + m * k * 2 + m * n * (2 if impl == "torch.mm" else 4)
                row, med = timed_row(launches, replays, moved, kernel="gemm", impl=impl, M=m, K=k, N=n, params="",
                                     copies=copies)
                rows.append({**row, "tflops": round(2 * m * n * k / med / 1e6, 1),
                             "max_rel_err_vs_fp32": diff.get(impl, "")})
                print(f"gemm {impl:16s} {m:3d}x{k}x{n}: {med:8.2f} us  {2 * m * n * k / med / 1e6:6.1f} TFLOP/s",
                      flush=True)
        del ws
        torch.cuda.empty_cache()
    bench_tail_gemm(rows, m_list, replays)


def bench_tail_gemm(rows, m_list, replays, tp: int = 8):
    """The MoE tail above 64 tokens: its tensor-core GEMV (what `fused` runs, m_tile 64) against the shared-memory GEMM
    with the tail's epilogue ('tgemm', bm 64 and 128), same inputs (W_up rotated; every shared buffer weighted), each
    checked against the fp32 epilogue first (every element written). GB/s counts W_up, r, Σ r², the tp shared
    buffers and the output."""
    from kimi_decode.kernels import moe as km

    k, n = GM.TAIL_SHAPE
    shape = km.shapes_for_tp(tp)
    copies, ws = rotated_weights(n, k)
    for m in m_list:
        r = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ssq = torch.rand(m, device="cuda") * k + 0.5 * k
        sh = torch.randn(tp, m, n, device="cuda").to(torch.bfloat16)
        coef = torch.rand(tp, device="cuda")
        ref = ((r.float() @ ws[0].float().T) * torch.rsqrt(ssq / k + shape.eps)[:, None]
               + torch.einsum("p,pmn->mn", coef, sh.float()))
        gemv = kc.load(km.tail_key_for(shape, m, False))
        impls = {"moe_tail_gemv": lambda w, o: gemv(w, r, ssq, sh, coef, o)}
        for bm in (64, 128):
            impls[f"cute_tail_gemm_bm{bm}"] = lambda w, o, bm=bm: GM.tail_gemm(r, w, ssq, sh, coef, out=o, bm=bm,
                                                                             eps=shape.eps)
        moved = n * k * 2 + m * k * 2 + m * 4 + tp * m * n * 2 + m * n * 2
        for impl, run in impls.items():
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            run(ws[0], out)
            torch.cuda.synchronize()
            err = (out.float() - ref).abs()
            if not (torch.isfinite(out).all() and (err <= 2 ** -8 * ref.abs() + 1e-3).all()):
                raise SystemExit(f"{impl} {m}x{k}x{n} tp{tp}: max err {err.max().item():.3g}, or NaN left in the output")
            row, med = timed_row([lambda w=w: run(w, out) for w in ws], replays, moved, kernel="moe_tail", impl=impl,
                                 M=m, K=k, N=n, params=f"tp={tp}", copies=copies)
            rows.append({**row, "tflops": round(2 * m * n * k / med / 1e6, 1),
                         "max_rel_err_vs_fp32": (err.max() / ref.abs().max()).item()})
            print(f"moe_tail {impl:20s} {m:3d}x{k}x{n}: {med:8.2f} us", flush=True)
    del ws
    torch.cuda.empty_cache()


def check_gemv(run, x, w, out, what: str) -> None:
    """NaN-poison `out`, `run()` a GEMV of x against w into it once, and require every element written and within
    twice the error of a bf16 torch.mm against the fp32 reference (the rule of tests/test_kernels_gemv.py)."""
    out.fill_(float("nan"))
    run()
    ref = x.float() @ w.float().T
    torch.cuda.synchronize()
    if not torch.isfinite(out).all():
        raise RuntimeError(f"{what} {tuple(x.shape)}x{tuple(w.shape)}: NaN left in the output")
    err = (out.float() - ref).abs().max().item()
    err_bf16 = ((x @ w.T).float() - ref).abs().max().item()
    if err > 2 * err_bf16 + 1e-3 * ref.abs().max().item():
        raise RuntimeError(f"{what} {tuple(x.shape)}x{tuple(w.shape)}: max err {err:.3g} vs bf16 {err_bf16:.3g}")


def check_mma_gemv(x, w, out, loop: bool = False):
    """`check_gemv` for the tensor-core GEMV (unrolled, or `loop`: the register-ring loop)."""
    check_gemv(lambda: G.gemv(x, w, out=out, mma=True, mma_loop=loop), x, w, out, "mma GEMV")


def bench_tuning(rows, ks, replays):
    """Every tiling of `G.tuning_keys` (built with `build --tuning`) at its m_tile's batch; only K in `ks` if given.
    Each tiling is checked against the fp32 reference before it is timed."""
    by_shape = {}
    for key in G.tuning_keys(kc.resolve_arch(None)):
        if ks and key.k not in ks:
            continue
        by_shape.setdefault((key.k, key.n), []).append(key)
    for (k, n), keys in by_shape.items():
        copies, ws = rotated_weights(n, k)
        for key in keys:
            m = 1 if key.m_tile == 1 else 8
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            try:
                fn = kc.load(key)
            except Exception as e:  # not built
                print(f"skip {key}: {e}")
                continue
            check_gemv(lambda w0=ws[0]: fn(w0, x, out, x, x), x, ws[0], out, f"GEMV tiling {key}")
            moved = n * k * 2 + m * k * 2 + m * n * 2
            row, med = timed_row([lambda w=w: fn(w, x, out, x, x) for w in ws], replays, moved, kernel="gemv",
                                 impl="cute_gemv_tuning", M=m, K=k, N=n, params=f"rows={key.rows} warps={key.warps} "
                                 f"unroll={key.unroll} m_tile={key.m_tile}", copies=copies)
            rows.append(row)
            print(f"tune {m}x{k}x{n} rows={key.rows} warps={key.warps} unroll={key.unroll}: {med:7.2f} us "
                  f"{moved / med / 1e3:6.0f} GB/s", flush=True)
        del ws
        torch.cuda.empty_cache()


def check_attn_res(c, n, j, w, use_delta, use_wo):
    """AttnRes + RMSNorm once on copies of the set `c` (y NaN-poisoned), against the fp32 reference: p + δ and the
    block write exact, y within twice the bf16-storage reference's error (the rule of tests/test_kernels_attn_res.py)."""
    from kimi_decode.reference.attn_res import attn_res
    from kimi_decode.reference.precision import Storage

    p, blocks, y = c["p"].clone(), c["blocks"].clone(), torch.full_like(c["y"], float("nan"))
    delta = c["delta"] if use_delta else None
    A.attn_res_fused(p, delta, blocks, n, j, w[0], w[1], w[2] if use_wo else None, out=y)
    torch.cuda.synchronize()
    args = [t.cpu() if isinstance(t, torch.Tensor) else t
            for t in (c["p"], delta, c["blocks"], n, j, w[0], w[1], w[2] if use_wo else None)]
    y_ref, p_ref, b_ref = attn_res(*args)
    y_bf = attn_res(*args, storage=Storage.BF16)[0]
    y = y.float().cpu()
    err, err_bf = (y - y_ref).abs().max().item(), (y_bf - y_ref).abs().max().item()
    if not (torch.isfinite(y).all() and torch.equal(p.cpu(), p_ref) and torch.equal(blocks.cpu(), b_ref)
            and err <= 2 * err_bf + 1e-3 * y_ref.abs().max().item()):
        raise RuntimeError(f"attn_res n={n} T={c['p'].shape[0]}: y max err {err:.3g} vs bf16 {err_bf:.3g}, or NaN "
                           f"left in y, or p / blocks differ from the reference")


def bench_attn_res(rows, t_list, replays):
    d, s = 7168, 8
    for n, use_delta, j, use_wo in [(8, True, -1, True), (4, True, -1, True), (1, True, -1, True)]:
        for T in t_list:
            per = T * d * 2
            copies = max(4, math.ceil(ROTATE_BYTES / (per * (n + 3))))
            sets = []
            for _ in range(copies):
                sets.append(dict(p=torch.randn(T, d, device="cuda").to(torch.bfloat16),
                                 delta=torch.randn(T, d, device="cuda").to(torch.bfloat16),
                                 blocks=torch.randn(T, s, d, device="cuda").to(torch.bfloat16),
                                 y=torch.empty(T, d, device="cuda", dtype=torch.bfloat16)))
            w = [(1 + 0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16) for _ in range(3)]
            check_attn_res(sets[0], n, j, w, use_delta, use_wo)
            launches = [lambda c=c: A.attn_res_fused(c["p"], c["delta"] if use_delta else None, c["blocks"], n, j,
                                                      w[0], w[1], w[2] if use_wo else None, out=c["y"]) for c in sets]
            moved = per * (1 + use_delta + n + 1 + 1) + 3 * d * 2  # read p, δ, n blocks; write p, y; weights
            row, med = timed_row(launches, replays, moved, kernel="attn_res", impl="cute_attn_res", M=T, K=d, N=n,
                                 params=f"n={n} delta={use_delta} j={j} norm_out={use_wo}", copies=copies)
            rows.append(row)
            print(f"attn_res n={n} T={T:2d}: {med:6.2f} us  {moved / med / 1e3:6.0f} GB/s", flush=True)
            del sets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--m", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--only", nargs="*", default=["gemv", "attn_res"], help="gemv, attn_res, tuning, gemm")
    ap.add_argument("--gemm-m", type=int, nargs="*", default=[128, 256, 512], help="gemm: tokens (65..512)")
    ap.add_argument("--tune-k", type=int, nargs="*", default=[], help="tuning: only these K")
    args = ap.parse_args()
    prov = provenance()
    print(json.dumps(prov), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    benches = [("gemv", bench_gemv, args.m), ("attn_res", bench_attn_res, [1, 8, 64]), ("tuning", bench_tuning, args.tune_k),
               ("gemm", bench_gemm, args.gemm_m)]
    for name, fn, sizes in benches:
        if name not in args.only:
            continue
        rows = []
        fn(rows, sizes, args.replays)
        path = out / f"kernels_{name}.csv" if name != "tuning" else out / "kernels_gemv_tuning.csv"
        keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
        with open(path, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=keys + list(prov))
            wr.writeheader()
            for r in rows:
                wr.writerow({**r, **prov})
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
