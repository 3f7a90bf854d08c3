"""The report's figures, drawn with matplotlib (Agg) from a `RunSummary`.

Per arm: training curves (loss, reward margin, chosen and rejected log-probs of the
policy against the reference), tripwire signals with their bands and alarms, and
the probe's step times. Per run: held-out accuracies with Wilson intervals, and the
paired evaluation behind the selection. A figure whose data a stage did not record
says so on its canvas instead of being left out, so the report always has the same
files. Every figure has one size, so a reader (or a test) can check it rendered.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from align.paths import FIRST_RUN, RERUN, ReportPaths
from align.receipts import atomic_path
from align.report.summary import (
    ArmRecord,
    RunSummary,
    policy_order,
    render_html,
    tripwire_cell,
)
from align.stages.select import NOT_RECORDED

FIGSIZE = (10.0, 6.0)
DPI = 100
FIGURE_PIXELS = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))
POLICY_COLOR, REFERENCE_COLOR, ALARM_COLOR = "tab:blue", "tab:gray", "tab:red"
FIRST_RUN_COLOR = "tab:orange"


def blank_figure() -> Figure:
    """A figure on its own Agg canvas: no pyplot, so no global figure state to leak."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def new_figure(nrows: int = 1, ncols: int = 1) -> tuple[Figure, Any]:
    fig = blank_figure()
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def save(fig: Figure, path: Path) -> None:
    """Write the PNG atomically at the fixed size (no tight bbox, which would change it)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)


def message_figure(title: str, message: str) -> Figure:
    """A figure that states why there is nothing to plot."""
    fig, axes = new_figure()
    ax = axes[0, 0]
    ax.set_axis_off()
    ax.set_title(title)
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, fontsize=14)
    return fig


def series(metrics: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    rows = [m for m in metrics if key in m]
    return [m["step"] for m in rows], [m[key] for m in rows]


def reference_logps(metrics: Sequence[dict[str, Any]], side: str, beta: float) -> list[float]:
    """The reference's mean log-prob per step: rewards/<side> = beta * (policy - reference)."""
    return [m[f"logps/{side}"] - m[f"rewards/{side}"] / beta for m in metrics]


def not_measured(record: ArmRecord, what: str) -> str:
    if record.result is None:
        return f"{what}: arm result {NOT_RECORDED}"
    return f"{what} {NOT_RECORDED}\n({record.standing['reason']})"


def training_figure(record: ArmRecord) -> Figure:
    title = f"{record.arm}: training"
    if not record.metrics or record.beta is None:
        return message_figure(title, not_measured(record, "training metrics"))
    fig, axes = new_figure(2, 3)
    rerun = "; the rerun after a tripwire, first run dotted" if record.first_run_metrics else ""
    fig.suptitle(f"{title} ({len(record.metrics)} optimizer steps, beta {record.beta}{rerun})")
    if record.first_run_metrics:
        plot_run(axes, record.first_run_metrics, record.first_run_beta, first=True)
    plot_run(axes, record.metrics, record.beta, first=False)
    plot_generation_checks(axes[:, 2], record)
    axes[0, 0].axhline(0.6931, color=REFERENCE_COLOR, ls="--", label="log 2 (policy = reference)")
    axes[0, 0].set(title="DPO loss", xlabel="step")
    axes[0, 1].axhline(0.0, color=REFERENCE_COLOR, ls="--")
    axes[0, 1].set(title="reward margin (chosen - rejected)", xlabel="step")
    axes[1, 0].set(title="chosen response log-prob (batch mean)", xlabel="step")
    axes[1, 1].set(title="rejected response log-prob (batch mean)", xlabel="step")
    for ax in (axes[0, 0], axes[1, 0], axes[1, 1]):
        ax.legend(fontsize=8)
    return fig


def plot_run(axes, metrics: Sequence[dict[str, Any]], beta: float | None, first: bool) -> None:
    """One run's curves: loss, margin, and the policy's log-probs beside the reference's.

    A first run that a rerun replaced is dotted, and its reference is left out: the
    reference is the same SFT policy in both runs.
    """
    color, style, suffix = run_style(first)
    axes[0, 0].plot(*series(metrics, "loss"), color=color, ls=style, label=f"loss{suffix}")
    axes[0, 1].plot(*series(metrics, "rewards/margins"), color=color, ls=style)
    for ax, side in ((axes[1, 0], "chosen"), (axes[1, 1], "rejected")):
        steps, policy = series(metrics, f"logps/{side}")
        ax.plot(steps, policy, color=color, ls=style, label=f"policy{suffix}")
        if not first and beta is not None:
            ax.plot(
                steps,
                reference_logps(metrics, side, beta),
                color=REFERENCE_COLOR,
                label="reference (SFT)",
            )


