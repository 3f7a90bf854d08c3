"""The Trainer on 1 and 2 ranks (torchrun, gloo): equal to one process, exact resume."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tiny_pairs import write_tiny_pairs

from align.exit_codes import RESUMABLE_STOP, TRIPWIRE
from align.paths import checkpoints_in, stop_marker_in

DRIVER = Path(__file__).parent / "drivers" / "train_tiny.py"
EXIT_AFTER = Path(__file__).parent / "drivers" / "exit_after.py"
N_PAIRS, SEQ = 24, 14
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("trainer")
    write_tiny_pairs(work, N_PAIRS, SEQ)
    rng = np.random.default_rng(0)
    np.savez(
        work / "ref.npz",
        chosen=rng.normal(-20, 2, N_PAIRS).astype(np.float32),
        rejected=rng.normal(-20, 2, N_PAIRS).astype(np.float32),
    )
    return work


def topology(world: int) -> list[str]:
    micro = 4 // world
    return [
        f"--batch.world_size={world}",
        f"--micro_batch={micro}",
        "--grad_accum=2",
        "--global_batch=8",
    ]


LR = 5e-3
COMMON = [
    "--epochs=2",
    f"--lr={LR}",
    "--warmup_steps=1",
    "--run.threads=1",
    "--trainer.keep_checkpoints=2",
]


def train(workdir: Path, world: int, tag: str, *extra: str) -> subprocess.CompletedProcess:
    args = [str(DRIVER), str(workdir), f"--tag={tag}", *topology(world), *COMMON, *extra]
    if world == 1:
        cmd = [sys.executable, *args]
    else:
        marker = stop_marker_in(workdir / f"run-{tag}")
        cmd = [
            sys.executable,
            "-m",
            "align.launch",
            f"--nproc={world}",
            f"--stop-marker={marker}",
            *args,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_two_nodes(
    args: list[str], *launch_args: str, node_env: tuple[dict, dict] = ({}, {})
) -> list[subprocess.CompletedProcess]:
    """Two launchers of one rank each, as two nodes joined by a c10d rendezvous on localhost."""
    launch = [sys.executable, "-m", "align.launch", "--nproc=1", "--nnodes=2", *launch_args]
    launch.append(f"--rdzv-endpoint=127.0.0.1:{free_port()}")
    nodes = [
        subprocess.Popen(
            [*launch, f"--node-rank={rank}", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **node_env[rank]},
        )
        for rank in range(2)
    ]
    done = []
    for node in nodes:
        out, err = node.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    return done


def train_two_nodes(workdir: Path, tag: str, *extra: str) -> list[subprocess.CompletedProcess]:
    args = [str(DRIVER), str(workdir), f"--tag={tag}", *topology(2), *COMMON, *extra]
    marker = stop_marker_in(workdir / f"run-{tag}")
    return launch_two_nodes(args, f"--rdzv-id={tag}", f"--stop-marker={marker}")


def weights(workdir: Path, tag: str) -> dict[str, np.ndarray]:
    return load_file(str(workdir / f"out-{tag}" / "model.safetensors"))


def metrics(workdir: Path, tag: str) -> list[dict]:
    return [
        json.loads(line)
        for line in (workdir / f"run-{tag}" / "metrics.jsonl").read_text().splitlines()
    ]


def ok(run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.fixture(scope="module")
def uninterrupted(workdir) -> dict[int, str]:
    for world in (1, 2):
        ok(train(workdir, world, f"full{world}"))
    return {1: "full1", 2: "full2"}


def test_two_ranks_equal_one_process_on_the_same_global_batch(workdir, uninterrupted):
    one, two = metrics(workdir, "full1"), metrics(workdir, "full2")
    assert len(one) == len(two) == 6
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-5, abs=1e-6)
    # Adam moves every element by about lr per step whatever its gradient's size, so the
    # reduction order's rounding in a near-zero gradient shows up as a fraction of lr.
    w1, w2 = weights(workdir, "full1"), weights(workdir, "full2")
    for name in w1:
        np.testing.assert_allclose(w1[name], w2[name], rtol=0, atol=LR / 100, err_msg=name)


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1"])
def test_a_signal_to_the_launcher_stops_every_rank_at_a_step_boundary_and_resumes_bitwise(
    workdir, uninterrupted, signal_name
):
    """As Slurm signals a job step: the launcher forwards it, torchrun does not shut down."""
    tag = f"launcher-{signal_name}"
    signal_args = ("--signal-at-step=2", "--signal-target=launcher", f"--signal-name={signal_name}")
    stopped = train(workdir, 2, tag, *signal_args)
    assert stopped.returncode == RESUMABLE_STOP, stopped.stderr[-3000:]
    assert re.search(r"stopped at step \d/6 \(signal " + signal_name, stopped.stderr)
    ok(train(workdir, 2, tag, "--trainer.resume=true"))
    full, resumed = weights(workdir, uninterrupted[2]), weights(workdir, tag)
    for name in full:
        assert full[name].tobytes() == resumed[name].tobytes(), name


def test_two_nodes_of_one_rank_equal_one_node_of_two_ranks(workdir, uninterrupted):
    runs = train_two_nodes(workdir, "nodes")
    for run in runs:
        ok(run)
    assert [m["loss"] for m in metrics(workdir, "nodes")] == [
        m["loss"] for m in metrics(workdir, uninterrupted[2])
    ]
    one_node, two_nodes = weights(workdir, uninterrupted[2]), weights(workdir, "nodes")
    for name in one_node:
        assert one_node[name].tobytes() == two_nodes[name].tobytes(), name


def test_sigterm_to_one_node_stops_both_and_the_resume_is_bitwise_equal(workdir, uninterrupted):
    signal_args = ("--signal-at-step=2", "--signal-target=launcher", "--signal-rank=1")
    stopped = train_two_nodes(workdir, "nodes-term", *signal_args)
    assert [run.returncode for run in stopped] == [RESUMABLE_STOP, RESUMABLE_STOP], [
        run.stderr[-2000:] for run in stopped
    ]
    resumed = train_two_nodes(workdir, "nodes-term", "--trainer.resume=true")
    for run in resumed:
        ok(run)
    full, after = weights(workdir, uninterrupted[2]), weights(workdir, "nodes-term")
    for name in full:
        assert full[name].tobytes() == after[name].tobytes(), name


@pytest.mark.parametrize("code", [RESUMABLE_STOP, TRIPWIRE])
def test_a_node_ending_after_the_rendezvous_host_reports_its_own_exit_code(code):
    """The store host's ranks end first; the other node's end later with the same code."""
    ends = launch_two_nodes(
        [str(EXIT_AFTER), str(code)],
        node_env=({"ALIGN_TEST_EXIT_DELAY_S": "0"}, {"ALIGN_TEST_EXIT_DELAY_S": "3"}),
    )
    assert [end.returncode for end in ends] == [code, code], [end.stderr[-2000:] for end in ends]


BF16 = ("--model.dtype=bfloat16",)


@pytest.fixture(scope="module")
def uninterrupted_bf16(workdir) -> dict[int, str]:
    for world in (1, 2):
        ok(train(workdir, world, f"bf16full{world}", *BF16))
    return {1: "bf16full1", 2: "bf16full2"}


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_compute_trains_float32_masters_on_every_rank_count(
    workdir, uninterrupted_bf16, world
):
    tag = uninterrupted_bf16[world]
    precision = json.loads((workdir / f"run-{tag}" / "precision.json").read_text())
    assert (precision["compute"], precision["master"], precision["reduce"]) == (
        "bfloat16",
        "float32",
        "float32",
    )
    assert precision["read_back"]["linear_outputs"] == ["bfloat16"]
    config = json.loads((workdir / f"out-{tag}" / "config.json").read_text())
    assert config["dtype"] == "float32"
    exported = weights(workdir, tag)
    # float32 updates leave weights between bf16 values: a bf16 master could not hold them.
    off_grid = sum(int((w.view(np.uint32) & 0xFFFF).astype(bool).sum()) for w in exported.values())
    assert off_grid > 0.5 * sum(w.size for w in exported.values())


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_compute_sigterm_then_resume_ends_bitwise_equal(workdir, uninterrupted_bf16, world):
    """SIGTERM to one worker: every rank stops at the same step; the resume ends on the
    uninterrupted run's losses and weights."""
    tag = f"bf16term{world}"
    stopped = train(workdir, world, tag, *BF16, "--signal-at-step=3")
    assert stopped.returncode == RESUMABLE_STOP, stopped.stderr[-3000:]
    assert "stopped at step 3/6" in stopped.stderr
    ok(train(workdir, world, tag, *BF16, "--trainer.resume=true"))
    full, resumed = weights(workdir, uninterrupted_bf16[world]), weights(workdir, tag)
    for name in full:
        assert full[name].tobytes() == resumed[name].tobytes(), name
    assert [m["loss"] for m in metrics(workdir, tag)] == [
        m["loss"] for m in metrics(workdir, uninterrupted_bf16[world])
    ]


