"""Scoring pairs with a policy: summed response log-probs of chosen and rejected.

The same routine builds the reference cache and evaluates policies, so both see
one forward path for a given dtype, backend and batch size.
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from align.data.loader import PairShard
from align.eval.stats import accuracy_summary
from align.train.logprobs import sequence_logps


@torch.no_grad()
def score_pairs(
    model, shard: PairShard, batch_size: int, desc: str = "score"
) -> tuple[np.ndarray, np.ndarray]:
    """(chosen, rejected) summed log-probs of every row of `shard`, in row order, float32."""
    model.eval()
    chosen = np.zeros(len(shard), dtype=np.float32)
    rejected = np.zeros(len(shard), dtype=np.float32)
    for start in tqdm(range(0, len(shard), batch_size), desc=desc, mininterval=5):
        rows = np.arange(start, min(start + batch_size, len(shard)))
        logps = sequence_logps(model, shard.collate(rows)).float().numpy()
        chosen[rows] = logps[: len(rows)]
        rejected[rows] = logps[len(rows) :]
    return chosen, rejected


def policy_preference(chosen: np.ndarray, rejected: np.ndarray) -> dict[str, float]:
    """The policy as judge: it prefers chosen when log p(chosen) > log p(rejected)."""
    return accuracy_summary((chosen > rejected).tolist())


def implicit_reward_preference(
    chosen: np.ndarray, rejected: np.ndarray, ref_chosen: np.ndarray, ref_rejected: np.ndarray
) -> dict[str, float]:
    """DPO's implicit reward: correct when (pi_c - ref_c) > (pi_r - ref_r)."""
    return accuracy_summary(((chosen - ref_chosen) > (rejected - ref_rejected)).tolist())
