"""Computing a reference cache: every pair of a shard scored by the reference forward path,
resumably and over any number of ranks.

A shard's rows are cut into slices of whole batches. Each finished slice is written
atomically as a part file in `<cache>.parts/` carrying the cache key and its rows; a
precompute restarted under the same key reuses those parts, and discards (loudly,
naming what differs) parts of another key or slice layout. Pending slices are dealt
round-robin over the ranks; rank 0 merges the parts in row order into the cache and
removes them. Batches never straddle slices, so the cache's bytes are the same for any
number of ranks, restarts and slice size.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from tqdm import tqdm

from align.config import ModelConfig, RefConfig, RunConfig
from align.data import deal
from align.data.loader import PairShard
from align.eval.preference import score_blocks, score_pairs
from align.exit_codes import AlignError, GateRefused
from align.log import stage_logger
from align.train.phases import PhaseMeter
from align.train.ref_cache import (
    GATE,
    PART_SUFFIX,
    CacheKey,
    forward_impl_name,
    part_path,
    parts_dir,
    read_cache_part,
    write_cache_part,
    write_ref_cache,
)
from align.train.session import load_policy, start_session
from align.utils.dist import DistInfo, barrier

LOG = stage_logger("ref_cache")


def slice_size(cfg: RefConfig) -> int:
    """Pairs per slice: `ref.slice_pairs` rounded up to whole batches."""
    return deal.slice_size(cfg.slice_pairs, cfg.batch_size)


def part_problem(
    metadata: dict[str, Any],
    arrays: dict[str, np.ndarray],
    index: int,
    bounds: list[tuple[int, int]],
    pair_ids: np.ndarray,
    key: CacheKey,
) -> str | None:
    """Why a part cannot stand in for slice `index` of this cache, or None when it can."""
    try:
        mismatch = CacheKey.of(metadata["key"], "part", GATE).mismatch(key)
    except GateRefused as err:
        return str(err)
    if mismatch:
        return mismatch
    if index >= len(bounds):
        return f"slice {index} does not exist: this shard has {len(bounds)} slices"
    start, stop = bounds[index]
    found = metadata["slice"]
    expected = {"index": index, "start": start, "stop": stop, "total": len(pair_ids)}
    if found != expected:
        return f"slice layout expected {expected}, found {found}"
    if not np.array_equal(arrays["pair_id"], pair_ids[start:stop]):
        return f"pair ids differ from the shard's rows [{start}, {stop})"
    return None


def _part_index(path: Path) -> int:
    """The slice index in a part file's name (`slice-000003.safetensors`)."""
    number = path.name.removeprefix("slice-").removesuffix(PART_SUFFIX)
    if number.isdigit() and path.name == part_path(path.parent, int(number)).name:
        return int(number)
    raise ValueError("not a part file (an unfinished write or a foreign file)")


def reusable_parts(
    parts: Path, bounds: list[tuple[int, int]], pair_ids: np.ndarray, key: CacheKey
) -> tuple[list[int], list[str]]:
    """Indices of the parts valid for this cache; every other file in `parts` is removed.

    Returns (reusable slice indices, one line per discarded file saying why).
    """
    if not parts.is_dir():
        return [], []
    reusable, discarded = [], []
    for path in sorted(parts.iterdir()):
        try:
            index = _part_index(path)
            metadata, arrays = read_cache_part(path)
            problem = part_problem(metadata, arrays, index, bounds, pair_ids, key)
        except ValueError as err:
            problem = str(err)
        if problem is None:
            reusable.append(index)
            continue
        discarded.append(f"{path}: {problem}")
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return reusable, discarded


def merge_parts(
    parts: Path, out: Path, bounds: list[tuple[int, int]], pair_ids: np.ndarray, key: CacheKey
) -> None:
    """Write the cache from every slice's part, in row order, then remove the parts."""
    chosen, rejected = [], []
    for index in range(len(bounds)):
        try:
            metadata, arrays = read_cache_part(part_path(parts, index))
            problem = part_problem(metadata, arrays, index, bounds, pair_ids, key)
        except ValueError as err:
            problem = str(err)
        if problem:
            raise AlignError(f"{parts}: part of slice {index} changed while merging: {problem}")
        chosen.append(arrays["chosen_logps"])
        rejected.append(arrays["rejected_logps"])
    write_ref_cache(out, pair_ids, np.concatenate(chosen), np.concatenate(rejected), key)
    shutil.rmtree(parts)


