"""The throughput probe's figures (no torch): step time, tokens/s, measured peaks, and the
wall-clock they project for the whole training run: its steps, its checkpoint saves and its
generation checks.

The memory the probe measures is set against the preflight's projections
(align.train.memory): peak RSS of the job, and each rank's device peak against the
projected allocator share of one GPU.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


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


def probe_figures(
    step_times: list[float],
    tokens_per_s: list[float],
    micro_steps: int,
    horizon_steps: int,
    peak_rss_mb: float,
    device_peaks_mb: list[float],
    projected_device_mb: float | None,
    beside: Beside | None = None,
) -> dict[str, Any]:
    """Median step time and the wall-clock it projects (the steps, and what the run does
    beside them); the largest rank's device peak (torch.cuda.max_memory_allocated), every
    rank's, and the largest over the projection."""
    if not step_times:
        raise ValueError("the probe ran no optimizer step: nothing was measured")
    # The first step pays one-off costs (allocator warm-up, lazy init); it is not typical.
    typical = step_times[1:] or step_times
    median = statistics.median(typical)
    return {
        "steps_measured": len(step_times),
        "micro_steps": micro_steps,
        "step_times": step_times,
        "median_step_s": median,
        "tokens_per_s": statistics.median(tokens_per_s[1:] or tokens_per_s),
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
        "projected_steps_s": median * horizon_steps,
        "projected_wall_s": median * horizon_steps
        + (beside.seconds(horizon_steps) if beside else 0.0),
    }
