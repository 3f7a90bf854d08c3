"""Stage adapters: what one micro-batch contributes to the loss, for SFT and DPO.

An adapter's `loss` returns the micro-batch's share of the step loss (already
divided by the step's total, so gradients accumulate to the step mean) and metric
sums that the trainer reduces to means.
"""

from __future__ import annotations

import torch

from align.data.loader import TokenBatch
from align.eval.logprobs import sequence_logps_and_counts
from align.losses.dpo import DPOObjective, dpo_objective
from align.train.tripwires import PairStats


class SftAdapter:
    """Token-mean negative log-likelihood of the response tokens."""

    name = "sft"
    metric_keys = ("nll_sum", "tokens")

    def step_denominator(self, micro_batches: list[TokenBatch]) -> float:
        return float(sum(b.num_loss_tokens for b in micro_batches))

    def loss(
        self, model, batch: TokenBatch, denominator: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        logps, counts = sequence_logps_and_counts(model, batch)
        nll = -logps.sum()
        return nll / denominator, {"nll_sum": float(nll.detach()), "tokens": int(counts.sum())}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["nll_sum"] / max(1, sums["tokens"])}


class DpoAdapter:
    """Pair-mean DPO objective against cached reference log-probs (looked up by row)."""

    name = "dpo"
    metric_keys = (
        "loss_sum",
        "pairs",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "nll_sum",
    )

    def __init__(
        self, objective: DPOObjective, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor
    ):
        self.objective = objective
        self.ref_chosen = ref_chosen
        self.ref_rejected = ref_rejected
        self.pair_stats: list[PairStats] = []  # drained by the tripwires after each step

    def step_denominator(self, micro_batches: list[TokenBatch]) -> float:
        return float(sum(len(b.rows) for b in micro_batches))

    def loss(
        self, model, batch: TokenBatch, denominator: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        logps, counts = sequence_logps_and_counts(model, batch)
        rows = torch.from_numpy(batch.rows)
        ref_chosen = self.ref_chosen[rows].to(logps.device)
        ref_rejected = self.ref_rejected[rows].to(logps.device)
        result = dpo_objective(logps, counts, ref_chosen, ref_rejected, self.objective)
        n = result.num_pairs
        sums = {
            "loss_sum": float(result.losses.detach().sum()),
            "pairs": n,
            "rewards/chosen": float(result.chosen_rewards.sum()),
            "rewards/rejected": float(result.rejected_rewards.sum()),
            "rewards/accuracies": float(
                (result.chosen_rewards > result.rejected_rewards).float().sum()
            ),
            "logps/chosen": float(result.chosen_logps.detach().sum()),
            "logps/rejected": float(result.rejected_logps.detach().sum()),
            "nll_sum": float(result.nll.detach().sum()) if result.nll is not None else 0.0,
        }
        chosen_tokens = result.chosen_tokens.double()
        self.pair_stats.append(
            PairStats(
                chosen_logratio_per_token=_numpy(
                    (result.chosen_logps.detach().double() - ref_chosen.double()) / chosen_tokens
                ),
                margins=_numpy(result.margins.double()),
                chosen_tokens=_numpy(chosen_tokens),
                rejected_tokens=_numpy(result.rejected_tokens.double()),
            )
        )
        return result.losses.sum() / denominator, sums

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        pairs = max(1, sums["pairs"])
        out = {"loss": sums["loss_sum"] / pairs}
        for key in (
            "rewards/chosen",
            "rewards/rejected",
            "rewards/accuracies",
            "logps/chosen",
            "logps/rejected",
        ):
            out[key] = sums[key] / pairs
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        if self.objective.rpo_alpha > 0:
            out["nll/chosen"] = sums["nll_sum"] / pairs
        return out


def _numpy(tensor: torch.Tensor):
    return tensor.detach().cpu().numpy()
