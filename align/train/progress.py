"""The training log's progress line, from rank 0, every `progress_every_steps` optimizer
steps or `progress_every_s` seconds, whichever comes first, and at the last step:
step/horizon, loss, reward accuracy (where the objective has one), tokens/s, elapsed, and
the ETA at this run's own pace beside the probe's projection of the whole run. The
metrics file stays the record; this line is for whoever tails a job's log."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

# The metric a line reads as reward accuracy (DPO's, as TRL names it); SFT has none.
REWARD_ACCURACY = "rewards/accuracies"


def clock(seconds: float) -> str:
    """`1h02m03s`, `2m05s`, `42s`."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """When a line is due, and what it says. `first_step` is where this process began (a
    resume), so the pace counts only the steps it ran."""

    def __init__(
        self,
        horizon: int,
        first_step: int,
        every_steps: int,
        every_s: float,
        projected_wall_s: float | None = None,
        now: Callable[[], float] = time.monotonic,
    ):
        self.horizon, self.first_step = horizon, first_step
        self.every_steps, self.every_s = every_steps, every_s
        self.projected_wall_s = projected_wall_s
        self.now = now
        self.started = self.last_at = now()
        self.last_step = first_step

    def due(self, step: int) -> bool:
        """Whether `step` (optimizer steps done) gets a line."""
        if step >= self.horizon:
            return True
        by_steps = self.every_steps and step - self.last_step >= self.every_steps
        by_time = self.every_s and self.now() - self.last_at >= self.every_s
        return bool(by_steps or by_time)

    def line(self, step: int, metrics: Mapping[str, Any]) -> str:
        """The line for `step`; it also marks the step as logged."""
        now = self.now()
        elapsed = now - self.started
        done = step - self.first_step
        parts = [f"step {step}/{self.horizon}", f"loss {metrics['loss']:.4f}"]
        if REWARD_ACCURACY in metrics:
            parts.append(f"reward acc {metrics[REWARD_ACCURACY]:.3f}")
        parts += [f"{metrics['tokens_per_s']:,.0f} tokens/s", f"elapsed {clock(elapsed)}"]
        if done > 0 and step < self.horizon:
            parts.append(f"ETA {clock(elapsed / done * (self.horizon - step))}")
        if self.projected_wall_s is not None:
            parts.append(f"probe projected {clock(self.projected_wall_s)} for the run")
        self.last_step, self.last_at = step, now
        return ", ".join(parts)
