"""The throughput probe's figures (no torch): step time, time per computed position,
measured peaks, and the wall-clock they project for the whole training run: its steps, its
checkpoint saves and its generation checks.

The dpo job's time limit covers its pre-registered worst case: with any wire armed, the
first run can go to its last step before a wire fires and the rerun then trains the whole
horizon again, so the job is projected two runs (`worst_case_runs`). A run ended early
is set against its share of one run's projection (`run_projection_s`).

The memory the probe measures is set against the preflight's projections
(align.train.memory): peak RSS of the job, and each rank's device peak against the
projected allocator share of one GPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.receipts import read_json


@dataclass(frozen=True)
class Beside:
    """What a training run does besides its steps, timed once by the probe: a checkpoint
    save every `checkpoint_every` optimizer steps, and the generation check before
    training, every `generation_every` steps and at the end (none when unarmed)."""

    checkpoint_s: float
    checkpoint_every: int
    generation_s: float | None
    generation_every: int

    def count(self, horizon: int) -> dict[str, int]:
        saves = horizon // self.checkpoint_every if self.checkpoint_every else 0
        checks = 0
        if self.generation_s is not None:
            every = self.generation_every
            checks = 1 + sum(1 for s in range(1, horizon + 1) if s % every == 0 or s == horizon)
        return {"checkpoint_saves": saves, "generation_checks": checks}

    def seconds(self, horizon: int) -> float:
        counts = self.count(horizon)
        saves = counts["checkpoint_saves"] * self.checkpoint_s
        return saves + counts["generation_checks"] * (self.generation_s or 0.0)


@dataclass(frozen=True)
class ProbeReceipt:
    """The probe's receipt (`probe_figures` and the projection it ran under) as every
    reader takes it: the gates before training, the workflow sizing the dpo job, and the
    report."""

    median_step_s: float
    projected_wall_s: float
    peak_rss_mb: float
    # One checkpoint save as the probe timed it; None where it timed none.
    checkpoint_s: float | None
    # The preflight projection it ran under: its fullest node, and the nodes it spans.
    projected_node_mb: float
    nodes: int
    topology: dict[str, int]
    training_path: dict[str, Any] | None
    # The job's worst case: `worst_case_runs` runs, each to the horizon.
    projected_job_wall_s: float = 0.0
    horizon_steps: int = 0
    # Every timed step's seconds, in order (the first pays for warm-up).
    step_times: tuple[float, ...] = ()

    @classmethod
    def of(cls, receipt: Mapping[str, Any]) -> ProbeReceipt:
        figures, projection = receipt["figures"], receipt["projection"]
        return cls(
            median_step_s=figures["median_step_s"],
            projected_wall_s=figures["projected_wall_s"],
            peak_rss_mb=figures["peak_rss_mb"],
            checkpoint_s=figures.get("checkpoint_s"),
            projected_node_mb=projection["node_mb"],
            nodes=projection["nodes"],
            topology=receipt.get("topology", {}),
            training_path=figures.get("training_path"),
            projected_job_wall_s=figures["projected_job_wall_s"],
            horizon_steps=figures["horizon_steps"],
            step_times=tuple(figures.get("step_times", ())),
        )

    @classmethod
    def read(cls, path: str | Path) -> ProbeReceipt | None:
        """The receipt at `path`, or None while the probe has not run."""
        return cls.of(read_json(path)) if Path(path).is_file() else None

    @property
    def measured_node_mb(self) -> float:
        """The measured peak of the job, per node."""
        return self.peak_rss_mb / self.nodes


def worst_case_runs(armed_wires: list[str]) -> int:
    """Runs a dpo job may train to their horizon: two where a wire can fire (the first run
    at its last step, then the rerun), one where none is armed."""
    return 2 if armed_wires else 1


def run_projection_s(projected_wall_s: float, steps: int, horizon_steps: int) -> float:
    """One run's projected wall clock for the `steps` it trained: its share of the whole
    run's projection (a run a wire ended, or an attempt that resumed, trains fewer)."""
    return projected_wall_s * (steps / horizon_steps)


def probe_figures(
    step_times: list[float],
    tokens_per_s: list[float],
    micro_steps: int,
    step_tokens: list[int],
    peak_rss_mb: float,
    device_peaks_mb: list[float],
    projected_device_mb: float | None,
    beside: Beside | None = None,
    runs: int = 1,
) -> dict[str, Any]:
    """The measured steps' time per computed position, and the wall-clock it projects for
    the run: every step of the horizon as long as the positions its batches compute
    (`step_tokens`, padding included: rows vary in length, and a step's time with them),
    and what the run does beside its steps; the largest rank's device peak
    (torch.cuda.max_memory_allocated), every rank's, and the largest over the projection;
    and the job's wall clock for `runs` runs to the horizon (`worst_case_runs`)."""
    if not step_times:
        raise ValueError("the probe ran no optimizer step: nothing was measured")
    # The first step pays one-off costs (allocator warm-up, lazy init); it is not typical.
    typical = range(1, len(step_times)) if len(step_times) > 1 else range(1)
    per_token = statistics.median(step_times[k] / step_tokens[k] for k in typical)
    horizon_steps = len(step_tokens)
    steps_s = per_token * sum(step_tokens)
    wall_s = steps_s + (beside.seconds(horizon_steps) if beside else 0.0)
    return {
        "steps_measured": len(step_times),
        "micro_steps": micro_steps,
        "step_times": step_times,
        "median_step_s": statistics.median([step_times[k] for k in typical]),
        "tokens_per_s": statistics.median(tokens_per_s[1:] or tokens_per_s),
        "seconds_per_computed_token": per_token,
        "horizon_computed_tokens": sum(step_tokens),
        "peak_rss_mb": peak_rss_mb,
        "peak_device_mb": max(device_peaks_mb, default=0.0),
        "device_peaks_mb": device_peaks_mb,
        "device_measured_over_projected": (
            max(device_peaks_mb) / projected_device_mb
            if projected_device_mb and device_peaks_mb
            else None
        ),
        "horizon_steps": horizon_steps,
        **(beside.count(horizon_steps) if beside else {}),
        "generation_check_s": beside.generation_s if beside else None,
        "projected_steps_s": steps_s,
        "projected_wall_s": wall_s,
        "runs_covered": runs,
        "projected_job_wall_s": wall_s * runs,
    }
