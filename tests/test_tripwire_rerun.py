"""End to end on the tiny model, on a copy of the finished default run: plain DPO at a high
learning rate loses the end of sequence, the periodic generation wire sees it, the arm reruns
exactly once with the pre-registered response, and the result records both runs. A rerun
that fires again ends the stage with exit 5."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from align.exit_codes import RESUMABLE_STOP, TRIPWIRE
from align.paths import RunPaths, ended_run_in

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
STOP_MARKER = RunPaths.of("results").arm("argilla").stop_marker
# One epoch: every wire these tests watch fires within it, and the rerun's epoch is the
# window a stop lands in.
SHORT = ["--epochs=1", "--lr=2e-3"]
GENERATION_EVERY = 5
ONLY_GENERATION = [
    "--tripwires.disarmed.collapse=this test watches the generation wire alone",
    "--tripwires.disarmed.length_drift=this test watches the generation wire alone",
    f"--tripwires.generation_every_steps={GENERATION_EVERY}",
]
ONLY_COLLAPSE = [
    "--tripwires.disarmed.generation=this test watches the collapse wire alone",
    "--tripwires.disarmed.length_drift=this test watches the collapse wire alone",
]


def copy_of(finished: Path, work: Path) -> Path:
    for name in ("results", "resources"):
        shutil.copytree(finished / name, work / name, symlinks=True)
    return work


@pytest.fixture
def work(finished_workflow, tmp_path) -> Path:
    return copy_of(finished_workflow, tmp_path)


def dpo_command(*overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "align.launch",
        "--nproc=2",
        f"--stop-marker={STOP_MARKER}",
        str(REPO / "workflow/scripts/dpo.py"),
        str(REPO / "config/arms/argilla.toml"),
        "--run.threads=1",
        # The default run's pin: which step a wire fires at is the same on any x86-64 CPU.
        "--run.cpu_isa=avx2",
        *SHORT,
        *overrides,
    ]


def dpo(work: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        dpo_command(*overrides), cwd=work, capture_output=True, text=True, timeout=900
    )


def result(work: Path) -> dict:
    return json.loads((work / "results/argilla/arm_result.json").read_text())


def test_a_second_alarm_ends_the_stage_with_exit_5_after_exactly_one_rerun(work):
    run = dpo(
        work, *ONLY_COLLAPSE, "--tripwires.response.rpo_alpha=none", "--tripwires.response.lr=2e-3"
    )
    assert run.returncode == TRIPWIRE, run.stderr[-3000:]
    assert "tripwire fired again after the pre-registered rerun" in run.stderr
    arm = result(work)
    assert arm["status"] == "FAILED"
    wire = arm["tripwire"]
    assert wire["ended_by_tripwire"] is True and [r["run"] for r in wire["runs"]] == [
        "first",
        "rerun",
    ]
    assert [(a["run"], a["name"]) for a in wire["fired"]] == [
        ("first", "chosen_logp_collapse"),
        ("rerun", "chosen_logp_collapse"),
    ]
    assert all(a["value"] < -1.0 for a in wire["fired"])


def launch_dpo(work: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        dpo_command(*overrides), cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_lines(path: Path, lines: int, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    """Until `path`, written since now, holds `lines` lines."""
    started, deadline = time.time(), time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        fresh = path.is_file() and path.stat().st_mtime > started
        if fresh and len(path.read_text().splitlines()) >= lines:
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} never reached {lines} lines (exit {proc.poll()})")


@dataclass(frozen=True)
class StoppedRerun:
    work: Path
    stopped: subprocess.CompletedProcess
    marker: dict
    first_metrics: bytes
    first_record: dict
    retried: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def generation_rerun(finished_workflow, tmp_path_factory) -> StoppedRerun:
    """The arm with the generation wire alone armed: SIGTERM once its rerun has passed its
    check after five steps, then the retry that resumes it to the end."""
    work = copy_of(finished_workflow, tmp_path_factory.mktemp("generation-rerun"))
    proc = launch_dpo(work, *ONLY_GENERATION)
    run_dir = work / "results/argilla/run"
    wait_for_lines(run_dir / "rerun/metrics.jsonl", GENERATION_EVERY + 1, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    stopped = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert stopped.returncode == RESUMABLE_STOP, stderr[-3000:]
    return StoppedRerun(
        work,
        stopped,
        json.loads((work / STOP_MARKER).read_text()),
        (run_dir / "metrics.jsonl").read_bytes(),
        json.loads(ended_run_in(run_dir).read_text())["record"],
        dpo(work, *ONLY_GENERATION, "--trainer.resume=true"),
    )


def test_the_generation_wire_fires_when_generations_stop_ending_and_the_arm_reruns_once(
    generation_rerun,
):
    work, run = generation_rerun.work, generation_rerun.retried
    assert run.returncode == 0, run.stderr[-3000:]
    arm = result(work)
    wire = arm["tripwire"]
    first, rerun = wire["runs"]  # exactly two runs: the first and the one rerun
    assert (first["run"], rerun["run"], wire["result_run"]) == ("first", "rerun", "rerun")
    assert wire["rerun"] is True and wire["ended_by_tripwire"] is False
    assert {a["run"] for a in wire["fired"]} == {"first"}
    assert "generation_terminated" in {a["name"] for a in wire["fired"]}
    # The first run's generations stopped ending; it ended at the alarm, before its horizon.
    minimum = first["generation_band"]["min_terminated_fraction"]
    assert first["generation_checks"][0] == {**first["generation_checks"][0], "step": 0}
    assert first["generation_checks"][-1]["terminated_fraction"] < minimum
    assert first["summary"]["steps"] < first["summary"]["horizon_steps"]
    # The rerun ran the pre-registered response to its horizon with every check in band.
    assert wire["response"] == {"lr": 5e-4, "rpo_alpha": 0.3}
    assert (
        rerun["config"]
        == arm["figures"]["final_config"]
        == {
            "lr": 5e-4,
            "beta": 0.1,
            "rpo_alpha": 0.3,
        }
    )
    assert rerun["summary"]["steps"] == rerun["summary"]["horizon_steps"]
    assert all(c["terminated_fraction"] >= minimum for c in rerun["generation_checks"])
    assert arm["figures"]["generation"]["inside"] is True
    assert arm["status"] == "PASSED"
    run_dir = work / "results/argilla/run"
    assert (run_dir / "rerun/metrics.jsonl").exists() and not (run_dir / "rerun/rerun").exists()
    # The SFT policy's check opens each run (the stopped launch trained both).
    assert generation_rerun.stopped.stderr.count("generation check after 0 steps") == 2


def test_a_stop_during_the_rerun_exits_75_and_the_retry_resumes_the_rerun_without_retraining_the_first_run(
    generation_rerun,
):
    """The launcher reads one stop marker per stage: a SIGTERM while the rerun trains must
    end in exit 75 with that marker naming the rerun's checkpoint. The retry reads the first
    run's end from its record, trains no step of it, and resumes the rerun with the checks
    and signal history its checkpoint holds."""
    work, marker, resumed = generation_rerun.work, generation_rerun.marker, generation_rerun.retried
    assert marker["reason"] == "signal SIGTERM"
    assert Path(marker["checkpoint"]).parent == Path("results/argilla/run/rerun/checkpoints")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "first: ended by generation_terminated" in resumed.stderr
    assert "resumed from results/argilla/run/checkpoints" not in resumed.stderr
    run_dir = work / "results/argilla/run"
    assert (run_dir / "metrics.jsonl").read_bytes() == generation_rerun.first_metrics
    arm = result(work)
    assert arm["tripwire"]["runs"][0] == generation_rerun.first_record
    assert [r["run"] for r in arm["tripwire"]["runs"]] == ["first", "rerun"]
    assert {a["run"] for a in arm["tripwire"]["fired"]} == {"first"}
    training = arm["figures"]["training"]
    assert training["resumed_after"] == marker, training
    assert training["resumed_from"] == marker["checkpoint"], training
    assert training["steps"] == training["horizon_steps"], training
    assert not (work / STOP_MARKER).exists()
    rerun, horizon = arm["tripwire"]["runs"][1], training["horizon_steps"]
    due = sorted({*range(0, horizon + 1, GENERATION_EVERY), horizon})
    assert [check["step"] for check in rerun["generation_checks"]] == due
    assert [step for step, _ in rerun["signals"]["generation_terminated"]] == due
