"""Batches from token shards as torch tensors, and the per-epoch order of rows.

`PairShard.collate` puts chosen rows first and rejected rows second in one batch,
so one forward serves both; sequences are cropped to the batch's longest row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from align.data.shards import read_shard


@dataclass
class TokenBatch:
    """Right-padded rows; `loss_mask[i, t]` marks tokens t whose prediction is scored."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rows: np.ndarray

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def _batch(
    ids: np.ndarray, lengths: np.ndarray, prompt_len: np.ndarray, rows: np.ndarray
) -> TokenBatch:
    width = int(lengths.max())
    positions = np.arange(width)[None, :]
    attention = positions < lengths[:, None]
    loss = (positions >= prompt_len[:, None]) & attention
    return TokenBatch(
        input_ids=torch.from_numpy(np.ascontiguousarray(ids[:, :width]).astype(np.int64)),
        attention_mask=torch.from_numpy(attention.astype(np.int64)),
        loss_mask=torch.from_numpy(loss),
        rows=rows,
    )


class PairShard:
    """A preference shard; rows are addressed by index, pairs identified by `pair_ids`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.arrays = read_shard(self.path)
        self.pair_ids = self.arrays["pair_id"]

    def __len__(self) -> int:
        return len(self.pair_ids)

    def collate(self, rows: np.ndarray) -> TokenBatch:
        """Chosen rows [0, b) then rejected rows [b, 2b) of the same pairs."""
        a = self.arrays
        width = a["chosen_ids"].shape[1]
        ids = np.concatenate([a["chosen_ids"][rows], a["rejected_ids"][rows]]).reshape(-1, width)
        lengths = np.concatenate([a["chosen_len"][rows], a["rejected_len"][rows]])
        prompt = np.concatenate([a["prompt_len"][rows], a["prompt_len"][rows]])
        return _batch(ids, lengths, prompt, rows)


class SftShard:
    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays["length"])

    def collate(self, rows: np.ndarray) -> TokenBatch:
        a = self.arrays
        return _batch(a["ids"][rows], a["length"][rows], a["prompt_len"][rows], rows)


class BatchSource:
    """This rank's micro-batches for each optimizer step of the run."""

    def __init__(self, shard: PairShard | SftShard, sampler):
        self.shard = shard
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def micro_batches(self, step: int) -> list[TokenBatch]:
        return [self.shard.collate(rows) for rows in self.sampler.rank_rows(step)]
