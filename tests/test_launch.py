"""align.launch's arguments: the multi-node rendezvous it derives, and what it refuses."""

from __future__ import annotations

import pytest

from align import launch

LAUNCH_NODE = "10.0.0.7"


def test_the_slurm_rendezvous_is_the_launch_nodes_address_on_a_port_from_the_job_id():
    endpoint = launch.slurm_rendezvous("123456", LAUNCH_NODE)
    assert endpoint == f"10.0.0.7:{launch.RDZV_PORT_BASE + 123456 % launch.RDZV_PORT_SPAN}"


def test_every_node_of_a_slurm_job_joins_the_same_rendezvous_as_a_client(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    monkeypatch.setenv("SLURM_LAUNCH_NODE_IPADDR", LAUNCH_NODE)
    for node in ("0", "1"):
        monkeypatch.setenv("SLURM_NODEID", node)
        ns = launch.parse(["--nproc=4", "--nnodes=2", "stage.py", "--x=1"])
        assert ns.node_rank == int(node)
        args = launch.torchrun_args(ns, launch.rendezvous_endpoint(ns))
        assert "--rdzv_endpoint=10.0.0.7:32956" in args
        assert "--rdzv_id=123456" in args
        assert "--rdzv_conf=is_host=false" in args
        assert args[-2:] == ["stage.py", "--x=1"]


def test_a_multi_node_launch_in_the_image_failed_calling_scontrol(monkeypatch):
    """The image has no Slurm client: the endpoint comes from what srun gives each task."""
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_LAUNCH_NODE_IPADDR", "192.0.2.1")
    ns = launch.parse(["--nproc=1", "--nnodes=2", "--node-rank=1", "stage.py"])
    assert launch.rendezvous_endpoint(ns) == f"192.0.2.1:{launch.RDZV_PORT_BASE + 7}"


def test_a_multi_node_launch_outside_a_slurm_step_without_an_endpoint_is_refused(monkeypatch):
    monkeypatch.delenv("SLURM_LAUNCH_NODE_IPADDR", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    ns = launch.parse(["--nproc=1", "--nnodes=2", "--node-rank=0", "stage.py"])
    with pytest.raises(SystemExit, match="needs --rdzv-endpoint outside a Slurm job step"):
        launch.rendezvous_endpoint(ns)


def test_one_node_runs_torchrun_standalone():
    ns = launch.parse(["--nproc=2", "stage.py"])
    assert launch.torchrun_args(ns, None)[0] == "--standalone"


@pytest.mark.parametrize("node_rank", [None, "2"])
def test_a_multi_node_launch_without_a_valid_node_rank_is_refused(monkeypatch, capsys, node_rank):
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    args = ["--nproc=1", "--nnodes=2", "stage.py"]
    if node_rank is not None:
        args.insert(0, f"--node-rank={node_rank}")
    with pytest.raises(SystemExit) as refused:
        launch.parse(args)
    assert refused.value.code == 2
    assert f"--nnodes=2 needs --node-rank in [0, 2) (or SLURM_NODEID), got {node_rank}" in (
        capsys.readouterr().err
    )


def test_a_multi_node_launch_outside_slurm_needs_an_endpoint(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    ns = launch.parse(["--nproc=1", "--nnodes=2", "--node-rank=0", "stage.py"])
    with pytest.raises(SystemExit, match="needs --rdzv-endpoint outside a Slurm job step"):
        launch.rendezvous_endpoint(ns)


def test_a_rank_out_of_space_reported_internal_when_a_lower_rank_saw_it_fail():
    """Rank 1's full disk (7) ends rank 0 in a broken collective (70): the job reports 7."""
    from align.exit_codes import INTERNAL, NO_SPACE

    assert launch.documented_code([INTERNAL, NO_SPACE, -15]) == NO_SPACE
    assert launch.documented_code([3, 7]) == 3
    assert launch.documented_code([0, INTERNAL, -9]) == INTERNAL
    assert launch.documented_code([0, -9]) == 128 + 9
