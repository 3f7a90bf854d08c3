"""glibc's heap under a rank: with the mmap threshold pinned, what a step frees leaves the
process; left dynamic, the threshold rises with the first large block freed and later
blocks stay resident after they are freed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from align.utils.heap import MALLOPT

PROGRAM = """
import json, sys
import numpy as np
from align.train.phases import status_mb
from align.utils.heap import fix_mmap_threshold
if sys.argv[1] == "pinned":
    assert fix_mmap_threshold()
big = np.ones(2 * 2**20)  # 16 MiB: freeing it raises a dynamic threshold to 16 MiB
del big
before = status_mb("VmRSS")
blocks, pins = [], []
for _ in range(50):  # 3 MiB each, 150 MiB, each followed by a live 200 KB block (10 MiB)
    blocks.append(np.ones(3 * 2**17))
    pins.append(np.ones(25000))  # 200 KB
del blocks
print(json.dumps({"kept_mb": status_mb("VmRSS") - before}))
"""


def kept_after_free(mode: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)["kept_mb"]


@pytest.mark.skipif(MALLOPT is None, reason="glibc's mallopt is not in this C library")
def test_freed_training_tensors_do_not_stay_resident_once_the_threshold_is_pinned():
    assert kept_after_free("dynamic") > 140
    assert kept_after_free("pinned") < 20  # the live 200 KB blocks
