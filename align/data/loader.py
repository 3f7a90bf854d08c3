"""Batches from memory-mapped token shards as torch tensors.

`collate_preference` puts chosen rows first and rejected rows second in one batch,
so one forward serves both; sequences are cropped to the batch's longest row.
`preference_dataset`, `collate_preference` and `make_preference_sampler` are the
entry points for reading a pair shard outside the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from align.data.sampler import TokenBudgetSampler
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


def collate_preference(arrays: dict[str, np.ndarray], rows: np.ndarray) -> TokenBatch:
    """Chosen rows [0, b) then rejected rows [b, 2b) of the pairs at `rows`."""
    rows = np.asarray(rows)
    width = arrays["chosen_ids"].shape[1]
    chosen, rejected = arrays["chosen_ids"][rows], arrays["rejected_ids"][rows]
    ids = np.concatenate([chosen, rejected]).reshape(-1, width)
    lengths = np.concatenate([arrays["chosen_len"][rows], arrays["rejected_len"][rows]])
    prompt = np.concatenate([arrays["prompt_len"][rows], arrays["prompt_len"][rows]])
    return _batch(ids, lengths, prompt, rows)


class PairShard:
    """A memory-mapped preference shard; rows addressed by index, pairs by `pair_ids`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.arrays = read_shard(self.path)
        self.pair_ids = self.arrays["pair_id"]

    def __len__(self) -> int:
        return len(self.pair_ids)

    @property
    def pair_widths(self) -> np.ndarray:
        """Each pair's padded width in a batch: its longer sequence, prompt included."""
        return np.maximum(self.arrays["chosen_len"], self.arrays["rejected_len"])

    def collate(self, rows: np.ndarray) -> TokenBatch:
        return collate_preference(self.arrays, rows)


def preference_dataset(path: str | Path) -> PairShard:
    """Open a pair shard written by the build stage, memory-mapped."""
    return PairShard(path)


def make_preference_sampler(
    shard: PairShard,
    *,
    max_tokens: int,
    max_rows: int | None = None,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> TokenBudgetSampler:
    """Token-budget batches of `shard` for this rank; `set_epoch` reshuffles."""
    return TokenBudgetSampler(
        shard.pair_widths,
        max_tokens=max_tokens,
        max_rows=max_rows,
        seed=seed,
        rank=rank,
        world_size=world_size,
        pair_ids=shard.pair_ids,
    )


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
