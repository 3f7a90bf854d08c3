"""Batches from memory-mapped token shards as torch tensors.

`collate_preference` puts chosen rows first and rejected rows second in one batch,
so one forward serves both; sequences are cropped to the batch's longest row.
`collate_shared_prompt` is the `shared` layout: one row per pair, [prompt | chosen
response | rejected response], the prompt run once; and the `packed` layout: several such
pairs per row, as many as fit the batch's widest (`batch.layout`). Their labels score the
same tokens, so the model returns the same [2b] log-probs.
`preference_dataset`, `collate_preference` and `make_preference_sampler` are the
entry points for reading a pair shard outside the trainer.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from align.constants import (
    IGNORE_INDEX,
    PAD_SEGMENT,
    PAIR_LAYOUTS,
    PREFIX_SEGMENT,
    SEGMENTS_PER_PAIR,
)
from align.data.sampler import TokenBudgetSampler
from align.data.shards import layout_rows, pack_pairs, pair_row_widths, read_shard
from align.kernels.segments import prefix_of


@dataclass
class TokenBatch:
    """Right-padded rows; `loss_mask[i, t]` marks tokens t whose prediction is scored.

    The shared and packed layouts also carry `position_ids` and `segment_ids` [B, T] for
    the model's forward, its shifted `labels` [2, B, T] (chosen, rejected), which then
    replace shift_labels(input_ids, loss_mask), and `pair_slots` [pairs]: where each pair
    of `rows` is among the model's per-(row, slot) results (see align.eval.logprobs).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rows: np.ndarray
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    pair_slots: torch.Tensor | None = None

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


def collate_shared_prompt(
    arrays: dict[str, np.ndarray], rows: np.ndarray, pack: bool = False
) -> TokenBatch:
    """The pairs at `rows` as prefix-shared rows [prompt | chosen | rejected], one pair per
    row, or with `pack` as many pairs per row as fit the widest pair (`pack_pairs`).

    Position ids restart the rejected response after the prompt; label set 0 scores every
    chosen response, set 1 every rejected one, whose first token is predicted from the last
    prompt token. `pair_slots` maps each pair to its (row, slot) in the model's per-pair
    results. Refuses a pair whose chosen and rejected prompts differ.
    """
    rows = np.asarray(rows)
    chosen, rejected = arrays["chosen_ids"][rows], arrays["rejected_ids"][rows]
    prompt = arrays["prompt_len"][rows].astype(np.int64)
    chosen_end = arrays["chosen_len"][rows].astype(np.int64)
    rejected_end = arrays["rejected_len"][rows].astype(np.int64)
    _check_shared_prompts(chosen, rejected, prompt[:, None], arrays["pair_id"][rows])
    lengths = chosen_end + rejected_end - prompt
    groups = pack_pairs(lengths) if pack else [[i] for i in range(len(rows))]
    shape = (len(groups), int(lengths.max()))
    ids = np.zeros(shape, np.int64)  # padding: any id; nothing reads it
    positions = np.zeros(shape, np.int64)
    segments = np.full(shape, PAD_SEGMENT, np.int64)
    labels = np.full((2, *shape), IGNORE_INDEX, np.int64)
    slots_per_row = max(map(len, groups))
    pair_slots = np.empty(len(rows), np.int64)
    for r, group in enumerate(groups):
        offset = 0
        for slot, i in enumerate(group):
            p, c, end = int(prompt[i]), int(chosen_end[i]), int(rejected_end[i])
            row = _PairRow(r, offset, PREFIX_SEGMENT + slot * SEGMENTS_PER_PAIR, p, c)
            row.lay_out(chosen[i, :c], rejected[i, p:end], ids, positions, segments, labels)
            pair_slots[i] = r * slots_per_row + slot
            offset += c + end - p
    real = segments != PAD_SEGMENT
    return TokenBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(real.astype(np.int64)),
        loss_mask=torch.from_numpy(real & (segments != prefix_of(segments))),
        rows=rows,
        position_ids=torch.from_numpy(positions),
        segment_ids=torch.from_numpy(segments),
        labels=torch.from_numpy(labels),
        pair_slots=torch.from_numpy(pair_slots),
    )


