"""The path-bias decision: a training path that matches the cache is accepted, one that
does not demands a cache built by the training path, and the DPO run trains on it.

Library level on a tiny model: policy = reference, so through a matching path every
pair's step-0 DPO loss is ln 2; through bfloat16 the bias is over the tolerance.
End to end on the session's finished workflow: training in bfloat16 and the packed
layout against the float32 padded cache makes path_bias.json say recompute, the
re-evaluated DAG adds the ref_cache job of the training path (dtype and layout), and
the arm result names that cache.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_snakemake
from tiny_pairs import write_tiny_pairs

from align.config import ArmConfig, RefConfig, RunConfig, apply_overrides
from align.data.loader import PairShard
from align.eval.logprobs import sequence_logps_and_counts
from align.exit_codes import GATE_REFUSED, AlignError
from align.losses.dpo import DPOObjective, dpo_objective
from align.paths import SPLITS, RunPaths
from align.receipts import load_receipt, read_json
from align.stages.ref_precompute import precompute_ref_caches, run_path_bias
from align.train.path_bias import ACCEPT, RECOMPUTE, PathBias, TrainingPath
from align.train.ref_cache import expected_key, load_ref_cache, read_cache_key
from align.train.session import load_policy, start_session
from align.utils.weights_hash import read_safetensors_header

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
N_PAIRS, SEQ = 48, 20
CACHE_IMPL = "sdpa-fp32-b16-padded"
# Mean |step-0 margin| in nats; on this model float32 at another batch padding measures
# ~3e-7 and bfloat16 ~8e-4.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny checkpoint, a shard, and the shard's cache through the float32 b16 path."""
    work = tmp_path_factory.mktemp("path_bias")
    write_tiny_pairs(work, N_PAIRS, SEQ)
    checkpoint, shard = work / "base", work / "pairs.safetensors"
    key = expected_key(checkpoint, shard, SEQ, "prompt_left_response_right", "float32", CACHE_IMPL)
    cache = work / "ref" / "train.safetensors"
    precompute_ref_caches(
        checkpoint, [(str(shard), cache, key)], RefConfig(batch_size=16), RunConfig(threads=1), work
    )
    return {"work": work, "checkpoint": checkpoint, "shard": shard, "cache": cache, "key": key}


def training_config(*overrides: str) -> ArmConfig:
    """One rank, micro-batches of 4 (not the cache's 16), every pair in the sample."""
    cfg = ArmConfig(arm="tiny")
    apply_overrides(
        cfg,
        [
            "--batch.world_size=1",
            "--micro_batch=4",
            "--grad_accum=1",
            "--global_batch=4",
            f"--path_bias.sample_pairs={N_PAIRS}",
            f"--path_bias.tolerance={TOLERANCE}",
            "--run.threads=1",
            *overrides,
        ],
        where="test",
    )
    return cfg


def path_bias(tiny: dict, cfg: ArmConfig) -> dict:
    figures, _ = run_path_bias(
        cfg, str(tiny["checkpoint"]), str(tiny["shard"]), tiny["cache"], tiny["key"], tiny["work"]
    )
    return figures


def test_a_matching_path_is_accepted_and_every_step0_loss_is_ln2(tiny):
    cfg = training_config()
    figures = path_bias(tiny, cfg)
    assert figures["action"] == ACCEPT, figures
    print(f"float32 b4 vs cache b16: mean |margin| {figures['mean_abs']:.2e}")
    assert figures["n"] == N_PAIRS
    assert figures["training_forward_impl"] == "sdpa-fp32-b4-padded"
    # The live path read back from the model is the one the gates expect of this config.
    assert figures["training_path"] == TrainingPath.of(cfg).as_dict()
    assert figures["settings"]["tolerance"] == TOLERANCE
    assert figures["cache_forward_impl"] == CACHE_IMPL
    assert PathBias.of({"figures": figures}).required_forward_impl == CACHE_IMPL

    assert_step0_losses_are_ln2(tiny, cfg)


def assert_step0_losses_are_ln2(tiny: dict, cfg: ArmConfig) -> None:
    """Step 0 through the training path: the policy is the reference the cache scored."""
    info = start_session(tiny["work"], cfg.run, cfg.batch)
    policy = load_policy(tiny["checkpoint"], cfg.model, info, cfg.trainer)
    policy.train()
    shard = PairShard(tiny["shard"], cfg.batch.layout)
    ref_chosen, ref_rejected = map(
        torch.from_numpy, load_ref_cache(tiny["cache"], tiny["key"], shard.pair_ids)
    )
    objective = DPOObjective.of(cfg.dpo)
    losses = []
    for start in range(0, len(shard), cfg.batch.micro_batch):
        rows = np.arange(start, min(start + cfg.batch.micro_batch, len(shard)))
        logps, counts = sequence_logps_and_counts(policy, shard.collate(rows))
        result = dpo_objective(logps, counts, ref_chosen[rows], ref_rejected[rows], objective)
        losses.append(result.losses.detach())
    losses = torch.cat(losses).double()
    assert losses.shape == (N_PAIRS,)
    assert float((losses - math.log(2)).abs().max()) <= 1e-6, losses


