"""The stage-generic step loop that SFT and DPO share, correct on 1..N ranks.

Per optimizer step: this rank's micro-batches, loss normalized by the global
denominator, gradient clip, a step skipped on every rank together when the loss
or norm is not finite, one JSON line of metrics (rank 0). Stops (SIGTERM, SIGUSR1,
max_wall_seconds) are agreed across ranks at a step boundary, saved, and end in
exit 75; a resumed run continues from the newest valid checkpoint exactly.
"""

from __future__ import annotations

import json
import math
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from align.config import TrainerConfig
from align.exit_codes import AlignError, ResumableStop, writing
from align.log import stage_logger
from align.paths import metrics_in, stop_marker_in
from align.train.checkpointing import CheckpointManager
from align.train.optim import param_groups_record
from align.train.progress import Progress
from align.train.stop_marker import StopMarker
from align.utils.dist import DistInfo, all_reduce_sum, any_rank, barrier

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def reduce_step_sums(
    adapter, batch_sums: list[dict[str, float]], tokens: int
) -> tuple[dict[str, float], float]:
    """The step's metrics over every micro-batch on every rank, and its attended tokens.

    Sums are added over micro-batches and ranks (one all-reduce) before the adapter
    divides, so a rank with fewer pairs or tokens weighs less.
    """
    keys = adapter.metric_keys
    local = [sum(sums[key] for sums in batch_sums) for key in keys]
    *reduced, total_tokens = all_reduce_sum([*local, tokens])
    return adapter.summarize(dict(zip(keys, reduced, strict=True))), total_tokens


class TrainingDiverged(AlignError):
    """Too many optimizer steps were skipped for non-finite loss or gradients."""


