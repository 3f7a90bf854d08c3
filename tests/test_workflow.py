"""The whole default workflow in a temporary directory: every receipt, and DPO beats SFT."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import run_snakemake

from align.paths import SPLITS, RunPaths
from align.receipts import PASSED, hash_file, load_receipt
from align.stages.gates import GATE_NAMES
from align.stages.selection_result import SelectionResult
from align.utils.guard import cpu_isa_here

REPO = Path(__file__).resolve().parents[1]
ARMS = ("argilla", "steppairs")
pytestmark = pytest.mark.slow


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return run_snakemake(workdir, *args)


@pytest.fixture(scope="module")
def workdir(finished_workflow) -> Path:
    return finished_workflow


def test_dry_run_lists_every_rule_of_the_chain(tmp_path):
    run = snakemake(tmp_path, "--dry-run", "arms")
    assert run.returncode == 0, run.stderr[-2000:]
    for rule in ("tiny_default", "sft", "sft_gate", "build_manifest", "ref_cache", "path_bias"):
        out = run.stdout + run.stderr
        assert f"rule {rule}:" in out or f"checkpoint {rule}:" in out, rule


def test_every_receipt_is_passed_and_its_hashes_hold(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    paths = RunPaths.of("results")
    gate = load_receipt(paths.sft_gate, "sft_gate", stage="sft_gate")
    assert gate["passed"] is True and gate["status"] == PASSED
    manifest = load_receipt(paths.manifest, "manifest", stage="build_manifest")
    for arm in ARMS:
        entry = manifest["arms"][arm]
        counts = entry["counts"]
        assert counts["read"] == counts["kept"] + sum(counts["removed"].values())
        assert counts["kept"] == counts["train"] + counts["held"]
        for split in SPLITS:
            shard = entry["shards"][split]
            assert hash_file(paths.results / shard["path"]) == shard["hash"]
        result = load_receipt(paths.arm(arm).arm_result, "dpo", stage="dpo")
        assert result["status"] == PASSED
        assert [g["gate"] for g in result["gates"]] == list(GATE_NAMES)
        for key in (
            "config_hash",
            "overrides",
            "package_version",
            "host",
            "started_at",
            "finished_at",
        ):
            assert key in result
        assert result["overrides"]["run.results_dir"] == "results"


def test_every_rank_of_the_default_run_computed_at_the_pinned_instruction_set(workdir):
    """config.yaml pins AVX2, so the figures are the same bits on any x86-64 CPU with it
    (another architecture runs unpinned, and its receipts name the set that ran)."""
    ran = ":cpu:AVX2:pid" if cpu_isa_here("avx2") else ":cpu:"
    paths = RunPaths.of(workdir / "results")
    receipts = [paths.sft_receipt, paths.selection, *(paths.arm(a).arm_result for a in ARMS)]
    for path in receipts:
        receipt = json.loads(Path(path).read_text())
        assert receipt["overrides"]["run.cpu_isa"] == "avx2", path
        devices = receipt["figures"]["devices"]
        assert devices and all(ran in device for device in devices), (path, devices)


@pytest.mark.parametrize("arm", ARMS)
def test_dpo_policy_beats_sft_on_held_out_pairs(workdir, arm):
    result = json.loads((workdir / "results" / arm / "arm_result.json").read_text())
    held = result["figures"]["held_out"]
    assert held["policy"]["n"] == held["sft"]["n"] > 50
    assert held["policy"]["ci_low"] > held["sft"]["accuracy"], held


def test_the_default_selects_a_policy_whose_generations_end_and_shows_a_wire_and_its_rerun(
    workdir,
):
    selection = SelectionResult.read(workdir / "results" / "selection.json")
    selected = selection.selected
    assert selection.status == PASSED and selected in ARMS, selection.decision
    band = selection.figures["generation_band"]
    generation = selection.figures["policies"][selected]["generation"]
    assert generation["terminated_fraction"] >= band["min_terminated_fraction"], generation
    low, high = band["mean_tokens"]
    assert low <= generation["mean_tokens"] <= high, (generation, band)
    # The default's pre-registrations arm every wire: on at least one arm a wire fires on
    # the first run, and the one pre-registered rerun, with its generations in band, is
    # the arm's result.
    rescued = []
    for arm in ARMS:
        result = json.loads((workdir / "results" / arm / "arm_result.json").read_text())
        wire = result["tripwire"]
        if wire["rerun"] and wire["result_run"] == "rerun" and not wire["ended_by_tripwire"]:
            assert {a["run"] for a in wire["fired"]} == {"first"}
            assert result["figures"]["generation"]["inside"] is True
            rescued.append(arm)
    assert rescued, "no arm shows a fired wire and the rerun that became its result"
