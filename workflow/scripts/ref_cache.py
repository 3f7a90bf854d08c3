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
    from align.train.ref_precompute import precompute_ref_cache

    forward_impl = forward_impl_name(cfg.ref.attn_implementation, cfg.ref.dtype, cfg.ref.batch_size)
    outputs, figures = {}, {}
    for split in SPLITS:
        shard = entry["shards"][split]["path"]
        key = expected_key(
            checkpoint, shard, cfg.data.seq_len, cfg.data.truncation, cfg.ref.dtype, forward_impl
        )
        out = arm.ref_cache(forward_impl, split)
        figures[split] = precompute_ref_cache(checkpoint, shard, out, key, cfg.ref, cfg.run.device)
        outputs[str(out)] = hash_file(out)
    receipt = stage.receipt(
        loaded,
        PASSED,
        inputs={checkpoint: figures["train"]["key"]["checkpoint_weights"]},
        outputs=outputs,
        figures=figures,
        forward_impl=forward_impl,
    )
    stage.write(arm.ref_receipt(forward_impl), receipt)


if __name__ == "__main__":
    run_with_exit_codes(main, "ref_cache")
