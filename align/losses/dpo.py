"""DPO objectives from sequence log-probabilities of policy and reference.

`pair_losses` holds the per-pair formulas of every variant; `dpo_losses` applies them
to log-ratios, and `dpo_objective` composes a full objective (length normalization,
R-DPO length penalty, RPO's NLL term) from the summed log-probs of a chosen-then-rejected
batch. Losses stay per pair; the caller reduces them, so metrics and tripwires see
every pair.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from align.config import DpoConfig


def _sigmoid(margins: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    losses = -F.logsigmoid(margins)
    if label_smoothing:
        # Conservative DPO: the preference label is flipped with probability label_smoothing.
        losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-margins)
    return losses


def _ipo(margins: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    # IPO regresses the unscaled log-ratio difference onto 1 / (2 tau), with tau = beta.
    return (margins / beta - 1 / (2 * beta)) ** 2


def _hinge(margins: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return torch.relu(1 - margins)


_PAIR_LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": _sigmoid,
    "ipo": _ipo,
    "hinge": _hinge,
}


@dataclass(frozen=True)
class DPOObjective:
    """A DPO variant and its weights, built from the pre-registration's [dpo] section
    (`of`); what that section's checks refuse raises here too, so no objective the config
    would refuse can be built in code.

    `length_normalize` scores per-token mean log-probs instead of sums; `rdpo_alpha`
    subtracts rdpo_alpha x (chosen tokens - rejected tokens) from the margin; `rpo_alpha`
    adds rpo_alpha x the chosen response's token-mean NLL to each pair's loss.
    """

    beta: float
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0
    length_normalize: bool = False
    rdpo_alpha: float = 0.0

    def __post_init__(self) -> None:
        failed = [c for c in DpoConfig(**dataclasses.asdict(self)).checks() if not c.holds]
        if failed:
            raise ValueError(
                "; ".join(f"dpo.{c.key} expected {c.expected}, found {c.value!r}" for c in failed)
            )

    @classmethod
    def of(cls, section: DpoConfig) -> DPOObjective:
        return cls(**dataclasses.asdict(section))

    @property
    def needs_token_means(self) -> bool:
        return self.length_normalize or self.rpo_alpha > 0


def pair_losses(margins: torch.Tensor, objective: DPOObjective) -> torch.Tensor:
    """Per-pair loss from reward margins beta x (chosen - rejected log-ratio) - length penalty."""
    return _PAIR_LOSSES[objective.loss](margins, objective.beta, objective.label_smoothing)


def dpo_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    objective: DPOObjective,
    *,
    length_penalty: torch.Tensor | float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair (loss, chosen reward, rejected reward); rewards are beta x log-ratios.

    `length_penalty` is subtracted from the reward margin inside the loss (R-DPO).
    """
    beta = objective.beta
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    margins = beta * (chosen_ratio - rejected_ratio) - length_penalty
    losses = pair_losses(margins, objective)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


@dataclass
class DPOResult:
    """Everything one DPO micro-batch yields, per pair unless noted.

    Log-probs are the policy's, summed over scored tokens (`*_mean`: per token) and
    still attached to the graph; rewards and margins (chosen minus rejected reward)
    are detached. `nll` is the chosen response's token-mean NLL when rpo_alpha > 0.
    """

    loss: torch.Tensor
    losses: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_logps_mean: torch.Tensor
    rejected_logps_mean: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    margins: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    nll: torch.Tensor | None = None

    @property
    def num_pairs(self) -> int:
        return self.losses.shape[0]


def dpo_objective(
    policy_logps: torch.Tensor,
    token_counts: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    objective: DPOObjective,
) -> DPOResult:
    """The objective from summed log-probs [2b] of chosen rows then rejected rows.

    `token_counts` [2b] are the scored tokens per row; `ref_*` [b] are summed over
    the same tokens.
    """
    pairs = ref_chosen.shape[0]
    if policy_logps.shape != (2 * pairs,) or token_counts.shape != (2 * pairs,):
        raise ValueError(
            f"expected [2b] = [{2 * pairs}] policy log-probs and token counts, got "
            f"{tuple(policy_logps.shape)} and {tuple(token_counts.shape)}"
        )
    if objective.needs_token_means and bool((token_counts == 0).any()):
        raise ValueError("a row has no scored tokens, so its per-token mean is undefined")
    counts = token_counts.to(policy_logps.dtype)
    means = policy_logps / counts.clamp_min(1)
    ref = torch.cat((ref_chosen, ref_rejected)).to(policy_logps.dtype)
    scored, ref_scored = (
        (means, ref / counts) if objective.length_normalize else (policy_logps, ref)
    )
    losses, chosen_rewards, rejected_rewards = dpo_losses(
        scored[:pairs],
        scored[pairs:],
        ref_scored[:pairs],
        ref_scored[pairs:],
        objective,
        length_penalty=objective.rdpo_alpha * (counts[:pairs] - counts[pairs:]),
    )
    nll = None
    if objective.rpo_alpha > 0:
        nll = -means[:pairs]
        losses = losses + objective.rpo_alpha * nll
    return DPOResult(
        loss=losses.mean(),
        losses=losses,
        chosen_logps=policy_logps[:pairs],
        rejected_logps=policy_logps[pairs:],
        chosen_logps_mean=means[:pairs],
        rejected_logps_mean=means[pairs:],
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        margins=chosen_rewards - rejected_rewards,
        chosen_tokens=token_counts[:pairs],
        rejected_tokens=token_counts[pairs:],
        nll=nll,
    )
