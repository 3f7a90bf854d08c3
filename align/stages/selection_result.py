"""The selection's receipt (selection.json) as the report reads it.

align.stages.selection writes it: PASSED with the selected arm, or FAILED when no arm is
eligible, with every arm's standing, the paired figures and the gates it ran. Imports
nothing heavy, so the report stays cheap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.receipts import read_json


@dataclass(frozen=True)
class SelectionResult:
    status: str
    # The rule's verdict: rule, default_arm, selected (None: no arm), branch and reason.
    decision: dict[str, Any]
    # Each arm's standing (eligible or not, and why), by arm.
    arms: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The eval set, each policy's paired scores and generations, the comparisons, the band.
    figures: dict[str, Any] = field(default_factory=dict)
    gates: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, receipt: Mapping[str, Any]) -> SelectionResult:
        return cls(
            status=receipt["status"],
            decision=dict(receipt["decision"]),
            arms=dict(receipt.get("arms", {})),
            figures=dict(receipt.get("figures", {})),
            gates=list(receipt.get("gates", [])),
        )

    @classmethod
    def read(cls, path: str | Path) -> SelectionResult | None:
        """The receipt at `path`, or None while the selection has none."""
        return cls.of(read_json(path)) if Path(path).is_file() else None

    @property
    def selected(self) -> str | None:
        """The selected arm, None when no arm was eligible."""
        return self.decision["selected"]
