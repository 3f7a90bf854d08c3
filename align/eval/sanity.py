"""Generation sanity: the band a policy's greedy generations must stay in.

Both the DPO stage's periodic generation wire and the selection judge a policy the
same way, against two references measured on the same footing: the SFT policy's
greedy generations on the same prompts, and the data's chosen responses. A policy
whose generations stop ending, or run much longer or shorter than both references,
has lost what DPO must not take away (likelihood displacement), however well it
ranks pairs. Imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from align.config import GenerationBandConfig

TERMINATED = "terminated_fraction"
LENGTH = "mean_tokens"


@dataclass(frozen=True)
class GenerationBand:
    """The minimum terminated fraction and the mean-length band, with what they came from."""

    min_terminated: float
    length_low: float
    length_high: float
    sft: Mapping[str, float]
    chosen: Mapping[str, float]

    @classmethod
    def of(
        cls, cfg: GenerationBandConfig, sft: Mapping[str, float], chosen: Mapping[str, float]
    ) -> GenerationBand:
        """`sft` and `chosen` hold a terminated fraction and a mean length each."""
        shortest = min(sft[LENGTH], chosen[LENGTH])
        longest = max(sft[LENGTH], chosen[LENGTH])
        return cls(
            min_terminated=max(
                cfg.min_terminated_vs_sft * sft[TERMINATED],
                cfg.min_terminated_vs_chosen * chosen[TERMINATED],
            ),
            length_low=cfg.length_low * shortest,
            length_high=cfg.length_high * longest,
            sft={TERMINATED: sft[TERMINATED], LENGTH: sft[LENGTH]},
            chosen={TERMINATED: chosen[TERMINATED], LENGTH: chosen[LENGTH]},
        )

    def terminated_ok(self, terminated: float) -> bool:
        return terminated >= self.min_terminated

    def length_ok(self, mean_tokens: float) -> bool:
        return self.length_low <= mean_tokens <= self.length_high

    def reasons(self, terminated: float, mean_tokens: float) -> list[str]:
        """Why generations with these figures are outside the band; empty when inside."""
        refs = (
            f"SFT {self.sft[TERMINATED]:.2f} / {self.sft[LENGTH]:.1f} tokens, data chosen "
            f"{self.chosen[TERMINATED]:.2f} / {self.chosen[LENGTH]:.1f} tokens"
        )
        out = []
        if not self.terminated_ok(terminated):
            out.append(
                f"terminated fraction {terminated:.2f} below the minimum "
                f"{self.min_terminated:.2f} ({refs})"
            )
        if not self.length_ok(mean_tokens):
            out.append(
                f"mean generation length {mean_tokens:.1f} tokens outside "
                f"[{self.length_low:.1f}, {self.length_high:.1f}] ({refs})"
            )
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "min_terminated_fraction": self.min_terminated,
            "mean_tokens": [self.length_low, self.length_high],
            "sft": dict(self.sft),
            "chosen": dict(self.chosen),
        }


def judge(band: GenerationBand, generation: Mapping[str, float]) -> dict[str, Any]:
    """A policy's generation figures beside its band, with the verdict and its reasons."""
    reasons = band.reasons(generation[TERMINATED], generation[LENGTH])
    return {
        TERMINATED: generation[TERMINATED],
        LENGTH: generation[LENGTH],
        "band": band.as_dict(),
        "inside": not reasons,
        "reasons": reasons,
    }


def chosen_responses(arrays: Mapping[str, Any], eos_id: int) -> dict[str, float]:
    """The data's chosen responses read as generations: the fraction that end with eos
    (truncation can cut it off) and their mean length without it, as greedy decoding counts."""
    import numpy as np

    ends = np.asarray(arrays["chosen_len"], dtype=np.int64)
    if len(ends) == 0:
        raise ValueError("no chosen responses to measure: the shard has no pairs")
    ended = arrays["chosen_ids"][np.arange(len(ends)), ends - 1] == eos_id
    lengths = ends - np.asarray(arrays["prompt_len"], dtype=np.int64) - ended
    return {TERMINATED: float(ended.mean()), LENGTH: float(lengths.mean())}
