"""Every model-loading stage of the finished default run records its phases: wall clock,
each rank's host peak and the launcher's, the job's sum beside that phase's projection,
the probe's projected training time beside DPO's, and checkpoint saves timed; and
benchmarks/projections.py reads them all back."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from align.paths import RunPaths
from align.receipts import read_json
from align.train.probes import run_projection_s

REPO = Path(__file__).resolve().parents[1]
PATHS = RunPaths.of("results")
pytestmark = pytest.mark.slow


def model_loading_receipts(work: Path) -> dict[str, dict]:
    arm = PATHS.arm("argilla")
    ref = next((work / arm.root / "ref").glob("*/receipt.json"))
    found = {
        "sft": PATHS.sft_receipt,
        "sft_gate": PATHS.sft_gate,
        "ref_cache": ref.relative_to(work),
        "path_bias": arm.path_bias,
        "probe": arm.probe,
        "dpo": arm.arm_result,
        "select_arms": PATHS.selection,
    }
    return {stage: read_json(work / path) for stage, path in found.items()}


EXPECTED_PHASES = {
    "sft": {"load", "train", "export", "evaluate"},
    "sft_gate": {"load", "evaluate"},
    "ref_cache": {"load", "evaluate"},
    "path_bias": {"load", "evaluate"},
    "probe": {"load", "train"},
    "dpo": {"load", "train", "export", "evaluate"},
    "select_arms": {"load", "evaluate"},
}


def test_every_model_loading_receipt_sets_each_phase_beside_its_projection(finished_workflow):
    for stage, receipt in model_loading_receipts(finished_workflow).items():
        phases = receipt["phases"]
        assert set(phases) == EXPECTED_PHASES[stage], stage
        launched = stage not in ("sft_gate", "select_arms")
        for name, phase in phases.items():
            ranks = phase["rank_host_peak_mb"]
            assert len(ranks) == (2 if launched else 1) and min(ranks) > 100, (stage, name)
            # The launcher (torchrun's agent with torch imported) is the job's too.
            assert (phase["launcher_peak_mb"] > 100) == launched, (stage, name)
            assert phase["host_peak_mb"] == sum(ranks) + phase["launcher_peak_mb"]
            assert phase["projected_host_mb"] == receipt["projection"]["phases"][name]["total_mb"]
            assert phase["host_ratio"] == phase["host_peak_mb"] / phase["projected_host_mb"]
            assert phase["wall_s"] > 0
    receipts = model_loading_receipts(finished_workflow)
    train = receipts["dpo"]["phases"]["train"]
    # Each run records its own wall clock and steps; the phase is set against the sum of
    # its runs' shares of the probe's one-run projection (a wire ends the default's first
    # runs early), and the job's limit covers a first run to its last step and the rerun.
    probe = receipts["probe"]["figures"]
    runs = [run["summary"] for run in receipts["dpo"]["tripwire"]["runs"]]
    assert all(run["fit_steps"] == run["steps"] > 0 and run["fit_wall_s"] > 0 for run in runs)
    assert sum(run["fit_wall_s"] for run in runs) <= train["wall_s"]
    assert train["projected_wall_s"] == sum(
        run_projection_s(probe["projected_wall_s"], run["fit_steps"], probe["horizon_steps"])
        for run in runs
    )
    assert train["wall_ratio"] == train["wall_s"] / train["projected_wall_s"]
    assert probe["runs_covered"] == 2
    assert probe["projected_job_wall_s"] == 2 * probe["projected_wall_s"]
    # The default saves no periodic checkpoint; the probe times the one it saves.
    assert receipts["dpo"]["figures"]["training"]["checkpoint_save_s"] == []
    assert receipts["probe"]["figures"]["checkpoint_s"] > 0


@pytest.mark.parametrize("mode", [(), ("--current",)])
def test_projections_benchmark_reads_back_every_phase(finished_workflow, mode):
    """As the receipts projected, and projected again by the memory model as it stands."""
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "projections.py"), *mode, "results"],
        cwd=finished_workflow,
        capture_output=True,
        text=True,
    )
    assert run.returncode in (0, 1), run.stderr
    for label in ("sft", "sft_gate", "ref_cache:argilla", "path_bias:argilla", "probe:argilla"):
        assert f"  {label}  (" in run.stdout, label
    for label in ("dpo:steppairs", "select_arms"):
        assert f"  {label}  (" in run.stdout, label
    assert run.stdout.count(" MiB = ") >= 2 + 2 + 2 + 2 + 2 * 2 + 2 * 4 + 2
    runs = sum(
        len(read_json(finished_workflow / PATHS.arm(arm).arm_result)["tripwire"]["runs"])
        for arm in ("argilla", "steppairs")
    )
    rows = re.findall(r"(?m)^    run (first|rerun) +\d+ steps, wall .* s/step \(probe", run.stdout)
    assert rows.count("first") == 2 and len(rows) == runs
    assert "figure(s) outside the goals" in run.stdout


def test_the_projections_table_has_a_row_per_job_and_phase(finished_workflow):
    """The README's table, from the finished run: each phase measured over projected, DPO's
    training wall beside the probe's projection."""
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "projections.py"), "--markdown", "results"],
        cwd=finished_workflow,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    rows = run.stdout.splitlines()
    assert rows[0].startswith("| stage | phase | ")
    assert any(row.startswith("| dpo:argilla | train wall | ") for row in rows)
    for stage, phase in (("sft", "evaluate"), ("ref_cache:steppairs", "evaluate")):
        row = next(r for r in rows if r.startswith(f"| {stage} | {phase} | "))
        assert re.search(r"[\d,]+ / [\d,]+ = \*\*\d\.\d\d\*\* \|$", row), row


def test_the_probe_records_the_attention_compilations_of_its_run(finished_workflow):
    # The default trains through sdpa, which compiles nothing; flex adds a row per bucket.
    for arm in ("argilla", "steppairs"):
        probe = read_json(finished_workflow / f"results/{arm}/probe.json")
        assert probe["figures"]["attention_compilations"] == [], arm
