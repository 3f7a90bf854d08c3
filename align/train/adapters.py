"""Stage adapters: what one micro-batch contributes to the loss, for SFT and DPO.

An adapter's `loss` returns the micro-batch's share of the step loss (already
divided by the step's total, so gradients accumulate to the step mean) and metric
sums that the trainer reduces to means.
"""

from __future__ import annotations

import torch

from align.data.loader import TokenBatch
from align.losses.dpo import dpo_losses
from align.train.logprobs import sequence_logps, token_logps
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
        logits = model(batch.input_ids, attention_mask=batch.attention_mask)
        nll = -(token_logps(logits, batch.input_ids) * batch.loss_mask[:, 1:]).sum()
        return nll / denominator, {"nll_sum": float(nll.detach()), "tokens": batch.num_loss_tokens}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["nll_sum"] / max(1, sums["tokens"])}


class DpoAdapter:
    """Pair-mean DPO loss against cached reference log-probs (looked up by row)."""

    name = "dpo"
    metric_keys = (
        "loss_sum",
        "pairs",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
    )

    def __init__(
        self, beta: float, loss: str, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor
    ):
        self.beta = beta
        self.loss_name = loss
        self.ref_chosen = ref_chosen
        self.ref_rejected = ref_rejected
        self.pair_stats: list[PairStats] = []  # drained by the tripwires after each step

    def step_denominator(self, micro_batches: list[TokenBatch]) -> float:
        return float(sum(len(b.rows) for b in micro_batches))

    def loss(
        self, model, batch: TokenBatch, denominator: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        logps = sequence_logps(model, batch)
        n = len(batch.rows)
        rows = torch.from_numpy(batch.rows)
        losses, chosen_r, rejected_r = dpo_losses(
            logps[:n],
            logps[n:],
            self.ref_chosen[rows],
            self.ref_rejected[rows],
            self.beta,
            self.loss_name,
        )
        sums = {
            "loss_sum": float(losses.detach().sum()),
            "pairs": n,
            "rewards/chosen": float(chosen_r.sum()),
            "rewards/rejected": float(rejected_r.sum()),
            "rewards/accuracies": float((chosen_r > rejected_r).float().sum()),
            "logps/chosen": float(logps[:n].detach().sum()),
            "logps/rejected": float(logps[n:].detach().sum()),
        }
        tokens = batch.loss_mask[:, 1:].sum(-1).double()
        self.pair_stats.append(
            PairStats(
                chosen_logratio_per_token=(chosen_r.double() / self.beta / tokens[:n]).numpy(),
                margins=(chosen_r - rejected_r).double().numpy(),
                chosen_tokens=tokens[:n].numpy(),
                rejected_tokens=tokens[n:].numpy(),
            )
        )
        return losses.sum() / denominator, sums

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
        return out
