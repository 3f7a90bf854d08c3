# Input and resource functions shared by the rules. Paths come from align.paths,
# the same module the stage scripts use; configs are read with align.config
# (stdlib only, so this costs milliseconds).
import os
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.settings.types import DeploymentMethod

from align.config import ArmConfig, SelectionConfig, SftConfig
from align.constants import GATED_ATTENTION
from align.exit_codes import TRIPWIRE, ConfigError
from align.topology import Topology, topology
from align.train.memory import MemoryVerdict, selection_seq_len
from align.train.probes import ProbeReceipt
from align.model.checkpoint_files import checkpoint_files, planned_checkpoint_files
from align.paths import SPLITS, ReportPaths, RunPaths, SelectionPaths
from align.receipts import read_json
from align.report.summary import selection_labels
from align.train.path_bias import PathBias
from align.train.ref_cache import ref_forward_impl
from align.workflow.commands import (
    image_entry,
    launch_command,
    ref_path_overrides,
    srun_prefix,
)
from align.workflow.inputs import selection_shards
from align.workflow.placement import (
    Placement,
    SlurmSite,
    kernel_gate_device,
    rank_threads,
)
from align.workflow.configs import cached_config
from align.workflow.resources import (
    JobResources,
    capped,
    first_attempt_cap,
    projected_request_mb,
    require_retries,
    wall_seconds,
)
from align.workflow.slurm import default_partition, node_memory

PATHS = RunPaths.of(config["results_dir"])
# Every arm's paths with the {arm} wildcard in place of its name: the rules' outputs.
ANY_ARM = PATHS.arm("{arm}")
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
        f"--run.gpus_per_node={config['gpus_per_node']}",
        f"--run.cpu_isa={config['cpu_isa']}",
    ]
)


def arm_toml(arm):
    return str(Path(workflow.basedir) / config["arm_config_dir"] / f"{arm}.toml")


def arm_cfg(arm):
    return cached_config(arm_toml(arm), ArmConfig)


def sft_cfg():
    return cached_config(SFT_TOML, SftConfig)


def selection_cfg():
    return cached_config(SELECTION_TOML, SelectionConfig)


# The pre-registration a job of each rule runs under, as a function of its wildcards.
def arm_cfg_of(wildcards):
    return arm_cfg(wildcards.arm)


def sft_cfg_of(wildcards):
    return sft_cfg()


def selection_cfg_of(wildcards):
    return selection_cfg()


def sft_checkpoint():
    """The SFT policy: the given checkpoint, or the one rule sft trains."""
    return config["sft_checkpoint"] or str(PATHS.sft_checkpoint)


def base_model_files(wildcards):
    """The base model's files: those rule tiny_default writes for the embedded default,
    else those the directory has (single-file or sharded), refusing one that is not a
    checkpoint. A function, so only a run that trains SFT asks for the base model."""
    if BASE_MODEL == TINY_BASE:
        return [TINY_BASE / name for name in TINY_BASE_FILES]
    return checkpoint_inputs(BASE_MODEL)


def sft_checkpoint_files(wildcards):
    """The SFT policy: the given checkpoint's files, or the directory rule sft trains."""
    if config["sft_checkpoint"]:
        return checkpoint_inputs(config["sft_checkpoint"])
    return PATHS.sft_checkpoint


# Checkpoints already warned about in this dry run (input functions run more than once).
WARNED_ABSENT_SHARDS = set()


def checkpoint_inputs(directory):
    """The files a checkpoint directory has. A dry run also plans with a hub checkpoint
    whose shards are not downloaded yet (config, tokenizer and shard index suffice) and
    warns naming them; any other run refuses it, as it refuses what is not a checkpoint.
    """
    if not workflow.dryrun:
        return checkpoint_files(directory)
    files, absent = planned_checkpoint_files(directory)
    if absent and directory not in WARNED_ABSENT_SHARDS:
        WARNED_ABSENT_SHARDS.add(directory)
        logger.warning(
            f"dry run: checkpoint {directory} lacks {', '.join(absent)}; "
            "a run refuses it until they are downloaded"
        )
    return files


