"""Build-manifest stage: filter, tokenize, split and shard every arm -> data/manifest.json."""

from __future__ import annotations

import sys

from align.config import ArmConfig, load_config
from align.exit_codes import run_with_exit_codes
from align.paths import RunPaths
from align.receipts import PASSED
from align.stage import Stage, parse_stage_args
from align.train import stage_gates


def main() -> None:
    args = parse_stage_args(sys.argv[1:], n_configs=None)
    loaded = [load_config(path, ArmConfig, args.overrides) for path in args.configs]
    results_dirs = {item.cfg.run.results_dir for item in loaded}
    if len(results_dirs) != 1:
        raise ValueError(f"arms disagree on run.results_dir: {sorted(results_dirs)}")
    paths = RunPaths.of(results_dirs.pop())
    stage = Stage("build_manifest")
    checkpoint = stage_gates.sft_gate(paths)["checkpoint"]
    from align.data.build import build_arm
    from align.model.tokenizer import load_tokenizer, tokenizer_hash

    tokenizer = load_tokenizer(checkpoint)
    arms = {
        item.cfg.arm: build_arm(item.cfg, tokenizer, paths.arm(item.cfg.arm)) for item in loaded
    }
    for item in loaded:
        arms[item.cfg.arm]["config_hash"] = item.config_hash
        arms[item.cfg.arm]["config_source"] = str(item.source)
    pins = {
        "tokenizer_checkpoint": checkpoint,
        "tokenizer_hash": tokenizer_hash(checkpoint),
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "chat_template": tokenizer.chat_template is not None,
    }
    inputs = {src: h for entry in arms.values() for src, h in entry["sources"].items()}
    outputs = {
        entry["shards"][s]["path"]: entry["shards"][s]["hash"]
        for entry in arms.values()
        for s in entry["shards"]
    }
    receipt = stage.receipt(loaded, PASSED, inputs=inputs, outputs=outputs, arms=arms, pins=pins)
    stage.write(paths.manifest, receipt)


if __name__ == "__main__":
    run_with_exit_codes(main, "build_manifest")
