"""Measured over projected, per stage and phase, from the receipts of finished runs.

`python benchmarks/projections.py RESULTS_DIR [RESULTS_DIR ...]` reads every receipt
under each results directory that records phases (align.train.phases): the sft,
sft_gate, ref_cache, path_bias, probe, dpo and select_arms jobs. For each phase it
prints the job's measured host peak (the sum of its ranks' peaks) over the projection
of align.train.memory, term by term where rank 0's own terms can be read apart, and
the phase's wall clock, over the probe's projection for DPO training, and each training
run's wall clock over its own projection with its time per step. It also sets
Snakemake's benchmark max_rss of each job beside the projection's largest phase, and
each checkpoint save against the probe's timed one.

With --current, each phase's host projection is made again by the memory model as it
stands (align.train.memory, from each receipt's config and the run's checkpoint), and DPO
training's wall clock by the probe's model as it stands (align.train.probes, from what the
probe measured), so a change to either can be judged against what a past rehearsal ran.

Goals (the scale rehearsal): host peak between 0.85x and 1.0x of its projection, wall
clock within 25%. A row outside them is marked; the exit status is 1 when any is.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

HOST_GOAL = (0.85, 1.0)
WALL_GOAL = 0.25


def receipts(results: Path) -> list[tuple[str, Path, dict]]:
    """(label, path, receipt) of every receipt under `results` that records phases."""
    found = []
    for path in sorted(results.rglob("*.json")):
        try:
            receipt = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(receipt, dict) and isinstance(receipt.get("phases"), dict):
            found.append((label_of(receipt, path.relative_to(results)), path, receipt))
    return found


def label_of(receipt: dict, relative: Path) -> str:
    """The stage, with its arm for an arm's job (its receipt, or the arm's directory)."""
    stage = receipt["stage"]
    in_arm = len(relative.parts) > 1 and relative.parts[0] != "sft"
    arm = receipt.get("arm") or (relative.parts[0] if in_arm else None)
    return f"{stage}:{arm}" if arm else stage


def model_size(results: Path) -> str:
    """The run's parameter count, from any receipt's projection."""
    for _, _, receipt in receipts(results):
        projection = receipt.get("projection") or {}
        if "parameters" in projection:
            return f"{projection['parameters'] / 1e6:.1f}M parameters"
    return "size not recorded"


def benchmark_max_rss(results: Path, receipt_path: Path, stage: str) -> float | None:
    """Snakemake's max_rss (MB) of the job that wrote the receipt, when one file names it."""
    rule = {"dpo": "dpo", "probe": "probe"}.get(stage, stage)
    candidates = sorted((results / "benchmarks" / rule).glob("*.tsv"))
    named = [c for c in candidates if c.stem.split("-")[0] in receipt_path.parts] or candidates
    if len(named) != 1:
        return None
    rows = list(csv.DictReader(named[0].open(), delimiter="\t"))
    return float(rows[-1]["max_rss"]) if rows and rows[-1]["max_rss"] != "NA" else None


def receipt_config(receipt: dict):
    """The pre-registration the receipt's stage ran, with its overrides."""
    from align.config import ArmConfig, SelectionConfig, SftConfig, load_config

    config_class = {"sft": SftConfig, "sft_gate": SftConfig, "select_arms": SelectionConfig}
    overrides = [f"--{key}={value}" for key, value in (receipt.get("overrides") or {}).items()]
    source = Path(receipt["config_source"][0])
    return load_config(source, config_class.get(receipt["stage"], ArmConfig), overrides).cfg


