"""Whether an optimizer step can move low-precision master weights (no torch; numpy lazily).

AdamW's first update of an element is about lr in magnitude (m / sqrt(v) = +-1 after bias
correction), and later ones rarely larger. A bfloat16 master keeps 8 significant bits, so
an update below half an ulp of the weight rounds back to the weight: at lr 5e-7 almost
nothing moves. `moved_fraction` rounds a sample of the checkpoint's own weights the way
the master dtype stores them, applies a step of lr, and counts the elements that change.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from align.utils.weights_hash import TensorLocation, checkpoint_tensors

if TYPE_CHECKING:
    import numpy as np

# A few evenly spaced contiguous blocks per tensor: cheap reads, the whole range sampled.
BLOCKS_PER_TENSOR = 8
BLOCK_ELEMENTS = 2048
_STORED = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


def _read_block(handle, location: TensorLocation, start: int, count: int, itemsize: int):
    import numpy as np

    handle.seek(location.begin + start * itemsize)
    raw = np.frombuffer(handle.read(count * itemsize), dtype=_STORED[location.dtype])
    if location.dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def sample_weights(checkpoint: str | Path) -> np.ndarray:
    """Float32 values from evenly spaced blocks of every floating tensor of `checkpoint`."""
    import numpy as np

    samples = []
    for location in checkpoint_tensors(checkpoint).values():
        if location.dtype not in _STORED:
            continue
        itemsize = np.dtype(_STORED[location.dtype]).itemsize
        numel = (location.end - location.begin) // itemsize
        count = min(BLOCK_ELEMENTS, numel)
        starts = np.linspace(0, numel - count, min(BLOCKS_PER_TENSOR, numel // count or 1))
        with open(location.path, "rb") as handle:
            samples += [_read_block(handle, location, int(s), count, itemsize) for s in starts]
    return np.concatenate(samples) if samples else np.zeros(0, dtype=np.float32)


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `values` rounded to nearest (ties to even) in `dtype`, returned as float64."""
    import numpy as np

    values = np.asarray(values, dtype=np.float32)
    if dtype == "float32":
        return values.astype(np.float64)
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float64)
    if dtype != "bfloat16":
        raise ValueError(f"unknown dtype {dtype!r}")
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def moved_fraction(weights: np.ndarray, step: float, dtype: str) -> float:
    """Fraction of `weights`, stored in `dtype`, that one update of size `step` changes."""
    import numpy as np

    if weights.size == 0:
        return 1.0
    stored = round_to(weights, dtype)
    updated = round_to((stored - step).astype(np.float32), dtype)
    return float(np.mean(updated != stored))
