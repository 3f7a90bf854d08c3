"""align.workflow without Snakemake: job memory and time from receipts, the trainer's budget
inside a time limit, Slurm's answers and resources, the refusals a submission meets, and
the launch command of one and several nodes."""

from __future__ import annotations

import dataclasses
import functools
import stat

import pytest
import yaml
from conftest import REPO

from align.config import ArmConfig, load_config
from align.exit_codes import ConfigError
from align.paths import RunPaths
from align.stages.select import UNION
from align.topology import Topology
from align.train.probes import ProbeReceipt
from align.workflow import slurm
from align.workflow.commands import (
    image_entry,
    launch_command,
    ref_path_overrides,
    srun_prefix,
)
from align.workflow.configs import cached_config
from align.workflow.inputs import selection_shards
from align.workflow.placement import Placement, SlurmSite, kernel_gate_device, rank_threads
from align.workflow.resources import (
    JobResources,
    capped,
    first_attempt_cap,
    projected_request_mb,
    require_retries,
    wall_seconds,
)

JOB = JobResources.of(
    {
        "mem_mb": 1000,
        "runtime_min": 7,
        "sft_runtime_min": 9,
        "mem_margin": 1.25,
        "mem_overhead_mb": 512,
        "runtime_margin": 1.5,
        "startup_s": 60,
        "checkpoint_s": 10,
        "exit_grace_s": 5,
    }
)
PROBE = ProbeReceipt.of(
    {
        "figures": {
            "median_step_s": 2.2,
            "checkpoint_s": 3.5,
            "projected_wall_s": 600.0,
            "projected_job_wall_s": 1200.0,
            "horizon_steps": 40,
            "peak_rss_mb": 3000.0,
        },
        "projection": {"node_mb": 1400.0, "nodes": 2},
    }
)


def test_the_workflow_configs_job_resources_are_the_record_the_module_reads():
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert JobResources.of(config["job_resources"]).mem_margin == 1.25


def test_memory_requests_scale_the_rss_by_the_margin_add_the_overhead_and_the_attempt():
    assert JOB.rss_mem_mb(1000.0, 1) == 1762
    assert JOB.rss_mem_mb(1000.0, 2) == 2 * 1762
    assert JOB.default_mem_mb(3) == 3000


def test_the_dpo_job_asks_for_the_higher_of_the_probes_projection_and_its_measured_peak():
    # Measured 3000 MB over 2 nodes is 1500 per node, above the projected 1400.
    assert JOB.probed_mem_mb(PROBE, 1) == JOB.rss_mem_mb(1500.0, 1)
    lighter = dataclasses.replace(PROBE, peak_rss_mb=2000.0)
    assert JOB.probed_mem_mb(lighter, 2) == JOB.rss_mem_mb(1400.0, 2)


def test_the_stop_window_is_two_steps_one_save_and_the_exit():
    assert JOB.stop_window_s(PROBE) == 8 + 5  # ceil(2 x 2.2 + 3.5) + exit grace
    assert JOB.stop_window_s(None) == 10 + 5  # no step measured; the allowance for a save


def test_a_fractional_exit_grace_still_gives_slurm_whole_seconds():
    grace = JobResources.of({**JOB.__dict__, "exit_grace_s": 2.5})
    assert grace.stop_window_s(None) == 13
    assert isinstance(grace.stop_window_s(None), int)


def test_the_probe_runtime_is_its_worst_case_projection_with_margin_and_reserve_per_attempt():
    # Two runs (a wire armed): (1200 x 1.5 + 60 + 3.5) / 60 = 31.06 -> 32 minutes, doubled
    # on the second attempt.
    assert JOB.probe_runtime(PROBE, 1) == 32
    assert JOB.probe_runtime(PROBE, 2) == 64
    one_run = dataclasses.replace(PROBE, projected_job_wall_s=600.0)
    assert JOB.probe_runtime(one_run, 1) == 17


