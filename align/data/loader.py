"""Batches from memory-mapped token shards as torch tensors.

`collate_preference` puts chosen rows first and rejected rows second in one batch,
so one forward serves both; sequences are cropped to the batch's longest row.
`collate_shared_prompt` is the prefix-shared layout (`batch.share_prompt`): one row
per pair, [prompt | chosen response | rejected response], the prompt run once; its
labels score the same tokens, so the model returns the same [2b] log-probs.
`preference_dataset`, `collate_preference` and `make_preference_sampler` are the
entry points for reading a pair shard outside the trainer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from align.constants import BRANCH_SEGMENT, IGNORE_INDEX, PAD_SEGMENT, PREFIX_SEGMENT
from align.data.sampler import TokenBudgetSampler
from align.data.shards import pair_row_widths, read_shard


@dataclass
class TokenBatch:
    """Right-padded rows; `loss_mask[i, t]` marks tokens t whose prediction is scored.

    The prefix-shared layout also carries `position_ids` and `segment_ids` [B, T] for
    the model's forward and its shifted `labels` [2, B, T] (chosen, rejected), which
    then replace shift_labels(input_ids, loss_mask).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rows: np.ndarray
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device) -> TokenBatch:
        """The same batch with its tensors on `device` (itself when they are there already)."""
        moved = {
            f.name: value.to(device, non_blocking=True)
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


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


def collate_shared_prompt(arrays: dict[str, np.ndarray], rows: np.ndarray) -> TokenBatch:
    """One row per pair at `rows`: [prompt | chosen response | rejected response].

    Position ids restart the rejected response after the prompt; labels set 0 scores the
    chosen response, set 1 the rejected one, whose first token is predicted from the last
    prompt token. Refuses a pair whose chosen and rejected prompts differ.
    """
    rows = np.asarray(rows)
    chosen, rejected = arrays["chosen_ids"][rows], arrays["rejected_ids"][rows]
    prompt = arrays["prompt_len"][rows].astype(np.int64)[:, None]
    chosen_end = arrays["chosen_len"][rows].astype(np.int64)[:, None]
    length = chosen_end + arrays["rejected_len"][rows][:, None] - prompt
    _check_shared_prompts(chosen, rejected, prompt, arrays["pair_id"][rows])
    width = int(length.max())
    pos = np.arange(width)[None, :]
    real = pos < length
    in_chosen = pos < chosen_end
    # Each token's index in its own unshared row: rejected token t, at packed position
    # chosen_end + t, is index prompt + t. That index is also its position id.
    own_index = np.where(in_chosen, pos, pos - chosen_end + prompt)
    source = own_index.clip(0, chosen.shape[1] - 1)
    ids = np.where(in_chosen, _take(chosen, source), _take(rejected, source))
    ids = np.where(real, ids, chosen[:, -1:])  # padding: any id; nothing reads it
    segments = np.select(
        [pos < prompt, in_chosen, real],
        [PREFIX_SEGMENT, BRANCH_SEGMENT, BRANCH_SEGMENT + 1],
        PAD_SEGMENT,
    )
    positions = np.where(real, own_index, 0)
    nxt = np.concatenate([ids[:, 1:], ids[:, -1:]], axis=1)  # the token after each position
    target = pos + 1
    chosen_labels = np.where((target >= prompt) & (target < chosen_end), nxt, IGNORE_INDEX)
    rejected_labels = np.where((target > chosen_end) & (target < length), nxt, IGNORE_INDEX)
    # The first rejected token is predicted by the last prompt token (none without a prompt).
    first = (prompt[:, 0] >= 1) & (length[:, 0] > chosen_end[:, 0])
    rejected_labels[first, prompt[first, 0] - 1] = ids[first, chosen_end[first, 0]]
    labels = np.stack([chosen_labels, rejected_labels])
    return TokenBatch(
        input_ids=torch.from_numpy(ids.astype(np.int64)),
        attention_mask=torch.from_numpy(real.astype(np.int64)),
        loss_mask=torch.from_numpy((pos >= prompt) & real),
        rows=rows,
        position_ids=torch.from_numpy(positions.astype(np.int64)),
        segment_ids=torch.from_numpy(segments.astype(np.int64)),
        labels=torch.from_numpy(labels.astype(np.int64)),
    )


def _take(ids: np.ndarray, columns: np.ndarray) -> np.ndarray:
    return np.take_along_axis(ids, columns, axis=1)


def _check_shared_prompts(
    chosen: np.ndarray, rejected: np.ndarray, prompt: np.ndarray, pair_ids: np.ndarray
) -> None:
    width = int(prompt.max())
    differs = (chosen[:, :width] != rejected[:, :width]) & (np.arange(width)[None, :] < prompt)
    bad = np.flatnonzero(differs.any(axis=1))
    if len(bad):
        raise ValueError(
            f"batch.share_prompt needs one prompt per pair, but pair_id {int(pair_ids[bad[0]])} "
            f"has different chosen and rejected prompt tokens ({len(bad)} such pairs in the batch)"
        )


class PairShard:
    """A memory-mapped preference shard; rows addressed by index, pairs by `pair_ids`.

    `share_prompt` picks the prefix-shared layout for every batch it collates.
    """

    def __init__(self, path: str | Path, share_prompt: bool = False):
        self.path = Path(path)
        self.arrays = read_shard(self.path)
        self.pair_ids = self.arrays["pair_id"]
        self.share_prompt = share_prompt

    def __len__(self) -> int:
        return len(self.pair_ids)

    @property
    def pair_widths(self) -> np.ndarray:
        """Each pair's padded width in a batch: its longer sequence, prompt included."""
        return pair_row_widths(self.arrays, shared=False)

    def collate(self, rows: np.ndarray) -> TokenBatch:
        if self.share_prompt:
            return collate_shared_prompt(self.arrays, rows)
        return collate_preference(self.arrays, rows)

    def computed_tokens(self, rows: np.ndarray) -> int:
        """Positions the collated batch of `rows` holds, padding included, without collating."""
        if not len(rows):
            return 0
        widths = pair_row_widths(self.arrays, self.share_prompt)[rows]
        return (1 if self.share_prompt else 2) * len(rows) * int(widths.max())


def preference_dataset(path: str | Path, share_prompt: bool = False) -> PairShard:
    """Open a pair shard written by the build stage, memory-mapped."""
    return PairShard(path, share_prompt)


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

    def computed_tokens(self, rows: np.ndarray) -> int:
        """Positions the collated batch of `rows` holds, padding included, without collating."""
        return len(rows) * int(self.arrays["length"][rows].max()) if len(rows) else 0


class BatchSource:
    """This rank's micro-batches for each optimizer step of the run."""

    def __init__(self, shard: PairShard | SftShard, sampler):
        self.shard = shard
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def micro_batches(self, step: int) -> list[TokenBatch]:
        return [self.shard.collate(rows) for rows in self.sampler.rank_rows(step)]

    def step_tokens(self, step: int) -> int:
        """Positions step `step` computes: in each micro-step, the fullest rank's batch, which
        every rank waits on."""
        return sum(
            max(self.shard.computed_tokens(rows) for rows in ranks)
            for ranks in self.sampler.micro_steps(step)
        )
