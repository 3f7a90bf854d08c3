"""Which rows each rank trains on at each optimizer step (numpy only).

An epoch is a permutation fixed by (seed, epoch), cut into `n // global_batch`
steps; the last step of an epoch also takes the remainder, so every row is seen
exactly once per epoch across ranks. A step's rows are split into
world_size x grad_accum near-equal micro-batches, rank r taking its grad_accum.
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

    def rank_rows(self, step: int) -> list[np.ndarray]:
        """This rank's grad_accum micro-batches of step `step`."""
        parts = np.array_split(self.global_rows(step), self.world_size * self.batch.grad_accum)
        accum = self.batch.grad_accum
        return parts[self.rank * accum : (self.rank + 1) * accum]
