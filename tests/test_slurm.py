"""The workflow on a real Slurm cluster (two nodes on this host, .ci/slurm_up.sh): what each
job asked for, and how its stops end.

`snakemake --executor slurm arms` runs one arm of a reduced tiny config whose site has one
GPU (rank) per node, so every stage of two ranks is a two-node job of one task per node.
The submitted jobs are read back from the controller (`scontrol show job`) and their
requested nodes, tasks, memory, time, CPUs, GPUs and partition are checked against what the
receipts demanded. The first SFT attempt is capped at one trainer second, so it stops at a
step boundary and exits 75. The first DPO attempt gets a one-minute time limit, so Slurm's
pre-timeout SIGTERM stops it; its retry is sent SIGTERM with scancel while it trains; the
third attempt must end with the same weights as an uninterrupted one-node run of the arm.
A last run asks for CUDA, which these nodes cannot give: its job must still have requested
every GPU in one task on the GPU partition, and the stage must refuse rather than fall back
to the CPU. Both runs go through the Slurm profile, so every job runs in the image: its
root filesystem built from containers/align.def's recipe, entered through an `apptainer`
shim with the profile's binds.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import apptainer_shim, dry_run_rules, run_snakemake, snakemake_command

from align.exit_codes import RESUMABLE_STOP
from align.paths import SPLITS, RunPaths

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "profiles" / "slurm"
ARM = "argilla"
# `make test` (and so CI) brings the services up first: there a missing one is a failure.
SERVICES_REQUIRED = os.environ.get("ALIGN_SERVICES") == "required"
# Margins of the reduced config; the expected requests below are computed from them.
JOB_RESOURCES = {
    "mem_mb": 1000,
    "runtime_min": 7,
    "sft_runtime_min": 9,
    "mem_margin": 1.25,
    "mem_overhead_mb": 512,
    "runtime_margin": 1.5,
    # No startup reserve: the trainer's own budget then ends after Slurm's pre-timeout
    # signal, so the first DPO attempt is stopped by the signal.
    "startup_s": 0,
    "checkpoint_s": 10,
    "exit_grace_s": 5,
}
# Long enough that the first DPO attempt still trains when its one-minute limit nears, on an
# idle host as under the suite's load: 140 steps at the fastest 0.55 s a step seen here
# outlast the 53 s before the pre-timeout signal.
ARM_EPOCHS = 5
# One training run per DPO attempt, so a stop and its resume are the run's own.
SLURM_ARM_WIRES = """
[tripwires.disarmed]
collapse = "these tests check the jobs and their stops (the wires: test_tripwire_rerun.py)"
length_drift = "these tests check the jobs and their stops (the wires: test_tripwire_rerun.py)"
generation = "these tests check the jobs and their stops (the wires: test_tripwire_rerun.py)"
"""
# One Snakemake run must finish well inside CI's budget; timeout -k makes sure it ends.
RUN_TIMEOUT_S = 1200

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class SlurmRun:
    workdir: Path
    result: subprocess.CompletedProcess
    jobs: list[dict[str, str]]
    seconds: float
    # The second DPO attempt's log when scancel stopped it.
    second_dpo_log: str = ""

    def output(self) -> str:
        return self.result.stdout[-6000:] + self.result.stderr[-6000:]

    def of_rule(self, rule: str) -> list[dict[str, str]]:
        """The rule's jobs in submission order (a retry is a new job)."""
        prefix = f"rule_{rule}"
        return [
            job
            for job in self.jobs
            if job["Comment"] == prefix or job["Comment"].startswith(f"{prefix}_wildcards_")
        ]

    def receipt(self, path: Path) -> dict:
        return json.loads((self.workdir / path).read_text())


