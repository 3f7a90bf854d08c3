"""An arm's result receipt (arm_result.json) as the selection and the report read it.

workflow/scripts/dpo.py writes it: PASSED or FAILED (a tripwire ended training) with the
policy it trained, or DESCOPED with the manifest's reason and no policy. Imports nothing
heavy, so a refused selection stays cheap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.receipts import read_json


@dataclass(frozen=True)
class TripwireRecord:
    """The arm result's tripwire section: both training runs, which one is the result,
    and every alarm, run by run (align.stages.dpo.tripwire_section writes it)."""

    # Whether a wire fired on the first run, so the pre-registered rerun trained.
    rerun: bool = False
    # Whether a wire fired again on the rerun, which ends the arm FAILED.
    ended_by_tripwire: bool = False
    # The run whose policy is the arm's: "first" or "rerun".
    result_run: str | None = None
    # The pre-registered response the rerun trained with (None without a rerun).
    response: dict[str, Any] | None = None
    # Every alarm, each with the run it fired in.
    fired: list[dict[str, Any]] = field(default_factory=list)
    # Each run's record: config, summary, alarms, signals, bands, generation checks.
    runs: list[dict[str, Any]] = field(default_factory=list)
    armed: list[str] = field(default_factory=list)
    # Each disarmed wire with its pre-registered reason.
    disarmed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, section: Mapping[str, Any]) -> TripwireRecord:
        return cls(
            rerun=bool(section.get("rerun")),
            ended_by_tripwire=bool(section.get("ended_by_tripwire")),
            result_run=section.get("result_run"),
            response=section.get("response"),
            fired=list(section.get("fired", [])),
            runs=list(section.get("runs", [])),
            armed=list(section.get("armed", [])),
            disarmed=dict(section.get("disarmed", {})),
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def alarms_of(self, run: str) -> list[dict[str, Any]]:
        """The alarms that fired in one training run."""
        return [alarm for alarm in self.fired if alarm["run"] == run]

    @property
    def fired_wires(self) -> list[str]:
        """The names of the signals that fired, over both runs."""
        return sorted({alarm["name"] for alarm in self.fired})


@dataclass(frozen=True)
class ArmResult:
    arm: str
    status: str
    descoped: bool = False
    # Why the manifest descoped the arm, or why it failed.
    reason: str | None = None
    # The exported policy and the SFT checkpoint it was trained from (recorded paths).
    policy: str | None = None
    checkpoint: str | None = None
    # Weights hashes by recorded path: the policy's among them.
    outputs: dict[str, str] = field(default_factory=dict)
    # The tripwires' record (runs, alarms, the rerun); None when none was recorded.
    tripwire: TripwireRecord | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    gates: list[dict[str, Any]] = field(default_factory=list)
    # The arm's pre-registration as the stage loaded it.
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, receipt: Mapping[str, Any]) -> ArmResult:
        return cls(
            arm=receipt.get("arm"),
            status=receipt.get("status"),
            descoped=bool(receipt.get("descoped")),
            reason=receipt.get("reason"),
            policy=receipt.get("policy"),
            checkpoint=receipt.get("checkpoint"),
            outputs=dict(receipt.get("outputs", {})),
            tripwire=TripwireRecord.of(receipt["tripwire"]) if receipt.get("tripwire") else None,
            figures=dict(receipt.get("figures", {})),
            gates=list(receipt.get("gates", [])),
            config=dict(receipt.get("config", {})),
        )

    @classmethod
    def read(cls, path: str | Path) -> ArmResult | None:
        """The receipt at `path`, or None while the arm has none."""
        return cls.of(read_json(path)) if Path(path).is_file() else None

    @property
    def policy_hash(self) -> str | None:
        """The weights hash recorded for the policy (None without one)."""
        return self.outputs.get(self.policy) if self.policy else None

    @property
    def held_out(self) -> dict[str, Any]:
        return self.figures.get("held_out", {})

    @property
    def final_beta(self) -> float | None:
        """The beta of the policy's run (a rerun's response may have changed it)."""
        return self.figures.get("final_config", {}).get("beta")

    @property
    def first_run_beta(self) -> float | None:
        return self.config.get("dpo", {}).get("beta")