def test_a_wire_that_fires_at_the_last_step_leaves_the_rerun_its_whole_horizon_in_time():
    """The dpo job's limit covered one run: a late alarm sent the rerun past it."""
    from align.train.probes import Beside, probe_figures, run_projection_s, worst_case_runs

    assert worst_case_runs(["collapse", "length"]) == 2 and worst_case_runs([]) == 1
    beside = Beside(checkpoint_s=5.0, checkpoint_every=10, generation_s=None, generation_every=1)
    figures = probe_figures([2.0, 1.0, 1.0], [1.0] * 3, 3, [100] * 20, 1.0, [], None, beside, 2)
    one_run = 20 * 1.0 + 2 * 5.0
    assert figures["projected_wall_s"] == one_run
    assert figures["projected_job_wall_s"] == 2 * one_run and figures["runs_covered"] == 2
    # The first run to its last step, then the whole rerun, inside the job's projection.
    assert (
        run_projection_s(one_run, 20, 20) + run_projection_s(one_run, 20, 20)
        <= (figures["projected_job_wall_s"])
    )
    assert run_projection_s(one_run, 5, 20) == one_run / 4


def test_the_trainer_budget_is_the_time_limit_less_the_reserve_capped_on_a_first_attempt():
    assert wall_seconds(10, 70.0, cap=0, time_limited=True) == 530
    assert wall_seconds(10, 70.0, cap=100, time_limited=True) == 100
    # Nothing limits a local job: only the first attempt's cap stops its trainer.
    assert wall_seconds(10, 70.0, cap=0, time_limited=False) == 0
    assert wall_seconds(10, 70.0, cap=100, time_limited=False) == 100


def test_a_time_limit_inside_the_reserve_is_refused():
    with pytest.raises(ValueError, match="leaves no training time after the 70 s reserve"):
        wall_seconds(1, 70.0, cap=0, time_limited=True)


def test_first_attempt_caps_apply_to_the_first_attempt_only():
    caps = {"dpo": 1}
    assert first_attempt_cap(caps, "dpo", 1) == 1
    assert first_attempt_cap(caps, "dpo", 2) == 0
    assert first_attempt_cap(caps, "sft", 1) == 0
    assert capped(17, 1) == 1 and capped(17, 0) == 17


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """An `scontrol` for a cluster whose default partition `cpu` has nodes of 64 and 32 GB."""
    script = tmp_path / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  "--oneliner show partition") echo "PartitionName=gpu Default=NO Nodes=g1";'
        ' echo "PartitionName=cpu Default=YES Nodes=c[1-2]" ;;\n'
        '  "--oneliner show partition cpu") echo "PartitionName=cpu Default=YES Nodes=c[1-2]" ;;\n'
        '  "--oneliner show node c[1-2]") echo "NodeName=c1 RealMemory=64000";'
        ' echo "NodeName=c2 RealMemory=32000" ;;\n'
        '  *) echo "unexpected: $*" >&2; exit 1 ;;\n'
        "esac\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")


def test_the_default_partition_and_its_smallest_node_come_from_scontrol(fake_scontrol):
    assert slurm.default_partition() == "cpu"
    assert slurm.partition_node_memory_mb("cpu") == 32000


def test_a_failing_scontrol_is_refused_naming_the_config_key_that_avoids_it(fake_scontrol):
    with pytest.raises(ConfigError, match="set slurm_node_memory_mb in the workflow config"):
        slurm.partition_node_memory_mb("gpu")


def test_the_workflow_configs_node_memory_needs_no_scontrol_and_names_its_source(
    fake_scontrol,
):
    assert slurm.node_memory("gpu", {"gpu": 512000}) == (
        512000,
        "slurm_node_memory_mb[gpu] (workflow config)",
    )
    assert slurm.node_memory("cpu", {"gpu": 512000}) == (
        32000,
        "scontrol: smallest RealMemory of partition cpu",
    )