def current_wall_s(results: Path, cfg, probe: dict) -> float:
    """DPO training's wall clock as today's probe model projects it from what the arm's
    probe measured: its step times, one save and one generation check."""
    from align.data.loader import BatchSource, PairShard
    from align.data.sampler import StepSampler
    from align.paths import RunPaths
    from align.train.probes import Beside, probe_figures

    shard = PairShard(RunPaths.of(results).arm(cfg.arm).shard("train"), cfg.batch.layout)
    source = BatchSource(shard, StepSampler(len(shard), cfg.batch, 0, cfg.batch.world_size))
    measured = probe["figures"]
    beside = Beside(
        measured["checkpoint_s"],
        cfg.trainer.checkpoint_every,
        measured["generation_check_s"],
        cfg.tripwires.generation_every_steps,
    )
    steps = [source.step_tokens(step) for step in range(len(source))]
    figures = probe_figures(
        measured["step_times"], [0.0], measured["micro_steps"], steps, 0.0, [], None, beside
    )
    return figures["projected_wall_s"]


def current_projection(results: Path, receipt: dict, arm_configs: list) -> dict:
    """The stage's projection by today's memory model, for the config its receipt ran."""
    from align.paths import SPLITS, RunPaths
    from align.train.memory import projected_job_rss, selection_seq_len, shards_shape, stage_nodes

    stage = receipt["stage"]
    cfg = receipt_config(receipt)
    if stage == "sft":
        checkpoint = Path(cfg.run.base_model)
    else:
        checkpoint = Path(cfg.run.sft_checkpoint or RunPaths.of(results).sft_checkpoint)
    run = RunPaths.of(results)
    if stage == "select_arms":
        shards = {arm.arm: run.arm(arm.arm).shard("held") for arm in arm_configs}
    elif stage in ("sft", "sft_gate"):
        shards = {}
    else:
        shards = {split: run.arm(cfg.arm).shard(split) for split in SPLITS}
    seq_len = selection_seq_len(arm_configs) if stage == "select_arms" else 0
    projected = "dpo" if stage == "probe" else stage
    nodes = stage_nodes(projected, cfg)
    shape = shards_shape(projected, cfg, nodes, seq_len, shards)
    return projected_job_rss(shape, checkpoint, sum(p.stat().st_size for p in shards.values()))


def with_current_projections(results: Path, found: list[tuple[str, Path, dict]]) -> None:
    """Each phase's projected figures, and DPO training's wall clock, replaced by today's
    models' (in place)."""
    arm_configs = [receipt_config(r) for _, _, r in found if r["stage"] == "dpo"]
    probes = {r.get("arm"): r for _, _, r in found if r["stage"] == "probe"}
    for _, _, receipt in found:
        projection = current_projection(results, receipt, arm_configs)
        for name, phase in receipt["phases"].items():
            expected = projection["phases"][name]
            phase["projected_host_mb"] = expected["total_mb"]
            phase["projected_terms_mb"] = expected["terms_mb"]
            phase["host_ratio"] = phase["host_peak_mb"] / expected["total_mb"]
        train = receipt["phases"].get("train", {})
        if receipt["stage"] == "dpo" and "projected_wall_s" in train:
            cfg = receipt_config(receipt)
            probe = probes[cfg.arm]["figures"]
            # One run's projection again; the phase's, its runs' shares of it.
            shares = train["projected_wall_s"] / probe["projected_wall_s"]
            probe["projected_wall_s"] = current_wall_s(results, cfg, probes[cfg.arm])
            train["projected_wall_s"] = probe["projected_wall_s"] * shares
            train["wall_ratio"] = train["wall_s"] / train["projected_wall_s"]


def ratio_mark(value: float, low: float, high: float) -> str:
    return "" if low <= value <= high else "  <-- outside goal"


