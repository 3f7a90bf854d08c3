"""Process-group setup and the collectives the trainer needs to agree across ranks.

`init_distributed` always leaves a process group (gloo on CPU, NCCL on CUDA), a
one-rank group when not launched by torchrun, so every stage has one code path.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from align.config import BatchConfig
from align.constants import CPU_ISAS
from align.exit_codes import ConfigError, GateRefused
from align.utils.guard import cpu_isa_here


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    # Every rank's host:device, in rank order, once the launch checks have gathered them.
    devices: tuple[str, ...] = ()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def init_distributed(run_dir: str | Path, device: str = "cpu") -> DistInfo:
    """Join (or create) the process group; on CUDA pin this rank's device first."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("run.device='cuda' requested but CUDA is not available on this host")
        torch.cuda.set_device(local_rank)  # before anything else touches CUDA
        target, backend = torch.device("cuda", local_rank), "nccl"
        _enable_flight_recorder(Path(run_dir))
    elif device == "cpu":
        target, backend = torch.device("cpu"), "gloo"
    else:
        raise ConfigError(f"run.device {device!r} cannot be honoured (expected 'cpu' or 'cuda')")
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world)
        elif world == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            raise ConfigError(
                f"WORLD_SIZE={world} but no MASTER_ADDR: launch multi-rank stages with torchrun"
            )
    return DistInfo(rank, local_rank, world, target, backend)


def _enable_flight_recorder(run_dir: Path) -> None:
    """NCCL flight-recorder dumps land under the run dir when a collective hangs."""
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(run_dir / "nccl_trace_rank_"))


def destroy_distributed() -> None:
    """Leave the process group together: a rank that tears its gloo pairs down while a peer
    still works on them can abort either process at exit (SIGABRT), after a finished stage."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def host_name() -> str:
    """The node this rank runs on: Slurm's node name inside a job, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def device_identity(info: DistInfo) -> str:
    """What makes a rank's device distinct: the node, the GPU's index and UUID (or the CPU
    process, with the instruction set its kernels run)."""
    if info.device.type == "cuda":
        props = torch.cuda.get_device_properties(info.device)
        return f"{host_name()}:cuda:{info.device.index}:{props.uuid}"
    return f"{host_name()}:cpu:{torch.backends.cpu.get_cpu_capability()}:pid{os.getpid()}"


def assert_cpu_isa(isa: str) -> None:
    """Refuse a run.cpu_isa that torch's CPU kernels do not run at (empty: any)."""
    isa = cpu_isa_here(isa)
    if not isa:
        return
    expected, found = CPU_ISAS[isa]["torch_capability"], torch.backends.cpu.get_cpu_capability()
    if found != expected:
        raise ConfigError(
            f"run.cpu_isa={isa!r} requested but torch's CPU kernels run {found} on "
            f"{host_name()}: the CPU lacks {expected}, or torch computed before the pin"
        )


def assert_distinct_devices(info: DistInfo, identity: str | None = None) -> list[str]:
    """All-gather each rank's device identity; refuse two ranks on one device, naming them."""
    identities: list[str | None] = [None] * info.world_size
    dist.all_gather_object(identities, identity or device_identity(info))
    seen: dict[str, int] = {}
    for rank, ident in enumerate(identities):
        if ident in seen:
            raise GateRefused(
                "distinct_devices", f"ranks {seen[ident]} and {rank} share one device ({ident})"
            )
        seen[ident] = rank
    return identities


def assert_launch_topology(batch: BatchConfig, world_size: int) -> None:
    """The launched world size and the batch arithmetic must match the pre-registration."""
    if world_size != batch.world_size:
        raise GateRefused(
            "topology",
            f"launched world size {world_size}, pre-registered batch.world_size {batch.world_size}",
        )
    product = batch.world_size * batch.micro_batch * batch.grad_accum
    if product != batch.global_batch:
        raise GateRefused(
            "topology",
            f"world_size x micro_batch x grad_accum = {product}, expected global_batch {batch.global_batch}",
        )


def collective_device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo reduces CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_gather_floats(value: float) -> list[float]:
    """Every rank's `value`, in rank order, on every rank."""
    t = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=collective_device())
    t[dist.get_rank()] = value
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any rank: one decision for all."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    dist.barrier()
