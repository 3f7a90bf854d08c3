"""The SFT gate's receipt (sft/gate.json) as the DPO gates and the report read it.

workflow/scripts/sft_gate.py writes it: PASSED with the checkpoint the arms start from,
its weights hash and fingerprint, and each check's value, threshold and verdict.
Imports nothing heavy, so a refused stage stays cheap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.receipts import read_json


@dataclass(frozen=True)
class SftGateResult:
    status: str
    passed: Any  # True when every check passed; anything else refuses the arms
    # The gated checkpoint as receipts record paths, and its weights hash and fingerprint.
    checkpoint: str | None = None
    checkpoint_hash: str | None = None
    checkpoint_fingerprint: Any = None
    # Each check by name: its value, its bound (max or min) and whether it passed.
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, receipt: Mapping[str, Any]) -> SftGateResult:
        return cls(
            status=receipt.get("status"),
            passed=receipt.get("passed"),
            checkpoint=receipt.get("checkpoint"),
            checkpoint_hash=receipt.get("checkpoint_hash"),
            checkpoint_fingerprint=receipt.get("checkpoint_fingerprint"),
            checks=dict(receipt.get("figures", {}).get("checks", {})),
        )

    @classmethod
    def read(cls, path: str | Path) -> SftGateResult | None:
        """The receipt at `path`, or None while the gate has none."""
        return cls.of(read_json(path)) if Path(path).is_file() else None
