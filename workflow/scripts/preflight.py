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
from align.stages.gates import GateContext, run_gates


def main() -> None:
    args = parse_stage_args(sys.argv[1:])
    loaded = load_config(args.configs[0], ArmConfig, args.overrides)
    cfg = loaded.cfg
    stage = Stage("preflight")
    ctx = GateContext(cfg, RunPaths.of_config(cfg))
    report = run_gates(ctx, through="preflight")
    print(f"align preflight: arm {cfg.arm}\n{report.table()}", file=sys.stderr)
    figures = ctx.projection.figures if ctx.projection else {"descoped": True}
    stage.write(
        ctx.arm.preflight, stage.receipt(loaded, PASSED, figures=figures, gates=report.recorded())
    )


if __name__ == "__main__":
    run_with_exit_codes(main, "preflight")
