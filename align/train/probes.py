"""The throughput probe's figures (no torch): step time, tokens/s, measured peaks, and the
wall-clock they project for the whole training run.

The memory the probe measures is set against the preflight's projections
(align.train.memory): peak RSS of the job, and each rank's device peak against the
projected allocator share of one GPU.
"""

from __future__ import annotations

import statistics
from typing import Any


def probe_figures(
    step_times: list[float],
    tokens_per_s: list[float],
    micro_steps: int,
    horizon_steps: int,
    peak_rss_mb: float,
    device_peaks_mb: list[float],
    projected_device_mb: float | None,
) -> dict[str, Any]:
    """Median step time and the wall-clock it projects; the largest rank's device peak
    (torch.cuda.max_memory_allocated), every rank's, and the largest over the projection."""
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
        "projected_wall_s": median * horizon_steps,
    }