@pytest.fixture(scope="module")
def cluster() -> None:
    """A live controller with idle nodes; under `make test` its absence is a failure."""
    if shutil.which("sinfo") is None:
        if not SERVICES_REQUIRED:
            pytest.skip(
                "no Slurm client on this host (sinfo absent); make services starts a cluster"
            )
        pytest.fail("no Slurm here, though make test brought the services up (.ci/services_up.sh)")
    state = subprocess.run(
        ["sinfo", "-h", "-o", "%P %t"], capture_output=True, text=True, timeout=30
    )
    assert state.returncode == 0 and state.stdout.strip(), (
        f"Slurm is installed but not answering (run .ci/slurm_up.sh): {state.stderr.strip()}"
    )
    partitions = dict(line.split() for line in state.stdout.splitlines())
    assert {"cpu*", "gpu"} <= partitions.keys(), (
        f"expected partitions cpu (default) and gpu: {partitions}"
    )


def threads() -> int:
    """Every torch job asks for the configured threads, so the node must have as many CPUs."""
    return min(2, os.cpu_count() or 1)


def reduced_config(work: Path, **overrides) -> Path:
    """The tiny default cut to one arm and one epoch of each training stage.

    The SFT gate's thresholds are relaxed because one epoch does not reach the
    pre-registered quality; this run checks the jobs, not the policy.
    """
    arms = work / "arms"
    arms.mkdir(exist_ok=True)
    arm_toml = (REPO / "config" / "arms" / f"{ARM}.toml").read_text()
    arm_toml = re.sub(r"(?m)^epochs = \d+$", f"epochs = {ARM_EPOCHS}", arm_toml)
    arm_toml += SLURM_ARM_WIRES
    (arms / f"{ARM}.toml").write_text(arm_toml)
    sft_toml = (REPO / "config" / "sft.toml").read_text()
    sft_toml = re.sub(r"(?m)^epochs = \d+$", "epochs = 1", sft_toml)
    sft_toml = re.sub(r"(?m)^max_held_nll = .*$", "max_held_nll = 100.0", sft_toml)
    sft_toml = re.sub(
        r"(?m)^min_terminated_fraction = .*$", "min_terminated_fraction = 0.0", sft_toml
    )
    device = overrides.pop("sft_device", None)
    if device is not None:
        sft_toml += f'\n[run]\ndevice = "{device}"\n'
        # The nodes' GPUs are dummies that load no CUDA; a real CUDA rank's host runtime
        # would not fit the two test nodes that share this host.
        sft_toml += "\n[preflight]\ncuda_rank_overhead_mb = 512.0\n"
    (work / "sft.toml").write_text(sft_toml)
    config = {
        "arms": [ARM],
        "arm_config_dir": str(arms),
        "sft_config": str(work / "sft.toml"),
        "threads": threads(),
        "slurm_partition": "cpu",
        "slurm_gpu_partition": "gpu",
        "job_resources": JOB_RESOURCES,
        **overrides,
    }
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def slurm_args(config: Path, *args: str) -> tuple[str, ...]:
    return (
        "--configfile",
        str(config),
        "--executor",
        "slurm",
        "--jobs",
        "2",
        "--latency-wait",
        "10",
        # No accounting database on the test cluster: poll the controller, name no account.
        "--slurm-status-command",
        "squeue",
        "--slurm-init-seconds-before-status-checks",
        "1",
        "--slurm-no-account",
        *args,
    )


def snakemake_on_slurm(work: Path, config: Path, *args: str) -> subprocess.CompletedProcess:
    return run_snakemake(work, *slurm_args(config, *args), timeout=RUN_TIMEOUT_S)


def in_the_image(work: Path, rootfs: Path, config: Path, *args: str) -> tuple[list[str], dict]:
    """The command and environment of a Slurm run under the profile, its jobs in `rootfs`:
    the profile's apptainer deployment and binds (its `$PWD` the work dir), the shim as
    `apptainer`, the root filesystem as the container image. The workflow lives outside
    the work dir here, so it is one more bind, as a site binds its model store."""
    shim = apptainer_shim(work / "bin")
    binds = yaml.safe_load((PROFILE / "config.yaml").read_text())["apptainer-args"]
    image = ("--config", f"container_image={rootfs}")
    return snakemake_command(
        work,
        *("--workflow-profile", str(PROFILE)),
        f"--apptainer-args={binds} --bind {REPO}:{REPO}:ro",
        *slurm_args(config, *args, *image),
        timeout=RUN_TIMEOUT_S,
        env={"PWD": str(work)},
        path_first=(shim,),
    )


