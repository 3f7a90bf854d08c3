"""Which rows each rank scores in each forward.

Held-out scoring and the path-bias sample deal blocks of a batch size round-robin; the
reference cache deals slices of whole blocks, one per rank per round. Every rank runs as
many forwards as the busiest (a sharded model needs all ranks in each), so a rank short of
rows scores the padding rows and drops the result. The scoring loops deal by these
functions, and the memory projection reads the same deal off the shards' lengths, so the
widest forward it projects is the widest a rank runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from align.data.shards import layout_rows

# A block of rows, or None: a padding forward of `padding_rows` whose result is dropped.
Block = np.ndarray | None


def batches(start: int, stop: int, batch_size: int) -> list[np.ndarray]:
    """Rows [start, stop) in consecutive blocks of `batch_size` (the last may be short)."""
    return [np.arange(s, min(s + batch_size, stop)) for s in range(start, stop, batch_size)]


def rank_blocks(n: int, batch_size: int, rank: int, world_size: int) -> list[Block]:
    """This rank's blocks of n rows dealt round-robin, padded to every rank's count."""
    blocks = batches(0, n, batch_size)
    rounds = -(-len(blocks) // world_size)
    return [
        blocks[i] if i < len(blocks) else None for i in range(rank, rounds * world_size, world_size)
    ]


def padding_rows(n: int, batch_size: int) -> np.ndarray:
    """The rows a padding forward scores: the first block's."""
    return np.arange(min(batch_size, n))


def slice_size(slice_pairs: int, batch_size: int) -> int:
    """Pairs per slice: `slice_pairs` rounded up to whole batches."""
    return -(-slice_pairs // batch_size) * batch_size


def slice_rows(n: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) of each slice of `size` rows of an n-row shard."""
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def slice_blocks(start: int, stop: int, batch_size: int, forwards: int) -> list[Block]:
    """The batches of rows [start, stop), then None (padding forwards) up to `forwards`."""
    blocks: list[Block] = list(batches(start, stop, batch_size))
    return blocks + [None] * (forwards - len(blocks))


def slice_rounds(
    bounds: list[tuple[int, int]], pending: list[int], batch_size: int, rank: int, world: int
) -> Iterator[tuple[int | None, list[Block]]]:
    """Per round of the pending slices, one per rank: this rank's slice (None: it has none
    this round) and its blocks, padded to the round's busiest rank."""
    for first in range(0, len(pending), world):
        dealt = pending[first : first + world]
        forwards = max(-(-(bounds[i][1] - bounds[i][0]) // batch_size) for i in dealt)
        index = dealt[rank] if rank < len(dealt) else None
        start, stop = bounds[index] if index is not None else (0, 0)
        yield index, slice_blocks(start, stop, batch_size, forwards)


def sample_rows(n: int, sample_pairs: int, seed: int) -> np.ndarray:
    """The pre-registered sample of pairs, sorted so batches follow shard order."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=min(n, sample_pairs), replace=False))


def forward_shapes(
    widths: np.ndarray, blocks: list[Block], pad: np.ndarray, layout: str
) -> set[tuple[int, int]]:
    """(rows, width) of each forward of `blocks` in `layout` (`widths` its pair widths):
    a batch pads its rows to its widest pair."""
    shapes = set()
    for block in blocks:
        rows = block if block is not None else pad
        if len(rows):
            shapes.add((layout_rows(widths[rows], layout), int(widths[rows].max())))
    return shapes
