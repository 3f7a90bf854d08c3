"""Computing a reference cache: score every pair of a shard with the reference forward path."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from align.config import ModelConfig, RefConfig, RunConfig
from align.data.loader import PairShard
from align.eval.preference import score_pairs
from align.train.ref_cache import write_ref_cache
from align.train.session import load_policy, start_session


def precompute_ref_caches(
    checkpoint: str | Path,
    jobs: list[tuple[str, Path, dict[str, str]]],
    cfg: RefConfig,
    run: RunConfig,
    run_dir: Path,
) -> dict[str, Any]:
    """Build one cache per (shard, out, key) job with one loaded model; returns per-cache figures."""
    info = start_session(run_dir, run, None)
    model = load_policy(checkpoint, ModelConfig(cfg.dtype, cfg.attn_implementation), info)
    figures = {}
    for shard_path, out, key in jobs:
        shard = PairShard(shard_path)
        started = time.perf_counter()
        chosen, rejected = score_pairs(model, shard, cfg.batch_size, info, desc=f"ref {out.stem}")
        elapsed = time.perf_counter() - started
        if info.is_main:
            write_ref_cache(out, shard.pair_ids, chosen, rejected, key)
        tokens = int(shard.arrays["chosen_len"].sum() + shard.arrays["rejected_len"].sum())
        figures[out.stem] = {
            "pairs": len(shard),
            "tokens": tokens,
            "seconds": elapsed,
            "tokens_per_s": tokens / elapsed,
            "key": key,
        }
    return figures, info