def _agree(info: DistInfo, value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    if info.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _slice_tokens(shard: PairShard, bounds: list[tuple[int, int]], indices: list[int]) -> int:
    a = shard.arrays
    return int(
        sum(
            a["chosen_len"][s:e].sum() + a["rejected_len"][s:e].sum()
            for s, e in (bounds[i] for i in indices)
        )
    )


def precompute_ref_cache(
    model, shard: PairShard, out: Path, key: CacheKey, cfg: RefConfig, info: DistInfo
) -> dict[str, Any]:
    """Score every pair of `shard` into the cache `out`, reusing valid parts; returns figures."""
    bounds = deal.slice_rows(len(shard), slice_size(cfg))
    parts = parts_dir(out)
    reused, discarded = (
        reusable_parts(parts, bounds, shard.pair_ids, key) if info.is_main else ([], [])
    )
    reused = _agree(info, reused)
    for line in discarded:
        LOG.info(f"discarded {line}")
    pending = [i for i in range(len(bounds)) if i not in set(reused)]
    if info.is_main:
        LOG.info(
            f"{out}: {len(bounds)} slices, {len(reused)} reused from {parts}, "
            f"{len(pending)} to compute on {info.world_size} rank(s)"
        )
    started = time.perf_counter()
    pad_rows = deal.padding_rows(len(shard), cfg.batch_size)
    rounds = deal.slice_rounds(bounds, pending, cfg.batch_size, info.rank, info.world_size)
    total = -(-len(pending) // info.world_size)
    for index, blocks in tqdm(
        rounds, desc=f"ref {out.stem}", total=total, mininterval=5, disable=not info.is_main
    ):
        scored = score_blocks(model, shard, blocks, pad_rows, show=False)
        if index is not None:
            start, stop = bounds[index]
            logps = [lp for lp in scored if lp is not None]
            chosen = np.concatenate([lp[: len(lp) // 2] for lp in logps]).astype(np.float32)
            rejected = np.concatenate([lp[len(lp) // 2 :] for lp in logps]).astype(np.float32)
            rows = (start, stop, len(shard))
            ids = shard.pair_ids[start:stop]
            write_cache_part(parts, index, rows, ids, chosen, rejected, key)
    barrier()
    elapsed = time.perf_counter() - started
    if info.is_main:
        merge_parts(parts, out, bounds, shard.pair_ids, key)
    computed_tokens = _slice_tokens(shard, bounds, pending)
    return {
        "pairs": len(shard),
        "tokens": _slice_tokens(shard, bounds, list(range(len(bounds)))),
        "slice_pairs": slice_size(cfg),
        "slices": len(bounds),
        "reused_slices": len(reused),
        "computed_slices": len(pending),
        "discarded_parts": len(discarded),
        "computed_tokens": computed_tokens,
        "world_size": info.world_size,
        "seconds": elapsed,
        "tokens_per_s": computed_tokens / elapsed if computed_tokens else None,
        "key": key.as_dict(),
        "precision": model.precision,
        "devices": list(info.devices),
    }


def precompute_ref_caches(
    checkpoint: str | Path,
    jobs: list[tuple[str, Path, CacheKey]],
    cfg: RefConfig,
    run: RunConfig,
    run_dir: Path,
    projection: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], DistInfo]:
    """Build one cache per (shard, out, key) job with one loaded model; returns per-cache
    figures and the phases' measures."""
    info = start_session(run_dir, run, None)
    meter = PhaseMeter(info.device.type)
    reference = ModelConfig(dtype=cfg.dtype, attn_implementation=cfg.attn_implementation)
    with meter.phase("load"):
        model = load_policy(checkpoint, reference, info)
    for _, out, key in jobs:
        _check_key_names_live_path(key, model, cfg, out)
    with meter.phase("evaluate"):
        figures = {
            out.stem: precompute_ref_cache(
                model, PairShard(shard_path, cfg.layout), out, key, cfg, info
            )
            for shard_path, out, key in jobs
        }
    return {**figures, "phases": meter.report(projection)}, info


def _check_key_names_live_path(key: CacheKey, model, cfg: RefConfig, out: Path) -> None:
    """The key's dtype and forward_impl must name what the loaded model computes in."""
    live = forward_impl_name(
        model.attn_implementation, model.precision["compute"], cfg.batch_size, cfg.layout
    )
    found = (key.dtype, key.forward_impl)
    if found != (model.precision["compute"], live):
        raise AlignError(
            f"{out}: cache key names dtype {found[0]!r} and forward_impl {found[1]!r}, but the "
            f"loaded reference computes in {model.precision['compute']!r} through {live!r}"
        )


def run_path_bias(
    cfg,
    checkpoint: str,
    shard_path: str,
    cache: Path,
    key: CacheKey,
    run_dir: Path,
    projection: dict[str, Any] | None = None,
):
    """Score the pre-registered sample through the training path; compare with the cache."""
    from align.train.path_bias import (
        TrainingPath,
        margin_errors,
        path_bias_figures,
    )
    from align.train.ref_cache import load_ref_cache

    info = start_session(run_dir, cfg.run, cfg.batch)
    meter = PhaseMeter(info.device.type)
    with meter.phase("load"):
        model = load_policy(checkpoint, cfg.model, info, cfg.trainer)
    shard = PairShard(shard_path, cfg.batch.layout)
    ref_chosen, ref_rejected = load_ref_cache(cache, key, shard.pair_ids)
    rows = deal.sample_rows(len(shard), cfg.path_bias.sample_pairs, cfg.path_bias.seed)
    with meter.phase("evaluate"):
        chosen, rejected = score_pairs(
            model, shard, cfg.batch.micro_batch, info, desc="path bias", rows=rows
        )
    errors = margin_errors(chosen, rejected, ref_chosen[rows], ref_rejected[rows])
    training = TrainingPath.of_model(model, cfg.batch.micro_batch, shard.layout)
    settings = dataclasses.asdict(cfg.path_bias)
    figures = path_bias_figures(errors, settings, key.forward_impl, training)
    placed = {"precision": model.precision, "devices": list(info.devices)}
    return {**figures, **placed, "phases": meter.report(projection)}, info
