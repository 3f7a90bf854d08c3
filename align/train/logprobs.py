"""Per-row summed log-probabilities of the scored tokens, from full logits.

Logits at position t predict token t + 1; a token is scored when its loss_mask is
set, so the sum covers exactly the response tokens.
"""

from __future__ import annotations

import torch

from align.data.loader import TokenBatch


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(x_{t+1} | x_<=t) for t in [0, T-1), in float32: shape [B, T-1]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def sequence_logps(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Summed log-prob of each row's scored tokens: shape [B], float32."""
    logits = model(batch.input_ids, attention_mask=batch.attention_mask)
    scored = batch.loss_mask[:, 1:]
    return (token_logps(logits, batch.input_ids) * scored).sum(-1)