def jobs_of(work: Path) -> list[dict[str, str]]:
    """Every job the controller still holds that was submitted from `work`, oldest first."""
    shown = subprocess.run(
        ["scontrol", "--oneliner", "show", "job"], capture_output=True, text=True, timeout=30
    )
    assert shown.returncode == 0, shown.stderr
    jobs = [
        dict(re.findall(r"(\S+?)=(\S*)", line))
        for line in shown.stdout.splitlines()
        if line.strip()
    ]
    mine = [job for job in jobs if Path(job.get("WorkDir", "/")) == work]
    return sorted(mine, key=lambda job: int(job["JobId"]))


def dpo_log(work: Path) -> Path:
    return work / RunPaths.of("results").log("dpo", ARM)


def wait_until_resumed_training(work: Path, proc: subprocess.Popen, timeout_s: float) -> dict:
    """The second dpo job of `work` once it has resumed and logged two optimizer steps."""
    metrics = work / RunPaths.of("results").arm(ARM).metrics
    deadline, logged = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline and proc.poll() is None:
        attempts = [j for j in jobs_of(work) if j["Comment"].startswith("rule_dpo")]
        running = len(attempts) == 2 and attempts[1]["JobState"] == "RUNNING"
        if running and "resumed from" in read_text(dpo_log(work)):
            lines = len(read_text(metrics).splitlines())
            logged = lines if logged is None else logged
            if lines >= logged + 2:
                return attempts[1]
        time.sleep(0.5)
    states = [j["JobState"] for j in jobs_of(work) if j["Comment"].startswith("rule_dpo")]
    raise AssertionError(
        f"the second dpo job of {work} never trained (snakemake exit {proc.poll()}, dpo jobs "
        f"{states}); a first attempt that completed inside its one-minute limit needs more "
        "ARM_EPOCHS on this host"
    )


def read_text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


@pytest.fixture(scope="module")
def cuda_attempts(cluster, image_rootfs, tmp_path_factory):
    """An SFT stage that asks for CUDA, submitted with one retry to the GPU partition, whose
    dummy GPUs fail it. It starts before the chain of `slurm_run`, so that the scheduler
    waits of the two runs overlap; the work dir and the finished process come back."""
    work = tmp_path_factory.mktemp("cuda").resolve()
    config = reduced_config(work, sft_device="cuda")
    target = str(RunPaths.of("results").sft_receipt)
    command, env = in_the_image(work, image_rootfs, config, "--retries", "1", target)
    with (work / "snakemake.out").open("w") as log:
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield work, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def slurm_run(cluster, cuda_attempts, image_rootfs, tmp_path_factory) -> SlurmRun:
    """`arms` on Slurm with one rank per node; the second DPO attempt gets scancel's SIGTERM
    after two optimizer steps. The CUDA attempts are under way beside it."""
    work = tmp_path_factory.mktemp("slurm").resolve()
    config = reduced_config(
        work,
        gpus_per_node=1,
        first_attempt_wall_s={"sft": 1},
        first_attempt_runtime_min={"dpo": 1},
    )
    command, env = in_the_image(work, image_rootfs, config, "--retries", "2", "arms")
    started = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        job = wait_until_resumed_training(work, proc, RUN_TIMEOUT_S)
        resumed = read_text(dpo_log(work))
        subprocess.run(["scancel", "--signal=TERM", job["JobId"]], check=True, timeout=30)
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S + 60)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=60)
    result = subprocess.CompletedProcess(command, proc.returncode, out, "")
    run = SlurmRun(work, result, jobs_of(work), time.monotonic() - started, resumed)
    print(f"slurm run: {run.seconds:.0f} s, {len(run.jobs)} jobs", file=sys.stderr)
    assert result.returncode == 0, run.output()
    return run


