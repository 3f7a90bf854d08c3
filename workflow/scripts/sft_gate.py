"""SFT quality gate (section 11): held-out NLL and greedy generations -> sft/gate.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from align.config import SftConfig, load_config
from align.exit_codes import GateRefused, run_with_exit_codes
from align.paths import RunPaths
from align.receipts import FAILED, PASSED
from align.stages.entry import Stage, parse_stage_args
from align.stages.gates import require_checkpoint
from align.train.memory import check_stage_rss
from align.utils.guard import apply_resource_guards


def main() -> None:
    args = parse_stage_args(sys.argv[1:])
    loaded = load_config(args.configs[0], SftConfig, args.overrides)
    cfg, paths = loaded.cfg, RunPaths.of_config(loaded.cfg)
    stage = Stage("sft_gate")
    checkpoint = Path(cfg.run.sft_checkpoint) if cfg.run.sft_checkpoint else paths.sft_checkpoint
    require_checkpoint("sft_gate", checkpoint)
    apply_resource_guards(cfg.run, "sft_gate", [cfg.run.results_dir])
    projection = check_stage_rss("sft_gate", cfg, checkpoint)
    from align.stages.sft import evaluate_sft_gate
    from align.utils.dist import destroy_distributed
    from align.utils.weights_hash import weights_fingerprint, weights_hash

    result = evaluate_sft_gate(cfg, checkpoint, paths.sft_gate_run_dir, projection)
    phases = result.pop("phases")
    receipt = stage.receipt(
        loaded,
        PASSED if result["passed"] else FAILED,
        inputs={paths.recorded(checkpoint): weights_hash(checkpoint)},
        figures=result,
        phases=phases,
        projection=projection,
        passed=result["passed"],
        checkpoint=paths.recorded(checkpoint),
        checkpoint_hash=weights_hash(checkpoint),
        checkpoint_fingerprint=weights_fingerprint(checkpoint),
    )
    if not result["passed"]:
        stage.log.error("receipt of the failed gate:\n" + json.dumps(receipt, indent=2))
        failed = {name: check for name, check in result["checks"].items() if not check["passed"]}
        raise GateRefused("sft_gate", f"{checkpoint}: failed checks {json.dumps(failed)}")
    stage.write(paths.sft_gate, receipt)
    destroy_distributed()


if __name__ == "__main__":
    run_with_exit_codes(main, "sft_gate")