def phase_rows(receipt: dict) -> list[str]:
    lines = []
    for name, phase in receipt["phases"].items():
        line = f"    {name:<9} wall {phase['wall_s']:8.1f} s"
        if "projected_wall_s" in phase:
            ratio = phase["wall_ratio"]
            line += f" / {phase['projected_wall_s']:8.1f} s = {ratio:4.2f}x"
            line += ratio_mark(ratio, 1 - WALL_GOAL, 1 + WALL_GOAL)
        lines.append(line)
        line = f"              host {phase['host_peak_mb']:8.0f} MiB"
        if "projected_host_mb" in phase:
            ratio = phase["host_ratio"]
            line += f" / {phase['projected_host_mb']:8.0f} MiB = {ratio:4.2f}x"
            line += ratio_mark(ratio, *HOST_GOAL)
        line += "   ranks " + ", ".join(f"{mb:.0f}" for mb in phase["rank_host_peak_mb"])
        lines.append(line)
        terms = phase.get("projected_terms_mb", {})
        if terms:
            lines.append(
                "              terms "
                + ", ".join(f"{term} {mb:.0f}" for term, mb in terms.items() if mb >= 0.5)
            )
        rank0 = [t for t in terms if t.endswith("_rank0") and terms[t] >= 0.5]
        peaks = phase["rank_host_peak_mb"]
        if rank0 and len(peaks) > 1:
            measured = peaks[0] - statistics.median(peaks[1:])
            projected = sum(terms[t] for t in rank0)
            lines.append(
                f"              rank 0 over the others {measured:.0f} MiB / "
                f"{projected:.0f} MiB projected ({', '.join(rank0)})"
            )
        if phase.get("rank_device_peak_mb"):
            line = "              device " + ", ".join(
                f"{mb:.0f}" for mb in phase["rank_device_peak_mb"]
            )
            if "projected_device_allocated_mb" in phase:
                ratio = phase["device_ratio"]
                line += f" / {phase['projected_device_allocated_mb']:.0f} MiB = {ratio:4.2f}x"
                line += ratio_mark(ratio, *HOST_GOAL)
            lines.append(line)
    return lines


def run_rows(receipt: dict, probe: dict | None) -> list[str]:
    """Each training run of a dpo receipt (the first, and a rerun after an alarm): its wall
    clock over its own projection (its steps' share of the probe's), and its time per step
    beside the probe's median."""
    runs = (receipt.get("tripwire") or {}).get("runs") or []
    if receipt["stage"] != "dpo" or probe is None or not runs:
        return []
    from align.train.probes import ProbeReceipt, run_projection_s

    measured = ProbeReceipt.of(probe)
    lines = []
    for run in runs:
        steps, wall = run["summary"]["fit_steps"], run["summary"]["fit_wall_s"]
        if not steps:
            continue
        projected = run_projection_s(measured.projected_wall_s, steps, measured.horizon_steps)
        ratio = wall / projected
        lines.append(
            f"    run {run['run']:<6} {steps} steps, wall {wall:.1f} s / {projected:.1f} s = "
            f"{ratio:4.2f}x, {wall / steps:.3f} s/step (probe median "
            f"{measured.median_step_s:.3f}){ratio_mark(ratio, 1 - WALL_GOAL, 1 + WALL_GOAL)}"
        )
    return lines


def checkpoint_rows(receipt: dict, probe_save_s: float | None) -> list[str]:
    training = (receipt.get("figures") or {}).get("training") or {}
    saves, loads = training.get("checkpoint_save_s", []), training.get("checkpoint_load_s", [])
    if not (saves or loads):
        return []
    line = f"    checkpoints: {len(saves)} saves"
    if saves:
        median = statistics.median(saves)
        line += f", median {median:.2f} s"
        if probe_save_s:
            line += f" / probe's {probe_save_s:.2f} s = {median / probe_save_s:4.2f}x"
    if loads:
        line += f"; {len(loads)} loads, median {statistics.median(loads):.2f} s"
    return [line]