def run_style(first: bool) -> tuple[str, str, str]:
    """Colour, line style and label suffix of a run: a replaced first run is dotted."""
    return (FIRST_RUN_COLOR, ":", " (first run)") if first else (POLICY_COLOR, "-", "")


GENERATION_PANELS = (
    ("terminated_fraction", "generation_terminated", "greedy generations that end (per check)"),
    ("mean_tokens", "generation_length", "mean greedy generation length (per check)"),
)


def plot_generation_checks(axes, record: ArmRecord) -> None:
    """The periodic generation checks of each run, with the band the wire held them to."""
    bands = record.runs[-1].get("bands", {}) if record.runs else {}
    for ax, (key, signal, title) in zip(axes, GENERATION_PANELS, strict=True):
        ax.set(title=title, xlabel="optimizer steps done")
        checks = [(run, run.get("generation_checks", [])) for run in record.runs]
        if not any(found for _, found in checks):
            ax.text(0.5, 0.5, f"generation checks {NOT_RECORDED}", ha="center", va="center")
            continue
        for run, found in checks:
            first = run["run"] == FIRST_RUN and record.rerun
            color, style, _ = run_style(first)
            ax.plot(
                [c["step"] for c in found],
                [c[key] for c in found],
                color=color,
                ls=style,
                marker="o",
                label=f"{run['run']} run",
            )
        if signal in bands:
            band_span(ax, bands[signal])
        ax.legend(fontsize=8)


def band_span(ax, band: Sequence[float | None]) -> None:
    low, high = band
    if low is not None or high is not None:
        ax.axhspan(
            low if low is not None else ax.get_ylim()[0],
            high if high is not None else ax.get_ylim()[1],
            color="tab:green",
            alpha=0.15,
            label="band",
        )


def mark_alarms(ax, alarms: Sequence[dict[str, Any]], label: str) -> None:
    if alarms:
        ax.scatter(
            [a["step"] for a in alarms],
            [a["value"] for a in alarms],
            color=ALARM_COLOR,
            marker="x",
            s=60,
            zorder=3,
            label=label,
        )


def tripwire_figure(record: ArmRecord) -> Figure:
    title = f"{record.arm}: tripwire signals"
    tripwire = record.tripwire
    if tripwire is None:
        return message_figure(title, not_measured(record, "tripwire signals"))
    final_run = RERUN if record.rerun else FIRST_RUN
    final = record.run_signals(final_run)
    first = record.run_signals(FIRST_RUN) if record.rerun else {}
    names = list(dict.fromkeys([*final, *first]))
    if not names:
        return message_figure(title, f"no tripwire signal recorded\n({tripwire_cell(record)})")
    fig, grid = new_figure(len(names), 1)
    fig.suptitle(f"{title} ({tripwire_cell(record)})")
    final_label = "rerun" if record.rerun else "run"
    bands = record.runs[-1].get("bands", {})
    for ax, name in zip(grid[:, 0], names, strict=True):
        if first.get(name):
            ax.plot(
                *zip(*first[name], strict=True), color=REFERENCE_COLOR, ls=":", label="first run"
            )
            mark_alarms(ax, [a for a in record.first_run_alarms if a["name"] == name], "alarm")
        if final.get(name):
            ax.plot(*zip(*final[name], strict=True), color=POLICY_COLOR, label=final_label)
            alarms = [a for a in record.final_run_alarms if a["name"] == name]
            mark_alarms(ax, alarms, f"alarm ({final_label})")
        if name in bands:
            band_span(ax, bands[name])
        ax.set(title=name, xlabel="step")
        ax.legend(fontsize=8)
    return fig


def probe_figure(record: ArmRecord) -> Figure:
    title = f"{record.arm}: probe step times"
    times = record.step_times
    if not times:
        what = "probe receipt" if record.probe is None else "probe step times"
        return message_figure(title, f"{what} {NOT_RECORDED}")
    fig, axes = new_figure()
    ax = axes[0, 0]
    median = statistics.median(times)
    ax.plot(range(len(times)), times, marker="o", color=POLICY_COLOR, label="step time")
    ax.axhline(median, color=REFERENCE_COLOR, ls="--", label=f"median {median:.3f} s")
    ax.set(title=f"{title} ({len(times)} measured steps)", xlabel="measured step", ylabel="s")
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig


HELD_OUT_KEYS = (
    ("sft", "SFT (preference)"),
    ("policy", "policy (preference)"),
    ("policy_implicit_reward", "policy (implicit reward)"),
)


def with_interval(ax, x: float, figure: dict[str, Any], **style) -> None:
    acc = figure["accuracy"]
    ax.errorbar(
        [x],
        [acc],
        yerr=[[acc - figure["ci_low"]], [figure["ci_high"] - acc]],
        fmt="o",
        capsize=4,
        **style,
    )


