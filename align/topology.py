"""How a job's ranks lie on nodes (stdlib only: the rules size jobs with it).

A pre-registered world size and the site's GPUs per node give the job's nodes; a world
size that the per-node count does not divide is refused before anything is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass

from align.exit_codes import ConfigError


@dataclass(frozen=True)
class Topology:
    """`nodes` x `per_node` ranks; one launcher (torchrun agent) per node."""

    nodes: int
    per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node


def ranks_per_node(world_size: int, gpus_per_node: int) -> int:
    """The site's GPUs per node, capped at the world; 0: every rank on one node."""
    return min(gpus_per_node or world_size, world_size)


def divides(world_size: int, per_node: int) -> bool:
    """Whether nodes of `per_node` ranks hold `world_size` ranks exactly."""
    return per_node >= 1 and world_size % per_node == 0


def topology(world_size: int, gpus_per_node: int) -> Topology:
    """The job's layout on nodes of the site's `gpus_per_node` GPUs; 0, or a world that fits
    one node, puts every rank on one node."""
    per_node = ranks_per_node(world_size, gpus_per_node)
    if not divides(world_size, per_node):
        raise ConfigError(
            f"batch.world_size = {world_size} does not divide into nodes of {per_node} ranks "
            f"(the workflow's gpus_per_node = {per_node}): choose a world size that is a "
            "multiple of it"
        )
    return Topology(nodes=world_size // per_node, per_node=per_node)
