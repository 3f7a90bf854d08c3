"""Tripwires armed by the pre-registration, fed per-pair statistics every step.

- chosen-logprob collapse: the windowed mean (last `logps_window` pairs) of the
  policy-minus-reference chosen log-prob per token falls below a floor while the
  windowed margin is above where it started;
- length drift: over the last `length_window_pairs` pairs, the fraction of pairs
  whose implicit reward prefers the longer response leaves baseline +- band; it can
  fire only once the window is full;
- generation: the periodic greedy generations of a fixed held-out prompt set (figures
  already summed over ranks) leave the band of align.eval.sanity: too few end
  (`generation_terminated`) or their mean length leaves its band (`generation_length`).
Each rank sees its own pairs; alarms are a union across ranks, so all ranks decide alike,
and an alarm records the rank that set it off with that rank's value.
A rank's windows and signal history are part of its checkpoint (`state_dict`), so a
resumed run decides as the uninterrupted run would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from align.config import TripwireConfig
from align.eval.sanity import LENGTH, TERMINATED, GenerationBand


@dataclass
class PairStats:
    """One micro-batch's pairs: chosen log-ratio per token, margins, lengths."""

    chosen_logratio_per_token: np.ndarray
    margins: np.ndarray
    chosen_tokens: np.ndarray
    rejected_tokens: np.ndarray


@dataclass
class Alarm:
    """A signal out of its band. `rank` is the first rank whose own window set it off,
    and `value` that rank's signal; None for a job-wide figure (the generation checks)."""

    name: str
    step: int
    value: float
    band: list[float]
    rank: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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

    def state_dict(self) -> dict[str, Any]:
        return {
            "logratios": list(self.logratios),
            "margins": list(self.margins),
            "start_margin": self.start_margin,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.logratios.clear()
        self.logratios.extend(state["logratios"])
        self.margins.clear()
        self.margins.extend(state["margins"])
        self.start_margin = state["start_margin"]


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

    def state_dict(self) -> dict[str, Any]:
        return {"prefers_longer": list(self.prefers_longer)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.prefers_longer.clear()
        self.prefers_longer.extend(state["prefers_longer"])


class GenerationWire:
    """The periodic generation check against its band: one signal and alarm per figure."""

    terminated = "generation_terminated"
    length = "generation_length"

    def __init__(self, band: GenerationBand):
        self.band = band

    def judge(self, check: Mapping[str, float]) -> list[tuple[str, float, bool]]:
        """(signal, value, inside its band) for the terminated fraction and the mean length."""
        return [
            (self.terminated, check[TERMINATED], self.band.terminated_ok(check[TERMINATED])),
            (self.length, check[LENGTH], self.band.length_ok(check[LENGTH])),
        ]

    def bands(self) -> dict[str, list[float]]:
        return {
            self.terminated: [self.band.min_terminated, 1.0],
            self.length: [self.band.length_low, self.band.length_high],
        }


def describe_alarm(alarm: Mapping[str, Any]) -> str:
    """One alarm (`Alarm.as_dict()`) as the logs name it."""
    where = "" if alarm.get("rank") is None else f", rank {alarm['rank']}"
    return (
        f"{alarm['name']} at step {alarm['step']} "
        f"({alarm['value']:.4g} outside {alarm['band']}{where})"
    )


@dataclass
class Tripwires:
    """The armed detectors and the signal history the report plots."""

    detectors: list = field(default_factory=list)
    signals: dict[str, list[list[float]]] = field(default_factory=dict)
    generation: GenerationWire | None = None

    @classmethod
    def armed(
        cls,
        cfg: TripwireConfig,
        chosen_longer_baseline: float,
        generation_band: GenerationBand | None = None,
    ) -> Tripwires:
        """`generation_band` is required when the generation wire is armed."""
        detectors = []
        if cfg.armed("collapse"):
            detectors.append(ChosenCollapse(cfg.logps_window, cfg.chosen_logp_floor))
        if cfg.armed("length_drift"):
            detectors.append(
                LengthDrift(cfg.length_window_pairs, chosen_longer_baseline, cfg.length_band)
            )
        signals = {d.name: [] for d in detectors}
        generation = None
        if cfg.armed("generation"):
            if generation_band is None:
                raise ValueError("the generation wire is armed but no generation band was given")
            generation = GenerationWire(generation_band)
            signals.update({name: [] for name in generation.bands()})
        return cls(detectors, signals, generation)

    def update(self, stats: list[PairStats]) -> None:
        for batch in stats:
            for detector in self.detectors:
                detector.update(batch)

    def check(self, step: int, gather) -> list[Alarm]:
        """Alarms of this step, a union over ranks. `gather(x)` returns every rank's `x` in
        rank order (a collective per detector, and one more for the value when one fires)."""
        alarms = []
        for detector in self.detectors:
            value = detector.signal()
            if value is not None:
                self.signals[detector.name].append([step, value])
            fired = gather(1.0 if detector.fired() else 0.0)
            if any(fired):
                rank = fired.index(1.0)
                values = gather(float("nan") if value is None else value)
                alarms.append(Alarm(detector.name, step, values[rank], detector.band(), rank))
        return alarms

    def check_generation(self, step: int, check: Mapping[str, float], any_rank) -> list[Alarm]:
        """Alarms of a generation check after `step` optimizer steps (0: before training)."""
        if self.generation is None:
            raise ValueError("a generation check was given but the generation wire is not armed")
        alarms = []
        bands = self.generation.bands()
        for name, value, inside in self.generation.judge(check):
            self.signals[name].append([step, value])
            if any_rank(not inside):
                alarms.append(Alarm(name, step, value, bands[name]))
        return alarms

    def bands(self) -> dict[str, list[float]]:
        bands = {d.name: d.band() for d in self.detectors}
        return {**bands, **(self.generation.bands() if self.generation else {})}

    def state_dict(self) -> dict[str, Any]:
        """This rank's windows and the signal history, as JSON-ready lists."""
        return {
            "windows": {d.name: d.state_dict() for d in self.detectors},
            "signals": self.signals,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state_dict()` of the same armed wires; refuses any other."""
        armed = sorted(self.signals)
        if sorted(state["signals"]) != armed:
            raise ValueError(
                f"the checkpoint's tripwire state is of wires {sorted(state['signals'])}, "
                f"but this run arms {armed}"
            )
        for detector in self.detectors:
            detector.load_state_dict(state["windows"][detector.name])
        self.signals = {name: [list(point) for point in state["signals"][name]] for name in armed}
