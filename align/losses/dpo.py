"""DPO objectives from sequence log-probabilities of policy and reference.

`dpo_losses` returns per-pair losses and implicit rewards; the caller reduces them,
so metrics and tripwires see every pair.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSSES = ("sigmoid",)


def dpo_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair (loss, chosen reward, rejected reward); rewards are beta x log-ratios."""
    if loss not in LOSSES:
        raise ValueError(f"DPO loss {loss!r} is not available (available: {', '.join(LOSSES)})")
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
