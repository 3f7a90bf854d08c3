"""Computing a reference cache: score every pair of a shard with the reference forward path."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from align.config import RefConfig
from align.data.loader import PairShard
from align.eval.preference import score_pairs
from align.model import load_pretrained
from align.train.ref_cache import write_ref_cache


def precompute_ref_cache(
    checkpoint: str | Path,
    shard_path: str | Path,
    out: Path,
    key: dict[str, str],
    cfg: RefConfig,
    device: str,
) -> dict[str, Any]:
    model = load_pretrained(
        checkpoint,
        device=device,
        dtype=getattr(torch, cfg.dtype),
        attn_implementation=cfg.attn_implementation,
    )
    shard = PairShard(shard_path)
    started = time.perf_counter()
    chosen, rejected = score_pairs(model, shard, cfg.batch_size, desc=f"ref {out.stem}")
    elapsed = time.perf_counter() - started
    write_ref_cache(out, shard.pair_ids, chosen, rejected, key)
    tokens = int(shard.arrays["chosen_len"].sum() + shard.arrays["rejected_len"].sum())
    return {
        "pairs": len(shard),
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "key": key,
    }
