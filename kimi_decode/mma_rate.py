"""`kimi-decode mma-rate`: cycles per `mma.sync.m16n8k16` bf16 on one SM sub-partition of this GPU, alone or
behind the MXFP4 pair decode, against warps and independent chains (`kernels/mma_rate.py`).

The pipelined moe_up issues 56 mmas per SM sub-partition per item (14 warps × 16, or 28 × 8) and takes about
2300 cycles per item; `cycles_per_mma` × 56 is what an item would cost if the mma alone bounded it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import pandas as pd

from .support import GPURequired

MOE_UP_MMAS_PER_SMSP = 56  # per item: 16 rows × 3584 codes / (16 × 16 per mma) over 4 sub-partitions


def run_mma_rate(keys: Iterable | None = None, outer: int | None = None, repeats: int = 5,
                 out_csv: str | Path | None = None, progress: bool = True) -> pd.DataFrame:
    """One row per configuration: median over `repeats` launches of the median CTA's slowest warp, as cycles
    per mma per sub-partition, the SM clock (cycles / ns) and the launch's µs, with provenance."""
    import torch

    from . import compile as kc
    from .bench import provenance
    from .kernels import mma_rate as km

    if not torch.cuda.is_available():
        raise GPURequired("mma-rate measures a GPU's tensor cores and needs one (run it through the offline "
                           "bundle on the GPU host)")
    keys = list(keys) if keys is not None else km.rate_keys(kc.resolve_arch(None))
    kc.require_available(keys, "the whole set is built by `kimi-decode bundle --tuning`")
    outer = km.MMA_RATE_OUTER if outer is None else int(outer)
    if outer < 1:
        raise ValueError(f"outer rounds must be at least 1, got {outer}")
    rows, prov = [], provenance()
    from tqdm.auto import tqdm
    it = tqdm(keys, desc="mma-rate", disable=not progress)
    gen = torch.Generator(device="cpu").manual_seed(0)
    for key in it:
        fn = kc.load(key)
        out = torch.zeros(km.MMA_RATE_SMS, key.warps, 3, dtype=torch.int64, device="cuda")
        seed = torch.randint(0, 1 << 30, (33,), generator=gen, dtype=torch.int32)
        seed[32] = outer
        seed = seed.cuda()
        cyc, ns = [], []
        for r in range(repeats + 1):
            out.fill_(-1)
            fn(out, seed)
            torch.cuda.synchronize()
            if bool((out[:, :, :2] < 0).any()):
                raise RuntimeError(f"{key}: some warp did not write its clocks")
            if r:  # the first launch warms up (module load, clocks)
                cyc.append(float(out[:, :, 0].max(dim=1).values.double().median()))
                ns.append(float(out[:, :, 1].max(dim=1).values.double().median()))
        mmas = (key.warps / 4) * outer * km.MMA_RATE_DEPTH * key.chains
        c, n = float(pd.Series(cyc).median()), float(pd.Series(ns).median())
        rows.append(dict(warps=key.warps, chains=key.chains, decode=key.decode, outer=outer,
                         mmas_per_smsp=mmas, cycles=c, us=n / 1e3, clock_GHz=c / n, cycles_per_mma=c / mmas,
                         moe_up_item_cycles_if_mma_bound=MOE_UP_MMAS_PER_SMSP * c / mmas, **prov))
    df = pd.DataFrame(rows)
    if out_csv:
        Path(out_csv).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(out_csv, index=False)
    return df
