"""The run's summary a researcher reads instead of logs: receipts gathered into tables.

Owns gathering a results
directory's receipts (SFT gate, manifest, each arm's result, metrics, tripwire
section and probe receipt, the selection) into one `RunSummary`, and rendering it
as terminal tables or as an HTML page with the same content. What a stage did not
record is shown as "not recorded", never filled in. Imports nothing heavy: the
figures are drawn by align.report.figures.
"""

from __future__ import annotations

import html
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.config import TripwireResponse
from align.data.manifest import Manifest
from align.paths import FIRST_RUN, RERUN, ArmPaths, RunPaths
from align.stages.arm_result import ArmResult, TripwireRecord
from align.stages.select import NOT_RECORDED, arm_standing
from align.stages.selection_result import SelectionResult
from align.stages.sft_gate_result import SftGateResult
from align.train.probes import ProbeReceipt


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """One dict per optimizer step; empty when the arm logged none."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class ArmRecord:
    """What one arm's stages recorded; None where a receipt is absent.

    `metrics` are the steps of the run that produced the arm's policy: the
    pre-registered rerun when a tripwire fired, with the first run's steps kept
    apart in `first_run_metrics`.
    """

    arm: str
    result: ArmResult | None
    metrics: list[dict[str, Any]]
    probe: ProbeReceipt | None
    first_run_metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tripwire(self) -> TripwireRecord | None:
        return self.result.tripwire if self.result else None

    @property
    def runs(self) -> list[dict[str, Any]]:
        """The training runs the DPO stage recorded, first run first."""
        return self.tripwire.runs if self.tripwire else []

    @property
    def rerun(self) -> bool:
        return bool(self.tripwire and self.tripwire.rerun)

    def run_alarms(self, run: str) -> list[dict[str, Any]]:
        return self.tripwire.alarms_of(run) if self.tripwire else []

    @property
    def first_run_alarms(self) -> list[dict[str, Any]]:
        """Alarms of the run a rerun replaced (none without a rerun)."""
        return self.run_alarms(FIRST_RUN) if self.rerun else []

    @property
    def final_run_alarms(self) -> list[dict[str, Any]]:
        """Alarms of the run that produced the policy."""
        return self.run_alarms(RERUN if self.rerun else FIRST_RUN)

    def run_signals(self, run: str) -> dict[str, list[list[float]]]:
        return next((r.get("signals", {}) for r in self.runs if r["run"] == run), {})

    @property
    def step_times(self) -> list[float] | None:
        return list(self.probe.step_times) if self.probe else None

    @property
    def standing(self) -> dict[str, Any] | None:
        return arm_standing(self.result) if self.result else None

    @property
    def beta(self) -> float | None:
        """The beta of the policy's run: a rerun's response may have changed it."""
        if self.result is None:
            return None
        final = self.result.final_beta
        return final if final is not None else self.first_run_beta

    @property
    def first_run_beta(self) -> float | None:
        return self.result.first_run_beta if self.result else None


@dataclass
class RunSummary:
    results_dir: Path
    sft_gate: SftGateResult | None
    manifest: Manifest | None
    selection: SelectionResult | None
    arms: list[ArmRecord] = field(default_factory=list)


def discover_arms(paths: RunPaths, manifest: Manifest | None) -> list[str]:
    """The manifest's arms in its order, or every results/<arm>/ holding an arm result."""
    if manifest is not None:
        return list(manifest.arms)
    return sorted(p.parent.name for p in paths.results.glob("*/arm_result.json"))


def gather(results_dir: str | Path, arms: Sequence[str] | None = None) -> RunSummary:
    paths = RunPaths.of(results_dir)
    manifest = Manifest.read(paths.manifest)
    summary = RunSummary(
        results_dir=paths.results,
        sft_gate=SftGateResult.read(paths.sft_gate),
        manifest=manifest,
        selection=SelectionResult.read(paths.selection),
    )
    for arm in arms or discover_arms(paths, manifest):
        summary.arms.append(arm_record(paths.arm(arm)))
    return summary


def arm_record(arm_paths: ArmPaths) -> ArmRecord:
    result = ArmResult.read(arm_paths.arm_result)
    record = ArmRecord(
        arm=arm_paths.arm,
        result=result,
        metrics=read_metrics(arm_paths.metrics),
        probe=ProbeReceipt.read(arm_paths.probe),
    )
    if record.rerun:
        record.first_run_metrics = record.metrics
        record.metrics = read_metrics(arm_paths.training_run_metrics(RERUN))
    return record


