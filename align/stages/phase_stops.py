"""Stops after training: SIGTERM or SIGUSR1 honoured at the next phase boundary or batch.

A training stage exports its policy, records what training decided beside it, then
evaluates. A stop in export ends once the export is written; a stop in evaluation ends
between batches. Either leaves the stage's stop marker, naming the phase, and exits 75;
the retry evaluates the export without training again. The handler is installed for the
whole stage: a trainer installs its own while it fits and puts this one back after.
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from align.exit_codes import GateRefused, ResumableStop
from align.log import stage_logger
from align.paths import trained_record_in
from align.receipts import read_json, write_json_atomic
from align.stages.entry import is_main_process
from align.train.stop_marker import StopMarker
from align.train.trainer import StopRequest
from align.utils.dist import any_rank, barrier
from align.utils.weights_hash import weights_fingerprint

EXPORT, EVALUATE = "export", "evaluate"


@dataclass(frozen=True)
class Trained:
    """What training decided, written beside the export (run/checkpoints/trained.json)
    before evaluation starts, so a retry after a stop evaluates without training again. A
    stage adds what its result needs of training (the DPO stage's `ArmTrained`)."""

    training: dict[str, Any]
    # Sizes and times of the exported weight files, to refuse a policy changed since.
    policy_fingerprint: dict[str, list[int]]

    @classmethod
    def read_before(cls, run_dir: Path, resume: bool) -> Self | None:
        """On a retry, what an earlier attempt recorded once it exported."""
        path = trained_record_in(run_dir)
        if not resume or not path.is_file():
            return None
        return cls(**read_json(path))

    def write(self, run_dir: Path) -> None:
        """Rank 0 writes it; every rank waits until it is there."""
        if is_main_process():
            write_json_atomic(trained_record_in(run_dir), dataclasses.asdict(self))
        barrier()


class PhaseStops:
    """The stop request of `stage` after training; `policy` is its export as receipts name it."""

    def __init__(self, stage: str, marker: Path, policy: str):
        self.stage, self.marker, self.policy = stage, marker, policy
        self.request = StopRequest()

    def __enter__(self) -> PhaseStops:
        self.request.install()
        return self

    def __exit__(self, *exc) -> None:
        self.request.uninstall()

    def stop_if_requested(self, phase: str) -> None:
        """On every rank alike: exit 75 through the stop marker when any rank was signalled."""
        if not any_rank(self.request.signal is not None):
            return
        reason = f"signal {signal.Signals(self.request.signal or signal.SIGTERM).name}"
        if is_main_process():
            StopMarker(self.policy, reason, phase=phase).write(self.marker)
        barrier()
        raise ResumableStop(
            f"{self.stage} stopped in {phase} ({reason}); the policy is exported to "
            f"{self.policy}, a retry evaluates it"
        )


def resume_evaluation(stage: str, policy: Path, fingerprint, marker: Path) -> dict[str, Any] | None:
    """On a retry after a stop in export or evaluation: the export must be the one training
    recorded (sizes and times); returns the stop it follows, read from the marker, which
    is then cleared. Every rank calls it."""
    if weights_fingerprint(policy) != fingerprint:
        raise GateRefused(
            stage, f"{policy}: weight files changed since they were exported (sizes and times)"
        )
    resumed = StopMarker.read(marker)
    barrier()
    if is_main_process():
        marker.unlink(missing_ok=True)
        stage_logger(stage).info(f"training recorded; evaluating the exported {policy}")
    return resumed.as_dict() if resumed else None
