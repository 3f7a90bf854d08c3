"""Which rows each rank reads, batch by batch (numpy only).

Both samplers see every row exactly once per epoch across ranks, in an order fixed
by (seed, epoch).

`StepSampler` (the trainer's): an epoch is cut into `n // global_batch` optimizer
steps; the last step of an epoch also takes the remainder. A step's rows are split
into world_size x grad_accum near-equal micro-batches, rank r taking its grad_accum.

`TokenBudgetSampler`: batches hold as many rows as fit `max_tokens` padded tokens
(chosen and rejected both padded to the batch's widest pair) and `max_rows` rows;
rows are sorted by width within windows of the shuffled order so batches pad little.
Every rank gets the same number of batches, rank r taking batches r, r + world, ...
"""

from __future__ import annotations

import numpy as np

from align.config import BatchConfig
from align.exit_codes import ConfigError


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The row order of one epoch: a permutation fixed by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def steps_per_epoch(n: int, global_batch: int) -> int:
    return max(1, n // global_batch)


class StepSampler:
    def __init__(self, n: int, batch: BatchConfig, rank: int, world_size: int):
        parts = world_size * batch.grad_accum
        if n < parts:
            raise ConfigError(
                f"{n} rows cannot fill world_size x grad_accum = {parts} micro-batches of one step"
            )
        self.n, self.batch, self.rank, self.world_size = n, batch, rank, world_size
        self.steps_per_epoch = steps_per_epoch(n, batch.global_batch)

    def __len__(self) -> int:
        return self.batch.epochs * self.steps_per_epoch

    def global_rows(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.steps_per_epoch)
        order = epoch_order(self.n, self.batch.seed, epoch)
        start = index * self.batch.global_batch
        end = self.n if index == self.steps_per_epoch - 1 else start + self.batch.global_batch
        return order[start:end]

    def micro_steps(self, step: int) -> list[list[np.ndarray]]:
        """Each of step `step`'s grad_accum micro-steps: the rows every rank takes, by rank."""
        parts = np.array_split(self.global_rows(step), self.world_size * self.batch.grad_accum)
        accum = self.batch.grad_accum
        return [[parts[rank * accum + i] for rank in range(self.world_size)] for i in range(accum)]

    def rank_rows(self, step: int) -> list[np.ndarray]:
        """This rank's grad_accum micro-batches of step `step`."""
        return [ranks[self.rank] for ranks in self.micro_steps(step)]


SORT_WINDOW_BATCHES = 64


def pack_by_tokens(
    order: np.ndarray, widths: np.ndarray, max_tokens: int, max_rows: int | None
) -> list[np.ndarray]:
    """Consecutive rows of `order` as batches of cost 2 x rows x widest <= max_tokens."""
    batches, start, widest = [], 0, 0
    for end, row in enumerate(order):
        grown = max(widest, int(widths[row]))
        rows = end - start + 1
        if end > start and (2 * rows * grown > max_tokens or (max_rows and rows > max_rows)):
            batches.append(order[start:end])
            start, grown = end, int(widths[row])
        widest = grown
    if len(order):
        batches.append(order[start:])
    return batches


def split_to_multiple(batches: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    """Split the largest batches in two until every rank can take the same number."""
    packed, batches = len(batches), list(batches)
    while len(batches) % world_size:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]))
        if len(batches[largest]) < 2:
            raise ConfigError(
                f"{sum(map(len, batches))} pairs packed into {packed} token-budget batches cannot "
                f"be split into a multiple of {world_size} ranks' batches; raise max_tokens"
            )
        batches[largest : largest + 1] = np.array_split(batches[largest], 2)
    return batches


class TokenBudgetSampler:
    def __init__(
        self,
        widths: np.ndarray,
        *,
        max_tokens: int,
        max_rows: int | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        pair_ids: np.ndarray | None = None,
    ):
        self.widths = np.asarray(widths, dtype=np.int64)
        self.max_tokens, self.max_rows, self.seed = max_tokens, max_rows, seed
        self.rank, self.world_size, self.epoch = rank, world_size, 0
        self._check(pair_ids)

    def _check(self, pair_ids: np.ndarray | None) -> None:
        if self.max_tokens < 1 or (self.max_rows is not None and self.max_rows < 1):
            raise ConfigError(
                f"max_tokens and max_rows must be positive, got {self.max_tokens}, {self.max_rows}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world_size {self.world_size}")
        if len(self.widths) < self.world_size:
            raise ConfigError(f"{len(self.widths)} pairs cannot feed {self.world_size} ranks")
        too_wide = np.flatnonzero(2 * self.widths > self.max_tokens)
        if len(too_wide):
            row = int(too_wide[0])
            name = f"pair_id {int(pair_ids[row])}" if pair_ids is not None else f"row {row}"
            raise ConfigError(
                f"max_tokens={self.max_tokens} cannot hold {name}: chosen and rejected padded to "
                f"{int(self.widths[row])} tokens cost {2 * int(self.widths[row])} "
                f"({len(too_wide)} pairs are over the budget)"
            )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def packed_batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's shuffled order, width-sorted within windows, packed to the budget."""
        order = epoch_order(len(self.widths), self.seed, epoch)
        window = SORT_WINDOW_BATCHES * (self.max_rows or 16)
        for start in range(0, len(order), window):
            block = order[start : start + window]
            order[start : start + window] = block[np.argsort(self.widths[block], kind="stable")]
        return pack_by_tokens(order, self.widths, self.max_tokens, self.max_rows)

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """Every rank's batches of `epoch`, in the order ranks take them round-robin."""
        batches = split_to_multiple(self.packed_batches(epoch), self.world_size)
        shuffle = np.random.default_rng([self.seed, epoch, 1]).permutation(len(batches))
        return [batches[i] for i in shuffle]

    def rank_batches(self, epoch: int) -> list[np.ndarray]:
        return self.epoch_batches(epoch)[self.rank :: self.world_size]

    def __iter__(self):
        return iter(self.rank_batches(self.epoch))

    def __len__(self) -> int:
        return len(self.rank_batches(self.epoch))
