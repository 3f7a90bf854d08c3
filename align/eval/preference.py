"""Scoring pairs with a policy: summed response log-probs of chosen and rejected.

The same routine builds the reference cache and evaluates policies, so both see
one forward path for a given dtype, backend and batch size. Under several ranks,
batches are dealt round-robin and every rank runs the same number of forwards
(sharded models need every rank in every forward); results are summed across ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from tqdm import tqdm

from align.data.deal import padding_rows, rank_blocks
from align.data.loader import PairShard
from align.eval.logprobs import sequence_logps
from align.eval.stats import accuracy_summary
from align.utils.dist import DistInfo, all_reduce_sum
from align.utils.heap import release_freed_memory


@torch.no_grad()
def score_blocks(
    model,
    shard: PairShard,
    blocks: list[np.ndarray | None],
    pad_rows: np.ndarray,
    desc: str = "score",
    show: bool = True,
    between_batches: Callable[[], None] | None = None,
) -> list[np.ndarray | None]:
    """Summed log-probs [chosen..., rejected...] (float64) of each block of shard rows.

    A None block is a forward of `pad_rows` whose result is dropped: it keeps this rank
    in step with ranks that have a block to score. `between_batches` runs before each
    forward on every rank alike (a stop check may raise there).
    """
    model.eval()
    # What a load or an earlier scoring freed goes back to the kernel before these forwards.
    release_freed_memory()
    out: list[np.ndarray | None] = []
    for block in tqdm(blocks, desc=desc, mininterval=5, disable=not show):
        if between_batches is not None:
            between_batches()
        rows = block if block is not None else pad_rows
        logps = sequence_logps(model, shard.collate(rows)).double().cpu().numpy()
        out.append(logps if block is not None else None)
    return out


def score_pairs(
    model,
    shard: PairShard,
    batch_size: int,
    info: DistInfo,
    desc: str = "score",
    rows: np.ndarray | None = None,
    between_batches: Callable[[], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(chosen, rejected) summed log-probs of `rows` of `shard` (default all), in that order."""
    selected = np.arange(len(shard)) if rows is None else np.asarray(rows)
    n = len(selected)
    out = np.zeros(2 * n, dtype=np.float64)
    blocks = rank_blocks(n, batch_size, info.rank, info.world_size)
    scored = score_blocks(
        model,
        shard,
        [selected[b] if b is not None else None for b in blocks],
        selected[padding_rows(n, batch_size)],
        desc,
        info.is_main,
        between_batches,
    )
    for block, logps in zip(blocks, scored, strict=True):
        if block is not None:
            out[block] = logps[: len(block)]
            out[n + block] = logps[len(block) :]
    if info.world_size > 1:
        out = np.asarray(all_reduce_sum(out.tolist()))
    return out[:n].astype(np.float32), out[n:].astype(np.float32)


def preference_correct(chosen: np.ndarray, rejected: np.ndarray) -> np.ndarray:
    """The policy as its own judge; a tie counts as wrong."""
    return np.asarray(chosen) > np.asarray(rejected)


def implicit_reward_correct(
    chosen: np.ndarray, rejected: np.ndarray, ref_chosen: np.ndarray, ref_rejected: np.ndarray
) -> np.ndarray:
    """DPO's implicit reward against a reference policy; a tie counts as wrong."""
    return (np.asarray(chosen) - ref_chosen) - (np.asarray(rejected) - ref_rejected) > 0


def policy_preference(chosen: np.ndarray, rejected: np.ndarray) -> dict[str, float]:
    """The policy as judge: it prefers chosen when log p(chosen) > log p(rejected)."""
    return accuracy_summary(preference_correct(chosen, rejected).tolist())


def implicit_reward_preference(
    chosen: np.ndarray, rejected: np.ndarray, ref_chosen: np.ndarray, ref_rejected: np.ndarray
) -> dict[str, float]:
    """DPO's implicit reward: correct when (pi_c - ref_c) > (pi_r - ref_r)."""
    return accuracy_summary(
        implicit_reward_correct(chosen, rejected, ref_chosen, ref_rejected).tolist()
    )