def memory_mb(value: str) -> int:
    """A Slurm memory figure (`2411M`, `8G`) in MiB."""
    number, unit = re.fullmatch(r"([\d.]+)([KMGT]?)", value).groups()
    return round(float(number) * {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024**2}[unit])


def minutes(value: str) -> int:
    """A Slurm time limit (`[days-]hh:mm:ss`) in whole minutes."""
    days, _, clock = value.rpartition("-")
    h, m, s = (int(part) for part in clock.split(":"))
    return (int(days or 0) * 24 + h) * 60 + m + math.ceil(s / 60)


def gpus(job: dict[str, str]) -> int:
    found = re.search(r"gres[:/]gpu[:=](\d+)", job.get("TresPerJob", "") + job.get("ReqTRES", ""))
    return int(found.group(1)) if found else 0


def rss_request(rss_mb: float, attempt: int) -> int:
    r = JOB_RESOURCES
    return math.ceil(rss_mb * r["mem_margin"] + r["mem_overhead_mb"]) * attempt


CHAIN = (
    "tiny_default",
    "sft",
    "sft_gate",
    "build_manifest",
    "ref_cache",
    "path_bias",
    "preflight",
    "probe",
)


def test_the_gates_target_is_the_chain_through_the_probe_and_trains_nothing(tmp_path):
    assert dry_run_rules(tmp_path, "gates") == [*CHAIN, "gates"]


def test_a_dry_run_of_the_arms_lists_every_gate_in_chain_order(tmp_path):
    assert dry_run_rules(tmp_path, "arms") == [*CHAIN, "dpo", "select_arms", "arms"]


def test_a_training_stage_submitted_without_retries_is_refused_before_any_job(tmp_path):
    """A stop at the time limit exits 75 and only a retry resumes it."""
    run = run_snakemake(
        tmp_path,
        *("--executor", "slurm", "--jobs", "1", "--slurm-no-account", "--retries", "0"),
        str(RunPaths.of("results").sft_receipt),
        timeout=120,
    )
    assert run.returncode != 0
    assert "training stages on a cluster need retries" in run.stderr, run.stderr[-3000:]
    assert not (tmp_path / ".snakemake" / "slurm_logs").exists()


CLUSTER_RULES = (
    "tiny_default",
    "sft",
    "sft_gate",
    "ref_cache",
    "path_bias",
    "probe",
    "dpo",
    "select_arms",
)
TORCH_RULES = CLUSTER_RULES[1:]
# The stages of two ranks, each a job of one task on each of the two nodes.
TWO_NODE_RULES = ("sft", "ref_cache", "path_bias", "probe", "dpo")


def rule_of(job: dict[str, str]) -> str:
    return job["Comment"].split("_wildcards_")[0].removeprefix("rule_")


def test_cluster_rules_are_slurm_jobs_and_bookkeeping_stays_local(slurm_run):
    assert {rule_of(job) for job in slurm_run.jobs} == set(CLUSTER_RULES), slurm_run.jobs
    for job in slurm_run.jobs:
        assert job["JobState"] in ("COMPLETED", "FAILED"), job


def test_cpu_jobs_take_the_cpu_partition_no_gpu_and_one_task_per_node(slurm_run):
    for job in slurm_run.jobs:
        rule = rule_of(job)
        nodes = "2" if rule in TWO_NODE_RULES else "1"
        assert job["Partition"] == "cpu", job
        assert gpus(job) == 0, job
        assert job["NumNodes"] == nodes and job["NumTasks"] == nodes, job
        assert int(job["CPUs/Task"]) == (threads() if rule in TORCH_RULES else 1), job


def test_untimed_jobs_take_the_configured_time(slurm_run):
    for rule in ("tiny_default", "sft_gate", "ref_cache", "path_bias", "probe", "select_arms"):
        (job,) = slurm_run.of_rule(rule)
        assert minutes(job["TimeLimit"]) == JOB_RESOURCES["runtime_min"], job
    (job,) = slurm_run.of_rule("tiny_default")
    assert memory_mb(job["MinMemoryNode"]) == JOB_RESOURCES["mem_mb"], job
    first_sft, second_sft = slurm_run.of_rule("sft")
    assert minutes(first_sft["TimeLimit"]) == JOB_RESOURCES["sft_runtime_min"], first_sft
    assert minutes(second_sft["TimeLimit"]) == 2 * JOB_RESOURCES["sft_runtime_min"], second_sft


