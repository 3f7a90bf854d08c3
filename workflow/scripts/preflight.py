"""Resource preflight: the job's projected RSS for the optimizer it runs, against the host.

Its receipt becomes the `mem_mb` of the probe and dpo jobs; exit 6 when it does not fit.
"""

from __future__ import annotations

import sys

from align.config import ArmConfig, load_config
from align.exit_codes import run_with_exit_codes
from align.paths import RunPaths
from align.receipts import PASSED
from align.stages.entry import Stage, parse_stage_args
from align.stages.gates import Descoped, run_gates


def main() -> None:
    args = parse_stage_args(sys.argv[1:])
    loaded = load_config(args.configs[0], ArmConfig, args.overrides)
    cfg = loaded.cfg
    stage = Stage("preflight")
    report, gated = run_gates(cfg, RunPaths.of_config(cfg), through="preflight")
    stage.log.info(f"arm {cfg.arm}\n{report.table()}")
    figures = {"descoped": True} if isinstance(gated, Descoped) else gated.projection.figures
    stage.write(
        gated.arm.preflight, stage.receipt(loaded, PASSED, figures=figures, gates=report.recorded())
    )


if __name__ == "__main__":
    run_with_exit_codes(main, "preflight")