def report(results: Path, current: bool = False) -> tuple[list[str], int]:
    lines = [f"== {results} ({model_size(results)})"]
    outside = 0
    found = receipts(results)
    if current:
        with_current_projections(results, found)
    probes = {r.get("arm"): r for _, _, r in found if r["stage"] == "probe"}
    probe_saves = {arm: (r.get("figures") or {}).get("checkpoint_s") for arm, r in probes.items()}
    for label, path, receipt in found:
        lines.append(f"  {label}  ({path.relative_to(results)})")
        rows = phase_rows(receipt) + run_rows(receipt, probes.get(receipt.get("arm")))
        outside += sum("outside goal" in row for row in rows)
        lines += rows
        lines += checkpoint_rows(receipt, probe_saves.get(receipt.get("arm")))
        max_rss = benchmark_max_rss(results, path, receipt["stage"])
        projected = max(
            (
                p["projected_host_mb"]
                for p in receipt["phases"].values()
                if "projected_host_mb" in p
            ),
            default=None,
        )
        if max_rss is not None and projected:
            lines.append(
                f"    snakemake max_rss {max_rss:.0f} MB / largest phase projection "
                f"{projected:.0f} MiB = {max_rss / projected:4.2f}x"
            )
    if not found:
        lines.append("  no receipt records phases")
        outside += 1
    return lines, outside


def figure_cells(results: Path, current: bool) -> dict[tuple[str, str], str]:
    """Each (job, phase) of a results directory as a table cell: measured / projected = ratio
    (the host peak; DPO's training wall clock as its own `train wall` row)."""
    found = receipts(results)
    if current:
        with_current_projections(results, found)
    cells = {}
    for label, _, receipt in found:
        for name, phase in receipt["phases"].items():
            if "projected_host_mb" in phase:
                cells[(label, name)] = (
                    f"{phase['host_peak_mb']:,.0f} / {phase['projected_host_mb']:,.0f} = "
                    f"**{phase['host_ratio']:.2f}**"
                )
            if "projected_wall_s" in phase:
                cells[(label, f"{name} wall")] = (
                    f"{phase['wall_s']:.0f} s / {phase['projected_wall_s']:.0f} s = "
                    f"**{phase['wall_ratio']:.2f}**"
                )
    return cells


# The rows in the order the chain runs its jobs, and each job's phases in theirs.
CHAIN = ("sft", "sft_gate", "ref_cache", "path_bias", "probe", "dpo", "select_arms")
PHASE_ROWS = ("load", "train", "train wall", "export", "evaluate")


def chain_order(row: tuple[str, str]) -> tuple:
    label, phase = row
    stage, _, arm = label.partition(":")
    return (CHAIN.index(stage), arm, PHASE_ROWS.index(phase))


def markdown_table(runs: list[Path], current: bool) -> list[str]:
    """The README's table: one row per job and phase, one column per results directory."""
    columns = [figure_cells(results, current) for results in runs]
    rows = sorted({key for cells in columns for key in cells}, key=chain_order)
    names = [results.resolve().parent.name for results in runs]
    lines = [
        "| stage | phase | " + " | ".join(f"{n}: measured / projected (MiB)" for n in names) + " |",
        "|---|---|" + "---|" * len(runs),
    ]
    for label, phase in rows:
        cells = [cells.get((label, phase), "(not run)") for cells in columns]
        lines.append(f"| {label} | {phase} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results directories of runs")
    parser.add_argument(
        "--current", action="store_true", help="project again with today's memory model"
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print the README's table of the runs instead"
    )
    args = parser.parse_args(argv)
    missing = [results for results in args.results if not results.is_dir()]
    if args.markdown and not missing:
        print("\n".join(markdown_table(args.results, args.current)))
        return 0
    outside = 0
    for results in args.results:
        if not results.is_dir():
            print(f"projections: {results}: no such results directory", file=sys.stderr)
            return 2
        lines, off = report(results, args.current)
        outside += off
        print("\n".join(lines))
    print(
        f"\n{outside} figure(s) outside the goals (host {HOST_GOAL[0]}-{HOST_GOAL[1]}x, "
        f"wall within {WALL_GOAL:.0%})"
    )
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