def projected_request(
    stage: str, cfg, checkpoint: Path, nodes: int, seq_len: int = 0, shards: dict | None = None
) -> int:
    """The memory a model-loading job must ask for: its stage's projection on its fullest
    node, with the bytes, longest rows and scoring forwards of the pair shards it reads,
    plus margins."""
    from align.train.memory import projected_job_rss, shards_shape

    shards = shards or {}
    shape = shards_shape(stage, cfg, nodes, seq_len, shards)
    shard_bytes = sum(path.stat().st_size for path in shards.values())
    projection = projected_job_rss(shape, checkpoint, shard_bytes)
    return rss_request(projection["node_mb"], attempt=1)


def test_model_loading_jobs_ask_for_their_stage_projection(slurm_run):
    from align.config import ArmConfig, SelectionConfig, SftConfig, load_config
    from align.train.memory import job_shape, projected_job_rss

    work = slurm_run.workdir
    arm = load_config(work / "arms" / f"{ARM}.toml", ArmConfig).cfg
    sft = load_config(work / "sft.toml", SftConfig).cfg
    selection = load_config(REPO / "config" / "selection.toml", SelectionConfig).cfg
    base, checkpoint = work / "resources/tiny/base", work / "results/sft/checkpoint"
    shards = RunPaths.of(work / "results").arm(ARM)
    pairs = {split: shards.shard(split) for split in SPLITS}
    expected = {
        "sft": projected_request("sft", sft, base, nodes=2),
        "sft_gate": projected_request("sft_gate", sft, checkpoint, nodes=1),
        "ref_cache": projected_request("ref_cache", arm, checkpoint, nodes=2, shards=pairs),
        "path_bias": projected_request("path_bias", arm, checkpoint, nodes=2, shards=pairs),
        "select_arms": projected_request(
            "select_arms",
            selection,
            checkpoint,
            nodes=1,
            seq_len=arm.data.seq_len,
            shards={ARM: shards.shard("held")},
        ),
    }
    for rule, request in expected.items():
        job = slurm_run.of_rule(rule)[0]
        assert memory_mb(job["MinMemoryNode"]) == request, (rule, job)
    # Rank 0's staging of the base model and the exported policy are in the SFT request.
    sft_terms = projected_job_rss(job_shape("sft", sft, 2), base, 0)["terms_mb"]
    assert {"load_staging_rank0", "export_gather_rank0"} <= sft_terms.keys()


def test_the_preflight_judged_the_compute_node_not_the_submit_host(slurm_run):
    figures = slurm_run.receipt(RunPaths.of("results").arm(ARM).preflight)["figures"]
    assert figures["node_memory_source"] == "scontrol: smallest RealMemory of partition cpu"
    shown = subprocess.run(
        ["scontrol", "--oneliner", "show", "node"], capture_output=True, text=True, check=True
    )
    real = {int(m) for m in re.findall(r"RealMemory=(\d+)", shown.stdout)}
    assert figures["available_mb"] == min(real), (figures, real)


def test_probe_memory_is_the_preflight_projection_plus_margin(slurm_run):
    preflight = slurm_run.receipt(RunPaths.of("results").arm(ARM).preflight)
    (probe,) = slurm_run.of_rule("probe")
    expected = rss_request(preflight["figures"]["node_mb"], attempt=1)
    assert memory_mb(probe["MinMemoryNode"]) == expected, (probe, preflight["figures"])


