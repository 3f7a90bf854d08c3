"""The share of computed positions that are padding, batch by batch, on real pair shards.

`python benchmarks/padding.py SHARD [SHARD ...]` reads each built pair shard (for example
the scale rehearsal's rehearsal/250m/results/data/<arm>/train/pairs.safetensors) and
prints, for each layout (align.constants.PAIR_LAYOUTS: two rows per pair, one
prefix-shared row per pair, or shared pairs packed several to a row) and batching:

- training micro-batches of 1, 2 and 4 pairs as the trainer draws them (StepSampler:
  shuffled, not sorted by width);
- scoring batches of 8 and 16 pairs in shard order, as the reference cache and the
  held-out evaluation deal them (align.data.deal);

the positions computed (padding included), the real ones, and padding's share. A layout
that computes the prompt once has fewer real positions: both counts are its own.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from align.config import BatchConfig
from align.constants import PAIR_LAYOUTS
from align.data import deal
from align.data.loader import PairShard
from align.data.sampler import StepSampler


def real_tokens(shard: PairShard, rows: np.ndarray) -> int:
    """Positions that hold a token: both sequences, or the prompt once and both responses."""
    arrays = shard.arrays
    total = arrays["chosen_len"][rows].astype(np.int64) + arrays["rejected_len"][rows]
    if shard.layout != "padded":
        total = total - arrays["prompt_len"][rows]
    return int(total.sum())


def training_batches(n: int, micro_batch: int) -> list[np.ndarray]:
    """One epoch's micro-batches of a single rank, as the trainer draws them."""
    batch = BatchConfig(micro_batch=micro_batch, grad_accum=1, global_batch=micro_batch)
    sampler = StepSampler(n, batch, rank=0, world_size=1)
    return [rows for step in range(len(sampler)) for rows in sampler.rank_rows(step)]


def padding_share(shard: PairShard, batches: list[np.ndarray]) -> tuple[int, int]:
    computed = sum(shard.computed_tokens(rows) for rows in batches)
    real = sum(real_tokens(shard, rows) for rows in batches)
    return computed, real


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards", nargs="+")
    args = parser.parse_args()
    print("shard | layout | batches | computed | real | padding")
    for path in args.shards:
        n = len(PairShard(path))
        cases = {f"train micro_batch {m}": training_batches(n, m) for m in (1, 2, 4)}
        cases.update({f"score batch {b}": deal.batches(0, n, b) for b in (8, 16)})
        for layout in PAIR_LAYOUTS:
            shard = PairShard(path, layout)
            for name, batches in cases.items():
                computed, real = padding_share(shard, batches)
                print(
                    f"{path} | {layout} | {name} | {computed:,} | {real:,} | "
                    f"{1 - real / computed:.1%}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
