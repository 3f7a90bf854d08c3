"""DPO objectives from sequence log-probabilities of policy and reference, and the
names and values of the metrics a DPO step logs.

`pair_losses` holds the per-pair formulas of every variant; `dpo_losses` applies them
to log-ratios, and `dpo_objective` composes a full objective (length normalization,
R-DPO length penalty, RPO's NLL term) from the summed log-probs of a chosen-then-rejected
batch. Losses stay per pair; the caller reduces them, so metrics and tripwires see
every pair. `metric_names` and `metric_sums` say what a step logs: names without a
suffix are on summed log-probs, as TRL's DPOTrainer logs them whatever its loss scores;
`_per_token` names are on per-token means, logged when the objective scores those.
tests/test_trl_parity.py holds every variant and metric to TRL's own loss code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from align.config import DpoConfig
from align.constants import DPO_LOSSES


def _sigmoid(margins: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    losses = -F.logsigmoid(margins)
    if label_smoothing:
        # Conservative DPO: the preference label is flipped with probability label_smoothing.
        losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-margins)
    return losses


def _ipo(margins: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    # IPO regresses the unscaled (per-token) log-ratio difference onto 1 / (2 tau), tau = beta.
    return (margins / beta - 1 / (2 * beta)) ** 2


def _hinge(margins: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return torch.relu(1 - margins)


# Each name of DPO_LOSSES, the one list the config checks, paired with its formula in order.
_PAIR_LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = dict(
    zip(DPO_LOSSES, (_sigmoid, _ipo, _hinge), strict=True)
)


@dataclass
class DPOObjective(DpoConfig):
    """A DPO variant and its weights: the pre-registration's [dpo] section (`of`), whose
    fields it inherits, checked on construction, so no objective the config would refuse
    can be built in code.

    `length_normalize` scores per-token mean log-probs instead of sums. IPO scores them
    always: its 1 / (2 beta) target is set on that scale (TRL's IPO, which its authors
    confirmed). `rdpo_alpha` subtracts rdpo_alpha x (chosen tokens - rejected tokens) from
    the margin (R-DPO, Park et al. 2024). `rpo_alpha` adds rpo_alpha x the chosen
    response's own token-mean NLL to each pair's loss, as the RPO paper (Pang et al. 2024)
    writes it; TRL's "sft" term instead takes one token-weighted mean NLL over all chosen
    tokens of the micro-batch, so the two agree only when the chosen responses have equal
    lengths. Hence the metric's name, `nll/chosen_seq_mean`, not TRL's.
    """

    def __post_init__(self) -> None:
        failed = [c for c in self.checks() if not c.holds]
        if failed:
            raise ValueError(
                "; ".join(f"dpo.{c.key} expected {c.expected}, found {c.value!r}" for c in failed)
            )

    @classmethod
    def of(cls, section: DpoConfig) -> DPOObjective:
        return cls(**dataclasses.asdict(section))

    @property
    def scores_per_token(self) -> bool:
        """Whether the loss compares per-token mean log-probs rather than sums."""
        return self.length_normalize or self.loss == "ipo"

    @property
    def needs_token_means(self) -> bool:
        return self.scores_per_token or self.rpo_alpha > 0


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

    Log-probs are the policy's, summed over scored tokens (`*_per_token`: their means)
    and still attached to the graph. Rewards are beta x (policy - reference) log-probs on
    the same two scales, detached; margins are chosen minus rejected reward, without the
    R-DPO length penalty. `per_token` says which scale the loss scored.
    `nll_chosen_seq_mean` is each chosen response's own token-mean NLL, when rpo_alpha > 0.
    """

    loss: torch.Tensor
    losses: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_logps_per_token: torch.Tensor
    rejected_logps_per_token: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_rewards_per_token: torch.Tensor
    rejected_rewards_per_token: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    per_token: bool
    nll_chosen_seq_mean: torch.Tensor | None = None

    @property
    def num_pairs(self) -> int:
        return self.losses.shape[0]

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def margins_per_token(self) -> torch.Tensor:
        return self.chosen_rewards_per_token - self.rejected_rewards_per_token

    @property
    def scored_margins(self) -> torch.Tensor:
        """The margins on the scale the loss compared."""
        return self.margins_per_token if self.per_token else self.margins


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
    # A row without scored tokens (refused above only where a mean is scored) gets mean 0.
    divisor = counts.clamp_min(1)
    means = policy_logps / divisor
    ref = torch.cat((ref_chosen, ref_rejected)).to(policy_logps.dtype)
    ref_means = ref / divisor
    scored, ref_scored = (means, ref_means) if objective.scores_per_token else (policy_logps, ref)
    losses, _, _ = dpo_losses(
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
    rewards = objective.beta * (policy_logps.detach() - ref)
    rewards_per_token = objective.beta * (means.detach() - ref_means)
    return DPOResult(
        loss=losses.mean(),
        losses=losses,
        chosen_logps=policy_logps[:pairs],
        rejected_logps=policy_logps[pairs:],
        chosen_logps_per_token=means[:pairs],
        rejected_logps_per_token=means[pairs:],
        chosen_rewards=rewards[:pairs],
        rejected_rewards=rewards[pairs:],
        chosen_rewards_per_token=rewards_per_token[:pairs],
        rejected_rewards_per_token=rewards_per_token[pairs:],
        chosen_tokens=token_counts[:pairs],
        rejected_tokens=token_counts[pairs:],
        per_token=objective.scores_per_token,
        nll_chosen_seq_mean=nll,
    )


# The metrics of one scale, named as TRL's DPOTrainer names them.
_SCALE_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
PER_TOKEN = "_per_token"
# Not TRL's `nll_loss`: a mean of per-sequence means, not one token-weighted mean.
NLL_METRIC = "nll/chosen_seq_mean"


def metric_names(objective: DPOObjective) -> tuple[str, ...]:
    """The metrics a DPO step logs under `objective`, in order."""
    names = ["loss", *_SCALE_METRICS]
    if objective.scores_per_token:
        names += [name + PER_TOKEN for name in _SCALE_METRICS]
    if objective.rpo_alpha > 0:
        names.append(NLL_METRIC)
    return tuple(names)


def _scale_values(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    suffix: str,
) -> dict[str, torch.Tensor]:
    values = (
        chosen_rewards,
        rejected_rewards,
        chosen_rewards - rejected_rewards,
        (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
        chosen_logps,
        rejected_logps,
    )
    return {name + suffix: value for name, value in zip(_SCALE_METRICS, values, strict=True)}


def metric_sums(result: DPOResult) -> dict[str, float]:
    """Each metric of `metric_names` summed over the micro-batch's pairs; a step logs the
    sums over its micro-batches and ranks divided by its pairs."""
    values = {
        "loss": result.losses,
        **_scale_values(
            result.chosen_rewards,
            result.rejected_rewards,
            result.chosen_logps,
            result.rejected_logps,
            "",
        ),
    }
    if result.per_token:
        values |= _scale_values(
            result.chosen_rewards_per_token,
            result.rejected_rewards_per_token,
            result.chosen_logps_per_token,
            result.rejected_logps_per_token,
            PER_TOKEN,
        )
    if result.nll_chosen_seq_mean is not None:
        values[NLL_METRIC] = result.nll_chosen_seq_mean
    return {name: float(value.detach().sum()) for name, value in values.items()}