def test_dpo_memory_and_time_follow_the_receipts_and_scale_with_the_attempt(slurm_run):
    paths = RunPaths.of("results").arm(ARM)
    probe = slurm_run.receipt(paths.probe)
    assert probe["projection"]["nodes"] == 2, probe["projection"]
    # The fullest node: the projection, or the probe's measured peak shared by two nodes.
    rss = max(probe["projection"]["node_mb"], probe["figures"]["peak_rss_mb"] / 2)
    reserve = JOB_RESOURCES["startup_s"] + probe["figures"]["checkpoint_s"]
    projected = probe["figures"]["projected_job_wall_s"] * JOB_RESOURCES["runtime_margin"]
    runtime = math.ceil((projected + reserve) / 60)
    attempts = slurm_run.of_rule("dpo")
    assert len(attempts) == 3, attempts
    for attempt, job in enumerate(attempts, start=1):
        assert memory_mb(job["MinMemoryNode"]) == rss_request(rss, attempt), (job, rss)
        limit = min(runtime, 1) if attempt == 1 else runtime * attempt
        assert minutes(job["TimeLimit"]) == limit, (job, probe["figures"])


def test_a_stopped_sft_attempt_is_retried_and_resumes(slurm_run):
    first, second = slurm_run.of_rule("sft")
    assert first["JobState"] == "FAILED" and second["JobState"] == "COMPLETED", (first, second)
    log = (slurm_run.workdir / RunPaths.of("results").log("sft", "all")).read_text()
    assert "--trainer.resume=true" in log and "resumed from" in log, log[-3000:]


def stage_exit(run: SlurmRun, job: dict[str, str]) -> int:
    """The exit status of the stage command in `job`, from the job's own log."""
    log = Path(job["StdOut"]).read_text()
    found = re.search(r"returned non-zero exit status (\d+)", log)
    assert found, log[-3000:]
    return int(found[1])


def test_the_dpo_job_at_its_time_limit_saved_and_exited_75(slurm_run):
    """The first attempt's one-minute limit: Slurm's pre-timeout SIGTERM reached the
    launchers, every rank stopped at a step boundary with a checkpoint and exited 75, and
    the second attempt resumed from that checkpoint."""
    first = slurm_run.of_rule("dpo")[0]
    assert first["JobState"] == "FAILED" and minutes(first["TimeLimit"]) == 1, first
    assert stage_exit(slurm_run, first) == RESUMABLE_STOP, first
    log = slurm_run.second_dpo_log
    assert "--trainer.resume=true" in log and "resumed from" in log, log[-3000:]


def test_scancel_sigterm_to_a_two_node_job_saves_exits_75_and_the_retry_resumes(slurm_run):
    _, second, third = slurm_run.of_rule("dpo")
    assert second["JobState"] == "FAILED", second
    assert stage_exit(slurm_run, second) == RESUMABLE_STOP, second
    assert third["JobState"] == "COMPLETED", third
    result = slurm_run.receipt(RunPaths.of("results").arm(ARM).arm_result)
    training = result["figures"]["training"]
    assert training["resumed_after"]["reason"] == "signal SIGTERM", training
    assert training["resumed_from"] == training["resumed_after"]["checkpoint"], training
    assert training["steps"] == training["horizon_steps"], training
    assert result["overrides"]["trainer.resume"] is True, result["overrides"]
    # The second attempt went on from the first stop, so the last resume is a later step.
    first_stop = int(re.search(r"resumed from \S+ at step (\d+)", slurm_run.second_dpo_log)[1])
    assert training["resumed_after"]["step"] > first_stop, (training, first_stop)


def test_the_trainer_budget_is_the_time_limit_less_the_reserve(slurm_run):
    result = slurm_run.receipt(RunPaths.of("results").arm(ARM).arm_result)
    last = slurm_run.of_rule("dpo")[-1]
    probe = slurm_run.receipt(RunPaths.of("results").arm(ARM).probe)
    reserve = JOB_RESOURCES["startup_s"] + probe["figures"]["checkpoint_s"]
    expected = math.floor(minutes(last["TimeLimit"]) * 60 - reserve)
    assert result["overrides"]["trainer.max_wall_seconds"] == expected, result["overrides"]