def test_a_job_asks_the_default_until_a_checkpoint_config_sizes_its_projection(tmp_path):
    from mistral_7b import write_config_only_checkpoint

    from align.config import ArmConfig
    from align.train.memory import job_shape, projected_job_rss

    cfg, absent = ArmConfig(arm="a"), tmp_path / "sft"
    shards = {"train": tmp_path / "train.safetensors", "held": tmp_path / "held.safetensors"}
    request = functools.partial(projected_request_mb, JOB, "dpo", cfg, 1, shards=shards)
    assert request([absent], seq_len=0, attempt=2) == JOB.default_mem_mb(2)
    base = write_config_only_checkpoint(tmp_path / "base")
    node_mb = projected_job_rss(job_shape("dpo", cfg), base, 0)["node_mb"]
    # The base model stands in for the checkpoint not yet trained; absent shards count nothing.
    assert request([absent, base], seq_len=0, attempt=2) == JOB.rss_mem_mb(node_mb, 2)


def test_a_config_is_loaded_again_only_when_its_file_changes(tmp_path):
    from align.config import ArmConfig

    toml = tmp_path / "arm.toml"
    toml.write_text('arm = "a"\n[dpo]\nbeta = 0.1\n')
    first = cached_config(toml, ArmConfig)
    assert cached_config(toml, ArmConfig) is first
    toml.write_text('arm = "a"\n[dpo]\nbeta = 0.25\n')
    assert cached_config(toml, ArmConfig).dpo.beta == 0.25
    with pytest.raises(ConfigError, match=r"absent\.toml"):
        cached_config(tmp_path / "absent.toml", ArmConfig)


def test_one_node_launches_without_srun_or_image_entry():
    command = launch_command(Topology(1, 2), 15, stop_marker="results/sft/run/stopped.json")
    assert command == (
        "python -m align.launch --nproc=2 --nnodes=1 --shutdown-timeout=15"
        " --stop-marker=results/sft/run/stopped.json"
    )


def test_a_multi_node_launch_runs_srun_on_the_host_and_enters_the_image_per_node():
    topo = Topology(2, 4)
    entry = image_entry("/scratch/run dir", "--nv --bind $PWD/results", "/images/align.sif")
    command = launch_command(
        topo, 40, per_node=srun_prefix(topo, 8, "gpu:h100:4") + entry, accept_exit=(5,)
    )
    assert command == (
        "srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=8 --gres=gpu:h100:4"
        " apptainer exec --home '/scratch/run dir' --nv --bind $PWD/results /images/align.sif"
        " python -m align.launch --nproc=4 --nnodes=2 --shutdown-timeout=40 --accept-exit=5"
    )


def test_the_probe_receipt_gives_the_measured_peak_per_node_beside_the_projection():
    assert PROBE.measured_node_mb == 1500.0 and PROBE.projected_node_mb == 1400.0


def test_an_absent_receipt_reads_as_not_yet_measured(tmp_path):
    assert ProbeReceipt.read(tmp_path / "probe.json") is None


@pytest.mark.parametrize(
    ("topo", "device", "gpus", "tasks", "gres"),
    [
        (Topology(1, 2), "cpu", 0, 1, None),
        (Topology(1, 4), "cuda", 4, None, None),
        (Topology(2, 1), "cpu", 0, 2, None),
        (Topology(2, 4), "cuda", 0, 2, "gpu:h100:4"),
    ],
)
def test_one_node_holds_its_gpus_in_one_task_and_several_nodes_one_task_each(
    topo, device, gpus, tasks, gres
):
    at = Placement(topo, device, "h100")
    assert (at.gpus(), at.tasks(), at.gres()) == (gpus, tasks, gres)


def test_a_site_without_a_gpu_model_asks_for_any_gpu():
    assert Placement(Topology(2, 4), "cuda").node_gres() == "gpu:4"


SITE = SlurmSite(partition="cpu", gpu_partition="gpu", account="lab", gpu_model="h100")


