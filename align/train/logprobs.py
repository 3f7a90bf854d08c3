"""Per-row summed log-probabilities of the scored tokens.

`sequence_logps` is the one path stages use: chunked from hidden states inside the
model's forward, so [B, T, V] logits never exist. `full_logits_sequence_logps` is the
straightforward reference that tests compare it with. Logits at position t predict
token t + 1; a token is scored when its loss_mask is set.
"""

from __future__ import annotations

import torch

from align.data.loader import TokenBatch
from align.losses.fused import shift_labels


def sequence_logps_and_counts(
    model: torch.nn.Module, batch: TokenBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob [B] float32, scored token count [B]) through the chunked path."""
    labels = shift_labels(batch.input_ids, batch.loss_mask)
    logps, counts = model(batch.input_ids, attention_mask=batch.attention_mask, labels=labels)
    return logps.float(), counts


def sequence_logps(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    return sequence_logps_and_counts(model, batch)[0]


def full_logits_sequence_logps(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """The reference: log_softmax over full logits, gathered at the labels."""
    logits = model(batch.input_ids, attention_mask=batch.attention_mask)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return (token * batch.loss_mask[:, 1:]).sum(-1)
