"""A stop after training, on a copy of the finished default run: SIGTERM while the policy is
exported ends once it is exported, SIGTERM while the held-out data is scored ends between
batches; both exit 75 with the stop marker naming the phase, and the retry evaluates the
exported policy without training, to the same result as the uninterrupted run. DPO's arm
and SFT alike."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from align.exit_codes import RESUMABLE_STOP
from align.paths import RunPaths, metrics_in, trained_record_in

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "drivers" / "stop_in_phase.py"
PATHS = RunPaths.of("results")
ARM = PATHS.arm("argilla")
pytestmark = pytest.mark.slow


def stage_args(receipt: dict, stage: str) -> list[str]:
    """The config and overrides the finished run's job ran with, as its receipt records."""
    command = shlex.split(receipt["command"])
    suffix = f"workflow/scripts/{stage}.py"
    script = next(i for i, arg in enumerate(command) if arg.endswith(suffix))
    return command[script + 1 :]


# What two trainings of the same steps differ in: how long each step and save took.
TIMINGS = ("step_time_s", "tokens_per_s", "checkpoint_save_s", "checkpoint_load_s", "fit_wall_s")


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def launch(work: Path, marker: Path, script: Path, *args: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "align.launch",
        "--nproc=2",
        f"--stop-marker={marker}",
        str(script),
        *args,
    ]
    return subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=900)


@dataclass(frozen=True)
class Stage:
    """A training stage as the test stops it: its script, receipt, run directory, marker."""

    name: str
    receipt: Path
    run_dir: Path
    marker: Path
    policy: str  # the export, as the marker names it


DPO = Stage("dpo", ARM.arm_result, ARM.run_dir, ARM.stop_marker, "argilla/policy")
SFT = Stage("sft", PATHS.sft_receipt, PATHS.sft_run_dir, PATHS.sft_stop_marker, "sft/checkpoint")


def stop_then_retry(finished: Path, work: Path, stage: Stage, phase: str) -> tuple[dict, dict]:
    """On a copy of the finished run: the stage stopped in `phase`, then retried with
    resume; (the uninterrupted receipt, the retry's), once the stop and retry are checked."""
    for name in ("results", "resources"):
        shutil.copytree(finished / name, work / name, symlinks=True)
    uninterrupted = json.loads((work / stage.receipt).read_text())
    args = stage_args(uninterrupted, stage.name)
    (work / stage.receipt).unlink()

    stopped = launch(work, stage.marker, DRIVER, stage.name, phase, *args)
    assert stopped.returncode == RESUMABLE_STOP, stopped.stderr[-3000:]
    marker = json.loads((work / stage.marker).read_text())
    assert marker == {"phase": phase, "checkpoint": stage.policy, "reason": "signal SIGTERM"}
    assert (work / trained_record_in(stage.run_dir)).is_file()
    metrics = (work / metrics_in(stage.run_dir)).read_bytes()

    retry = [arg for arg in args if not arg.startswith("--trainer.resume=")]
    script = REPO / "workflow" / "scripts" / f"{stage.name}.py"
    resumed = launch(work, stage.marker, script, *retry, "--trainer.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "training recorded; evaluating the exported" in resumed.stderr
    assert (work / metrics_in(stage.run_dir)).read_bytes() == metrics  # no step trained again
    assert not (work / stage.marker).exists()
    result = json.loads((work / stage.receipt).read_text())
    assert result["figures"]["evaluation_resumed_after"] == marker
    assert result["outputs"] == uninterrupted["outputs"]
    return uninterrupted, result


@pytest.mark.parametrize("phase", ["export", "evaluate"])
def test_a_stop_after_training_exits_75_and_the_retry_evaluates_the_export_to_the_same_result(
    finished_workflow, tmp_path, phase
):
    uninterrupted, result = stop_then_retry(finished_workflow, tmp_path / "work", DPO, phase)
    for key in ("held_out", "training", "final_config", "generation"):
        assert without_timings(result["figures"][key]) == without_timings(
            uninterrupted["figures"][key]
        ), key
    assert without_timings(result["tripwire"]) == without_timings(uninterrupted["tripwire"])


@pytest.mark.parametrize("phase", ["export", "evaluate"])
def test_a_stop_after_sft_training_exits_75_and_the_retry_evaluates_the_export_to_the_same_nll(
    finished_workflow, tmp_path, phase
):
    uninterrupted, result = stop_then_retry(finished_workflow, tmp_path / "work", SFT, phase)
    assert result["figures"]["held_nll"] == uninterrupted["figures"]["held_nll"]
    assert without_timings(result["figures"]["training"]) == without_timings(
        uninterrupted["figures"]["training"]
    )