def arm_shards(arm):
    """The arm's pair shards by split."""
    return {split: PATHS.arm(arm).shard(split) for split in SPLITS}


def selection_shards_of(wildcards):
    return selection_shards(selection_cfg_of(wildcards).paired.eval_set, PATHS, ARMS)


def preregistered_ref_caches(wildcards):
    """The cache built by the pre-registered reference path; path_bias measures against it."""
    impl = ref_forward_impl(arm_cfg(wildcards.arm).ref)
    return [PATHS.arm(wildcards.arm).ref_cache(impl, split) for split in SPLITS]


def caches_in_use(wildcards):
    """The cache the path-bias report demands (the DAG is re-evaluated once it exists)."""
    bias_receipt = checkpoints.path_bias.get(arm=wildcards.arm).output[0]
    impl = PathBias.of(read_json(bias_receipt)).required_forward_impl
    return [PATHS.arm(wildcards.arm).ref_cache(impl, split) for split in SPLITS]


def ref_overrides(wildcards):
    """The ref-path overrides that build the cache named by the forward_impl wildcard."""
    return ref_path_overrides(wildcards.forward_impl)


def kernel_receipts(wildcards):
    """The equivalence receipts of the gated backends an arm's stages run."""
    return [PATHS.kernel_receipt(b) for b in arm_cfg(wildcards.arm).gated_backends()]


# The kernel_gate rule's output wildcard: one of the gated backends.
KERNEL_GATE_WILDCARD = "{backend," + "|".join(GATED_ATTENTION) + "}"


def kernel_gate_source(wildcards):
    return Path(workflow.basedir) / GATED_ATTENTION[wildcards.backend][1]


def kernel_gate_layout(wildcards):
    """One process on the device of the arms that run the backend."""
    arms = [arm_cfg(arm) for arm in ARMS]
    return Topology(nodes=1, per_node=1), kernel_gate_device(wildcards.backend, arms)


def arm_stop_marker(wildcards):
    return PATHS.arm(wildcards.arm).stop_marker


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
JOB = JobResources.of(config["job_resources"])


def container_image():
    """The image path against the workflow (not the working directory), or a registry URI."""
    image = config["container_image"]
    return image if "://" in image else str(Path(workflow.basedir) / image)


CONTAINER = container_image()


def container_for(layout):
    """The image Snakemake runs a job's command in: a one-node job's whole command. A
    multi-node job's command is `srun` on the host, since Slurm's client is not in the image
    and must match the cluster's; each node's launcher enters the image itself
    (`image_entry`), as Apptainer's hybrid model for MPI jobs does."""
    at = placement_of(layout)
    return lambda wildcards: None if at(wildcards).multi_node else CONTAINER


def job_image_entry():
    """The image entry of each node's launcher in a multi-node job (`container_for`):
    nothing where jobs run outside the image."""
    settings = workflow.deployment_settings
    if DeploymentMethod.APPTAINER not in settings.deployment_method:
        return []
    return image_entry(os.getcwd(), settings.apptainer_args, CONTAINER)


def arm_layout(wildcards):
    """The arm's ranks on nodes (ref_cache, path_bias, probe, dpo) and their device."""
    cfg = arm_cfg(wildcards.arm)
    return batch_topology(cfg.batch), cfg.run.device


def sft_layout(wildcards):
    cfg = sft_cfg()
    return batch_topology(cfg.batch), cfg.run.device


def sft_gate_layout(wildcards):
    """sft_gate scores in one process on the SFT pre-registration's device."""
    return Topology(nodes=1, per_node=1), sft_cfg().run.device


def selection_layout(wildcards):
    """select_arms scores every policy in one process on the selection's device."""
    return Topology(nodes=1, per_node=1), selection_cfg().run.device


def cpu_layout(wildcards):
    return Topology(nodes=1, per_node=1), "cpu"


def batch_topology(batch):
    """Nodes x ranks per node from the pre-registered world size and the site's gpus_per_node."""
    try:
        return topology(batch.world_size, config["gpus_per_node"])
    except ConfigError as err:
        raise WorkflowError(str(err)) from err


SITE = SlurmSite(
    partition=config["slurm_partition"],
    gpu_partition=config["slurm_gpu_partition"],
    account=config["slurm_account"],
    gpu_model=config["slurm_gpu_model"],
)


