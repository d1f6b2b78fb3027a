"""`kimi-decode` command line: demo, bytes, check (and build/bundle when available)."""

from __future__ import annotations

import argparse
import json
import sys

from .config import LAYER_KINDS, DecodeShape, ShardSpec
from .support import UnsupportedConfiguration, check_supported, describe_supported, support_matrix


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
    except UnsupportedConfiguration as e:
        print(f"kimi-decode {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
