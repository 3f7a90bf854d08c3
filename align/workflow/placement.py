"""Where a job runs on Slurm and how its ranks are laid out, from its topology and device.

One node: one task holds every GPU of the job (sbatch --gpus=N); torchrun starts the ranks
inside it and rank i takes cuda:LOCAL_RANK, so each rank has its own device and every stage
asserts that before it loads a model (align.utils.dist.assert_distinct_devices). A task
count on a GPU job would turn into --ntasks-per-gpu, so GPU jobs name no tasks and CPU jobs
exactly one.

Several nodes: one task per node (--nodes=N --ntasks=N, each node's GPUs as --gres), and
the job runs its command in the allocation itself (the executor's `mpi` mode), which starts
one launcher per node under srun (align.workflow.commands).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from align.config import ArmConfig
from align.exit_codes import ConfigError
from align.topology import Topology


@dataclass(frozen=True)
class SlurmSite:
    """The workflow config's Slurm keys: where jobs go and whom they bill."""

    # CPU jobs' partition; empty: the cluster's default.
    partition: str = ""
    # GPU jobs' partition; empty: `partition`.
    gpu_partition: str = ""
    # The account jobs bill; empty: the user's default.
    account: str = ""
    # The GRES type of the GPU model jobs must land on; empty: any.
    gpu_model: str = ""

    def partition_for(self, on_gpus: bool) -> str | None:
        if on_gpus and self.gpu_partition:
            return self.gpu_partition
        return self.partition or None


@dataclass(frozen=True)
class Placement:
    """A job's topology on its device."""

    topo: Topology
    device: str
    # The site's GRES type of the GPU model jobs must land on; empty: any.
    gpu_model: str = ""

    @property
    def multi_node(self) -> bool:
        return self.topo.nodes > 1

    @property
    def on_gpus(self) -> bool:
        return self.device == "cuda"

    def gpus(self) -> int:
        """The GPUs a one-node job asks for (sbatch --gpus); a multi-node job asks per node."""
        return self.topo.world_size if self.on_gpus and not self.multi_node else 0

    def tasks(self) -> int | None:
        if self.multi_node:
            return self.topo.nodes
        return None if self.on_gpus else 1

    def node_gres(self) -> str:
        """Each node's GPUs as a gres, of the site's GPU model when it names one."""
        model = f"{self.gpu_model}:" if self.gpu_model else ""
        return f"gpu:{model}{self.topo.per_node}"

    def gres(self) -> str | None:
        """The job's gres: a multi-node GPU job's per-node GPUs (one-node jobs use --gpus)."""
        return self.node_gres() if self.multi_node and self.on_gpus else None

    def slurm_resources(self, site: SlurmSite) -> dict[str, Any]:
        """The slurm executor's resources for this job (None: the plugin's default); the GPU
        model is the placement's own, as its gres names it."""
        return {
            "gpu": self.gpus(),
            # The plugin asks for --gpus=MODEL:N; a multi-node job names the model in its gres.
            "gpu_model": (self.gpu_model or None) if self.gpus() else None,
            "nodes": self.topo.nodes,
            "tasks": self.tasks(),
            # A multi-node job runs its command in the allocation, which sruns one launcher
            # per node (align.workflow.commands), with no task-per-GPU binding.
            "mpi": "srun" if self.multi_node else None,
            "tasks_per_gpu": 0 if self.multi_node else None,
            "gres": self.gres(),
            "slurm_partition": site.partition_for(self.on_gpus),
            "slurm_account": site.account or None,
        }

    def require_scheduler(self, scheduled: bool) -> None:
        """A multi-node job needs Slurm's allocation: no local run can start its nodes."""
        if self.multi_node and not scheduled:
            raise ConfigError(
                f"{self.topo.nodes} nodes x {self.topo.per_node} ranks: a multi-node stage runs "
                "under Slurm (--executor slurm or the workflow profile), not locally"
            )


def rank_threads(task_threads: int, ranks: int) -> int:
    """Each rank's threads: the task's shared among the ranks it holds, at least one each."""
    return max(1, task_threads // ranks)


def kernel_gate_device(backend: str, arms: Iterable[ArmConfig]) -> str:
    """Where a backend's equivalence gate runs: on CUDA when any arm that uses the backend
    runs there, else on the CPU (for triton_fa2, under the interpreter)."""
    devices = {arm.run.device for arm in arms if backend in arm.gated_backends()}
    return "cuda" if "cuda" in devices else "cpu"
