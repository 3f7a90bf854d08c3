"""Each gate of GATE_ORDER broken alone on an otherwise valid finished run.

The refusal has the gate's exit code, names the gate with expected vs found, runs
nothing after it, and (gates 1-4) never imports torch. A finished run copied to
another directory passes its gates there, checked from a third, on its own bytes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from align.config import ArmConfig, load_config
from align.exit_codes import GATE_REFUSED, PREFLIGHT_REFUSED
from align.paths import SPLITS, RunPaths
from align.receipts import hash_file, read_json
from align.train.ref_cache import TENSORS_HASH, read_cache_key, ref_forward_impl, write_ref_cache
from align.utils.weights_hash import file_tensors_hash, read_safetensors_header

REPO = Path(__file__).resolve().parents[1]
DPO = REPO / "workflow" / "scripts" / "dpo.py"
ARGILLA = REPO / "config" / "arms" / "argilla.toml"
# What rules/common.smk passes every stage for the default config/config.yaml.
RUN_OVERRIDES = ("--run.base_model=resources/tiny/base", "--run.sft_checkpoint=")
pytestmark = pytest.mark.slow


@pytest.fixture
def run_copy(finished_workflow, tmp_path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(finished_workflow / "results", work / "results", symlinks=True)
    shutil.copytree(finished_workflow / "resources", work / "resources", symlinks=True)
    return work


def refuse(work: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-X", "importtime", str(DPO), str(ARGILLA), *overrides],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return run, time.perf_counter() - started


def imported_torch(run: subprocess.CompletedProcess) -> bool:
    return any(line.rstrip().endswith("| torch") for line in run.stderr.splitlines())


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def assert_refused(run, gate: str, *fragments: str, code: int = GATE_REFUSED) -> str:
    assert run.returncode == code, run.stderr[-3000:]
    reason = [line for line in run.stderr.splitlines() if line.startswith("align dpo:")][-1]
    assert f"gate {gate}" in reason or gate == "preflight", reason
    for fragment in fragments:
        assert fragment in reason, reason
    return reason


def test_valid_run_passes_every_gate(run_copy):
    run, _ = refuse(run_copy, "--gates-only")
    assert run.returncode == 0, run.stderr[-3000:]
    assert not imported_torch(run)
    for gate in ("sft_gate", "manifest", "ref_cache", "path_bias", "preflight", "probe"):
        assert f"  {gate}" in run.stderr


def test_failed_sft_gate_is_refused_first(run_copy):
    edit_json(run_copy / "results/sft/gate.json", lambda r: r.update(passed=False))
    run, seconds = refuse(run_copy)
    assert_refused(run, "sft_gate", "expected passed=true, found False")
    assert not imported_torch(run)
    print(f"sft_gate refusal {seconds:.3f} s")


def test_a_checkpoint_without_weights_is_refused_with_exit_3_naming_the_file(run_copy):
    (run_copy / "results/sft/checkpoint/model.safetensors").unlink()
    run, _ = refuse(run_copy)
    assert_refused(run, "sft_gate", "is not a checkpoint directory", "missing model.safetensors")
    assert "Traceback" not in run.stderr


def test_manifest_count_differing_from_the_preregistration_is_refused(run_copy):
    run, _ = refuse(run_copy, "--data.expected_train_pairs=1")
    assert_refused(run, "manifest", "expected 1", "found")
    assert not imported_torch(run)


def test_reference_cache_with_a_wrong_key_is_refused_naming_the_component(run_copy):
    caches = next((run_copy / "results/argilla/ref").iterdir())
    shutil.copyfile(caches / "held.safetensors", caches / "train.safetensors")
    run, _ = refuse(run_copy)
    assert_refused(run, "ref_cache", "key component 'shard'")
    assert not imported_torch(run)


def test_path_bias_decision_not_honoured_is_refused(run_copy):
    def demand_recompute(report):
        report["figures"].update(action="recompute", training_forward_impl="sdpa-fp32-b3-padded")

    edit_json(run_copy / "results/argilla/path_bias.json", demand_recompute)
    run, _ = refuse(run_copy)
    assert_refused(run, "path_bias", "sdpa-fp32-b3-padded", "reference cache missing")
    assert "path_bias  FAILED" in run.stderr
    assert not imported_torch(run)


@pytest.mark.parametrize(
    "override, trains_through",
    [
        ("--model.dtype=bfloat16", "'forward_impl': 'sdpa-bf16-"),
        ("--batch.layout=shared", "-shared'"),
        ("--batch.layout=packed", "-packed'"),
        ("--model.attn_implementation=eager", "'forward_impl': 'eager-fp32-"),
        ("--model.master_dtype=bfloat16", "'master': 'bfloat16'"),
    ],
)
def test_a_training_path_path_bias_did_not_measure_is_refused(run_copy, override, trains_through):
    run, _ = refuse(run_copy, override, "--gates-only")
    reason = assert_refused(run, "path_bias", "measured the training path", trains_through)
    assert "'forward_impl': 'sdpa-fp32-" in reason.split("this run trains")[0], reason
    assert not imported_torch(run)


def test_a_path_bias_tolerance_other_than_the_measured_one_is_refused(run_copy):
    run, _ = refuse(run_copy, "--path_bias.tolerance=1e-9", "--gates-only")
    assert_refused(run, "path_bias", "'tolerance': 0.001", "'tolerance': 1e-09")
    assert not imported_torch(run)


def test_a_training_path_the_probe_did_not_measure_is_refused(run_copy):
    probe = run_copy / "results/argilla/probe.json"
    edit_json(probe, lambda r: r["figures"]["training_path"].update(reduce="bfloat16"))
    run, _ = refuse(run_copy, "--gates-only")
    assert_refused(run, "probe", "measured the training path", "'reduce': 'bfloat16'")


def as_if_measured_with_bf16_masters(work: Path) -> None:
    """The path-bias and probe receipts of a run that measured bfloat16 masters."""
    for name in ("path_bias", "probe"):
        edit_json(
            work / f"results/argilla/{name}.json",
            lambda r: r["figures"]["training_path"].update(master="bfloat16"),
        )


def test_preflight_over_the_host_memory_is_refused_with_exit_6(run_copy):
    run, _ = refuse(run_copy, "--preflight.host_memory_fraction=0.0001")
    reason = assert_refused(
        run, "preflight", "projected RSS", "per node", "optimizer_state", code=PREFLIGHT_REFUSED
    )
    assert "exceeds 0% of the node's" in reason


def test_probe_from_another_topology_is_refused(run_copy):
    edit_json(run_copy / "results/argilla/probe.json", lambda r: r["topology"].update(world_size=4))
    run, _ = refuse(run_copy)
    assert_refused(run, "probe", "'world_size': 4", "expected")


def test_projection_undershooting_the_measured_peak_is_a_failed_calibration(run_copy):
    edit_json(
        run_copy / "results/argilla/probe.json", lambda r: r["figures"].update(peak_rss_mb=1e6)
    )
    run, _ = refuse(run_copy)
    assert_refused(run, "probe", "failed calibration")


def test_pure_bf16_masters_at_a_dpo_learning_rate_are_refused_with_exit_6(run_copy):
    as_if_measured_with_bf16_masters(run_copy)
    run, _ = refuse(run_copy, "--model.master_dtype=bfloat16", "--lr=5e-7")
    reason = assert_refused(
        run,
        "preflight",
        "model.master_dtype = 'bfloat16'",
        "optimizer.lr = 5e-07",
        code=PREFLIGHT_REFUSED,
    )
    moved = float(reason.split("one step would move ")[1].split("%")[0])
    assert moved < 5, reason
    assert not imported_torch(run)


def test_pure_bf16_masters_at_a_learning_rate_they_can_represent_pass(run_copy):
    as_if_measured_with_bf16_masters(run_copy)
    run, _ = refuse(run_copy, "--model.master_dtype=bfloat16", "--lr=1e-2", "--gates-only")
    assert run.returncode == 0, run.stderr[-3000:]


def test_projected_device_memory_over_the_device_is_refused_with_exit_6(run_copy):
    run, _ = refuse(run_copy, "--run.device=cuda", "--preflight.device_memory_gb=0.5")
    reason = assert_refused(
        run,
        "preflight",
        "projected device memory",
        "MiB per GPU",
        "preflight.device_memory_gb",
        code=PREFLIGHT_REFUSED,
    )
    for term in ("master_weights", "optimizer_state", "activations", "loss_head", "cuda_context"):
        assert term in reason, reason
    assert not imported_torch(run)


# --- the reference cache's own bytes -----------------------------------------------------


def argilla_cache(results: Path, split: str) -> Path:
    impl = ref_forward_impl(load_config(ARGILLA, ArmConfig).cfg.ref)
    return RunPaths.of(results).arm("argilla").ref_cache(impl, split)


def flip_tensor_byte(path: Path, tensor: str | None = None) -> None:
    """Flip one bit of `tensor` (default: the first in the file), as bit rot would."""
    locations = read_safetensors_header(path)
    location = locations[tensor] if tensor else min(locations.values(), key=lambda t: t.begin)
    data = bytearray(path.read_bytes())
    data[location.begin] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("split", SPLITS)
def test_flipped_byte_in_the_cache_is_refused_naming_the_file_and_both_hashes(run_copy, split):
    cache = argilla_cache(run_copy / "results", split)
    recorded = read_json(cache.parent / "receipt.json")["caches"][split][TENSORS_HASH]
    flip_tensor_byte(cache, "chosen_logps")
    run, _ = refuse(run_copy)
    assert_refused(
        run,
        "ref_cache",
        f"{split}.safetensors: tensor bytes hash expected {recorded[:12]}",
        f"found {file_tensors_hash(cache)[:12]}",
    )
    assert not imported_torch(run)


def test_cache_rewritten_with_its_own_hash_is_refused_against_the_receipt(run_copy):
    cache = argilla_cache(run_copy / "results", "train")
    arrays, key = load_file(str(cache)), read_cache_key(cache)
    chosen = arrays["chosen_logps"] + 0.5
    write_ref_cache(cache, arrays["pair_id"], chosen, arrays["rejected_logps"], key)
    run, _ = refuse(run_copy)
    assert_refused(run, "ref_cache", "tensor bytes hash expected", "receipt.json")


# --- a finished run copied elsewhere -----------------------------------------------------


@pytest.fixture
def moved(finished_workflow, tmp_path) -> tuple[Path, Path]:
    """(copied results dir, a third directory to run from). Only results/ is copied: the
    default's SFT checkpoint lies inside it, and the gates read nothing else."""
    results = tmp_path / "moved" / "results"
    shutil.copytree(finished_workflow / "results", results, symlinks=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return results, elsewhere


def gates_from(cwd: Path, results: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-X", "importtime", str(DPO), str(ARGILLA)]
    return subprocess.run(
        [*command, f"--run.results_dir={results}", *RUN_OVERRIDES, *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_copied_run_checked_from_another_directory_passes_its_gates(moved, finished_workflow):
    results, elsewhere = moved
    run = gates_from(elsewhere, results, "--gates-only")
    assert run.returncode == 0, run.stderr[-3000:]
    assert not imported_torch(run)
    for gate in ("sft_gate", "manifest", "ref_cache", "path_bias", "preflight", "probe"):
        assert f"  {gate}" in run.stderr
    assert "checkpoint=sft/checkpoint" in run.stderr
    assert str(finished_workflow) not in run.stderr


TAMPERED = {
    "shard": ("data/argilla/train/pairs.safetensors", "manifest"),
    "cache": ("argilla/ref/sdpa-fp32-b16-padded/held.safetensors", "ref_cache"),
    "sft_weights": ("sft/checkpoint/model.safetensors", "sft_gate"),
}


@pytest.mark.parametrize("name", TAMPERED)
def test_a_file_tampered_in_a_copied_run_is_caught_in_the_copy(moved, finished_workflow, name):
    results, elsewhere = moved
    relative, gate = TAMPERED[name]
    original = finished_workflow / "results" / relative
    untouched = hash_file(original)
    flip_tensor_byte(results / relative)
    run = gates_from(elsewhere, results)
    named = results / relative if name != "sft_weights" else results / "sft" / "checkpoint"
    assert_refused(run, gate, f"{named}: ", "expected", "found")
    assert hash_file(original) == untouched


def test_a_copied_receipt_sending_the_gates_to_the_original_run_is_refused(
    moved, finished_workflow
):
    results, elsewhere = moved
    original = finished_workflow / "results" / "sft" / "checkpoint"
    edit_json(results / "sft" / "gate.json", lambda r: r.update(checkpoint=str(original)))
    run = gates_from(elsewhere, results)
    assert_refused(run, "sft_gate", repr(str(original)), "outside the results directory")
    assert not imported_torch(run)
