"""Reference-cache stage: summed reference log-probs of every pair, keyed by six components."""

from __future__ import annotations

import sys

from align.config import ArmConfig, load_config
from align.exit_codes import run_with_exit_codes
from align.paths import SPLITS, RunPaths
from align.receipts import PASSED, hash_file
from align.stage import Stage, parse_stage_args
from align.train import stage_gates
from align.utils.guard import cap_threads


def main() -> None:
    args = parse_stage_args(sys.argv[1:])
    loaded = load_config(args.configs[0], ArmConfig, args.overrides)
    cfg, paths = loaded.cfg, RunPaths.of(loaded.cfg.run.results_dir)
    arm = paths.arm(cfg.arm)
    stage = Stage("ref_cache")
    checkpoint = stage_gates.sft_gate(paths)["checkpoint"]
    entry = stage_gates.manifest_entry(paths, cfg)
    cap_threads(cfg.run.threads)
    from align.train.ref_cache import expected_key, forward_impl_name
    from align.train.ref_precompute import precompute_ref_caches
    from align.utils.dist import destroy_distributed

    forward_impl = forward_impl_name(cfg.ref.attn_implementation, cfg.ref.dtype, cfg.ref.batch_size)
    jobs = []
    for split in SPLITS:
        shard = entry["shards"][split]["path"]
        key = expected_key(checkpoint, shard, cfg.data.seq_len, cfg.data.truncation, cfg.ref.dtype, forward_impl)
        jobs.append((shard, arm.ref_cache(forward_impl, split), key))
    figures, info = precompute_ref_caches(checkpoint, jobs, cfg.ref, cfg.run, arm.ref_dir(forward_impl))
    if info.is_main:
        receipt = stage.receipt(
            loaded, PASSED, inputs={checkpoint: jobs[0][2]["checkpoint_weights"]},
            outputs={str(out): hash_file(out) for _, out, _ in jobs}, figures=figures, forward_impl=forward_impl,
        )
        stage.write(arm.ref_receipt(forward_impl), receipt)
    destroy_distributed()


if __name__ == "__main__":
    run_with_exit_codes(main, "ref_cache")
