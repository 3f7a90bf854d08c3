"""Stage adapters: what one micro-batch contributes to the loss, for SFT and DPO.

An adapter's `loss` returns the micro-batch's share of the step loss (already
divided by the step's total, so gradients accumulate to the step mean) and metric
sums that the trainer reduces to means.
"""

from __future__ import annotations

import torch

from align.data.loader import TokenBatch
from align.eval.logprobs import sequence_logps_and_counts
from align.losses.dpo import DPOObjective, dpo_objective, metric_names, metric_sums
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
    """Pair-mean DPO objective against cached reference log-probs (looked up by row).

    Logs `align.losses.dpo.metric_names`: each the mean over the step's pairs.
    """

    name = "dpo"

    def __init__(
        self, objective: DPOObjective, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor
    ):
        self.objective = objective
        self.ref_chosen = ref_chosen
        self.ref_rejected = ref_rejected
        self.metric_keys = ("pairs", *metric_names(objective))
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
        sums = {"pairs": result.num_pairs, **metric_sums(result)}
        chosen_tokens = result.chosen_tokens.double()
        self.pair_stats.append(
            PairStats(
                chosen_logratio_per_token=_numpy(
                    (result.chosen_logps.detach().double() - ref_chosen.double()) / chosen_tokens
                ),
                margins=_numpy(result.scored_margins.double()),
                chosen_tokens=_numpy(chosen_tokens),
                rejected_tokens=_numpy(result.rejected_tokens.double()),
            )
        )
        return result.losses.sum() / denominator, sums

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        pairs = max(1, sums["pairs"])
        return {key: sums[key] / pairs for key in self.metric_keys if key != "pairs"}


def _numpy(tensor: torch.Tensor):
    return tensor.detach().cpu().numpy()
