"""Error measures used to compare any executor with the fp32 reference.

The accuracy rule (style.md, after FlashAttention-4): a kernel's error against
the fp32 reference must be at most about twice the error of the same
computation done in bf16 by plain PyTorch (`reference` with `Storage.BF16`),
plus a small absolute slack for outputs that are near zero.
"""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64. NaN in either gives NaN (which fails every bound)."""
    a, b = out.detach().double().cpu(), ref.detach().double().cpu()
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    den = b.norm()
    if den == 0:
        raise ValueError("reference is all zeros: compare on non-zero data")
    return float((a - b).norm() / den)


def within_bf16_rule(out: torch.Tensor, ref_fp32: torch.Tensor, ref_bf16: torch.Tensor,
                     factor: float = 2.0, slack: float = 1e-3) -> tuple[bool, float, float]:
    """(ok, err, bound): err = rel_err(out, ref_fp32) <= factor * rel_err(ref_bf16, ref_fp32) + slack."""
    err = rel_err(out, ref_fp32)
    bound = factor * rel_err(ref_bf16, ref_fp32) + slack
    return bool(err <= bound), err, bound


def all_written(out: torch.Tensor) -> bool:
    """True when no element is NaN: outputs are poisoned with NaN before a launch."""
    return not bool(torch.isnan(out).any())


def routing_agreement(exec_ids: torch.Tensor, x_ref: torch.Tensor, moe_weights, cfg,
                      tie_tol: float = 5e-3) -> tuple[torch.Tensor, int, bool]:
    """Which tokens an executor routed to the same experts as the reference.

    Top-k routing is discontinuous: bf16-sized differences in the router input
    can swap two experts whose biased scores are nearly tied. Returns
    (same [N] bool, number of tokens routed differently, whether every such
    token is a near-tie: the gap between the reference's k-th and (k+1)-th
    biased score is below `tie_tol`). Outputs are compared on `same` tokens;
    a difference that is not a near-tie is a bug.
    """
    from .reference.moe import route

    r = route(x_ref, moe_weights, cfg)
    k = cfg.num_experts_per_token
    ref_sorted = torch.sort(r.ids, 1).values.cpu()
    ex_sorted = torch.sort(exec_ids.long(), 1).values.cpu()
    same = (ref_sorted == ex_sorted).all(1)
    biased = (r.scores + moe_weights.e_score_correction_bias.float()).cpu()
    top = torch.topk(biased, k + 1, dim=-1).values
    gap = top[:, k - 1] - top[:, k]
    ties = gap < tie_tol
    return same, int((~same).sum()), bool((same | ties).all())


def compare_step(out: torch.Tensor, ref_fp32: torch.Tensor, ref_bf16: torch.Tensor, exec_ids=None,
                 x_router: torch.Tensor | None = None, moe_weights=None, cfg=None) -> dict:
    """An executor's step output against the fp32 reference and its bf16-storage twin.

    With `exec_ids` (the executor's top-k ids) and the router input, tokens routed differently from the
    reference (allowed only at near-ties) are left out and counted in `routing_flips`. Returns the
    check columns of the measured CSVs: check_ok, err_vs_fp32, err_bound, all_written, routing_flips.
    """
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    flips, ties = 0, True
    if exec_ids is not None and moe_weights is not None:
        keep, flips, ties = routing_agreement(exec_ids, x_router, moe_weights, cfg)
    keep = keep.to(out.device)
    ok, err, bound = within_bf16_rule(out[keep].float(), ref_fp32[keep], ref_bf16[keep])
    written = all_written(out)
    return {"check_ok": bool(ok and written and ties), "err_vs_fp32": err, "err_bound": bound,
            "all_written": written, "routing_flips": flips}