@pytest.mark.parametrize("layout", ["shared", "packed"])
def test_prefix_shared_training_against_a_padded_cache_is_accepted(tiny, layout):
    cfg = training_config(f"--batch.layout={layout}")
    figures = path_bias(tiny, cfg)
    assert figures["action"] == ACCEPT, figures
    print(f"{layout} b4 vs padded cache b16: mean |margin| {figures['mean_abs']:.2e}")
    assert figures["training_forward_impl"] == f"sdpa-fp32-b4-{layout}"
    assert_step0_losses_are_ln2(tiny, cfg)


@pytest.mark.parametrize("layout", ["shared", "packed"])
def test_a_prefix_shared_precompute_matches_the_padded_cache(tiny, layout):
    impl = f"sdpa-fp32-b16-{layout}"
    key = expected_key(
        tiny["checkpoint"], tiny["shard"], SEQ, "prompt_left_response_right", "float32", impl
    )
    cache = tiny["work"] / f"ref_{layout}" / "train.safetensors"
    precompute_ref_caches(
        tiny["checkpoint"],
        [(str(tiny["shard"]), cache, key)],
        RefConfig(batch_size=16, layout=layout),
        RunConfig(threads=1),
        tiny["work"],
    )
    pair_ids = PairShard(tiny["shard"]).pair_ids
    shared = load_ref_cache(cache, key, pair_ids)
    padded = load_ref_cache(tiny["cache"], tiny["key"], pair_ids)
    for got, want in zip(shared, padded, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_bfloat16_training_against_a_float32_cache_demands_a_recompute(tiny):
    figures = path_bias(tiny, training_config("--model.dtype=bfloat16"))
    assert figures["action"] == RECOMPUTE, figures
    print(f"bfloat16 b4 vs cache float32 b16: mean |margin| {figures['mean_abs']:.2e}")
    assert figures["training_forward_impl"] == "sdpa-bf16-b4-padded"
    assert PathBias.of({"figures": figures}).required_forward_impl == "sdpa-bf16-b4-padded"
    # The name comes from what the loaded policy computes in, read back from it.
    precision = figures["precision"]
    assert (precision["compute"], precision["master"]) == ("bfloat16", "float32")
    assert precision["read_back"]["linear_outputs"] == ["bfloat16"]


def test_a_cache_key_that_names_another_dtype_than_the_reference_computes_is_refused(tiny):
    impl = "sdpa-bf16-b16-padded"
    key = expected_key(
        tiny["checkpoint"], tiny["shard"], SEQ, "prompt_left_response_right", "float32", impl
    )
    with pytest.raises(AlignError, match=r"names dtype 'float32'.*computes in 'bfloat16'"):
        precompute_ref_caches(
            tiny["checkpoint"],
            [(str(tiny["shard"]), tiny["work"] / "wrong" / "train.safetensors", key)],
            RefConfig(batch_size=16, dtype="bfloat16"),
            RunConfig(threads=1),
            tiny["work"],
        )


# --- end to end on a copy of the finished workflow ---------------------------------------

ARM = "argilla"
TRAINING_IMPL = "sdpa-bf16-b4-packed"
# Only mtimes decide what reruns: the copied arm configs are dated before every output,
# so nothing but the forced path_bias and what depends on it runs again.
MTIME_ONLY = ("--rerun-triggers=mtime",)


def bf16_arm(source: str) -> str:
    """The argilla pre-registration trained in bfloat16 on packed rows, and briefly (this
    checks wiring)."""
    edited = source.replace('[model]\ndtype = "float32"', '[model]\ndtype = "bfloat16"')
    edited = edited.replace("[batch]\n", '[batch]\nlayout = "packed"\n')
    for change in ('[model]\ndtype = "bfloat16"', 'layout = "packed"'):
        assert change in edited, change
    disarmed = (
        '\n[tripwires.disarmed]\nlength_drift = "four micro-steps check wiring only"\n'
        'generation = "four micro-steps check wiring only"\n'
    )
    return edited + disarmed + "\n[trainer]\nmax_micro_steps = 4\nprobe_steps = 4\n"


def bf16_copy(finished: Path, tmp_path: Path) -> tuple[Path, tuple[str, ...]]:
    """A copy of a finished run whose argilla arm trains in bfloat16; the snakemake args."""
    work = tmp_path / "work"
    for tree in ("results", "resources"):
        shutil.copytree(finished / tree, work / tree, symlinks=True)
    arms = tmp_path / "arms"
    arms.mkdir()
    for toml in (REPO / "config" / "arms").glob("*.toml"):
        text = toml.read_text()
        (arms / toml.name).write_text(bf16_arm(text) if toml.stem == ARM else text)
    oldest = min(p.stat().st_mtime for p in (work / "results").rglob("*") if p.is_file())
    for toml in arms.iterdir():
        os.utime(toml, (oldest - 60, oldest - 60))
    return work, (f"--config=arm_config_dir={arms}", *MTIME_ONLY)


@pytest.fixture
def bf16_workflow(finished_workflow, tmp_path) -> tuple[Path, tuple[str, ...]]:
    return bf16_copy(finished_workflow, tmp_path)


@pytest.mark.slow
def test_bfloat16_packed_training_recomputes_the_cache_with_its_layout_and_trains_on_it(
    bf16_workflow,
):
    work, args = bf16_workflow
    arm = RunPaths.of(work / "results").arm(ARM)
    fp32_impl = read_cache_key(arm.ref_cache(CACHE_IMPL, "train")).forward_impl
    assert fp32_impl == CACHE_IMPL

    bias = run_snakemake(
        work, "--cores", "2", *args, "--forcerun=path_bias", str(arm.path_bias.relative_to(work))
    )
    assert bias.returncode == 0, bias.stdout[-3000:] + bias.stderr[-3000:]
    figures = read_json(arm.path_bias)["figures"]
    assert figures["action"] == RECOMPUTE, figures
    assert figures["cache_forward_impl"] == CACHE_IMPL
    assert figures["training_forward_impl"] == TRAINING_IMPL

    target = str(arm.arm_result.relative_to(work))
    dry = run_snakemake(work, "--dry-run", *args, target)
    out = dry.stdout + dry.stderr
    assert dry.returncode == 0, out[-3000:]
    jobs = re.findall(r"(?m)^(?:local)?(?:rule|checkpoint) (\w+):$", out)
    assert jobs.count("ref_cache") == 1 and "path_bias" not in jobs, jobs
    assert f"forward_impl={TRAINING_IMPL}" in out, out[-3000:]
    for rule in ("preflight", "probe", "dpo"):
        assert rule in jobs, jobs

    run = run_snakemake(work, "--cores", "2", *args, target)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = load_receipt(arm.arm_result, "dpo", stage="dpo")
    for split in SPLITS:
        cache = arm.ref_cache(TRAINING_IMPL, split)
        assert result["caches"][split] == str(cache.relative_to(work / "results"))
        key = read_cache_key(cache)
        assert (key.forward_impl, key.dtype) == (TRAINING_IMPL, "bfloat16"), key
    assert result["path_bias"]["action"] == RECOMPUTE
    gate = {row["gate"]: row for row in result["gates"]}["path_bias"]
    assert gate["figures"]["cache"] == TRAINING_IMPL, gate
    built = read_json(arm.ref_receipt(TRAINING_IMPL))
    assert built["figures"]["train"]["key"]["forward_impl"] == TRAINING_IMPL
    assert built["figures"]["train"]["world_size"] == 2
    # Every stage on this path read back bf16 compute over float32 masters.
    for precision in (
        built["figures"]["train"]["precision"],
        figures["precision"],
        result["figures"]["precision"],
    ):
        assert (precision["compute"], precision["master"]) == ("bfloat16", "float32")
        assert precision["read_back"]["linear_outputs"] == ["bfloat16"]
    assert "compute bfloat16, master float32" in result["figures"]["banner"]

    # The recomputed cache's bytes are checked too: one flipped bit is refused at path_bias.
    cache = arm.ref_cache(TRAINING_IMPL, "held")
    data = bytearray(cache.read_bytes())
    data[read_safetensors_header(cache)["chosen_logps"].begin] ^= 0x01
    cache.write_bytes(bytes(data))
    dpo, toml = REPO / "workflow" / "scripts" / "dpo.py", work.parent / "arms" / f"{ARM}.toml"
    gates = subprocess.run(
        [sys.executable, str(dpo), str(toml), "--gates-only"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert gates.returncode == GATE_REFUSED, gates.stderr[-3000:]
    recorded = built["caches"]["held"]["tensors_hash"]
    assert (
        f"gate path_bias: {cache.relative_to(work)}: tensor bytes hash expected {recorded[:12]}"
        in gates.stderr
    ), gates.stderr[-3000:]
