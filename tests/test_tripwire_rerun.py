"""End to end on the tiny model: a deliberately high learning rate collapses the chosen
log-probs, the arm reruns once with the pre-registered response, and the result says so."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from align.exit_codes import TRIPWIRE

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
ARMED = [
    "--tripwires.collapse=true",
    "--tripwires.chosen_logp_floor=-0.3",
    "--tripwires.logps_window=32",
    "--tripwires.length_drift=false",
    "--epochs=2",
    "--lr=2e-3",
]


@pytest.fixture
def work(finished_workflow, tmp_path) -> Path:
    for name in ("results", "resources"):
        shutil.copytree(finished_workflow / name, tmp_path / name, symlinks=True)
    return tmp_path


def dpo(work: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "align.launch",
        "--nproc=2",
        str(REPO / "workflow/scripts/dpo.py"),
        str(REPO / "config/arms/argilla.toml"),
        "--run.threads=1",
        *ARMED,
        *overrides,
    ]
    return subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=900)


def result(work: Path) -> dict:
    return json.loads((work / "results/argilla/arm_result.json").read_text())


def test_collapse_triggers_one_rerun_with_the_preregistered_response(work):
    run = dpo(work)
    assert run.returncode == 0, run.stderr[-3000:]
    arm = result(work)
    wire = arm["tripwire"]
    assert wire["rerun"] is True and wire["ended_by_tripwire"] is False
    assert wire["alarms"][0]["name"] == "chosen_logp_collapse"
    assert wire["alarms"][0]["value"] < -0.3
    assert wire["response"] == {"lr": 5e-4, "rpo_alpha": 1.0}
    assert wire["first_run"]["steps"] < wire["first_run"]["horizon_steps"]
    assert arm["figures"]["final_config"] == {"lr": 5e-4, "beta": 0.1, "rpo_alpha": 1.0}
    assert arm["status"] == "PASSED"
    assert (work / "results/argilla/run/rerun/metrics.jsonl").exists()


def test_a_second_alarm_ends_the_stage_with_exit_5_and_a_result_that_says_so(work):
    run = dpo(work, "--tripwires.response.rpo_alpha=none", "--tripwires.response.lr=2e-3")
    assert run.returncode == TRIPWIRE, run.stderr[-3000:]
    assert "tripwire fired again after the pre-registered rerun" in run.stderr
    arm = result(work)
    assert arm["status"] == "FAILED"
    assert arm["tripwire"]["ended_by_tripwire"] is True
    assert arm["tripwire"]["rerun_alarms"][0]["name"] == "chosen_logp_collapse"
