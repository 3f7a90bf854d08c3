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


def run_path_bias(
    cfg, checkpoint: str, shard_path: str, cache: Path, key: dict[str, str], run_dir: Path
):
    """Score the pre-registered sample through the training path; compare with the cache."""
    from align.train.path_bias import margin_errors, path_bias_figures, sample_rows
    from align.train.ref_cache import forward_impl_name, load_ref_cache

    info = start_session(run_dir, cfg.run, cfg.batch)
    model = load_policy(checkpoint, cfg.model, info, cfg.trainer)
    shard = PairShard(shard_path)
    ref_chosen, ref_rejected = load_ref_cache(cache, key, shard.pair_ids)
    rows = sample_rows(len(shard), cfg.path_bias.sample_pairs, cfg.path_bias.seed)
    chosen, rejected = score_pairs(
        model, shard, cfg.batch.micro_batch, info, desc="path bias", rows=rows
    )
    errors = margin_errors(chosen, rejected, ref_chosen[rows], ref_rejected[rows])
    training_impl = forward_impl_name(
        model.attn_implementation, cfg.model.dtype, cfg.batch.micro_batch
    )
    cache_impl = key["forward_impl"]
    return path_bias_figures(errors, cfg.path_bias.tolerance, cache_impl, training_impl), info
