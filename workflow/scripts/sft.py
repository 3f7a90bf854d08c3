"""SFT stage: train the starting policy from the base model (rule `sft`, under torchrun)."""

from __future__ import annotations

import sys

from align.config import SftConfig, load_config
from align.exit_codes import run_with_exit_codes
from align.paths import RunPaths
from align.receipts import PASSED
from align.stages.entry import Stage, parse_stage_args
from align.stages.gates import require_checkpoint
from align.train.memory import check_stage_rss
from align.utils.guard import apply_resource_guards


def main() -> None:
    args = parse_stage_args(sys.argv[1:])
    loaded = load_config(args.configs[0], SftConfig, args.overrides)
    cfg, paths = loaded.cfg, RunPaths.of_config(loaded.cfg)
    stage = Stage("sft")
    require_checkpoint("base_model", cfg.run.base_model)
    apply_resource_guards(cfg.run, "sft", [cfg.run.results_dir])
    projection = check_stage_rss("sft", cfg, cfg.run.base_model)
    from align.stages.sft import run_sft
    from align.utils.dist import destroy_distributed
    from align.utils.weights_hash import weights_hash

    figures, info = run_sft(cfg, paths, stage.started, projection)
    phases = figures.pop("phases")
    if info.is_main:
        outputs = {paths.recorded(paths.sft_checkpoint): weights_hash(paths.sft_checkpoint)}
        inputs = {paths.recorded(cfg.run.base_model): weights_hash(cfg.run.base_model)}
        stage.write(
            paths.sft_receipt,
            stage.receipt(
                loaded,
                PASSED,
                inputs=inputs,
                outputs=outputs,
                figures=figures,
                phases=phases,
                projection=projection,
            ),
        )
    destroy_distributed()


if __name__ == "__main__":
    run_with_exit_codes(main, "sft")