@dataclass(frozen=True)
class _PairRow:
    """Where one pair lies in a shared or packed row: the row, its first column, its
    prefix's segment id, its prompt length and its chosen sequence's (prompt included)."""

    row: int
    offset: int
    prefix_segment: int
    prompt: int
    chosen_end: int

    def lay_out(self, chosen, rejected_response, ids, positions, segments, labels) -> None:
        """Write [prompt | chosen response | rejected response] and its two label sets."""
        r, o, p, c = self.row, self.offset, self.prompt, self.chosen_end
        end = c + len(rejected_response)  # the pair's width in the row
        ids[r, o : o + c] = chosen
        ids[r, o + c : o + end] = rejected_response
        positions[r, o : o + c] = np.arange(c)
        positions[r, o + c : o + end] = np.arange(p, p + len(rejected_response))
        segments[r, o : o + p] = self.prefix_segment
        segments[r, o + p : o + c] = self.prefix_segment + 1
        segments[r, o + c : o + end] = self.prefix_segment + 2
        # Position t predicts the token at t + 1; the first token of a prompt-less
        # sequence is predicted by nothing.
        first = max(p, 1)
        labels[0, r, o + first - 1 : o + c - 1] = chosen[first:c]
        labels[1, r, o + c : o + end - 1] = rejected_response[1:]
        if p >= 1 and end > c:
            labels[1, r, o + p - 1] = rejected_response[0]


def collate_pairs(arrays: dict[str, np.ndarray], rows: np.ndarray, layout: str) -> TokenBatch:
    """The pairs at `rows` in `layout` (align.constants.PAIR_LAYOUTS)."""
    if layout == "padded":
        return collate_preference(arrays, rows)
    return collate_shared_prompt(arrays, rows, pack=layout == "packed")


def _check_shared_prompts(
    chosen: np.ndarray, rejected: np.ndarray, prompt: np.ndarray, pair_ids: np.ndarray
) -> None:
    width = int(prompt.max())
    differs = (chosen[:, :width] != rejected[:, :width]) & (np.arange(width)[None, :] < prompt)
    bad = np.flatnonzero(differs.any(axis=1))
    if len(bad):
        raise ValueError(
            f"the shared and packed layouts need one prompt per pair, but pair_id {int(pair_ids[bad[0]])} "
            f"has different chosen and rejected prompt tokens ({len(bad)} such pairs in the batch)"
        )


class PairShard:
    """A memory-mapped preference shard; rows addressed by index, pairs by `pair_ids`.

    `layout` (align.constants.PAIR_LAYOUTS) is how every batch it collates lays pairs out.
    """

    def __init__(self, path: str | Path, layout: str = "padded"):
        if layout not in PAIR_LAYOUTS:
            raise ValueError(f"pair layout must be one of {PAIR_LAYOUTS}, got {layout!r}")
        self.path = Path(path)
        self.arrays = read_shard(self.path)
        self.pair_ids = self.arrays["pair_id"]
        self.layout = layout

    def __len__(self) -> int:
        return len(self.pair_ids)

    @property
    def pair_widths(self) -> np.ndarray:
        """Each pair's padded width in a batch: its longer sequence, prompt included."""
        return pair_row_widths(self.arrays, "padded")

    def collate(self, rows: np.ndarray) -> TokenBatch:
        return collate_pairs(self.arrays, rows, self.layout)

    def computed_tokens(self, rows: np.ndarray) -> int:
        """Positions the collated batch of `rows` holds, padding included, without collating."""
        if not len(rows):
            return 0
        widths = self.layout_widths[rows]
        return layout_rows(widths, self.layout) * int(widths.max())

    @functools.cached_property
    def layout_widths(self) -> np.ndarray:
        """Each pair's width in this shard's layout, read once: the probe sizes every step
        of the horizon by it."""
        return pair_row_widths(self.arrays, self.layout)


def preference_dataset(path: str | Path, layout: str = "padded") -> PairShard:
    """Open a pair shard written by the build stage, memory-mapped."""
    return PairShard(path, layout)


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
