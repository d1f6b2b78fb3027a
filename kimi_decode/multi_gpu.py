"""The stock schedule with real TP all-reduces, one process per GPU (NCCL), timed under CUDA graphs.

    python -m kimi_decode.multi_gpu --gpus 8 --layers kda_moe,mla_moe,dense --batches 1,64 --out CSV

Each process holds its rank of the layer at real shapes (`ShardSpec(tp=gpus, rank=r)`) and runs
`StockLayer(..., group=WORLD)`: every all-reduce is `dist.all_reduce` (NCCL, captured in the CUDA
graph). Checks before timing: every rank holds the same output after the final all-reduce, and
it is finite and fully written. Rank 0 also times the single-GPU emulation of the same rank
(`StockLayer` without a group: all-reduces emulated as in `docs/stock_schedule.md`), so each CSV
row carries the emulation's error. NVLink multicast stays off (`distributed.MULTICAST_OFF`), also
in the spawned processes. With `--gpus 1` it is a dry run of the NCCL path on one GPU.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .distributed import apply_multicast_off, init


def _worker(rank: int, world: int, init_method: str, args: dict, out: str) -> None:
    import pandas as pd

    from .accuracy import all_written
    from .bench import provenance, time_graph
    from .config import DecodeShape, ShardSpec
    from .state import make_decode_state
    from .stock.schedule import StockLayer
    from .byte_counts import layer_bytes
    from .sweeps import choose_copies, weight_copy
    from .weights import make_layer_weights

    apply_multicast_off()
    init(rank, world, init_method, backend="nccl")
    group = dist.group.WORLD
    rows = []
    for kind in args["layers"]:
        shard = ShardSpec(tp=args["shard_tp"] or world, rank=rank)
        w = make_layer_weights(kind, shard, seed=0).to("cuda")
        for b in args["batches"]:
            shape = DecodeShape(b, 1, args["context"])
            row = {"executor": "stock", "layer": kind, "tp": shard.tp, "processes": world, "batch": b,
                   "context": args["context"], "collectives": "nccl"}
            st = make_decode_state(kind, shard, shape, seed=1, device="cuda")
            layer = StockLayer(w, st, group=group)
            layer()
            torch.cuda.synchronize()
            h = layer.h.clone()
            gathered = [torch.empty_like(h) for _ in range(world)]
            dist.all_gather(gathered, h)
            row["ranks_agree"] = all(torch.equal(g, h) for g in gathered)
            row["all_written"] = all_written(h) and bool(torch.isfinite(h.float()).all())
            streamed = layer_bytes(kind, shard, shape).streamed
            copies = choose_copies(streamed)
            execs = [StockLayer(w if i == 0 else weight_copy(w, i),
                                make_decode_state(kind, shard, shape, seed=2 + i, device="cuda"), group=group)
                     for i in range(copies)]
            dist.barrier()
            t = time_graph(execs, replays=args["replays"])
            row.update(us_median=t.us_median, us_p10=t.us_p10, us_p90=t.us_p90, kernels_measured=t.kernels_per_layer,
                       copies=copies)
            del execs
            if rank == 0:  # the same rank with emulated all-reduces, same process, same weights
                em = [StockLayer(w if i == 0 else weight_copy(w, i),
                                 make_decode_state(kind, shard, shape, seed=2 + i, device="cuda"))
                      for i in range(copies)]
                te = time_graph(em, replays=args["replays"])
                row.update(emulated_us_median=te.us_median, emulation_error=te.us_median / t.us_median - 1)
                del em
            torch.cuda.empty_cache()
            rows.append(row)
        del w
    if rank == 0:
        prov = provenance()
        pd.DataFrame([{**r, **prov} for r in rows]).to_csv(out, index=False)
        for r in rows:
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_decode.multi_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=None, help="processes, one per GPU (default: all visible)")
    p.add_argument("--layers", default="kda_moe,mla_moe,dense")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--shard-tp", type=int, default=None,
                   help="rank shapes of this TP size (default: --gpus); e.g. --gpus 1 --shard-tp 8 is a one-GPU "
                        "dry run of the NCCL path at TP8 rank shapes (the all-reduce spans one process)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("multi_gpu needs CUDA GPUs (NCCL); none is visible here")
        return 3
    world = a.gpus or torch.cuda.device_count()
    if world > torch.cuda.device_count():
        print(f"--gpus {world} but only {torch.cuda.device_count()} GPU(s) are visible")
        return 2
    from .support import check_supported
    shard_tp = a.shard_tp or world
    if shard_tp % world:
        print(f"--shard-tp {shard_tp} must be a multiple of --gpus {world}")
        return 2
    for kind in a.layers.split(","):
        check_supported(layer=kind, tp=shard_tp, batch=max(int(b) for b in a.batches.split(",")), context=a.context)
    args = {"layers": a.layers.split(","), "batches": [int(b) for b in a.batches.split(",")],
            "context": a.context, "replays": a.replays, "shard_tp": a.shard_tp}
    apply_multicast_off()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, f"file://{os.path.join(tmp, 'rdv')}", args, a.out), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