def placement_of(layout):
    """The job's Placement (align.workflow.placement), from `layout(wildcards)`."""
    return lambda wildcards: Placement(*layout(wildcards), SITE.gpu_model)


def placement(layout):
    """The Slurm resources of a job laid out as `layout(wildcards)` = (topology, device):
    Placement.slurm_resources, one input function per resource."""
    at = placement_of(layout)

    def resource(key):
        return lambda wildcards: at(wildcards).slurm_resources(SITE)[key]

    # The names it sets are the same for every job; any placement lists them.
    keys = Placement(Topology(1, 1), "cpu").slurm_resources(SITE)
    return {
        **{key: resource(key) for key in keys},
        "cpus_per_task": lambda wildcards, threads: threads,
    }


def launcher(layout, stop_marker=None, accept_exit=()):
    """The stage's launch command (align.workflow.commands). `exec` in the rule's shell
    makes the launcher the process Slurm's signals reach, so SIGTERM ends in a checkpoint.
    """

    def command(wildcards, resources):
        at = placement_of(layout)(wildcards)
        topo, per_node = at.topo, []
        try:
            at.require_scheduler(time_limited())
        except ConfigError as err:
            raise WorkflowError(str(err)) from err
        if at.multi_node:
            per_node = (
                srun_prefix(topo, config["threads"], at.gres()) + job_image_entry()
            )
        return launch_command(
            topo,
            resources.stop_window_s,
            per_node=per_node,
            stop_marker=stop_marker(wildcards) if stop_marker else None,
            accept_exit=accept_exit,
        )

    return command


def layout_rank_threads(layout):
    """Each rank's threads: the task's threads shared by the ranks of its node."""
    return lambda wildcards: rank_threads(
        config["threads"], layout(wildcards)[0].per_node
    )


def node_memory_overrides(wildcards):
    """The preflight runs on the submit host but judges the node the job will run on: its
    memory from the workflow config (slurm_node_memory_mb, by partition), else from
    Slurm's record of the partition's smallest node. A local run's jobs run here, and the
    preflight measures this host itself."""
    if not workflow.non_local_exec:
        return ""
    try:
        partition = (
            SITE.partition_for(arm_layout(wildcards)[1] == "cuda")
            or default_partition()
        )
        mb, source = node_memory(partition, config["slurm_node_memory_mb"])
    except ConfigError as err:  # scontrol failed: the workflow refuses, naming the key
        raise WorkflowError(str(err)) from err
    return f"--run.node_memory_mb={mb} --run.node_memory_source={shlex.quote(source)}"


def default_mem_mb(wildcards, attempt):
    """Jobs that no receipt sizes."""
    return JOB.default_mem_mb(attempt)


def default_runtime(wildcards, attempt):
    """Minutes, for jobs that nothing times in advance."""
    return JOB.default_runtime(attempt)


def sft_runtime(wildcards, attempt):
    return first_attempt_limit("sft", JOB.sft_runtime_min * attempt, attempt)


def first_attempt_limit(stage, runtime_min, attempt):
    """`first_attempt_runtime_min` caps the first attempt's time limit, so the job meets
    its limit (and the pre-timeout signal) while it trains, and the retry resumes."""
    caps = config["first_attempt_runtime_min"]
    return capped(runtime_min, first_attempt_cap(caps, stage, attempt))


def projected_mem_mb(
    stage, cfg, layout, checkpoint, shards=lambda wildcards: {}, seq_len=lambda: 0
):
    """A model-loading job's memory request: the projection of align.train.memory for
    the stage (staging, export, shards, runtime; on the CPU the model itself) on its
    fullest node. The checkpoint's own config sizes it once the checkpoint exists, the base
    model's (the same architecture) before; the default stands in when neither does.
    `shards(wildcards)`: the pair shards the job reads, their bytes and longest rows
    counted once they exist;
    `seq_len()`: the row length of a stage whose config names none."""

    def mem_mb(wildcards, attempt):
        nodes = layout(wildcards)[0].nodes
        checkpoints = (checkpoint, BASE_MODEL)
        cfg_now, shards_now = cfg(wildcards), shards(wildcards)
        return projected_request_mb(
            JOB, stage, cfg_now, nodes, checkpoints, shards_now, seq_len(), attempt
        )

    return mem_mb