def held_out_figure(summary: RunSummary) -> Figure:
    fig, axes = new_figure()
    ax = axes[0, 0]
    ax.set(
        title="held-out preference accuracy per arm (Wilson 95% intervals)",
        ylabel="accuracy",
        ylim=(0, 1),
    )
    ax.axhline(0.5, color=REFERENCE_COLOR, ls=":", label="chance")
    labels, labelled = [], set()
    for i, record in enumerate(summary.arms):
        held = record.result.held_out if record.result else {}
        labels.append(record.arm if held else f"{record.arm}\n({not_measured_label(record)})")
        for j, (key, name) in enumerate(HELD_OUT_KEYS):
            if key in held:
                label = None if key in labelled else name
                labelled.add(key)
                with_interval(ax, i + (j - 1) * 0.2, held[key], color=f"C{j}", label=label)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.legend(fontsize=8, loc="lower right")
    return fig


def not_measured_label(record: ArmRecord) -> str:
    return record.standing["standing"] if record.result else NOT_RECORDED


def paired_figure(summary: RunSummary) -> Figure:
    selection = summary.selection
    if selection is None:
        return message_figure("paired evaluation", f"selection.json {NOT_RECORDED}")
    figures, decision = selection.figures, selection.decision
    fig = blank_figure()
    axes = fig.subplot_mosaic([["accuracy", "length"], ["difference", "difference"]])
    fig.suptitle(
        f"selected: {decision['selected'] or 'none'} ({decision['branch']}); "
        f"eval set {figures['eval_set']['name']}, n={figures['eval_set']['pairs']}"
    )
    policies = {name: figures["policies"][name] for name in policy_order(figures)}
    paired_accuracies(axes["accuracy"], policies)
    generation_lengths(axes["length"], policies, figures["eval_set"])
    paired_differences(axes["difference"], figures["comparisons"])
    return fig


def paired_accuracies(ax, policies: dict[str, Any]) -> None:
    names = list(policies)
    for i, name in enumerate(names):
        with_interval(ax, i, policies[name], color=f"C{i}")
    ax.axhline(0.5, color=REFERENCE_COLOR, ls=":")
    ax.set_xticks(range(len(names)), names)
    ax.set(
        title="accuracy on the common set (Wilson 95%)", ylim=(0, 1), xlim=(-0.5, len(names) - 0.5)
    )


def generation_lengths(ax, policies: dict[str, Any], eval_set: dict[str, Any]) -> None:
    names = list(policies)
    lengths = [policies[n]["generation"]["mean_tokens"] for n in names]
    ax.bar(range(len(names)), lengths, color=[f"C{i}" for i in range(len(names))])
    tokens = eval_set.get("response_tokens", {})
    for side, style in (("chosen", "--"), ("rejected", ":")):
        if side in tokens:
            ax.axhline(tokens[side], color=REFERENCE_COLOR, ls=style, label=f"data {side}")
    ax.set_xticks(range(len(names)), names)
    ax.set(title="mean greedy generation length (tokens)")
    if tokens:
        ax.legend(fontsize=8)


def paired_differences(ax, comparisons: Sequence[dict[str, Any]]) -> None:
    """Each difference with its interval; red where the interval excludes 0."""
    for i, c in enumerate(comparisons):
        ax.errorbar(
            [c["diff"]],
            [i],
            xerr=[[c["diff"] - c["ci_low"]], [c["ci_high"] - c["diff"]]],
            fmt="o",
            capsize=4,
            color=ALARM_COLOR if c["excludes_zero"] else POLICY_COLOR,
        )
    ax.axvline(0.0, color=REFERENCE_COLOR, ls="--")
    ax.set_yticks(range(len(comparisons)), [f"{c['a']} - {c['b']}" for c in comparisons])
    ax.set(
        title="accuracy difference a - b (paired bootstrap interval)",
        xlabel="difference",
        ylim=(-0.5, len(comparisons) - 0.5),
    )


def write_report_files(summary: RunSummary, paths: ReportPaths) -> list[Path]:
    """Every figure and the summary page; returns the paths written."""
    drawn = []
    for record in summary.arms:
        for name, draw in (
            ("training", training_figure),
            ("tripwires", tripwire_figure),
            ("probe", probe_figure),
        ):
            drawn.append((paths.arm_figure(record.arm, name), draw(record)))
    drawn.append((paths.run_figure("held_out"), held_out_figure(summary)))
    drawn.append((paths.run_figure("paired"), paired_figure(summary)))
    for path, fig in drawn:
        save(fig, path)
    with atomic_path(paths.summary_html) as tmp:
        tmp.write_text(render_html(summary))
    return [path for path, _ in drawn] + [paths.summary_html]
