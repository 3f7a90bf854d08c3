"""Build-manifest stage: filter, tokenize, split and shard every arm -> data/manifest.json."""

from __future__ import annotations

import sys

from align.config import ArmConfig, load_config
from align.exit_codes import ConfigError, run_with_exit_codes
from align.paths import RunPaths, external_locations
from align.receipts import PASSED
from align.stages import gates
from align.stages.entry import Stage, parse_stage_args


def main() -> None:
    args = parse_stage_args(sys.argv[1:], n_configs=None)
    loaded = [load_config(path, ArmConfig, args.overrides) for path in args.configs]
    results_dirs = {item.cfg.run.results_dir for item in loaded}
    if len(results_dirs) != 1:
        raise ConfigError(f"arms disagree on run.results_dir: {sorted(results_dirs)}")
    external = [place for item in loaded for place in external_locations(item.cfg)]
    paths = RunPaths.of(results_dirs.pop(), external)
    stage = Stage("build_manifest")
    checkpoint = gates.sft_gate(paths).checkpoint
    from align.data.build import prepare_arm, write_arms
    from align.data.chat_template import template_hash
    from align.data.tokenize import PromptRenderer
    from align.model.tokenizer import CONFIG_FILE, load_tokenizer, tokenizer_hash

    tokenizer = load_tokenizer(checkpoint)
    # Compiling the template once here names the checkpoint if it is broken.
    PromptRenderer(tokenizer, where=f"{checkpoint}/{CONFIG_FILE}")
    builds = [prepare_arm(item.cfg, tokenizer) for item in loaded]
    pins = {
        "tokenizer_checkpoint": paths.recorded(checkpoint),
        "tokenizer_hash": tokenizer_hash(checkpoint),
        "chat_template": tokenizer.chat_template is not None,
        "chat_template_hash": template_hash(tokenizer.chat_template),
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "pad_source": tokenizer.pad_source,
    }

    def manifest(arms: dict) -> dict:
        for item in loaded:
            arms[item.cfg.arm]["config_hash"] = item.config_hash
            arms[item.cfg.arm]["config_source"] = str(item.source)
        inputs = {src: h for entry in arms.values() for src, h in entry["sources"].items()}
        outputs = {
            entry["shards"][s]["path"]: entry["shards"][s]["hash"]
            for entry in arms.values()
            for s in entry["shards"]
        }
        return stage.receipt(loaded, PASSED, inputs=inputs, outputs=outputs, arms=arms, pins=pins)

    receipt = write_arms(builds, tokenizer, paths, manifest)
    for arm, entry in receipt["arms"].items():
        counts = entry["counts"]
        line = f"arm {arm}: read {counts['read']}, kept {counts['kept']} (train {counts['train']}, held {counts['held']})"
        stage.log.info(f"{line} {entry['status']}")


if __name__ == "__main__":
    run_with_exit_codes(main, "build_manifest")
