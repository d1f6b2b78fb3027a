"""The stock schedule with real TP all-reduces, one process per GPU (NCCL), timed under CUDA graphs.

    python -m kimi_decode.multi_gpu --gpus 8 --layers kda_moe,mla_moe,dense --batches 1,64 --dcps 1,2,4,8 \
        --allreduce nccl,oneshot --out CSV

Each process holds its rank of the layer at real shapes (`ShardSpec(tp=gpus, rank=r, dcp=d)`) and runs
`StockLayer(..., group=WORLD, dcp_group=...)`: every all-reduce is `dist.all_reduce` (NCCL, captured in
the CUDA graph), or with `--allreduce oneshot` a one-shot all-reduce over peer memory (torch symmetric
memory, `one_shot_all_reduce_out`: each rank reads every peer's partial over NVLink, as vLLM's custom
all-reduce does for small tensors); with DCP d > 1 (MLA layers) each rank holds only its positions of the latent cache, and
the query all-gather and the partials' all-to-all run over its DCP group (consecutive blocks of d ranks).
Checks before timing: every rank holds the same output after the final all-reduce, and it is finite and
fully written. Rank 0 also times the single-GPU emulation of the same rank (`StockLayer` without a
group: collectives emulated as in `docs/stock_schedule.md`), so each CSV row carries the emulation's
error. NVLink multicast stays off (`distributed.MULTICAST_OFF`), also in the spawned processes. With
`--gpus 1` it is a dry run of the NCCL path on one GPU (DCP 1 only).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .distributed import apply_multicast_off, dcp_groups, init


def check_step(w, shape, group, dcp_group, device, allreduce: str = "nccl") -> tuple[dict, torch.Tensor]:
    """One step of the stock layer with real collectives on this rank: ({ranks_agree, all_written}, h).
    Every rank of `group` must call it (it all-gathers the outputs to compare them)."""
    from .accuracy import all_written
    from .state import make_decode_state
    from .stock.schedule import StockLayer

    st = make_decode_state(w.kind, w.shard, shape, seed=1, device=device)
    layer = StockLayer(w, st, group=group, dcp_group=dcp_group, allreduce=allreduce)
    layer()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    h = layer.h.clone()
    gathered = [torch.empty_like(h) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, h, group=group)
    return {"ranks_agree": all(torch.equal(g, h) for g in gathered),
            "all_written": all_written(h) and bool(torch.isfinite(h.float()).all())}, h


def _worker(rank: int, world: int, init_method: str, args: dict, out: str) -> None:
    import pandas as pd

    from .accuracy import rel_err
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
    dcps = sorted(set(args["dcps"]) | {1})  # DCP 1 first: the reference the other sizes are compared with
    dgroups = {d: dcp_groups(d) for d in dcps}  # every rank creates every group, in one order
    rows, h_dcp1 = [], {}
    w0, w0_kind = None, None
    for kind, dcp in [(k, d) for k in args["layers"] for d in (dcps if k == "mla_moe" else (1,))]:
        shard = ShardSpec(tp=args["shard_tp"] or world, rank=rank, dcp=dcp)
        if kind != w0_kind:  # one layer's weights at a time (the DCP sizes share them)
            w0 = None
            torch.cuda.empty_cache()
            w0, w0_kind = make_layer_weights(kind, ShardSpec(tp=shard.tp, rank=rank), seed=0).to("cuda"), kind
        w = dataclasses.replace(w0, shard=shard)
        for b, ar in [(b, ar) for b in args["batches"] for ar in args["allreduce"]]:
            shape = DecodeShape(b, 1, args["context"])
            row = {"executor": "stock", "layer": kind, "tp": shard.tp, "dcp": dcp, "processes": world, "batch": b,
                   "context": args["context"], "collectives": ar}
            checks, h = check_step(w, shape, group, dgroups[dcp], "cuda", allreduce=ar)
            row.update(checks)
            if dcp == 1 and ar == args["allreduce"][0]:
                h_dcp1[(kind, b)] = h
            else:  # same weights and inputs: DCP and the collective only reorder sums
                row["rel_err_vs_dcp1"] = rel_err(h.float(), h_dcp1[(kind, b)].float())
            lb = layer_bytes(kind, shard, shape)
            streamed = lb.streamed
            row["floor_us_h200"] = lb.floor_seconds() * 1e6
            copies = choose_copies(streamed)
            execs = [StockLayer(w if i == 0 else weight_copy(w, i),
                                make_decode_state(kind, shard, shape, seed=2 + i, device="cuda"), group=group,
                                dcp_group=dgroups[dcp], allreduce=ar)
                     for i in range(copies)]
            dist.barrier()
            t = time_graph(execs, replays=args["replays"])
            row.update(us_median=t.us_median, us_p10=t.us_p10, us_p90=t.us_p90, kernels_measured=t.kernels_per_layer,
                       copies=copies)
            del execs
            if rank == 0 and ar == args["allreduce"][0]:  # the same rank with emulated collectives, same weights
                em = [StockLayer(w if i == 0 else weight_copy(w, i),
                                 make_decode_state(kind, shard, shape, seed=2 + i, device="cuda"))
                      for i in range(copies)]
                te = time_graph(em, replays=args["replays"])
                row.update(emulated_us_median=te.us_median, emulation_error=te.us_median / t.us_median - 1)
                del em
            torch.cuda.empty_cache()
            rows.append(row)
        del w
    del w0
    rows = [r for r in rows if r["dcp"] in args["dcps"] or r["layer"] != "mla_moe"]  # DCP 1 only as asked
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
    p.add_argument("--allreduce", default="nccl",
                   help="TP all-reduce implementations to time, e.g. nccl,oneshot (oneshot: torch symmetric memory, "
                        "one_shot_all_reduce, peers read over NVLink; no multicast)")
    p.add_argument("--dcps", default="1", help="DCP sizes for the MLA layers, each dividing --gpus (e.g. 1,2,4,8)")
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
    dcps = [int(d) for d in a.dcps.split(",")]
    for d in dcps:
        check_supported(dcp=d)
        if world % d:
            print(f"--dcps {d} does not divide --gpus {world}: a DCP group is {d} of the TP ranks")
            return 2
    from .stock.schedule import ALLREDUCE_KINDS
    allreduce = a.allreduce.split(",")
    if any(k not in ALLREDUCE_KINDS for k in allreduce):
        print(f"--allreduce takes {', '.join(ALLREDUCE_KINDS)}, got {a.allreduce}")
        return 2
    args = {"layers": a.layers.split(","), "batches": [int(b) for b in a.batches.split(",")], "dcps": dcps,
            "allreduce": allreduce,
            "context": a.context, "replays": a.replays, "shard_tp": a.shard_tp}
    apply_multicast_off()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, f"file://{os.path.join(tmp, 'rdv')}", args, a.out), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
