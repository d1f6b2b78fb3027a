"""`kimi-decode ring-rate`: how fast a persistent bulk-copy ring streams weights on this GPU, by slot size, slots
in flight and CTAs per SM, with the consumers releasing each slot at once or after the tail ring's row loop
(`kernels/ring_rate.py`).

Each launch streams `mb` MB (default: W_up of the TP8 tail, 51.4 MB) from one of `copies` buffers, so that
nothing is L2-hot; the copies are captured in one CUDA graph and timed by `bench.time_graph` (median of the
replays, per launch). GB/s counts the bytes read; `fraction_of_copy` divides them by this card's measured
copy bandwidth (bytes read + written per second, `bench.measure_copy_bandwidth`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import pandas as pd

from .support import GPURequired

TAIL_MB = 7168 * 3584 * 2 / 1e6  # W_up at TP8: what the tail ring streams


def run_ring_rate(keys: Iterable | None = None, mb: float | None = None, copies: int = 4, replays: int = 100,
                  out_csv: str | Path | None = None, progress: bool = True) -> pd.DataFrame:
    """One row per (geometry, work): µs per launch (median, p10, p90 over `replays`), GB/s and the fraction
    of the copy bandwidth, with provenance. Every consumer warp's result is checked where it does the work."""
    import torch

    from . import compile as kc
    from .bench import measure_copy_bandwidth, provenance, time_graph
    from .kernels import ring_rate as kr

    if not torch.cuda.is_available():
        raise GPURequired("ring-rate measures a GPU's memory system and needs one (run it through the offline "
                           "bundle on the GPU host)")
    mb = TAIL_MB if mb is None else float(mb)
    if not 1 <= copies <= 64 or mb <= 0:
        raise ValueError(f"copies must be 1..64 and mb positive, got copies={copies}, mb={mb}")
    keys = list(keys) if keys is not None else kr.rate_keys(kc.resolve_arch(None))
    kc.require_available(keys, "the whole set is built by `kimi-decode bundle --tuning`")
    prov, copy_bw = provenance(), measure_copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    from tqdm.auto import tqdm
    jobs = [(k, w) for k in keys for w in (0, 1)]
    rows = []
    for key, work in tqdm(jobs, desc="ring-rate", disable=not progress):
        fn = kc.load(key)
        nblocks = max(1, round(mb * 1e6 / key.slot_bytes))
        elems = nblocks * key.slot_bytes // 2
        bufs = [torch.randn(elems, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        outs = [torch.full((nblocks, kr.RING_RATE_WARPS), float("nan"), device="cuda") for _ in range(copies)]
        arg = torch.tensor([nblocks, work, 1], dtype=torch.int32, device="cuda")
        if work:  # correctness first: each warp's quarter of each block, summed (x = 1), every sum written
            for b, o in zip(bufs, outs):
                fn(b, o, arg)
            torch.cuda.synchronize()
            for b, o in zip(bufs, outs):
                quarters = b.float().view(nblocks, kr.RING_RATE_WARPS, -1)
                ref = quarters.sum(-1)
                if not torch.isfinite(o).all():
                    raise RuntimeError(f"{key}: some consumer warp did not write its sum")
                err = (o - ref).abs().max().item()
                bound = 1e-4 * quarters.abs().sum(-1).max().item()
                if err > bound:
                    raise RuntimeError(f"{key}: sums differ from the reference by {err:.3g} (bound {bound:.3g})")
        t = time_graph([lambda b=b, o=o: fn(b, o, arg) for b, o in zip(bufs, outs)], replays=replays)
        nbytes = nblocks * key.slot_bytes
        rows.append(dict(slot_kb=key.slot_kb, stages=key.stages, ctas_per_sm=key.ctas // kr.H200_SMS,
                         kb_in_flight_per_sm=key.kb_in_flight_per_sm, work=bool(work), mbytes=nbytes / 1e6,
                         us_median=t.us_median, us_p10=t.us_p10, us_p90=t.us_p90,
                         achieved_GBps=nbytes / t.us_median / 1e3, copy_GBps=copy_bw / 1e9,
                         fraction_of_copy=nbytes / (t.us_median * 1e-6) / copy_bw, checked=bool(work), **prov))
        del bufs, outs
    df = pd.DataFrame(rows)
    if out_csv:
        Path(out_csv).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(out_csv, index=False)
    return df