@dataclass
class Section:
    """One titled table of the summary; `notes` are lines printed before it."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)


def interval(figure: dict[str, Any] | None) -> str:
    if not figure:
        return NOT_RECORDED
    return f"{figure['accuracy']:.3f} [{figure['ci_low']:.3f}, {figure['ci_high']:.3f}]"


def signed(value: float | None, digits: int = 3) -> str:
    return NOT_RECORDED if value is None else f"{value:+.{digits}f}"


def sft_gate_section(gate: SftGateResult | None) -> Section:
    headers = ["check", "value", "threshold", "passed"]
    if gate is None:
        return Section("SFT gate", headers, [], [f"SFT gate: {NOT_RECORDED}"])
    rows = []
    for name, check in gate.checks.items():
        threshold = (
            f"<= {check['max']}"
            if "max" in check
            else f">= {check['min']}"
            if "min" in check
            else ""
        )
        rows.append([name, str(check["value"]), threshold, str(check["passed"])])
    note = f"SFT gate {gate.status}: checkpoint {gate.checkpoint}"
    return Section("SFT gate", headers, rows, [note])


def tripwire_cell(record: ArmRecord) -> str:
    tripwire = record.tripwire
    if tripwire is None:
        return NOT_RECORDED
    if not record.rerun:
        return f"{len(record.final_run_alarms)} alarms"
    first, again = len(record.first_run_alarms), len(record.final_run_alarms)
    ended = "; ended by tripwire" if tripwire.ended_by_tripwire else ""
    return f"{first} alarms, rerun ({again} on rerun){ended}"


def probe_cell(record: ArmRecord) -> str:
    times = record.step_times
    if not times:
        return NOT_RECORDED
    return f"median {statistics.median(times):.3f} s/step ({len(times)} steps)"


def arms_section(arms: Sequence[ArmRecord], selection: SelectionResult | None) -> Section:
    headers = [
        "arm",
        "status",
        "standing",
        "steps",
        "final loss",
        "final margin",
        "held-out SFT",
        "policy",
        "implicit reward",
        "tripwire",
        "probe",
    ]
    rows = []
    for record in arms:
        if record.result is None:
            rows.append([record.arm, NOT_RECORDED, *[""] * (len(headers) - 2)])
            continue
        held = record.result.held_out
        last = record.metrics[-1] if record.metrics else {}
        # The selection judges generations too, so its standing is the last word.
        judged = selection.arms.get(record.arm, record.standing) if selection else record.standing
        rows.append(
            [
                record.arm,
                record.result.status,
                judged["standing"],
                str(len(record.metrics)) if record.metrics else NOT_RECORDED,
                f"{last['loss']:.4f}" if last else NOT_RECORDED,
                signed(last.get("rewards/margins")) if last else NOT_RECORDED,
                interval(held.get("sft")),
                interval(held.get("policy")),
                interval(held.get("policy_implicit_reward")),
                tripwire_cell(record),
                probe_cell(record),
            ]
        )
    return Section("Arms (held-out accuracy with Wilson 95% intervals)", headers, rows)


def run_metrics(record: ArmRecord, run: str) -> list[dict[str, Any]]:
    """The metric lines of one training run of the arm."""
    return record.first_run_metrics if run == FIRST_RUN and record.rerun else record.metrics


def checks_cell(checks: Sequence[dict[str, Any]]) -> str:
    """Each generation check as `step: terminated fraction / mean tokens`."""
    if not checks:
        return NOT_RECORDED
    return ", ".join(
        f"{c['step']}: {c['terminated_fraction']:.2f} / {c['mean_tokens']:.1f}" for c in checks
    )


def runs_section(arms: Sequence[ArmRecord]) -> Section:
    """The first run and the rerun side by side: what each ran with and how it went."""
    headers = [
        "arm",
        "run",
        " / ".join(TripwireResponse.TARGETS),
        "steps",
        "final loss",
        "final margin",
        "final chosen logp",
        "fired",
        "generations: step: terminated / mean tokens",
        "result",
    ]
    rows, notes = [], []
    for record in arms:
        if not record.runs:
            notes.append(f"{record.arm}: training runs {NOT_RECORDED}")
            continue
        result_run = record.tripwire.result_run
        for run in record.runs:
            name, config, summary = run["run"], run["config"], run["summary"]
            last = (run_metrics(record, name) or [{}])[-1]
            fired = ", ".join(f"{a['name']} at {a['step']}" for a in record.run_alarms(name))
            rows.append(
                [
                    record.arm,
                    name,
                    " / ".join(f"{config[key]:g}" for key in TripwireResponse.TARGETS),
                    f"{summary['steps']}/{summary['horizon_steps']}",
                    f"{last['loss']:.4f}" if "loss" in last else NOT_RECORDED,
                    signed(last.get("rewards/margins")),
                    f"{last['logps/chosen']:.2f}" if "logps/chosen" in last else NOT_RECORDED,
                    fired or "none",
                    checks_cell(run.get("generation_checks", [])),
                    "yes" if name == result_run else "no",
                ]
            )
    return Section(
        "Training runs (the first run and the pre-registered rerun side by side)",
        headers,
        rows,
        notes,
    )


def gates_section(arms: Sequence[ArmRecord], selection: SelectionResult | None) -> Section:
    rows = [
        [record.arm, g["gate"], g["status"], f"{g['ms']:.2f}"]
        for record in arms
        if record.result
        for g in record.result.gates
    ]
    if selection is not None:
        rows += [["select_arms", g["gate"], g["status"], f"{g['ms']:.2f}"] for g in selection.gates]
    return Section("Gates", ["stage", "gate", "status", "ms"], rows)


def alarms_section(arms: Sequence[ArmRecord]) -> Section:
    rows, notes = [], []
    for record in arms:
        if record.tripwire is None:
            notes.append(f"{record.arm}: tripwire signals {NOT_RECORDED}")
            continue
        runs = (
            ("first run", record.first_run_alarms),
            ("rerun" if record.rerun else "run", record.final_run_alarms),
        )
        for run, alarms in runs:
            rows += [
                [
                    record.arm,
                    run,
                    a["name"],
                    str(a["step"]),
                    f"{a['value']:.4g}",
                    str(a.get("band")),
                ]
                for a in alarms
            ]
        if not record.first_run_alarms and not record.final_run_alarms:
            notes.append(f"{record.arm}: no tripwire alarm")
    return Section(
        "Tripwire alarms", ["arm", "run", "signal", "step", "value", "band"], rows, notes
    )


def policy_order(figures: dict[str, Any]) -> list[str]:
    """Policies in the order they were compared (arms, then SFT); receipts sort their keys."""
    compared = [name for c in figures["comparisons"] for name in (c["a"], c["b"])]
    return list(dict.fromkeys([*compared, *figures["policies"]]))


def eval_set_note(eval_set: dict[str, Any]) -> str:
    tokens = eval_set.get("response_tokens", {})
    sources = ", ".join(f"{name} {n}" for name, n in eval_set["sources"].items())
    return (
        f"eval set {eval_set['name']}: {eval_set['pairs']} pairs from {sources} "
        f"({eval_set['duplicates_removed']} duplicates removed); data responses average "
        f"{tokens.get('chosen', float('nan')):.1f} chosen / "
        f"{tokens.get('rejected', float('nan')):.1f} rejected tokens"
    )


def policy_row(name: str, p: dict[str, Any]) -> list[str]:
    return [
        name,
        interval(p),
        signed(p["mean_chosen_logp_change"], 2),
        signed(p["mean_rejected_logp_change"], 2),
        f"{p['generation']['mean_tokens']:.1f}",
        f"{p['generation']['terminated_fraction']:.2f}",
    ]


def comparison_row(c: dict[str, Any]) -> list[str]:
    return [
        f"{c['a']} - {c['b']}",
        f"{c['diff']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]",
        "yes" if c["excludes_zero"] else "no",
        str(c["mcnemar"]["a_only"]),
        str(c["mcnemar"]["b_only"]),
        f"{c['mcnemar']['p_value']:.4g}",
    ]


def paired_sections(selection: SelectionResult | None) -> list[Section]:
    if selection is None:
        return [Section("Paired evaluation", [], [], [f"selection.json: {NOT_RECORDED}"])]
    figures = selection.figures
    policies = figures["policies"]
    names = policy_order(figures)
    methods = {}
    for name in names:
        methods.setdefault(policies[name]["method"], []).append(name)
    notes = [eval_set_note(figures["eval_set"])]
    notes += [f"correct on a pair ({', '.join(who)}): {method}" for method, who in methods.items()]
    policy_headers = [
        "policy",
        "accuracy [95% CI]",
        "chosen logp vs SFT",
        "rejected logp vs SFT",
        "greedy tokens",
        "terminated",
    ]
    comparison_headers = [
        "a - b",
        "accuracy difference [CI]",
        "excludes 0",
        "a only",
        "b only",
        "McNemar p",
    ]
    return [
        Section(
            "Paired evaluation on the common held-out set",
            policy_headers,
            [policy_row(name, policies[name]) for name in names],
            notes,
        ),
        Section(
            "Paired comparisons (paired bootstrap interval, exact McNemar)",
            comparison_headers,
            [comparison_row(c) for c in figures["comparisons"]],
        ),
    ]


def selection_row(arm: str, standing: dict[str, Any], policy: dict[str, Any] | None) -> list[str]:
    generation = standing.get("generation")
    rerun = standing.get("rerun")
    return [
        arm,
        standing["status"],
        standing["standing"],
        f"{policy['accuracy']:.3f}" if policy else NOT_RECORDED,
        f"{generation['terminated_fraction']:.2f}" if generation else NOT_RECORDED,
        f"{generation['mean_tokens']:.1f}" if generation else NOT_RECORDED,
        ", ".join(standing.get("alarms", [])) or "none",
        NOT_RECORDED if rerun is None else ("yes" if rerun else "no"),
        standing["reason"],
    ]


def band_note(band: dict[str, Any] | None) -> str:
    if band is None:
        return f"generation band: {NOT_RECORDED}"
    low, high = band["mean_tokens"]
    return (
        f"generation band: terminated fraction >= {band['min_terminated_fraction']:.2f}, "
        f"mean length in [{low:.1f}, {high:.1f}] tokens (SFT {band['sft']['terminated_fraction']:.2f}"
        f" / {band['sft']['mean_tokens']:.1f}, data chosen {band['chosen']['terminated_fraction']:.2f}"
        f" / {band['chosen']['mean_tokens']:.1f})"
    )


def selection_section(selection: SelectionResult | None) -> Section:
    headers = [
        "arm",
        "status",
        "standing",
        "accuracy",
        "terminated",
        "mean tokens",
        "wires fired",
        "rerun",
        "reason",
    ]
    if selection is None:
        return Section("Selection", headers, [], [f"selection: {NOT_RECORDED}"])
    decision = selection.decision
    policies = selection.figures.get("policies", {})
    rows = [selection_row(arm, s, policies.get(arm)) for arm, s in selection.arms.items()]
    notes = [
        f"rule {decision['rule']}, pre-registered default arm {decision['default_arm']}",
        band_note(selection.figures.get("generation_band")),
        f"selected: {decision['selected'] or 'none'} ({decision['branch']})",
        f"reason: {decision['reason']}",
    ]
    return Section("Selection", headers, rows, notes)


def sections(summary: RunSummary) -> list[Section]:
    return [
        sft_gate_section(summary.sft_gate),
        arms_section(summary.arms, summary.selection),
        runs_section(summary.arms),
        gates_section(summary.arms, summary.selection),
        alarms_section(summary.arms),
        *paired_sections(summary.selection),
        selection_section(summary.selection),
    ]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]
    line = "  ".join

    def fmt(cells: Sequence[str]) -> str:
        return line(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [fmt(headers), line("-" * w for w in widths), *(fmt(r) for r in rows)]


def render_text(summary: RunSummary) -> str:
    out = [f"align report: {summary.results_dir}"]
    for section in sections(summary):
        out += ["", f"== {section.title}", *section.notes]
        if section.headers and section.rows:
            out += text_table(section.headers, section.rows)
    return "\n".join(out) + "\n"


def html_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


STYLE = (
    "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin:.5em 0}"
    "td,th{border:1px solid #bbb;padding:.2em .5em;text-align:left}th{background:#eee}"
)


def render_html(summary: RunSummary) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>align report: {html.escape(str(summary.results_dir))}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>align report: {html.escape(str(summary.results_dir))}</h1>",
    ]
    for section in sections(summary):
        parts.append(f"<h2>{html.escape(section.title)}</h2>")
        parts += [f"<p>{html.escape(note)}</p>" for note in section.notes]
        if section.headers and section.rows:
            parts.append(html_table(section.headers, section.rows))
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def selection_labels(selection_path: str | Path) -> dict[str, str]:
    """The decision as report labels, so the report's front page can show it."""
    selection = SelectionResult.read(selection_path)
    if selection is None:
        raise FileNotFoundError(f"{selection_path}: no selection receipt to label the report")
    decision = selection.decision
    return {
        "selected arm": selection.selected or "none",
        "branch": decision["branch"],
        "reason": decision["reason"],
    }