def test_a_one_node_gpu_job_asks_for_its_model_on_the_gpu_partition():
    resources = Placement(Topology(1, 4), "cuda", SITE.gpu_model).slurm_resources(SITE)
    assert resources == {
        "gpu": 4,
        "gpu_model": "h100",
        "nodes": 1,
        "tasks": None,
        "mpi": None,
        "tasks_per_gpu": None,
        "gres": None,
        "slurm_partition": "gpu",
        "slurm_account": "lab",
    }


def test_a_multi_node_job_sruns_one_task_per_node_and_names_its_gpus_in_the_gres():
    resources = Placement(Topology(2, 4), "cuda", SITE.gpu_model).slurm_resources(SITE)
    assert (resources["gpu"], resources["gpu_model"], resources["gres"]) == (0, None, "gpu:h100:4")
    assert (resources["nodes"], resources["tasks"], resources["mpi"]) == (2, 2, "srun")
    assert resources["tasks_per_gpu"] == 0


def test_a_site_that_names_no_partition_or_account_leaves_them_to_the_cluster():
    resources = Placement(Topology(1, 2), "cpu").slurm_resources(SlurmSite())
    assert (resources["slurm_partition"], resources["slurm_account"]) == (None, None)
    assert SlurmSite(partition="cpu").partition_for(on_gpus=True) == "cpu"


def test_a_multi_node_stage_outside_a_scheduler_is_refused():
    Placement(Topology(1, 2), "cpu").require_scheduler(scheduled=False)
    Placement(Topology(2, 1), "cpu").require_scheduler(scheduled=True)
    with pytest.raises(ConfigError, match="2 nodes x 1 ranks: a multi-node stage runs under"):
        Placement(Topology(2, 1), "cpu").require_scheduler(scheduled=False)


def test_a_cluster_submission_without_retries_is_refused_and_a_local_run_needs_none():
    require_retries(submitting=False, retries=0)
    require_retries(submitting=True, retries=1)
    with pytest.raises(ConfigError, match="training stages on a cluster need retries"):
        require_retries(submitting=True, retries=0)


def test_selection_reads_each_arms_held_shard_or_the_one_eval_set_it_names(tmp_path):
    paths = RunPaths.of(tmp_path)
    union = selection_shards(UNION, paths, ["a", "b"])
    assert union == {"a": paths.arm("a").shard("held"), "b": paths.arm("b").shard("held")}
    assert selection_shards("data/eval.safetensors", paths, ["a"]) == {
        "eval_set": "data/eval.safetensors"
    }


def test_ref_path_overrides_build_the_cache_the_forward_impl_names():
    overrides = ref_path_overrides("flex-bf16-b8-packed")
    assert overrides == (
        "--ref.attn_implementation=flex --ref.dtype=bfloat16 --ref.batch_size=8 --ref.layout=packed"
    )
    with pytest.raises(ValueError, match="is not of the form"):
        ref_path_overrides("flex-bf16-b8-two_rows")


def test_each_rank_gets_its_share_of_the_task_threads_and_at_least_one():
    assert rank_threads(8, 2) == 4
    assert rank_threads(2, 4) == 1


def arm(*overrides: str) -> ArmConfig:
    return load_config(REPO / "config" / "arms" / "argilla.toml", ArmConfig, list(overrides)).cfg


def test_a_kernel_gate_runs_on_the_device_of_the_arms_that_use_its_backend():
    cpu_triton = arm("--model.attn_implementation=triton_fa2")
    cuda_flex = arm("--ref.attn_implementation=flex", "--run.device=cuda")
    assert cpu_triton.gated_backends() == ["triton_fa2"]
    assert cuda_flex.gated_backends() == ["flex"]
    assert arm().gated_backends() == []
    assert kernel_gate_device("triton_fa2", [cpu_triton, cuda_flex]) == "cpu"
    assert kernel_gate_device("flex", [cpu_triton, cuda_flex]) == "cuda"
