"""The `align` command: `align report RESULTS_DIR` prints the run's summary as terminal tables;
`align memory ARM_TOML --checkpoint DIR` prints the per-GPU memory projection of the arm.

With `--figures`, report also writes the report's figures and summary page under
RESULTS_DIR/report/, which is how the workflow's report_figures rule draws them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from align.exit_codes import USAGE, AlignError
from align.paths import RunPaths
from align.report import ReportPaths, gather, render_text


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="align", description=__doc__.splitlines()[0])
    commands = top.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="print the summary of a results directory")
    report.add_argument("results_dir", type=Path, help="the workflow's results directory")
    report.add_argument(
        "--arm",
        action="append",
        dest="arms",
        help="an arm to report, in order (repeatable; default: the manifest's arms)",
    )
    report.add_argument(
        "--figures",
        action="store_true",
        help="also write the figures and summary.html under RESULTS_DIR/report/",
    )
    memory = commands.add_parser(
        "memory", help="print an arm's projected per-GPU memory, term by term (no GPU needed)"
    )
    memory.add_argument("arm_toml", type=Path, help="the arm's pre-registration")
    memory.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="a checkpoint directory (config.json suffices)",
    )
    memory.add_argument(
        "overrides", nargs="*", help="dotted --key=value overrides, as a stage takes them"
    )
    return top


def memory(arm_toml: Path, checkpoint: Path, overrides: Sequence[str]) -> int:
    from align.config import ArmConfig, load_config
    from align.train.memory import projected_device_memory

    cfg = load_config(arm_toml, ArmConfig, list(overrides)).cfg
    projection = projected_device_memory(cfg, checkpoint)
    b = cfg.batch
    print(
        f"{cfg.arm}: {projection['optimizer']}, {projection['precision']}, world size "
        f"{b.world_size}, micro_batch {b.micro_batch} x seq_len {cfg.data.seq_len}, activation "
        f"checkpointing {'on' if cfg.trainer.activation_checkpointing else 'off'}"
    )
    for term, mb in projection["terms_mb"].items():
        print(f"  {term:<18} {mb / 1024:8.2f} GiB")
    print(f"  {'total per GPU':<18} {projection['total_mb'] / 1024:8.2f} GiB")
    return 0


def report(results_dir: Path, arms: Sequence[str] | None, figures: bool) -> int:
    if not results_dir.is_dir():
        print(f"align report: {results_dir}: no such results directory", file=sys.stderr)
        return USAGE
    summary = gather(results_dir, arms)
    sys.stdout.write(render_text(summary))
    if figures:
        from align.eval.plots import write_report_files

        paths = ReportPaths.of(RunPaths.of(results_dir))
        written = write_report_files(summary, paths)
        print(f"align report: wrote {len(written)} files under {paths.root}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = parser().parse_known_args(argv)
    if args.command == "memory":
        try:
            return memory(args.arm_toml, args.checkpoint, [*args.overrides, *rest])
        except AlignError as err:
            print(f"align memory: {err}", file=sys.stderr)
            return err.exit_code
    if rest:
        parser().error(f"unrecognized arguments: {' '.join(rest)}")
    return report(args.results_dir, args.arms, args.figures)


if __name__ == "__main__":
    sys.exit(main())
