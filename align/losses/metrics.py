"""DPO metrics under the names the ecosystem logs, kept as sums so they reduce exactly.

A rank turns each micro-batch's `DPOResult` into per-metric sums plus a pair count;
`reduce_metrics` adds those over ranks in one all-reduce and only then divides, so a
rank with fewer pairs weighs less.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from align.losses.dpo import DPOResult

PAIRS = "pairs"


def metric_sums(result: DPOResult) -> dict[str, torch.Tensor]:
    """Per-metric sums over the result's pairs, and the pair count under "pairs"."""
    sums = {
        "loss": result.losses,
        "rewards/chosen": result.chosen_rewards,
        "rewards/rejected": result.rejected_rewards,
        "rewards/margins": result.margins,
        "rewards/accuracies": (result.chosen_rewards > result.rejected_rewards),
        "logps/chosen": result.chosen_logps,
        "logps/rejected": result.rejected_logps,
    }
    if result.nll is not None:
        sums["nll_loss"] = result.nll
    totals = {name: values.detach().to(torch.float64).sum() for name, values in sums.items()}
    totals[PAIRS] = torch.tensor(
        float(result.num_pairs), dtype=torch.float64, device=result.losses.device
    )
    return totals


def add_metric_sums(
    total: Mapping[str, torch.Tensor], sums: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Key-wise sum of two micro-batches' sums; both must name the same metrics."""
    if set(total) != set(sums):
        raise ValueError(f"metric names differ: {sorted(total)} vs {sorted(sums)}")
    return {name: total[name] + sums[name] for name in total}


def reduce_metrics(
    sums: Mapping[str, torch.Tensor | float], group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Metric means over every pair on every rank of `group` (this rank alone without one).

    Ranks must pass the same metric names; they are reduced in sorted order.
    """
    if PAIRS not in sums:
        raise ValueError(f"sums must carry the pair count under {PAIRS!r}")
    names = sorted(sums)
    device = next((v.device for v in sums.values() if isinstance(v, torch.Tensor)), None)
    stacked = torch.stack(
        [torch.as_tensor(sums[name], dtype=torch.float64, device=device) for name in names]
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
    elif group is not None:
        raise ValueError("a process group was given but torch.distributed is not initialized")
    totals = dict(zip(names, stacked.tolist(), strict=True))
    pairs = totals.pop(PAIRS)
    if pairs <= 0:
        raise ValueError("no pairs to average metrics over")
    return {name: value / pairs for name, value in totals.items()}
