"""Token-mean negative log-likelihood of response tokens over a shard."""

from __future__ import annotations

import numpy as np
import torch

from align.train.logprobs import token_logps


@torch.no_grad()
def mean_nll(model, shard, batch_size: int) -> float:
    model.eval()
    total, tokens = 0.0, 0
    for start in range(0, len(shard), batch_size):
        batch = shard.collate(np.arange(start, min(start + batch_size, len(shard))))
        logits = model(batch.input_ids, attention_mask=batch.attention_mask)
        total -= float((token_logps(logits, batch.input_ids) * batch.loss_mask[:, 1:]).sum())
        tokens += batch.num_loss_tokens
    return total / tokens
