"""Token-mean negative log-likelihood of response tokens over a shard (any number of ranks)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from align.data.deal import padding_rows, rank_blocks
from align.eval.logprobs import sequence_logps_and_counts
from align.utils.dist import DistInfo, all_reduce_sum


@torch.no_grad()
def mean_nll(
    model, shard, batch_size: int, info: DistInfo, between_batches: Callable[[], None] | None = None
) -> float:
    """Token-mean NLL of the shard; `between_batches` runs on every rank before each batch."""
    model.eval()
    total, tokens = 0.0, 0
    for rows in rank_blocks(len(shard), batch_size, info.rank, info.world_size):
        if between_batches is not None:
            between_batches()
        batch = shard.collate(rows if rows is not None else padding_rows(len(shard), batch_size))
        logps, counts = sequence_logps_and_counts(model, batch)
        if rows is not None:
            total -= float(logps.sum())
            tokens += int(counts.sum())
    total, tokens = all_reduce_sum([total, tokens])
    return total / tokens
