"""Tripwires armed by the pre-registration, fed per-pair statistics every step.

- chosen-logprob collapse: the windowed mean (last `logps_window` pairs) of the
  policy-minus-reference chosen log-prob per token falls below a floor while the
  windowed margin is above where it started;
- length drift: over the last `length_window_pairs` pairs, the fraction of pairs
  whose implicit reward prefers the longer response leaves baseline +- band; it can
  fire only once the window is full.
Each rank sees its own pairs; alarms are a union across ranks, so all ranks decide alike.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from align.config import TripwireConfig


@dataclass
class PairStats:
    """One micro-batch's pairs: chosen log-ratio per token, margins, lengths."""

    chosen_logratio_per_token: np.ndarray
    margins: np.ndarray
    chosen_tokens: np.ndarray
    rejected_tokens: np.ndarray


@dataclass
class Alarm:
    name: str
    step: int
    value: float
    band: list[float]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "value": self.value, "band": self.band}


class ChosenCollapse:
    name = "chosen_logp_collapse"

    def __init__(self, window: int, floor: float):
        self.floor = floor
        self.logratios: deque[float] = deque(maxlen=window)
        self.margins: deque[float] = deque(maxlen=window)
        self.start_margin: float | None = None

    def update(self, stats: PairStats) -> None:
        self.logratios.extend(stats.chosen_logratio_per_token.tolist())
        self.margins.extend(stats.margins.tolist())
        if self.start_margin is None and len(self.margins) == self.margins.maxlen:
            self.start_margin = float(np.mean(self.margins))

    def signal(self) -> float | None:
        return float(np.mean(self.logratios)) if self.logratios else None

    def fired(self) -> bool:
        value = self.signal()
        margins_grew = (
            self.start_margin is not None and float(np.mean(self.margins)) > self.start_margin
        )
        return value is not None and value < self.floor and margins_grew

    def band(self) -> list[float]:
        return [self.floor, float("inf")]


class LengthDrift:
    name = "length_drift"

    def __init__(self, window: int, baseline: float, band: float):
        self.baseline, self.width = baseline, band
        self.prefers_longer: deque[bool] = deque(maxlen=window)

    def update(self, stats: PairStats) -> None:
        longer = stats.chosen_tokens != stats.rejected_tokens
        chosen_is_longer = stats.chosen_tokens > stats.rejected_tokens
        prefers_chosen = stats.margins > 0
        self.prefers_longer.extend((prefers_chosen == chosen_is_longer)[longer].tolist())

    def signal(self) -> float | None:
        return float(np.mean(self.prefers_longer)) if self.prefers_longer else None

    def fired(self) -> bool:
        if len(self.prefers_longer) < self.prefers_longer.maxlen:
            return False
        low, high = self.band()
        return not (low <= self.signal() <= high)

    def band(self) -> list[float]:
        return [self.baseline - self.width, self.baseline + self.width]


@dataclass
class Tripwires:
    """The armed detectors and the signal history the report plots."""

    detectors: list = field(default_factory=list)
    signals: dict[str, list[list[float]]] = field(default_factory=dict)

    @classmethod
    def armed(cls, cfg: TripwireConfig, chosen_longer_baseline: float) -> Tripwires:
        detectors = []
        if cfg.collapse:
            detectors.append(ChosenCollapse(cfg.logps_window, cfg.chosen_logp_floor))
        if cfg.length_drift:
            detectors.append(
                LengthDrift(cfg.length_window_pairs, chosen_longer_baseline, cfg.length_band)
            )
        return cls(detectors, {d.name: [] for d in detectors})

    def update(self, stats: list[PairStats]) -> None:
        for batch in stats:
            for detector in self.detectors:
                detector.update(batch)

    def check(self, step: int, any_rank) -> list[Alarm]:
        """Alarms of this step, unioned across ranks by `any_rank` (a collective per detector)."""
        alarms = []
        for detector in self.detectors:
            value = detector.signal()
            if value is not None:
                self.signals[detector.name].append([step, value])
            if any_rank(detector.fired()):
                alarms.append(
                    Alarm(
                        detector.name,
                        step,
                        float("nan") if value is None else value,
                        detector.band(),
                    )
                )
        return alarms

    def bands(self) -> dict[str, list[float]]:
        return {d.name: d.band() for d in self.detectors}