def test_the_ranks_ran_on_two_nodes_and_the_receipts_say_where(slurm_run):
    paths = RunPaths.of("results").arm(ARM)
    for receipt in (paths.probe, paths.arm_result):
        devices = slurm_run.receipt(receipt)["figures"]["devices"]
        hosts = [device.split(":")[0] for device in devices]
        assert len(devices) == 2 and len(set(hosts)) == 2, devices


def test_two_node_jobs_run_srun_on_the_host_where_the_image_has_none(slurm_run):
    """Slurm's client is not in the image: a two-node job runs srun on the host and each
    node's launcher enters the image, so every stage still ran the image's Python."""
    paths = RunPaths.of("results")
    arm = paths.arm(ARM)
    for receipt in (paths.sft_receipt, arm.path_bias, arm.probe, arm.arm_result):
        command = slurm_run.receipt(receipt)["command"]
        assert command.startswith("/opt/align/venv/bin/python "), (receipt, command)


# --- the same arm on one node, uninterrupted ----------------------------------------------


def copy_of_run(run: SlurmRun, work: Path) -> None:
    """The results and the tiny default of a finished run, in `work`."""
    for tree in ("results", "resources"):
        shutil.copytree(run.workdir / tree, work / tree, symlinks=True)


def date_configs_before_results(work: Path) -> None:
    """Only forced rules rerun when mtime is the one trigger and every config predates
    every output."""
    oldest = min(p.stat().st_mtime for p in (work / "results").rglob("*") if p.is_file())
    for config in [*(work / "arms").iterdir(), work / "sft.toml", work / "config.yaml"]:
        os.utime(config, (oldest - 60, oldest - 60))


@pytest.fixture(scope="module")
def one_node_result(slurm_run, tmp_path_factory) -> dict:
    """The arm's result when preflight, probe and dpo run again on this host, one node of two
    ranks, with no stop (in a copy of the Slurm run)."""
    work = tmp_path_factory.mktemp("one-node").resolve()
    copy_of_run(slurm_run, work)
    config = reduced_config(work)
    date_configs_before_results(work)
    target = str(RunPaths.of("results").arm(ARM).arm_result)
    run = run_snakemake(
        work,
        *("--configfile", str(config), "--cores", "2", "--rerun-triggers", "mtime"),
        *("--forcerun", "preflight", "--", target),
        timeout=RUN_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads((work / target).read_text())


def test_the_two_node_result_equals_the_one_node_result(slurm_run, one_node_result):
    """Two stops (the time limit, scancel) and two nodes against one uninterrupted node: the
    weights are the same bytes."""
    two = slurm_run.receipt(RunPaths.of("results").arm(ARM).arm_result)
    one = one_node_result
    assert one["figures"]["training"]["resumed_from"] is None, one["figures"]["training"]
    assert {d.split(":")[0] for d in one["figures"]["devices"]} == {os.uname().nodename}
    assert one["outputs"] == two["outputs"], (one["outputs"], two["outputs"])
    assert one["figures"]["held_out"] == two["figures"]["held_out"]


def test_a_cuda_job_holds_every_gpu_in_one_task_on_the_gpu_partition(cuda_attempts):
    """The node's GPUs are dummies: the request is what is checked, and the refusal."""
    work, proc = cuda_attempts
    proc.wait(timeout=RUN_TIMEOUT_S + 60)
    assert proc.returncode != 0, "a CUDA stage cannot succeed on this node"
    jobs = jobs_of(work)
    # The tiny default is built first, as a job of its own; then the two SFT attempts.
    assert [rule_of(job) for job in jobs] == ["tiny_default", "sft", "sft"], jobs
    for job in jobs[1:]:
        assert job["Partition"] == "gpu", job
        assert gpus(job) == 2, job
        assert job["NumTasks"] == "1" and job["NumNodes"] == "1", job
        assert "NtasksPerTRES" not in job or job["NtasksPerTRES"] in ("0", ""), job
    log = (work / RunPaths.of("results").log("sft")).read_text()
    assert "CUDA is not available" in log, log[-3000:]