# What the preflight will project for the probe and dpo jobs (the dpo stage's shape, as
# align.stages.gates projects it), while no preflight receipt exists to read it from.
preflight_mem_mb = projected_mem_mb(
    "dpo", arm_cfg_of, arm_layout, sft_checkpoint(), lambda w: arm_shards(w.arm)
)


def probe_mem_mb(wildcards, input, attempt):
    """The preflight's projected RSS of the fullest node, for the optimizer the stage runs
    (before the preflight has run, the same projection made here)."""
    preflight = MemoryVerdict.read(input.preflight)
    if preflight is None:
        return preflight_mem_mb(wildcards, attempt)
    return JOB.rss_mem_mb(preflight.node_mb, attempt)


def dpo_mem_mb(wildcards, input, attempt):
    """The preflight's projection as the probe ran it, or the probe's measured peak (per
    node) if higher (before the probe has run, the preflight's projection made here)."""
    probe = ProbeReceipt.read(input.probe)
    if probe is None:
        return preflight_mem_mb(wildcards, attempt)
    return JOB.probed_mem_mb(probe, attempt)


def dpo_stop_window_s(wildcards, input):
    return JOB.stop_window_s(ProbeReceipt.read(input.probe))


def unmeasured_stop_window_s(wildcards, input=None):
    return JOB.stop_window_s(None)


def pre_timeout_signal(window):
    """sbatch's request for SIGTERM to the job's steps `window(...)` seconds before its
    limit: to the steps, not the batch shell, which is Snakemake's own process."""

    def slurm_extra(wildcards, input):
        return f"--signal=TERM@{window(wildcards, input)}"

    return slurm_extra


def dpo_runtime(wildcards, input, attempt):
    """Minutes: the probe's projected wall-clock with its margin, the reserve, the attempt."""
    probe = ProbeReceipt.read(input.probe)
    if probe is None:
        return JOB.default_runtime(attempt)
    return first_attempt_limit("dpo", JOB.probe_runtime(probe, attempt), attempt)


def trainer_resume(wildcards, attempt):
    """A retry follows a stop (exit 75) or a failure: resume from the newest valid checkpoint.

    Params are fixed at a job's first attempt and never see `attempt`; resources are
    re-evaluated for each one, so the per-attempt stage flags are resources.
    """
    require_retries_on_a_scheduler()
    return "true" if attempt > 1 else "false"


def require_retries_on_a_scheduler():
    """A training stage submitted to a cluster needs a retry to resume after a stop."""
    submitting = workflow.non_local_exec and not workflow.remote_exec
    # Only a submission has execution settings to read (a report or a lint has none).
    retries = workflow.execution_settings.retries if submitting else 0
    try:
        require_retries(submitting, retries)
    except ConfigError as err:
        raise WorkflowError(str(err)) from err


def time_limited():
    """Whether a scheduler enforces the job's runtime.

    True on the submitting side of a cluster executor and inside the job it runs.
    Nothing stops a local job, so its trainer is not stopped either.
    """
    return workflow.non_local_exec or workflow.remote_exec


def trainer_wall_s(stage, runtime_min, reserve_s, attempt):
    """The trainer's budget inside the job's time limit (align.workflow.resources);
    `first_attempt_wall_s` caps the first attempt, which makes the resumed retry testable.
    """
    cap = first_attempt_cap(config["first_attempt_wall_s"], stage, attempt)
    return wall_seconds(runtime_min, reserve_s, cap, time_limited())


def dpo_wall_s(wildcards, input, attempt):
    probe = ProbeReceipt.read(input.probe)
    runtime = dpo_runtime(wildcards, input, attempt)
    return trainer_wall_s("dpo", runtime, JOB.stop_reserve_s(probe), attempt)


def sft_wall_s(wildcards, attempt):
    return trainer_wall_s(
        "sft", sft_runtime(wildcards, attempt), JOB.stop_reserve_s(None), attempt
    )


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
