"""Resource guards applied before any heavy work: the CPU thread cap and instruction-set
pin, a host-wide lock so two heavy stages never share a host without swap, an optional
strict host check, and run directories kept off the root filesystem."""

from __future__ import annotations

import os
import platform
import socket
import sys
import tempfile
from pathlib import Path

from filelock import FileLock, Timeout

from align.constants import CPU_ISAS, LOCK_MODES
from align.exit_codes import ConfigError, PreflightRefused
from align.utils.heap import fix_mmap_threshold

# platform.machine() of the CPUs run.cpu_isa names sets of.
X86_64 = ("x86_64", "AMD64")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# oneDNN, and ideep above it, keep a compiled primitive per matmul shape, 1,024 each by
# default: bfloat16 matmuls on the CPU with a new row count each step grew a process by
# about 8 MiB a shape at 2,000 rows (tests/test_primitive_caches.py). One step's shapes fit
# in 64, and rows that vary never hit across steps, so the bound drops no reuse.
PRIMITIVE_CACHE_VARS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}
_held: list[FileLock] = []  # held until the process exits; the OS releases it even on SIGKILL


def cap_threads(threads: int) -> None:
    """Cap math-library threads; call before importing torch so its pools honour it."""
    if threads < 1:
        raise ValueError(f"run.threads must be >= 1, got {threads}")
    for var in THREAD_VARS:
        os.environ[var] = str(threads)
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(threads)


def cpu_isa_here(isa: str) -> str:
    """The pin that applies to this CPU. The sets are x86-64 ones: a CPU of another
    architecture runs unpinned, and its receipts name the set torch ran there."""
    if isa and isa not in CPU_ISAS:
        raise ConfigError(f"run.cpu_isa expected one of {tuple(CPU_ISAS)}, found {isa!r}")
    return isa if platform.machine() in X86_64 else ""


def pin_cpu_isa(isa: str) -> None:
    """Cap the CPU math libraries at `isa` (empty: leave them to pick); call before torch
    computes anything, since each library reads its variable once. The stage's device
    identity reads back what torch dispatches to."""
    if cpu_isa_here(isa):
        os.environ.update(CPU_ISAS[isa]["env"])


def configure_cpu(run) -> None:
    """The run's thread cap, instruction-set pin, heap threshold and primitive-cache bound,
    before torch is imported (a value already in the environment is kept)."""
    cap_threads(run.threads)
    pin_cpu_isa(run.cpu_isa)
    fix_mmap_threshold()
    for var, entries in PRIMITIVE_CACHE_VARS.items():
        os.environ.setdefault(var, entries)


def heavy_lock_path(configured: str | Path) -> Path:
    """The configured lock, or this user's own in the temporary directory."""
    return Path(configured or Path(tempfile.gettempdir()) / f"align-heavy-{os.getuid()}.lock")


def acquire_heavy_lock(lock_path: str | Path, mode: str, stage: str) -> None:
    """Take the heavy-job lock of this user on this host: wait for it, or refuse (exit 6)
    when it is held. Only rank 0 takes it, so a job's own ranks never wait on each other;
    inside a Slurm job the scheduler already owns the node's resources, so none is taken."""
    if mode not in LOCK_MODES:
        raise ConfigError(f"run.heavy_lock expected one of {LOCK_MODES}, found {mode!r}")
    if mode == "off" or os.environ.get("RANK", "0") != "0" or "SLURM_JOB_ID" in os.environ:
        return
    lock_path = heavy_lock_path(lock_path)
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=-1 if mode == "wait" else 0)
    except Timeout as err:
        raise PreflightRefused(
            f"{stage}: another heavy stage holds {lock_path} on {socket.gethostname()} "
            "(run.heavy_lock=refuse; use wait to queue behind it)"
        ) from err
    _held.append(lock)


def assert_expected_host(expected: str) -> None:
    """The strict host check: refuse to run anywhere but the named host (empty: any host)."""
    if expected and socket.gethostname() != expected:
        raise PreflightRefused(
            f"run.expected_host is {expected!r}, this host is {socket.gethostname()!r}"
        )


def assert_paths_off_root(*paths: str | Path) -> None:
    """Refuse run directories on the root filesystem, which a full disk would take down."""
    root = os.stat("/").st_dev
    for path in paths:
        existing = Path(path).resolve()
        while not existing.exists():
            existing = existing.parent
        if os.stat(existing).st_dev == root:
            raise PreflightRefused(f"{path}: on the root filesystem (run.require_off_root=true)")


def apply_resource_guards(run, stage: str, run_dirs: list[str | Path]) -> None:
    """Every guard the run config asks for, before a model is loaded."""
    configure_cpu(run)
    assert_expected_host(run.expected_host)
    if run.require_off_root:
        assert_paths_off_root(*run_dirs)
    acquire_heavy_lock(run.heavy_lock_path, run.heavy_lock, stage)
