"""The command a model-loading rule runs: `python -m align.launch` on one node, or one
launcher per node under srun in a multi-node allocation, each entering the image itself.

Slurm's client is not in the image (it must match the cluster's), so a multi-node job's
command runs srun on the host and every task enters the image (Apptainer's hybrid model
for MPI jobs); a one-node job's command runs in the image whole, as Snakemake enters it.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from align.topology import Topology
from align.train.ref_cache import parse_forward_impl


def image_entry(home: str | Path, apptainer_args: str, image: str) -> list[str]:
    """`apptainer exec` into `image` as Snakemake enters it for a one-node job: `home` (the
    working directory) as $HOME, then the profile's arguments, left for the job's shell to
    expand ($PWD)."""
    return ["apptainer exec --home", shlex.quote(str(home)), apptainer_args, shlex.quote(image)]


def srun_prefix(topo: Topology, threads: int, gres: str | None) -> list[str]:
    """One task per node, each with the job's threads and, on GPUs, its node's gres."""
    prefix = ["srun", f"--nodes={topo.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={threads}"]
    return prefix + ([f"--gres={gres}"] if gres else [])


def launch_command(
    topo: Topology,
    shutdown_timeout_s: int,
    *,
    per_node: Sequence[str] = (),
    stop_marker: str | Path | None = None,
    accept_exit: Sequence[int] = (),
) -> str:
    """`python -m align.launch` for the topology's ranks, after `per_node` (the srun and
    image entry of a multi-node job; nothing on one node)."""
    args = [
        "python -m align.launch",
        f"--nproc={topo.per_node}",
        f"--nnodes={topo.nodes}",
        f"--shutdown-timeout={shutdown_timeout_s}",
    ]
    if stop_marker is not None:
        args.append(f"--stop-marker={stop_marker}")
    args += [f"--accept-exit={code}" for code in accept_exit]
    return " ".join([*per_node, *args])


def ref_path_overrides(forward_impl: str) -> str:
    """The `--ref.*` overrides that make the ref_cache stage build the cache named by
    `forward_impl` (align.train.ref_cache.forward_impl_name)."""
    path = parse_forward_impl(forward_impl)
    return " ".join(f"--ref.{key}={value}" for key, value in path.items())
