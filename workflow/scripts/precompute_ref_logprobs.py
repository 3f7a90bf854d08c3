"""Reference log-probs of every pair (rule `ref_cache`), or with --path-bias the step-0
measurement of the training forward path against that cache (rule `path_bias`)."""

from __future__ import annotations

import sys
from pathlib import Path

from align.config import ArmConfig, load_config
from align.exit_codes import run_with_exit_codes
from align.paths import SPLITS, RunPaths
from align.receipts import PASSED, hash_file
from align.stages import gates
from align.stages.entry import Stage, parse_stage_args
from align.stages.gates import ArmEntry
from align.train.memory import check_stage_rss
from align.train.ref_cache import TENSORS_HASH, expected_key, ref_forward_impl
from align.utils.guard import apply_resource_guards
from align.utils.weights_hash import file_tensors_hash


def build_caches(
    loaded, checkpoint: Path, entry: ArmEntry, paths: RunPaths, stage: Stage, projection
) -> None:
    from align.stages.ref_precompute import precompute_ref_caches

    cfg = loaded.cfg
    arm = paths.arm(cfg.arm)
    forward_impl = ref_forward_impl(cfg.ref)
    jobs = []
    for split in SPLITS:
        shard = entry.shards[split]
        key = expected_key(
            checkpoint, shard, cfg.data.seq_len, cfg.data.truncation, cfg.ref.dtype, forward_impl
        )
        jobs.append((shard, arm.ref_cache(forward_impl, split), key))
    figures, info = precompute_ref_caches(
        checkpoint, jobs, cfg.ref, cfg.run, arm.ref_dir(forward_impl), projection
    )
    phases = figures.pop("phases")
    if info.is_main:
        for split, f in figures.items():
            rate = f"{f['tokens_per_s']:.0f} tokens/s" if f["tokens_per_s"] else "nothing computed"
            stage.log.info(
                f"arm {cfg.arm} {forward_impl} {split}: {f['pairs']} pairs, "
                f"{f['slices']} slices ({f['reused_slices']} reused, {f['discarded_parts']} parts "
                f"discarded), {rate} on {f['world_size']} rank(s)"
            )
        # The gates check each cache's tensor bytes against this record, not only its metadata.
        caches = {
            split: {
                "path": paths.recorded(out),
                "hash": hash_file(out),
                TENSORS_HASH: file_tensors_hash(out),
            }
            for split, (_, out, _) in zip(SPLITS, jobs, strict=True)
        }
        receipt = stage.receipt(
            loaded,
            PASSED,
            inputs={paths.recorded(checkpoint): jobs[0][2].checkpoint_weights},
            outputs={cache["path"]: cache["hash"] for cache in caches.values()},
            figures=figures,
            phases=phases,
            projection=projection,
            forward_impl=forward_impl,
            caches=caches,
        )
        stage.write(arm.ref_receipt(forward_impl), receipt)


def measure_path_bias(
    loaded, checkpoint: Path, entry: ArmEntry, paths: RunPaths, stage: Stage, projection
) -> None:
    from align.stages.ref_precompute import run_path_bias
    from align.train.path_bias import table

    cfg = loaded.cfg
    arm = paths.arm(cfg.arm)
    cache_impl = ref_forward_impl(cfg.ref)
    shard = entry.shards["train"]
    key = expected_key(
        checkpoint, shard, cfg.data.seq_len, cfg.data.truncation, cfg.ref.dtype, cache_impl
    )
    cache = arm.ref_cache(cache_impl, "train")
    figures, info = run_path_bias(cfg, checkpoint, shard, cache, key, arm.run_dir, projection)
    phases = figures.pop("phases")
    if info.is_main:
        stage.log.info(f"arm {cfg.arm}\n{table(figures)}")
        receipt = stage.receipt(
            loaded,
            PASSED,
            inputs={paths.recorded(cache): hash_file(cache)},
            figures=figures,
            phases=phases,
            projection=projection,
            checkpoint=paths.recorded(checkpoint),
        )
        stage.write(arm.path_bias, receipt)


def main() -> None:
    args = parse_stage_args(sys.argv[1:], flags=("path-bias",))
    loaded = load_config(args.configs[0], ArmConfig, args.overrides)
    cfg, paths = loaded.cfg, RunPaths.of_config(loaded.cfg)
    mode = "path_bias" if "path-bias" in args.flags else "ref_cache"
    stage = Stage(mode)
    checkpoint = gates.sft_gate(paths).checkpoint
    entry = gates.manifest_entry(paths, cfg, checkpoint)
    apply_resource_guards(cfg.run, mode, [cfg.run.results_dir])
    projection = check_stage_rss(mode, cfg, checkpoint, {s: entry.shards[s] for s in SPLITS})
    from align.utils.dist import destroy_distributed

    run = measure_path_bias if mode == "path_bias" else build_caches
    run(loaded, checkpoint, entry, paths, stage, projection)
    destroy_distributed()


if __name__ == "__main__":
    run_with_exit_codes(main, "precompute_ref_logprobs")
