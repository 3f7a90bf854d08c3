"""Resource guards applied before any heavy import: the CPU thread cap."""

from __future__ import annotations

import os

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def cap_threads(threads: int) -> None:
    """Cap math-library threads; call before importing torch so its pools honour it."""
    if threads < 1:
        raise ValueError(f"run.threads must be >= 1, got {threads}")
    for var in THREAD_VARS:
        os.environ[var] = str(threads)
    import sys

    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(threads)
