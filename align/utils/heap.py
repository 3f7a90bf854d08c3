"""The C heap under every rank: glibc's mmap threshold held fixed, and freed pages returned.

glibc serves an allocation above its mmap threshold with a mapping of its own, given back
whole when freed; below it, from the heap, which keeps what is freed. The threshold rises
to the size of each large block freed, up to 32 MiB, so after a model's first training
step most of its tensors come from the heap, and the activations each step frees stay
resident and fragment: at 60M parameters a CPU rank's training peak grew from 1,117 to
1,642 MiB over four steps. `fix_mmap_threshold` pins it at 2 MiB (tensors above it cost a
mapping each). Under another C library (musl) neither call exists and both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

# mallopt's parameter number for the threshold (malloc.h: M_MMAP_THRESHOLD).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 2 * 2**20


def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


LIBC = _libc()
MALLOPT = getattr(LIBC, "mallopt", None)
MALLOC_TRIM = getattr(LIBC, "malloc_trim", None)


def fix_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold (the dynamic raise stops with it); True when pinned."""
    return bool(MALLOPT is not None and MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def release_freed_memory() -> None:
    """Collect unreachable objects, then hand the heap's free pages back to the kernel:
    otherwise the next phase is charged for what the last one freed."""
    gc.collect()
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)
