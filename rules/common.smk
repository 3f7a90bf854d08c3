# Input and resource functions shared by the rules. Paths come from align.paths,
# the same module the stage scripts use; configs are read with align.config
# (stdlib only, so this costs milliseconds).
import json
import math
from pathlib import Path

from align.config import ArmConfig, SelectionConfig, SftConfig, load_config
from align.eval.selection import SelectionPaths
from align.model.checkpoint_files import checkpoint_files
from align.paths import SPLITS, RunPaths
from align.receipts import read_json
from align.report import ReportPaths, selection_labels
from align.train.path_bias import required_forward_impl
from align.train.ref_cache import parse_forward_impl, ref_forward_impl

PATHS = RunPaths.of(config["results_dir"])
ARMS = list(config["arms"])
SCRIPTS = Path(workflow.basedir) / "workflow" / "scripts"
SFT_TOML = str(Path(workflow.basedir) / config["sft_config"])
TINY_TOML = str(Path(workflow.basedir) / config["tiny_config"])
SELECTION_TOML = str(Path(workflow.basedir) / config["selection_config"])
REPORT = ReportPaths.of(PATHS)
TINY_DIR = Path(config["tiny_dir"])
BASE_MODEL = Path(config["base_model"])
# What rule tiny_default writes as the embedded default's base model.
TINY_BASE = TINY_DIR / "base"
TINY_BASE_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

RUN_OVERRIDES = " ".join(
    [
        f"--run.results_dir={config['results_dir']}",
        f"--run.base_model={config['base_model']}",
        f"--run.sft_checkpoint={config['sft_checkpoint']}",
    ]
)


def arm_toml(arm):
    return str(Path(workflow.basedir) / config["arm_config_dir"] / f"{arm}.toml")


def arm_cfg(arm):
    return load_config(arm_toml(arm), ArmConfig).cfg


def sft_cfg():
    return load_config(SFT_TOML, SftConfig).cfg


def base_model_files(wildcards):
    """The base model's files: those rule tiny_default writes for the embedded default,
    else those the directory has (single-file or sharded), refusing one that is not a
    checkpoint. A function, so only a run that trains SFT asks for the base model."""
    if BASE_MODEL == TINY_BASE:
        return [TINY_BASE / name for name in TINY_BASE_FILES]
    return checkpoint_files(BASE_MODEL)


def sft_checkpoint_files(wildcards):
    """The SFT policy: the given checkpoint's files, or the directory rule sft trains."""
    if config["sft_checkpoint"]:
        return checkpoint_files(config["sft_checkpoint"])
    return PATHS.sft_checkpoint


def arm_shards(arm):
    return [PATHS.arm(arm).shard(split) for split in SPLITS]


def preregistered_ref_caches(wildcards):
    """The cache built by the pre-registered reference path; path_bias measures against it."""
    impl = ref_forward_impl(arm_cfg(wildcards.arm).ref)
    return [PATHS.arm(wildcards.arm).ref_cache(impl, split) for split in SPLITS]


def caches_in_use(wildcards):
    """The cache the path-bias report demands (the DAG is re-evaluated once it exists)."""
    bias_receipt = checkpoints.path_bias.get(arm=wildcards.arm).output[0]
    impl = required_forward_impl(read_json(bias_receipt))
    return [PATHS.arm(wildcards.arm).ref_cache(impl, split) for split in SPLITS]


def ref_overrides(wildcards):
    """The ref-path overrides that build the cache named by the forward_impl wildcard."""
    path = parse_forward_impl(wildcards.forward_impl)
    path["share_prompt"] = str(path["share_prompt"]).lower()
    return " ".join(f"--ref.{key}={value}" for key, value in path.items())