class StopRequest:
    """Set by SIGTERM / SIGUSR1; read at the next optimizer-step boundary."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous = {}

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.signal = signum


@dataclass
class TrainState:
    """Counters that a checkpoint restores; the step is also the sampler position."""

    step: int = 0
    micro_step: int = 0
    skipped_steps: int = 0
    consecutive_skipped: int = 0
    step_times: list[float] = field(default_factory=list)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Trainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        model,
        source,
        adapter,
        optimizer,
        scheduler,
        run_dir: str | Path,
        stage: str,
        info: DistInfo,
        grad_clip: float,
        stage_started: float,
        stop_marker: Path | None = None,
        projected_wall_s: float | None = None,
    ):
        self.cfg, self.model, self.source, self.adapter = cfg, model, source, adapter
        # max_wall_seconds is the job's budget: every trainer of a stage counts from the
        # stage's start (time.monotonic()), a rerun's too.
        self.stage_started = stage_started
        self.log = stage_logger(stage)
        # The probe's projection of the whole run, shown beside the progress line's ETA.
        self.projected_wall_s = projected_wall_s
        self.fit_wall_s, self.fit_steps = 0.0, 0
        self.optimizer, self.scheduler, self.grad_clip = optimizer, scheduler, grad_clip
        self.run_dir, self.stage, self.info = Path(run_dir), stage, info
        self.checkpoints = CheckpointManager(self.run_dir, info, cfg.keep_checkpoints)
        self.state = TrainState()
        self.last_metrics: dict[str, Any] = {}
        self.stop = StopRequest()
        self.resumed_from: str | None = None
        self.resumed_after: dict[str, Any] | None = None  # the stop the resume follows
        self.rank_state = None  # see fit
        # The stage's one marker, the file its launcher reads, whichever run of it stopped.
        self.stop_marker = Path(stop_marker) if stop_marker else stop_marker_in(self.run_dir)

    @property
    def metrics_path(self) -> Path:
        return metrics_in(self.run_dir)

    def prepare(self) -> None:
        """Resume from the newest valid checkpoint, or rotate stale ones away for a fresh run."""
        stopped = self._own_stop() if self.cfg.resume else None
        barrier()
        if stopped is not None:
            self.resumed_after = stopped.as_dict()
            if self.info.is_main:
                self.stop_marker.unlink()
        latest = self.checkpoints.latest() if self.cfg.resume else None
        if latest is None:
            self.checkpoints.rotate_stale()
            if self.info.is_main:
                self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
                self.metrics_path.write_text("")
            return
        saved = self.checkpoints.load(latest, self.model, self.optimizer)
        self.scheduler.load_state_dict(saved["scheduler"])
        self.state = TrainState(**saved["trainer"])
        if self.rank_state is not None:
            self.rank_state.load_state_dict(self.checkpoints.load_rank_state(latest))
        self.resumed_from = str(latest.path)
        if self.info.is_main:
            self.log.info(f"resumed from {latest.path} at step {self.state.step}")
            self._truncate_metrics(self.state.step)

    def _truncate_metrics(self, steps: int) -> None:
        """Drop metric lines past the checkpoint so the log matches the restored state."""
        lines = self.metrics_path.read_text().splitlines() if self.metrics_path.exists() else []
        self.metrics_path.write_text("".join(line + "\n" for line in lines[:steps]))

    def train_step(self) -> dict[str, Any]:
        self.model.train()
        started = time.perf_counter()
        micro_batches = self.source.micro_batches(self.state.step)
        local_denominator = self.adapter.step_denominator(micro_batches)
        (denominator,) = all_reduce_sum([local_denominator])
        batch_sums = []
        for batch in micro_batches:
            loss, sums = self.adapter.loss(self.model, batch, denominator)
            # FSDP averages gradients over ranks; the loss is already a share of the global
            # mean, so scale it back to a sum (gloo cannot pre-multiply in the reduction).
            (loss * self.info.world_size).backward()
            batch_sums.append(sums)
        tokens = sum(int(batch.attention_mask.sum()) for batch in micro_batches)
        metrics, tokens = reduce_step_sums(self.adapter, batch_sums, tokens)
        grad_norm = _to_float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        )
        skipped = any_rank(not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm)))
        lr = self.scheduler.get_last_lr()[0]
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        elapsed = time.perf_counter() - started
        self._count(skipped, elapsed, len(micro_batches))
        metrics.update(
            step=self.state.step - 1,
            micro_step=self.state.micro_step,
            lr=lr,
            grad_norm=grad_norm,
            skipped=skipped,
            tokens=tokens,
            tokens_per_s=tokens / elapsed,
            step_time_s=elapsed,
        )
        return metrics

    def _count(self, skipped: bool, elapsed: float, micro: int) -> None:
        s = self.state
        s.step += 1
        s.micro_step += micro
        s.step_times.append(elapsed)
        s.skipped_steps += skipped
        s.consecutive_skipped = s.consecutive_skipped + 1 if skipped else 0
        if s.consecutive_skipped > self.cfg.max_consecutive_skipped_steps:
            raise TrainingDiverged(
                f"{s.consecutive_skipped} consecutive steps skipped for non-finite loss or gradient norm "
                f"(trainer.max_consecutive_skipped_steps={self.cfg.max_consecutive_skipped_steps})"
            )
        if s.skipped_steps > self.cfg.max_skipped_fraction * len(self.source):
            raise TrainingDiverged(
                f"{s.skipped_steps} of {len(self.source)} steps skipped, over "
                f"trainer.max_skipped_fraction={self.cfg.max_skipped_fraction}"
            )

    def fit(self, on_step=None, rank_state=None) -> dict[str, Any]:
        """Run to the horizon (or max_micro_steps); `on_step(metrics)` sees every step's metrics.

        `rank_state` (state_dict / load_state_dict, JSON-ready) is what this rank keeps
        beside the model, such as tripwire windows: each checkpoint holds it, a resume
        restores it.
        """
        self.rank_state = rank_state
        self.prepare()
        self.stop.install()
        started, first_step = time.monotonic(), self.state.step
        total = len(self.source)
        bar = tqdm(
            total=total,
            initial=self.state.step,
            desc=self.stage,
            disable=not (self.info.is_main and sys.stderr.isatty()),
        )
        # A log (not a terminal) gets a progress line now and then instead of the bar.
        progress = None
        if self.info.is_main and bar.disable:
            progress = Progress(
                total,
                self.state.step,
                self.cfg.progress_every_steps,
                self.cfg.progress_every_s,
                self.projected_wall_s,
            )
        try:
            while self.state.step < total:
                metrics = self.train_step()
                self.last_metrics = metrics
                self._log(metrics)
                bar.update(1)
                if progress is not None and progress.due(self.state.step):
                    self.log.info(progress.line(self.state.step, metrics))
                if on_step is not None:
                    on_step(metrics)
                if self._capped():
                    break
                if self._stop_requested():
                    checkpoint = self.save()
                    self._leave_stop_marker(checkpoint.path)
                    raise ResumableStop(
                        f"{self.stage} stopped at step {self.state.step}/{total} "
                        f"({self._stop_reason()}); checkpoint saved, a retry resumes"
                    )
                if self.cfg.checkpoint_every and self.state.step % self.cfg.checkpoint_every == 0:
                    self.save()
        finally:
            bar.close()
            self.stop.uninstall()
            self.fit_wall_s += time.monotonic() - started
            self.fit_steps += self.state.step - first_step
        return self.summary()

    def _capped(self) -> bool:
        return bool(self.cfg.max_micro_steps) and self.state.micro_step >= self.cfg.max_micro_steps

    def _stop_reason(self) -> str:
        return (
            f"signal {signal.Signals(self.stop.signal).name}"
            if self.stop.signal
            else "max_wall_seconds"
        )

    def _stop_requested(self) -> bool:
        over_time = (
            bool(self.cfg.max_wall_seconds)
            and time.monotonic() - self.stage_started > self.cfg.max_wall_seconds
        )
        return any_rank(self.stop.signal is not None or over_time)

    def save(self):
        trainer_state = {
            "trainer": self.state.__dict__,
            "scheduler": self.scheduler.state_dict(),
            "world_size": self.info.world_size,
            "stage": self.stage,
        }
        rank_state = self.rank_state.state_dict() if self.rank_state is not None else None
        return self.checkpoints.save(
            self.state.micro_step, self.model, self.optimizer, trainer_state, rank_state
        )

    def _own_stop(self) -> StopMarker | None:
        """The stop marker, when the checkpoint it names is one of this run's: a stage that
        trains more than one run resumes each after its own stop only."""
        stopped = StopMarker.read(self.stop_marker)
        if stopped is None or Path(stopped.checkpoint).parent != self.checkpoints.root:
            return None
        return stopped

    def _leave_stop_marker(self, checkpoint: Path) -> None:
        """Tells the launcher the stop was clean and resumable."""
        if self.info.is_main:
            marker = StopMarker(str(checkpoint), self._stop_reason(), step=self.state.step)
            marker.write(self.stop_marker)

    def _log(self, metrics: dict[str, Any]) -> None:
        if self.info.is_main:
            line = json.dumps(metrics) + "\n"
            with writing(self.metrics_path, len(line)), open(self.metrics_path, "a") as log:
                log.write(line)

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.state.step,
            "horizon_steps": len(self.source),
            "micro_steps": self.state.micro_step,
            "skipped_steps": self.state.skipped_steps,
            # This process's fit: its wall clock and the steps it trained (a resume's own).
            "fit_wall_s": round(self.fit_wall_s, 3),
            "fit_steps": self.fit_steps,
            "resumed_from": self.resumed_from,
            "resumed_after": self.resumed_after,
            "checkpoint_save_s": [round(s, 3) for s in self.checkpoints.save_s],
            "checkpoint_load_s": [round(s, 3) for s in self.checkpoints.load_s],
            # Read off the live optimizer: which parameters it decays, and by how much.
            "optimizer": {
                "class": type(self.optimizer).__name__,
                "param_groups": param_groups_record(self.optimizer),
            },
            "final": self.last_metrics,
        }


def _to_float(value) -> float:
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)
