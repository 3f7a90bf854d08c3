"""The `align` command.

`align report RESULTS_DIR` prints the run's summary as terminal tables; with
`--figures` it also writes the report's figures and summary page under
RESULTS_DIR/report/, which is how the workflow's report_figures rule draws them.

`align memory ARM_TOML --checkpoint DIR` prints the per-GPU memory projection of an arm,
term by term (no GPU needed).

`align preregister config/arms/<arm>.toml ...` runs each arm's data build without
writing shards and prints the counts its pre-registration must fix: rows read,
kept and removed by reason, train and held. With `--write` it sets
`data.expected_train_pairs` and `data.expected_held_pairs` in the TOML, under a
comment naming the date and the hashes of the input files and tokenizer.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from align.exit_codes import USAGE, AlignError, ConfigError
from align.log import stage_logger
from align.paths import ReportPaths, RunPaths
from align.report.summary import gather, render_text
from align.stages.entry import parse_stage_args

WORKFLOW_CONFIG = Path("config/config.yaml")


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
    prereg = commands.add_parser(
        "preregister",
        help="count what each arm's data build gives, without writing shards",
        description="Overrides (--key=value) after the TOMLs are applied as by every stage.",
    )
    prereg.add_argument("configs", nargs="+", help="arm pre-registrations (.toml)")
    prereg.add_argument(
        "--checkpoint",
        type=Path,
        help="the checkpoint whose tokenizer counts (default: the workflow config's "
        "sft_checkpoint, else its base_model)",
    )
    prereg.add_argument(
        "--workflow-config",
        type=Path,
        default=WORKFLOW_CONFIG,
        help=f"the workflow config naming the checkpoint (default: {WORKFLOW_CONFIG})",
    )
    prereg.add_argument(
        "--write",
        action="store_true",
        help="write the train and held counts into each TOML, with their provenance",
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
        stage_logger("report").error(f"{results_dir}: no such results directory")
        return USAGE
    summary = gather(results_dir, arms)
    sys.stdout.write(render_text(summary))
    if figures:
        from align.report.figures import write_report_files

        paths = ReportPaths.of(RunPaths.of(results_dir))
        written = write_report_files(summary, paths)
        print(f"align report: wrote {len(written)} files under {paths.root}")
    return 0


def tokenizer_checkpoint(checkpoint: Path | None, workflow_config: Path) -> Path:
    """The checkpoint whose tokenizer the build will use: the one the workflow trains from."""
    if checkpoint is not None:
        return checkpoint
    if not workflow_config.is_file():
        raise ConfigError(
            f"{workflow_config}: no workflow config to name the checkpoint; "
            "pass --checkpoint DIR or --workflow-config PATH"
        )
    import yaml

    config = yaml.safe_load(workflow_config.read_text(encoding="utf-8")) or {}
    chosen = config.get("sft_checkpoint") or config.get("base_model")
    if not chosen:
        raise ConfigError(f"{workflow_config}: names neither sft_checkpoint nor base_model")
    return Path(chosen)


def load_checkpoint_tokenizer(checkpoint: Path):
    from align.model.tokenizer import load_tokenizer

    try:
        return load_tokenizer(checkpoint)
    except FileNotFoundError as err:
        raise ConfigError(
            f"{checkpoint}: no tokenizer to count with ({err}); the embedded default's is "
            "written by `snakemake --cores 2 resources/tiny/receipt.json`"
        ) from err


def preregister(
    configs: Sequence[Path],
    overrides: list[str],
    checkpoint: Path | None,
    workflow_config: Path,
    write: bool,
) -> int:
    from align.config import ArmConfig, load_config
    from align.data.preregister import count_arm, format_counts, provenance, write_expected_counts
    from align.model.tokenizer_hash import tokenizer_hash

    loaded = [load_config(path, ArmConfig, overrides) for path in configs]
    changed = sorted(k for k in loaded[0].overrides if not k.startswith("run."))
    if write and changed:
        raise ConfigError(
            f"--write records the counts of the TOML as written; overrides {changed} would "
            "make them disagree with it"
        )
    directory = tokenizer_checkpoint(checkpoint, workflow_config)
    tokenizer = load_checkpoint_tokenizer(directory)
    digest = tokenizer_hash(directory)
    for item in loaded:
        counts = count_arm(item.cfg, tokenizer)
        print(f"align preregister: arm {counts.arm} ({item.source}), tokenizer of {directory}")
        print(format_counts(counts, item.cfg))
        if write:
            write_expected_counts(item.source, counts.splits, provenance(counts, directory, digest))
            print(f"  wrote expected_train_pairs and expected_held_pairs into {item.source}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = parser().parse_known_args(argv)
    if args.command == "memory":
        try:
            return memory(args.arm_toml, args.checkpoint, [*args.overrides, *rest])
        except AlignError as err:
            stage_logger("memory").error(str(err))
            return err.exit_code
    if args.command == "preregister":
        try:
            # TOMLs and overrides split as every stage splits them (`lr=5e-7` is an override).
            split = parse_stage_args([*args.configs, *rest], n_configs=None)
            return preregister(
                split.configs, split.overrides, args.checkpoint, args.workflow_config, args.write
            )
        except AlignError as err:
            stage_logger("preregister").error(str(err))
            return err.exit_code
    if rest:
        parser().error(f"unrecognized arguments: {' '.join(rest)}")
    return report(args.results_dir, args.arms, args.figures)


if __name__ == "__main__":
    sys.exit(main())
