"""`kimi-decode` command line: demo, bytes, check (and build/bundle when available)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .config import LAYER_KINDS, DecodeShape, ShardSpec
from .support import GPURequired, UnsupportedConfiguration, check_supported, describe_supported, support_matrix


def _add_shape_args(p: argparse.ArgumentParser, context_default: int = 4096) -> None:
    p.add_argument("--batch", type=int, default=1, help="sequences in the step (1..64; default 1)")
    p.add_argument("--tokens", type=int, default=1,
                   help="tokens per sequence: 1 = decode, 2..8 = speculative verify (default 1)")
    p.add_argument("--context", type=int, default=context_default,
                   help=f"cached tokens per sequence before the step (MLA layers; default {context_default})")


def _cmd_demo(args) -> int:
    from .demo import format_demo, run_demo

    check_supported(tp=args.tp, batch=args.batch, tokens_per_seq=args.tokens, context=args.context)
    shape = DecodeShape(args.batch, args.tokens, args.context)
    df = run_demo(tp=args.tp, shape=shape, seed=args.seed, progress=not args.no_progress)
    print(format_demo(df, args.tp, shape))
    return 0


def _cmd_bytes(args) -> int:
    from .byte_counts import layer_bytes

    check_supported(layer=args.layer, tp=args.tp, dcp=args.dcp, batch=args.batch,
                    tokens_per_seq=args.tokens, context=args.context)
    b = layer_bytes(args.layer, ShardSpec(tp=args.tp, dcp=args.dcp),
                    DecodeShape(args.batch, args.tokens, args.context), args.active_experts)
    d = b.as_dict()
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"{args.layer} layer, TP{args.tp} rank, DCP{args.dcp}, batch {args.batch} x {args.tokens} token(s), "
          f"context {args.context}")
    width = max(map(len, d))
    for k, v in d.items():
        if isinstance(v, float):
            print(f"  {k:<{width}} {v:,.2f}")
        elif isinstance(v, int) and k not in ("tp", "dcp", "batch", "tokens_per_seq", "context", "active_experts"):
            print(f"  {k:<{width}} {v:>16,} B")
        else:
            print(f"  {k:<{width}} {v}")
    return 0


def _cmd_check(args) -> int:
    try:
        check_supported(layer=args.layer, tp=args.tp, dcp=args.dcp, batch=args.batch,
                        tokens_per_seq=args.tokens, context=args.context, dtype=args.dtype, arch=args.arch)
    except UnsupportedConfiguration as e:
        print(f"kimi-decode check: {e}", file=sys.stderr)
        return 2
    print(describe_supported(args.layer, ShardSpec(tp=args.tp, dcp=args.dcp),
                             DecodeShape(args.batch, args.tokens, args.context)))
    return 0


def _cmd_inventory(args) -> int:
    from .inventory import inventory

    df = inventory(args.layer, args.tp, DecodeShape(args.batch, args.tokens, args.context), args.executor, args.dcp)
    if args.json:
        print(json.dumps({"layer": args.layer, "tp": args.tp, "executor": args.executor,
                          "launches": df.to_dict(orient="records"), "count": len(df)}, indent=2))
        return 0
    print(f"{args.executor} schedule, {args.layer} layer, TP{args.tp} rank" + (f", DCP{args.dcp}" if args.dcp > 1 else "")
          + f", batch {args.batch} x {args.tokens} "
          f"token(s), context {args.context}")
    print(df.to_string(index=False, formatters={"bytes_read": "{:,}".format, "bytes_written": "{:,}".format,
                                                "flops": "{:,}".format}))
    print(f"total: {len(df)} launches, {df.bytes_read.sum() + df.bytes_written.sum():,} bytes")
    return 0


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _executor_name(text: str) -> str:
    """argparse type of --executor: a known executor, or a fused one with @VARIANT (checked, no GPU needed)."""
    from .executors import check_executor_name
    try:
        check_executor_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _moe_executors(text: str) -> str:
    """argparse type of `moe --executors`: comma-separated MoE executors, each checked (its @VARIANT parsed) without a
    GPU, so that a typo fails before any work."""
    from .moe_bench import make_moe_executor
    names = [n for n in text.split(",") if n]
    if not names:
        raise argparse.ArgumentTypeError("give at least one executor, e.g. stock,fused")
    for name in names:
        try:
            make_moe_executor(name)
        except (ValueError, KeyError) as e:
            raise argparse.ArgumentTypeError(f"{name}: {e}") from None
    return ",".join(names)


def _cmd_sweep(args) -> int:
    from .executors import make_executor
    from .sweeps import run_sweep, stock_configs

    configs = stock_configs(kinds=tuple(args.layers.split(",")), tps=_ints(args.tps), batches=_ints(args.batches),
                            contexts=_ints(args.contexts), dcps=_ints(args.dcps))
    configs = [(k, t, DecodeShape(s.batch, n, s.context_lens), d) for n in _ints(args.tokens) for k, t, s, d in configs]
    if args.executor != "stock" and any(d > 1 for *_, d in configs):
        print(f"--dcps above 1 runs the stock schedule only (its MLA path shards the cache); got --executor "
              f"{args.executor}")
        return 2
    df = run_sweep(make_executor(args.executor), args.executor, configs, out_csv=args.out,
                   replays=args.replays, progress=not args.no_progress, timed=not args.check_only)
    print(f"{len(df)} configurations, {int(df.check_ok.sum())} passed the reference check"
          + (f"; written to {args.out}" if args.out else ""))
    return 0 if bool(df.check_ok.all()) else 1


def _add_run_args(p, tokens_help: str) -> None:
    """The arguments every checked-and-timed GPU run shares (`sweep`, `moe`)."""
    p.add_argument("--tokens", default="1", help=tokens_help)
    p.add_argument("--replays", type=int, default=100)
    p.add_argument("--out", default=None, help="CSV to write (e.g. data/measured/NAME.csv)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--check-only", action="store_true",
                   help="only compare each configuration with the fp32 reference (no graph capture, no timing)")


def _cmd_moe(args) -> int:
    from .moe_bench import run_moe_breakdown, run_moe_sweep

    if args.trace:
        from .moe_trace import run_moe_trace, sub_partition_summary, summarize_trace, warp_item_summary
        if len(_ints(args.tps)) != 1:
            raise SystemExit("--trace takes one --tps value")
        exe = args.executors.split(",")
        if len(exe) != 1 or exe[0].partition("@")[0] != "fused":
            raise SystemExit("--trace times the pipelined kernels of one executor: --executors fused[@variant]")
        df = run_moe_trace(_ints(args.tps)[0], _ints(args.batches), variant=exe[0].partition("@")[2] or None,
                           replays=args.replays, out_csv=args.out, progress=not args.no_progress)
        print(summarize_trace(df).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        print("moe_up, cycles from an item's slot arrival, per warp (median over CTAs and copies):")
        print(warp_item_summary(df).to_string(index=False, float_format=lambda v: f"{v:.0f}"))
        print("moe_up, by sub-partition (warp w runs on w mod 4): cycles until its last warp stored its partials:")
        print(sub_partition_summary(df).to_string(index=False, float_format=lambda v: f"{v:.0f}"))
        return 0

    if args.breakdown:
        if len(_ints(args.tps)) != 1:
            raise SystemExit("--breakdown takes one --tps value")
        df = run_moe_breakdown(args.executors.split(","), _ints(args.tps)[0], _ints(args.batches),
                               replays=args.replays, out_csv=args.out)
        print(df[["executor", "batch", "launch", "label", "prefix_us", "added_us", "GBps_of_added"]]
              .to_string(index=False, float_format=lambda v: f"{v:.1f}"))
        return 0 if bool(df.check_ok.all()) else 1

    df = run_moe_sweep(args.executors.split(","), _ints(args.tps), _ints(args.batches), _ints(args.tokens),
                       replays=args.replays, out_csv=args.out, timed=not args.check_only,
                       progress=not args.no_progress)
    print(f"{len(df)} runs, {int(df.check_ok.sum())} passed the reference check"
          + (f"; written to {args.out}" if args.out else ""))
    return 0 if bool(df.check_ok.all()) else 1


def _cmd_results(args) -> int:
    from .measured import PROFILE_OVERHEAD_BOUNDS, all_names, markdown_table, profile_vs_graph, results_markdown

    if args.list is not None:
        found = all_names(args.list)
        print("\n".join(found) if found else f"no measured CSV matches {args.list!r}")
        return 0 if found else 1
    if args.name is None:
        print("kimi-decode results: give a NAME (or --list [GLOB] to see them)", file=sys.stderr)
        return 2
    if args.name == "profile-vs-graph":
        df = profile_vs_graph()
        print(markdown_table(df))
        lo, hi = PROFILE_OVERHEAD_BOUNDS
        bad = df[(df.ratio < lo) | (df.ratio > hi)]
        print(f"\n{len(df) - len(bad)} of {len(df)} profiles within {lo}-{hi}x of the graph-replay time")
        return 0 if bad.empty else 1
    try:
        print(results_markdown(args.name))
    except FileNotFoundError as e:
        print(f"kimi-decode results: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_profile(args) -> int:
    from .profile import ProfileRequest, ProfilerUnavailable, profile, profile_folder

    req = ProfileRequest(args.executor, args.layer, args.tp, args.batch, args.tokens, args.context,
                         args.metrics, args.seed)
    req.check()
    if args.source is not None:
        import re
        try:
            re.compile(args.source)
        except re.error as e:
            print(f"kimi-decode profile: --source is not a regular expression ({e})", file=sys.stderr)
            return 2
    try:
        df = profile(req, backend=args.backend)
    except ProfilerUnavailable as e:
        print(f"kimi-decode profile: {e}", file=sys.stderr)
        return 3
    cols = [c for c in ("order", "label", "kernel", "duration_us", "dram_GBps", "registers_per_thread",
                        "achieved_occupancy_pct", "share_of_layer") if c in df.columns]
    print(df[cols].to_string(index=False))
    print(f"{len(df)} kernels, {df.duration_us.sum():.1f} µs in total ({df.backend.iloc[0]}); "
          f"saved to {profile_folder(req)}")
    if args.source:
        from .profile import source_page
        print(f"source counters: {source_page(req, args.source)}")
    return 0


def _cmd_ring_rate(args) -> int:
    from .ring_rate import run_ring_rate
    try:
        df = run_ring_rate(mb=args.mb, copies=args.copies, out_csv=args.out, progress=not args.no_progress)
    except (RuntimeError, ValueError) as e:
        print(f"kimi-decode ring-rate: {e}", file=sys.stderr)
        return 3
    print(df[["slot_kb", "stages", "ctas_per_sm", "kb_in_flight_per_sm", "work", "us_median", "achieved_GBps",
              "fraction_of_copy"]].round(3).to_string(index=False))
    if args.out:
        print(f"written to {args.out}")
    return 0


def _cmd_mma_rate(args) -> int:
    from .mma_rate import run_mma_rate
    try:
        df = run_mma_rate(outer=args.outer, out_csv=args.out, progress=not args.no_progress)
    except RuntimeError as e:
        print(f"kimi-decode mma-rate: {e}", file=sys.stderr)
        return 3
    print(df[["warps", "chains", "decode", "cycles_per_mma", "clock_GHz", "moe_up_item_cycles_if_mma_bound"]]
          .round(2).to_string(index=False))
    if args.out:
        print(f"written to {args.out}")
    return 0


def _cmd_matrix(args) -> int:
    for row in support_matrix():
        print(f"{row.axis:<20} {row.supported}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kimi-decode",
        description="Kimi K3 decode-step workbench: reference layer, byte accounting, support matrix, kernels.",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run one decode step of each layer type through the reference (CPU)",
                       description="Build one TP rank of each layer type (dense layer 0, KDA+MoE, MLA+MoE) at "
                                   "real shapes with seeded random weights, run a decode step through the fp32 "
                                   "reference and print weight bytes, the H200 memory floor and the CPU time.")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size of the rank (8 or 16; default 8)")
    _add_shape_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("bytes", help="bytes one rank streams and keeps resident for one layer's decode step",
                       description="Exact byte accounting (weights, KV, state, activations) of one decode step "
                                   "of one layer on one rank, and its H200 memory floor.")
    p.add_argument("--layer", required=True, choices=LAYER_KINDS)
    p.add_argument("--tp", type=int, default=8, help="8 or 16 (default 8)")
    p.add_argument("--dcp", type=int, default=1, help="decode context parallel size, MLA layers (default 1)")
    _add_shape_args(p)
    p.add_argument("--active-experts", type=int, default=None,
                   help="distinct routed experts read (default: expected under uniform routing; 16 for one token)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_bytes)

    p = sub.add_parser("check", help="check a configuration against the support matrix",
                       description="Exit 0 with a one-line summary when the configuration is supported, "
                                   "non-zero with the reason otherwise. Unspecified axes take their defaults.")
    p.add_argument("--layer", default="kda_moe", help=f"one of {', '.join(LAYER_KINDS)} (default kda_moe)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--dcp", type=int, default=1)
    _add_shape_args(p)
    p.add_argument("--dtype", default="bfloat16", help="activation dtype (default bfloat16)")
    p.add_argument("--arch", default=None, help="GPU arch to check, e.g. sm_90a (default: not checked)")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("inventory", help="list every launch of an executor for one layer's decode step",
                       description="Every kernel launch of the chosen executor for one decode step of one layer on "
                                   "one rank, in order: label, the vLLM op it stands for, implementation, stream, "
                                   "bytes read/written, FLOPs; and the total count.")
    p.add_argument("--layer", required=True, choices=LAYER_KINDS)
    p.add_argument("--tp", type=int, default=8, help="8 or 16 (default 8)")
    p.add_argument("--executor", default="stock", choices=["stock"])
    p.add_argument("--dcp", type=int, default=1, help="decode context parallel size, MLA layers (default 1)")
    _add_shape_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_inventory)

    p = sub.add_parser("sweep", help="check and time an executor over layers, TP, batch and context (GPU)",
                       description="For each configuration: check against the fp32 reference (NaN-poisoned outputs), "
                                   "then time it under CUDA graphs (layer copies rotated through L2, CUDA events, "
                                   "median of replays), count the kernels in the captured graph, and report GB/s "
                                   "and the fraction of the memory floor. Writes a CSV with provenance.")
    p.add_argument("--executor", default="stock", choices=["stock", "compile"],
                   help="stock: the stock-vLLM schedule; compile: the reference under torch.compile")
    p.add_argument("--layers", default="dense,kda_moe,mla_moe")
    p.add_argument("--tps", default="8,16")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="8192,32768", help="MLA contexts (KDA layers use the first)")
    p.add_argument("--dcps", default="1",
                   help="decode context parallel sizes for the MLA layers, e.g. 1,2,4,8 (stock: one rank with the "
                        "DCP collectives emulated; other layers run DCP 1)")
    _add_run_args(p, "tokens per sequence, e.g. 1 or 1,4,8 (2..8 = speculative verify)")
    p.set_defaults(func=_cmd_sweep)

    p = sub.add_parser("moe", help="check and time the MoE half: stock (15 launches) vs fused (4-5) (GPU)",
                       description="For each TP, batch and tokens per sequence: run the MoE half of a layer with each "
                                   "executor on a fresh input, compare with the fp32 reference (NaN-poisoned outputs), "
                                   "then time it under CUDA graphs (weights rotated through L2) and report the floor "
                                   "ratio and the speedup of fused over stock. Writes a CSV with provenance.")
    p.add_argument("--executors", default="stock,fused", type=_moe_executors,
                   help="comma-separated: stock, fused, fused5, fused-nopdl, fused-pdl, fused-direct, fused-pipeup; "
                        "fused@VARIANT and fused-direct@VARIANT take options joined by '-' (e.g. fused@wdownsh8, "
                        "fused@fgemm-tgemm: the front and tail as the shared-memory GEMM above 64 tokens); the "
                        "options are listed in FusedMoE's docstring and docs/fused_moe.md, and a malformed name is "
                        "refused before any GPU work")
    p.add_argument("--tps", default="8", help="tensor-parallel shards, e.g. 8 or 8,16")
    p.add_argument("--batches", default="1,8,64", help="sequences per step, e.g. 1,8,64 (1..64)")
    _add_run_args(p, "tokens per sequence, e.g. 1,4,8 (batch x tokens <= 512 fused)")
    p.add_argument("--breakdown", action="store_true",
                   help="time the graph of each executor's first k launches, k = 1..n: what each launch adds "
                        "inside the graph (one --tps; tokens per sequence 1)")
    p.add_argument("--trace", action="store_true",
                   help="timeline of the pipelined expert kernels in the graph: per CTA, the time of each checkpoint "
                        "(start, wait, staging, every item's slot arrival and completion, flushes, end); one --tps, "
                        "--executors fused[@variant], batch x tokens <= 8")
    p.set_defaults(func=_cmd_moe)

    p = sub.add_parser("results", help="print a measured CSV (data/measured/NAME.csv) as the docs' markdown table")
    p.add_argument("name", nargs="?", help="a CSV name, or profile-vs-graph (saved profiles' kernel sums vs graph "
                                            "replay)")
    p.add_argument("--list", nargs="?", const="*", metavar="GLOB",
                   help="list the measured CSVs' names (those matching GLOB, e.g. 'moe_half_*') instead")
    p.set_defaults(func=_cmd_results)

    p = sub.add_parser("profile", help="Nsight Compute profile of one decode step, one row per kernel (GPU)",
                       description="Profile one decode step of an executor with Nsight Compute (nsight-python where "
                                   "its ncu requirement is met, else the ncu CLI in a subprocess; clocks unlocked) "
                                   "and save profiles/<executor>/<layer>-tp<T>-b<B>[-ctx<C>]/ with the report, a "
                                   "CSV summary and provenance.")
    p.add_argument("--executor", default="stock", type=_executor_name,
                   help="stock, compile: a whole layer; stock-moe, fused-moe, fused5-moe: the MoE half only "
                        "(fused-moe@VARIANT: with the options of `moe --executors fused@VARIANT`, e.g. "
                        "fused-moe@fring; saved under profiles/fused-moe.VARIANT/); cute-kernels: the layer's "
                        "stand-alone CuTe kernels (AttnRes, decode GEMVs)")
    p.add_argument("--layer", required=True, choices=LAYER_KINDS)
    p.add_argument("--tp", type=int, default=8)
    _add_shape_args(p, context_default=8192)
    p.add_argument("--metrics", default="full",
                   help="metric set: time, memory, full (default), stalls (warp-state reasons, issue activity, "
                        "shared-memory wavefronts and bank conflicts; saved under profiles/<executor>/stalls/)")
    p.add_argument("--source", default=None, metavar="REGEX",
                   help="also sample the warp states of every SASS instruction of the kernels matching REGEX "
                        "(ncu's source page, saved as source/source_sass.csv.xz in the profile folder)")
    p.add_argument("--backend", default=None, choices=["nsight-python", "ncu-cli"],
                   help="force a backend (default: chosen automatically)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("mma-rate", help="cycles per mma.sync (bf16 m16n8k16) on one SM sub-partition (GPU)",
                       description="Time mma.sync.m16n8k16 bf16 on every SM (one CTA each) for 4-32 warps and 1-2 "
                                   "independent chains, alone and behind the MXFP4 pair decode "
                                   "(kernels/mma_rate.py): cycles per mma per sub-partition, and what a moe_up item "
                                   "(56 mmas per sub-partition) would cost if the mma alone bounded it.")
    p.add_argument("--outer", type=int, default=None, help="rounds of 8 mmas per chain between the clock reads "
                                                            "(default kernels.mma_rate.MMA_RATE_OUTER)")
    p.add_argument("--out", default=None, help="CSV to write")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_mma_rate)

    p = sub.add_parser("ring-rate", help="GB/s of a persistent bulk-copy ring by slot size, depth and CTAs per SM (GPU)",
                       description="Stream MB of weights through the ring of the one-token tail (kernels/ring_rate.py) "
                                   "for each geometry built ahead of time, with the consumers releasing each slot at "
                                   "once or after the tail ring's row loop, under a CUDA graph over several buffer "
                                   "copies: µs per launch, GB/s, and the fraction of this card's copy bandwidth.")
    p.add_argument("--mb", type=float, default=None, help="MB per launch (default: W_up at TP8, 51.4)")
    p.add_argument("--copies", type=int, default=4, help="buffers the graph rotates over (default 4)")
    p.add_argument("--out", default=None, help="CSV to write")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_ring_rate)

    p = sub.add_parser("matrix", help="print the support matrix")
    p.set_defaults(func=_cmd_matrix)

    try:  # the kernel toolchain commands live with the compile path
        from .bundle import add_build_parser, add_bundle_parser
    except ImportError:
        pass
    else:
        add_build_parser(sub)
        add_bundle_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UnsupportedConfiguration, GPURequired) as e:  # a request this machine or the matrix cannot serve
        print(f"kimi-decode {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the output piped into `head` and the like, which stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