def per_rank_threads(world_size):
    """The job's threads, shared among its ranks (at least one each)."""
    return max(1, config["threads"] // world_size)


def arm_world_size(wildcards):
    return arm_cfg(wildcards.arm).batch.world_size


def arm_rank_threads(wildcards):
    return per_rank_threads(arm_world_size(wildcards))


def arm_stop_marker(wildcards):
    return PATHS.arm(wildcards.arm).run_dir / "stopped.json"


# ---------------------------------------------------------------------------
# Job resources. Slurm gets them from the executor plugin, a local run schedules by
# them, and the image runs every rule under --software-deployment-method apptainer.
# These callables run on the submit host and again inside each job, before the
# container starts: stdlib only (json + pathlib), a file read at most. Snakemake
# re-evaluates them before each submission and on each retry, so what a receipt
# measured sizes the job that follows it, and `attempt` scales what a retry needs
# more of (memory, time). A receipt that does not exist yet (a dry run, or a job
# sized before its upstream ran) reads as not yet known, and the configured
# default stands in for it.
JOB = config["job_resources"]


def container_image():
    """The image path against the workflow (not the working directory), or a registry URI."""
    image = config["container_image"]
    return image if "://" in image else str(Path(workflow.basedir) / image)


CONTAINER = container_image()


def receipt_json(path):
    """A receipt as a dict, or None while it does not exist."""
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else None


def device_count(device, processes):
    """GPUs a job takes: one per process on CUDA, none on the CPU."""
    return processes if device == "cuda" else 0


def arm_gpus(wildcards):
    """The arm's torchrun ranks (ref_cache, path_bias, probe, dpo), each on its own GPU."""
    cfg = arm_cfg(wildcards.arm)
    return device_count(cfg.run.device, cfg.batch.world_size)


def sft_gpus(wildcards):
    cfg = sft_cfg()
    return device_count(cfg.run.device, cfg.batch.world_size)


def sft_single_gpu(wildcards):
    """sft_gate runs one process on the SFT pre-registration's device."""
    return device_count(sft_cfg().run.device, 1)


def selection_gpus(wildcards):
    """select_arms scores every policy in one process on the selection's device."""
    cfg = load_config(SELECTION_TOML, SelectionConfig).cfg
    return device_count(cfg.run.device, 1)


def no_gpu(wildcards):
    return 0


def placement(gpus):
    """Where a job runs and how it is laid out, from its GPU count `gpus(wildcards)`.

    One task on one node holds every GPU of the job (sbatch --gpus=N); torchrun starts
    the ranks inside that task and rank i takes cuda:LOCAL_RANK, so each rank has its
    own device and every training stage asserts that before it loads a model
    (align.utils.dist.assert_distinct_devices). Per-task GPU binding needs one task per
    rank, which torchrun replaces; and a task count on a GPU job turns into
    --ntasks-per-gpu, so GPU jobs name no tasks and CPU jobs exactly one.
    """
    return {
        "gpu": gpus,
        "nodes": lambda wildcards: 1,
        "tasks": lambda wildcards: None if gpus(wildcards) else 1,
        "cpus_per_task": lambda wildcards, threads: threads,
        "slurm_partition": lambda wildcards: slurm_partition(gpus(wildcards)),
        "slurm_account": lambda wildcards: config["slurm_account"] or None,
    }


def slurm_partition(gpus):
    """GPU jobs go to the GPU partition when one is named; empty leaves the cluster's default."""
    if gpus and config["slurm_gpu_partition"]:
        return config["slurm_gpu_partition"]
    return config["slurm_partition"] or None


def default_mem_mb(wildcards, attempt):
    """Jobs that no receipt sizes."""
    return JOB["mem_mb"] * attempt


def default_runtime(wildcards, attempt):
    """Minutes, for jobs that nothing times in advance."""
    return JOB["runtime_min"] * attempt


def sft_runtime(wildcards, attempt):
    return JOB["sft_runtime_min"] * attempt


def rss_mem_mb(rss_mb, attempt):
    """A job's memory request from an RSS figure: the margin, the in-job overhead, the attempt."""
    return math.ceil(rss_mb * JOB["mem_margin"] + JOB["mem_overhead_mb"]) * attempt


def probe_mem_mb(wildcards, input, attempt):
    """The preflight's projected job RSS, for the optimizer the stage really runs."""
    preflight = receipt_json(input.preflight)
    if preflight is None:
        return default_mem_mb(wildcards, attempt)
    return rss_mem_mb(preflight["figures"]["total_mb"], attempt)


def dpo_mem_mb(wildcards, input, attempt):
    """The preflight's projection as the probe ran it, or the probe's measured peak if higher."""
    probe = receipt_json(input.probe)
    if probe is None:
        return default_mem_mb(wildcards, attempt)
    rss = max(probe["projection"]["total_mb"], probe["figures"]["peak_rss_mb"])
    return rss_mem_mb(rss, attempt)


def checkpoint_s(probe):
    """One checkpoint save: the probe's timing when its receipt has one, else the allowance."""
    measured = probe["figures"].get("checkpoint_s") if probe else None
    return measured if measured is not None else JOB["checkpoint_s"]


def stop_reserve_s(probe):
    """Seconds of a job outside the trainer's own clock, plus the save at a stop.

    The trainer's clock starts after the gates and the model load, and a stop saves a
    checkpoint after the step in flight; the evaluation and export after the last step
    fall outside it too.
    """
    return JOB["startup_s"] + checkpoint_s(probe)


def dpo_runtime(wildcards, input, attempt):
    """Minutes: the probe's projected wall-clock with its margin, the reserve, the attempt."""
    probe = receipt_json(input.probe)
    if probe is None:
        return default_runtime(wildcards, attempt)
    projected = probe["figures"]["projected_wall_s"] * JOB["runtime_margin"]
    return math.ceil((projected + stop_reserve_s(probe)) / 60) * attempt


def trainer_resume(wildcards, attempt):
    """A retry follows a stop (exit 75) or a failure: resume from the newest valid checkpoint.

    Params are fixed at a job's first attempt and never see `attempt`; resources are
    re-evaluated for each one, so the per-attempt stage flags are resources.
    """
    return "true" if attempt > 1 else "false"


def time_limited():
    """Whether a scheduler enforces the job's runtime.

    True on the submitting side of a cluster executor and inside the job it runs.
    Nothing stops a local job, so its trainer is not stopped either.
    """
    return workflow.non_local_exec or workflow.remote_exec


def wall_seconds(runtime_min, reserve_s, attempt):
    """The trainer's budget (0: none): the job's time limit less the reserve.

    So the stage stops at a step boundary and saves before Slurm's SIGTERM and SIGKILL.
    `first_attempt_wall_s` caps the first attempt, which makes the resumed retry testable.
    """
    cap = config["first_attempt_wall_s"] if attempt == 1 else 0
    if not time_limited():
        return cap
    wall = math.floor(runtime_min * 60 - reserve_s)
    if wall <= 0:
        raise ValueError(
            f"time limit {runtime_min} min leaves no training time after the "
            f"{reserve_s:.0f} s reserve (job_resources.startup_s + checkpoint_s)"
        )
    return min(wall, cap) if cap else wall


def dpo_wall_s(wildcards, input, attempt):
    probe = receipt_json(input.probe)
    runtime = dpo_runtime(wildcards, input, attempt)
    return wall_seconds(runtime, stop_reserve_s(probe), attempt)


def sft_wall_s(wildcards, attempt):
    return wall_seconds(sft_runtime(wildcards, attempt), stop_reserve_s(None), attempt)


# --- selection and report ---


def arm_report_figures(name, caption, label):
    """One figure per arm, filed under the arm in the report."""
    return [arm_report_figure(arm, name, caption, label) for arm in ARMS]


def arm_report_figure(arm, name, caption, label):
    return report(
        REPORT.arm_figure(arm, name),
        caption=f"../report/{caption}",
        category="Arms",
        subcategory=arm,
        labels={"arm": arm, "figure": label},
    )