@pytest.mark.parametrize("world", [2])
def test_sigkill_while_checkpointing_resumes_from_the_last_valid_one(workdir, uninterrupted, world):
    tag = f"kill{world}"
    killed = train(workdir, world, tag, "--trainer.checkpoint_every=1", "--kill-in-checkpoint-at=4")
    assert killed.returncode != 0
    checkpoints = checkpoints_in(workdir / f"run-{tag}")
    assert (checkpoints / "micro_00000008.partial").is_dir()
    resumed = train(workdir, world, tag, "--trainer.checkpoint_every=1", "--trainer.resume=true")
    ok(resumed)
    assert "skipping torn checkpoint" in resumed.stderr
    assert "at step 3" in resumed.stderr
    full, after = weights(workdir, uninterrupted[world]), weights(workdir, tag)
    for name in full:
        assert full[name].tobytes() == after[name].tobytes(), name


def test_fresh_run_rotates_stale_checkpoints_aside(workdir, uninterrupted):
    ok(train(workdir, 1, "rot", "--trainer.checkpoint_every=3"))
    ok(train(workdir, 1, "rot", "--trainer.checkpoint_every=3"))
    stale = [
        p.name for p in (workdir / "run-rot").iterdir() if p.name.startswith("checkpoints.stale-")
    ]
    assert len(stale) == 1
