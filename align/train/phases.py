"""What each phase of a model-loading stage cost, read from the kernel and the allocator.

A stage runs in phases (load, train, export, evaluate). A phase begins by returning what
the last one freed to the kernel (glibc keeps it resident otherwise); then each rank
resets its resident-set high-water mark (VmHWM, by writing 5 to /proc/self/clear_refs)
and CUDA's peak counter, and reads both, with the wall clock, when the phase ends. The job's host
peak of a phase is the sum of its ranks' peaks and its launchers' (the processes of the
job's tree), the quantity the projection sums (align.train.memory), so the receipt can
set each phase's projection beside it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from align.constants import LAUNCHER_PID_ENV
from align.utils.dist import all_gather_floats
from align.utils.heap import release_freed_memory

MIB = 2**20
STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
PHASES = ("load", "train", "export", "evaluate")


def status_mb(field: str, status: Path = STATUS) -> float:
    """One of a process's memory figures in its /proc status (VmRSS, VmHWM), in MiB."""
    for line in status.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{status} has no {field} line")


def launcher_peak_mb() -> float:
    """The peak of this node's launcher (align.launch, which runs torchrun in-process), read
    by the node's first rank, whose parent it is; 0 for a stage run without one."""
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if pid is None or os.environ.get("LOCAL_RANK", "0") != "0" or int(pid) != os.getppid():
        return 0.0
    return status_mb("VmHWM", Path(f"/proc/{pid}/status"))


def reset_host_peak() -> None:
    """VmHWM (and so ru_maxrss) restarts from the current RSS (Linux 4.0+)."""
    CLEAR_REFS.write_text("5")


@dataclass
class PhaseMeasure:
    """One rank's figures of one phase; a phase entered again keeps its peaks and adds time."""

    wall_s: float = 0.0
    host_start_mb: float = 0.0
    host_peak_mb: float = 0.0
    device_peak_mb: float = 0.0
    entries: int = 0


class PhaseMeter:
    """This rank's phases of one stage, in the order they first ran."""

    def __init__(self, device: str):
        # CUDA's peak counters are the current device's: every rank has pinned its own.
        self.on_cuda = device == "cuda"
        self.phases: dict[str, PhaseMeasure] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"phase {name!r}: expected one of {PHASES}")
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats()
        release_freed_memory()
        reset_host_peak()
        measure = self.phases.setdefault(name, PhaseMeasure())
        start_mb, started = status_mb("VmRSS"), time.perf_counter()
        try:
            yield
        finally:
            measure.wall_s += time.perf_counter() - started
            if not measure.entries:
                measure.host_start_mb = start_mb
            measure.host_peak_mb = max(measure.host_peak_mb, status_mb("VmHWM"))
            if self.on_cuda:
                device_peak = torch.cuda.max_memory_allocated() / MIB
                measure.device_peak_mb = max(measure.device_peak_mb, device_peak)
            measure.entries += 1

    def job_host_peak_mb(self) -> float:
        """The largest phase's host peak summed over ranks, with the launchers' (every rank
        calls it)."""
        launchers = sum(all_gather_floats(launcher_peak_mb()))
        return launchers + max(sum(all_gather_floats(m.host_peak_mb)) for m in self.phases.values())

    def report(
        self, projection: dict[str, Any] | None, projected_wall_s: dict[str, float] | None = None
    ) -> dict[str, Any]:
        """Every phase with every rank's figures and the job's sums, beside the projection's
        terms for it (and its projected wall clock, where one was made); every rank calls
        it (collectives), rank 0's copy is the record."""
        projected = (projection or {}).get("phases", {})
        walls = projected_wall_s or {}
        # The launchers' peaks (steady while the ranks run) count in every phase.
        launchers = sum(all_gather_floats(launcher_peak_mb()))
        phases = {}
        for name, measure in self.phases.items():
            peaks = all_gather_floats(measure.host_peak_mb)
            starts = all_gather_floats(measure.host_start_mb)
            walls_s = all_gather_floats(measure.wall_s)
            host = sum(peaks) + launchers
            record: dict[str, Any] = {
                "wall_s": max(walls_s),
                "entries": measure.entries,
                "host_peak_mb": host,
                "launcher_peak_mb": launchers,
                "rank_host_peak_mb": peaks,
                "rank_host_start_mb": starts,
            }
            if self.on_cuda:
                record["rank_device_peak_mb"] = all_gather_floats(measure.device_peak_mb)
                device = (projection or {}).get("device", {}).get("phases", {}).get(name)
                if device is not None:
                    # The allocator's peak: the projection less the CUDA context.
                    allocated = device["total_mb"] - device["terms_mb"]["cuda_context"]
                    record["projected_device_allocated_mb"] = allocated
                    record["device_ratio"] = max(record["rank_device_peak_mb"]) / allocated
            if name in projected:
                expected = projected[name]
                record["projected_host_mb"] = expected["total_mb"]
                record["projected_terms_mb"] = expected["terms_mb"]
                record["host_ratio"] = host / expected["total_mb"]
            if name in walls:
                record["projected_wall_s"] = walls[name]
                record["wall_ratio"] = max(walls_s) / walls[name]
            phases[name] = record
        return phases
