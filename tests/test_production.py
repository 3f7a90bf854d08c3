"""The production pre-registration (config/production/) as a researcher copies it, checked
without weights: a config-only Mistral-7B-v0.1 (tests/mistral_7b.py) and data files in the
public schemas lie where the README's guide puts the downloads, under resources/
(conftest.production_checkout)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import production_checkout, run_snakemake, stand_in_apptainer
from snakemake.utils import validate

from align.config import ArmConfig, SelectionConfig, SftConfig, load_config
from align.train.memory import check_stage_rss, job_shape, projected_job_rss, selection_seq_len

REPO = Path(__file__).resolve().parents[1]
PRODUCTION = REPO / "config" / "production"
WORKFLOW_CONFIG = "config/production/config.yaml"
# The guide's command, dry-run (README, "Your model, your data, your cluster", step 4).
DRY_RUN = ("--workflow-profile", str(REPO / "profiles" / "slurm"), "--configfile", WORKFLOW_CONFIG)
# Every job of the chain from a base model, with the kernel gate of the triton_fa2 arms.
CHAIN = {
    "kernel_gate": 1,
    "sft": 1,
    "sft_gate": 1,
    "build_manifest": 1,
    "ref_cache": 2,
    "path_bias": 2,
    "preflight": 2,
    "probe": 2,
    "dpo": 2,
    "select_arms": 1,
    "arms": 1,
}
# GPUs per job: world size 4 for the ranked stages, one for those that score in one process.
GPUS = {"kernel_gate": 1, "sft_gate": 1, "select_arms": 1}
LOCAL = ("build_manifest", "preflight", "arms")
# The stage each model-loading job projects; the probe is sized by the preflight, which
# projects the dpo stage that follows it.
PROJECTED_AS = {
    "sft": "sft",
    "sft_gate": "sft_gate",
    "ref_cache": "ref_cache",
    "path_bias": "path_bias",
    "probe": "dpo",
    "dpo": "dpo",
    "select_arms": "select_arms",
}


def workflow_config() -> dict:
    return yaml.safe_load((REPO / WORKFLOW_CONFIG).read_text())


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return production_checkout(tmp_path_factory.mktemp("production"))


def arm_cfg(arm: str) -> ArmConfig:
    return load_config(PRODUCTION / "arms" / f"{arm}.toml", ArmConfig).cfg


def stage_cfg(stage: str, arm: str | None):
    if stage in ("sft", "sft_gate"):
        return load_config(PRODUCTION / "sft.toml", SftConfig).cfg
    if stage == "select_arms":
        return load_config(PRODUCTION / "selection.toml", SelectionConfig).cfg
    return arm_cfg(arm)


def test_the_production_workflow_config_passes_the_schema():
    config = workflow_config()
    validate(config, str(REPO / "config" / "schema" / "config.schema.yaml"))
    assert config["gpus_per_node"] == 4
    for key in ("arm_config_dir", "sft_config", "selection_config"):
        assert (REPO / config[key]).exists(), key


def test_the_production_arms_preregister_the_real_run():
    for arm, source in (
        ("argilla", "distilabel-intel-orca-dpo-pairs"),
        ("steppairs", "Math-Step-DPO-10K"),
    ):
        cfg = arm_cfg(arm)
        assert cfg.data.files == [f"resources/data/{source}.parquet"]
        assert (cfg.data.seq_len, cfg.batch.world_size, cfg.optimizer.name) == (
            2048,
            4,
            "adamw8bit",
        )
        assert (cfg.model.dtype, cfg.model.master_dtype) == ("bfloat16", "float32")
        assert cfg.model.attn_implementation == cfg.ref.attn_implementation == "triton_fa2"
        assert cfg.trainer.checkpoint_every > 0, "a production run saves periodically"
        assert cfg.run.device == "cuda"
    assert load_config(PRODUCTION / "sft.toml", SftConfig).cfg.trainer.checkpoint_every > 0


def dry_run_jobs(output: str) -> list[dict]:
    """Each job of a dry run's listing: rule, wildcards and resources."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?(?:rule|checkpoint) \w+:\n)", output)[1:]:
        rule = re.match(r"(?:local)?(?:rule|checkpoint) (\w+):", block).group(1)
        fields = dict(re.findall(r"(?m)^    (\w+): (.*)$", block))
        resources = dict(
            item.split("=", 1) for item in fields.get("resources", "").split(", ") if "=" in item
        )
        wildcards = dict(
            item.split("=", 1) for item in fields.get("wildcards", "").split(", ") if "=" in item
        )
        jobs.append({"rule": rule, "wildcards": wildcards, "resources": resources})
    return jobs


@pytest.fixture(scope="module")
def dry_run(work, tmp_path_factory) -> list[dict]:
    # No image here: the stand-in answers Snakemake's version check; nothing runs.
    bin_dir = stand_in_apptainer(tmp_path_factory.mktemp("bin"))
    run = run_snakemake(work, "arms", *DRY_RUN, "--dry-run", timeout=300, path_first=(bin_dir,))
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    # The config-only checkpoint is planned with, and named as lacking its weights.
    assert "lacks model-00001-of-00002.safetensors" in output
    return dry_run_jobs(output.split("Job stats:")[1])


def test_the_production_dry_run_lists_the_whole_chain(dry_run):
    counts = {}
    for job in dry_run:
        counts[job["rule"]] = counts.get(job["rule"], 0) + 1
    assert counts == CHAIN


