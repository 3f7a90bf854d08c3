"""The `align` command: `align report RESULTS_DIR` prints the run's summary as terminal tables.

With `--figures` it also writes the report's figures and summary page under
RESULTS_DIR/report/, which is how the workflow's report_figures rule draws them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from align.exit_codes import USAGE
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
    return top


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
    args = parser().parse_args(argv)
    return report(args.results_dir, args.arms, args.figures)


if __name__ == "__main__":
    sys.exit(main())
