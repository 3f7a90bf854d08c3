"""A stage's stop marker (<run_dir>/stopped.json): what a clean, resumable stop left.

The trainer leaves it at a checkpoint (with the step); align.stages.phase_stops leaves it
after training (with the phase it stopped in, naming the export). align.launch turns its
presence into exit 75, and a retry reads it to resume where the stop was.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.receipts import read_json, write_json_atomic


@dataclass(frozen=True)
class StopMarker:
    # The checkpoint (in training) or exported policy (after it) a retry resumes from.
    checkpoint: str
    # What asked for the stop, e.g. "signal SIGTERM" or the wall-time budget.
    reason: str
    # The optimizer step of a stop in training; None after training.
    step: int | None = None
    # The phase after training it stopped in (export, evaluate); None in training.
    phase: str | None = None

    @classmethod
    def read(cls, path: Path) -> StopMarker | None:
        """The marker at `path`, or None where no stop left one."""
        return cls(**read_json(path)) if path.is_file() else None

    def write(self, path: Path) -> None:
        write_json_atomic(path, self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        """The marker as written, without the fields its kind of stop leaves unset."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