def test_every_production_job_requests_gpus_memory_and_time(dry_run):
    for job in dry_run:
        rule, resources = job["rule"], job["resources"]
        if rule in LOCAL:
            assert "gpu" not in resources, job
            continue
        assert int(resources["gpu"]) == GPUS.get(rule, 4), job
        assert resources["nodes"] == "1" and resources["slurm_partition"] == "gpu", job
        assert int(resources["mem_mb"]) > 0 and int(resources["runtime"]) > 0, job
    sft = next(job for job in dry_run if job["rule"] == "sft")
    assert int(sft["resources"]["runtime"]) == workflow_config()["job_resources"]["sft_runtime_min"]


def test_the_site_gpu_model_reaches_the_kernel_gate_and_every_arm_job(work, tmp_path):
    bin_dir = stand_in_apptainer(tmp_path / "bin")
    args = ("arms", *DRY_RUN, "--config", "slurm_gpu_model=h100", "--dry-run")
    run = run_snakemake(work, *args, timeout=300, path_first=(bin_dir,))
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    jobs = dry_run_jobs((run.stdout + run.stderr).split("Job stats:")[1])
    on_gpus = [job for job in jobs if job["rule"] not in LOCAL]
    assert {job["rule"] for job in on_gpus} == set(CHAIN) - set(LOCAL)
    for job in on_gpus:
        assert job["resources"].get("gpu_model") == "h100", job
    assert all("gpu_model" not in job["resources"] for job in jobs if job["rule"] in LOCAL)


def test_each_model_loading_job_requests_its_projected_peak(dry_run, work):
    stub = work / workflow_config()["base_model"]
    covered = set()
    for job in dry_run:
        if job["rule"] not in PROJECTED_AS:
            continue
        stage = PROJECTED_AS[job["rule"]]
        cfg = stage_cfg(job["rule"], job["wildcards"].get("arm"))
        seq_len = (
            selection_seq_len([arm_cfg(a) for a in workflow_config()["arms"]])
            if stage == "select_arms"
            else 0
        )
        projection = projected_job_rss(job_shape(stage, cfg, 1, seq_len), stub, shard_bytes=0)
        terms = projection["terms_mb"]
        # Rank 0's staging copy of the bf16 checkpoint and its float32 master, and for
        # stages that export, the gathered float32 state.
        assert terms["load_staging_rank0"] == pytest.approx(3 * 7_241_732_096 * 2 / 2**20)
        assert ("export_gather_rank0" in terms) == (stage in ("sft", "dpo"))
        requested = int(job["resources"]["mem_mb"])
        assert requested >= projection["node_mb"], (job, projection)
        print(
            f"{job['rule']:<12} {job['wildcards']} mem_mb {requested} >= {projection['node_mb']:.0f}"
        )
        covered.add(job["rule"])
    assert covered == set(PROJECTED_AS)


@pytest.mark.parametrize("arm", ["argilla", "steppairs"])
def test_the_preflight_projection_of_each_production_arm_fits_its_declared_node(work, arm):
    cfg = arm_cfg(arm)
    config = workflow_config()
    stub = work / config["base_model"]
    partition = config["slurm_gpu_partition"]
    # What the workflow passes the preflight for a job on that partition (rules/common.smk).
    cfg.run.node_memory_mb = config["slurm_node_memory_mb"][partition]
    cfg.run.node_memory_source = f"slurm_node_memory_mb[{partition}] (workflow config)"
    cfg.run.gpus_per_node = config["gpus_per_node"]
    projection = check_stage_rss("dpo", cfg, stub)
    assert projection["nodes"] == 1
    assert projection["node_memory_source"] == "slurm_node_memory_mb[gpu] (workflow config)"
    assert projection["headroom_mb"] > 0
    device = projection["device"]
    assert device["device_source"] == "preflight.device_memory_gb"
    assert device["total_mb"] / 1024 == pytest.approx(25.5, abs=0.05)  # the README's table


def test_the_production_workflow_lints_clean(work):
    lint = run_snakemake(work, "--lint", "--configfile", WORKFLOW_CONFIG, timeout=300)
    out = lint.stdout + lint.stderr
    assert lint.returncode == 0 and "Congratulations" in out, out[-3000:]


def test_a_run_on_the_config_only_checkpoint_is_refused_before_any_job(work):
    run = run_snakemake(work, "--configfile", WORKFLOW_CONFIG, "--cores", "1", "arms", timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert "is not a checkpoint directory: missing model-00001-of-00002.safetensors" in out
    assert not (work / "results" / "sft").exists()


def test_sft_gate_on_a_checkpoint_without_weights_exits_3_not_70(work):
    """It loaded the model and died with a traceback (exit 70); the gate now refuses it."""
    stub = work / workflow_config()["base_model"]
    for script, override in (
        ("sft_gate.py", f"--run.sft_checkpoint={stub}"),
        ("sft.py", f"--run.base_model={stub}"),
    ):
        run = subprocess.run(
            [
                sys.executable,
                str(REPO / "workflow" / "scripts" / script),
                str(PRODUCTION / "sft.toml"),
                override,
                f"--run.results_dir={work / 'refused'}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 3, run.stderr[-3000:]
        assert "Traceback" not in run.stderr
        assert f"{stub} is not a checkpoint directory: missing " in run.stderr
        assert "model-00002-of-00002.safetensors (named by model.safetensors.index.json)" in (
            run.stderr
        )
