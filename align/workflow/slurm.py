"""What the workflow asks Slurm on the submit host: the default partition, and the memory of
a partition's smallest node, which the preflight judges a job against where the workflow
config gives none."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping

from align.exit_codes import ConfigError


def scontrol(*args: str) -> str:
    """`scontrol --oneliner ARGS`'s output; refused naming the config key that avoids it."""
    try:
        return subprocess.run(
            ["scontrol", "--oneliner", *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise ConfigError(
            f"scontrol {' '.join(args)} failed ({err}); set slurm_node_memory_mb in the "
            "workflow config for the partitions the jobs use"
        ) from err


def slurm_fields(line: str) -> dict[str, str]:
    """`Key=Value` pairs of one line of scontrol's --oneliner output."""
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def default_partition() -> str:
    for line in scontrol("show", "partition").splitlines():
        fields = slurm_fields(line)
        if fields.get("Default") == "YES":
            return fields["PartitionName"]
    raise ConfigError("Slurm names no default partition: set slurm_partition")


def partition_node_memory_mb(partition: str) -> int:
    """The smallest RealMemory of the partition's nodes."""
    nodes = slurm_fields(scontrol("show", "partition", partition)).get("Nodes", "")
    memory = [
        int(slurm_fields(line)["RealMemory"])
        for line in scontrol("show", "node", nodes).splitlines()
        if "RealMemory=" in line
    ]
    if not memory:
        raise ConfigError(f"scontrol shows no node memory for partition {partition}")
    return min(memory)


def node_memory(partition: str, configured: Mapping[str, int]) -> tuple[int, str]:
    """The memory (MB) of the partition's nodes a job is judged against, and its source:
    the workflow config's slurm_node_memory_mb for the partition, else Slurm's record of the
    partition's smallest node."""
    if partition in configured:
        return configured[partition], f"slurm_node_memory_mb[{partition}] (workflow config)"
    return (
        partition_node_memory_mb(partition),
        f"scontrol: smallest RealMemory of partition {partition}",
    )
