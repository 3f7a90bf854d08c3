"""A job's memory and time from the receipts before it: memory from an RSS figure, the
time limit from the probe's projected wall clock, the window a stop needs, and the
trainer's budget inside the limit. Every figure scales with the attempt, so a retry asks
for more of what the last attempt may have run out of."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.exit_codes import ConfigError
from align.train.memory import projected_job_rss, shards_shape
from align.train.probes import ProbeReceipt


@dataclass(frozen=True)
class JobResources:
    """The workflow config's `job_resources`: the defaults and margins of every request."""

    # MiB, for jobs that no receipt sizes.
    mem_mb: int
    # Minutes, for jobs that nothing times in advance.
    runtime_min: int
    # Minutes of the SFT job, which no probe times.
    sft_runtime_min: int
    # An RSS projection or measurement is multiplied by this ...
    mem_margin: float
    # ... plus this, for the in-job Snakemake, srun and the container runtime.
    mem_overhead_mb: int
    # The probe's projected wall clock is multiplied by this.
    runtime_margin: float
    # Gates, model load, evaluation and export: the job's time outside the trainer's clock.
    startup_s: float
    # One checkpoint save, where no probe timed one.
    checkpoint_s: float
    # After a stop's last save: the processes' exit and the scheduler's bookkeeping.
    exit_grace_s: float

    @classmethod
    def of(cls, table: Mapping[str, Any]) -> JobResources:
        return cls(**table)

    def default_mem_mb(self, attempt: int) -> int:
        return self.mem_mb * attempt

    def default_runtime(self, attempt: int) -> int:
        return self.runtime_min * attempt

    def rss_mem_mb(self, rss_mb: float, attempt: int) -> int:
        """A job's memory request from an RSS figure: the margin, the in-job overhead, the
        attempt."""
        return math.ceil(rss_mb * self.mem_margin + self.mem_overhead_mb) * attempt

    def probed_mem_mb(self, probe: ProbeReceipt, attempt: int) -> int:
        """The DPO job's request once the probe ran: the projection it ran under, or what it
        measured (per node) where that is higher."""
        return self.rss_mem_mb(max(probe.projected_node_mb, probe.measured_node_mb), attempt)

    def checkpoint_s_of(self, probe: ProbeReceipt | None) -> float:
        """One checkpoint save: the probe's timing when its receipt has one, else the
        allowance."""
        measured = probe.checkpoint_s if probe else None
        return measured if measured is not None else self.checkpoint_s

    def stop_window_s(self, probe: ProbeReceipt | None) -> int:
        """Seconds a stop needs: the optimizer step in flight (twice the probe's median, or
        nothing where no probe measured one), one checkpoint save, and the processes' exit.

        torchrun waits this long for stopped workers before it kills them, and Slurm
        signals the job step (SIGTERM) this long before its time limit.
        """
        step = probe.median_step_s if probe else 0.0
        return math.ceil(2 * step + self.checkpoint_s_of(probe)) + math.ceil(self.exit_grace_s)

    def stop_reserve_s(self, probe: ProbeReceipt | None) -> float:
        """Seconds of a job outside the trainer's own clock, plus the save at a stop: the
        trainer's clock starts after the gates and the model load, a stop saves after the
        step in flight, and the evaluation and export after the last step fall outside."""
        return self.startup_s + self.checkpoint_s_of(probe)

    def probe_runtime(self, probe: ProbeReceipt, attempt: int) -> int:
        """Minutes: the probe's projected wall clock of the job's worst case (the first run
        to its last step and the rerun, where a wire is armed) with its margin, the
        reserve, the attempt."""
        projected = probe.projected_job_wall_s * self.runtime_margin
        return math.ceil((projected + self.stop_reserve_s(probe)) / 60) * attempt


def first_attempt_cap(caps: Mapping[str, int], stage: str, attempt: int) -> int:
    """A training stage's configured cap for its first attempt (0: none, and on retries)."""
    return caps.get(stage, 0) if attempt == 1 else 0


def capped(value: int, cap: int) -> int:
    """`value`, no more than `cap` where one is set (0: none)."""
    return min(value, cap) if cap else value


def wall_seconds(runtime_min: int, reserve_s: float, cap: int, time_limited: bool) -> int:
    """The trainer's budget (0: none): the job's time limit less the reserve, so the stage
    stops at a step boundary and saves before the scheduler's SIGTERM and SIGKILL. Nothing
    stops a job no scheduler limits, so only the first attempt's `cap` applies there."""
    if not time_limited:
        return cap
    wall = math.floor(runtime_min * 60 - reserve_s)
    if wall <= 0:
        raise ValueError(
            f"time limit {runtime_min} min leaves no training time after the "
            f"{reserve_s:.0f} s reserve (job_resources.startup_s + checkpoint_s)"
        )
    return capped(wall, cap)


def projected_request_mb(
    job: JobResources,
    stage: str,
    cfg: Any,
    nodes: int,
    checkpoints: Sequence[str | Path],
    shards: Mapping[str, str | Path],
    seq_len: int,
    attempt: int,
) -> int:
    """A model-loading job's memory request: its stage's projection on its fullest node
    (align.train.memory) with the margins, sized by the first of `checkpoints` whose config
    exists, with the pair `shards` that exist (by split for an arm's stages); the default
    while no checkpoint's config exists."""
    found = [Path(c) for c in checkpoints if (Path(c) / "config.json").is_file()]
    if not found:
        return job.default_mem_mb(attempt)
    present = {key: Path(p) for key, p in shards.items() if Path(p).is_file()}
    shape = shards_shape(stage, cfg, nodes, seq_len, present)
    shard_bytes = sum(p.stat().st_size for p in present.values())
    return job.rss_mem_mb(projected_job_rss(shape, found[0], shard_bytes)["node_mb"], attempt)


def require_retries(submitting: bool, retries: int) -> None:
    """On a cluster a training stage stopped at its time limit exits 75 and only a retry
    resumes it: refuse to submit one with no retries rather than lose the run."""
    if submitting and retries < 1:
        raise ConfigError(
            "training stages on a cluster need retries to resume after a stop (exit 75): "
            "run with --workflow-profile profiles/slurm (retries, jobs, the image), or add "
            "--retries 2"
        )
