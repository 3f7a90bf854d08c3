"""The CPU math libraries' per-shape primitive caches under a rank: bounded by
configure_cpu, so bfloat16 matmuls whose row count changes every step stop growing the
process once a step's shapes are cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from align.constants import CPU_ISAS
from align.utils.guard import PRIMITIVE_CACHE_VARS

# What an earlier test or the caller may have left set: an instruction-set pin changes the
# primitives oneDNN compiles, and a cache bound would make the default run bounded too.
INHERITED = {*PRIMITIVE_CACHE_VARS, *(var for isa in CPU_ISAS.values() for var in isa["env"])}

PROGRAM = """
import json, os, sys
from align.config import RunConfig
from align.utils.guard import configure_cpu
if sys.argv[1] == "configured":
    configure_cpu(RunConfig(threads=1))
import torch
from align.train.phases import status_mb
weight = torch.randn(768, 256, dtype=torch.bfloat16, requires_grad=True)

def step(rows):
    x = torch.randn(rows, 256, dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.linear(x, weight).sum().backward()

for rows in range(1000, 1040):  # warm: allocator and libraries settle
    step(rows)
before = status_mb("VmRSS")
for rows in range(2000, 2120):
    step(rows)
print(json.dumps({"grew_mb": status_mb("VmRSS") - before}))
"""


def growth(mode: str) -> float:
    env = {var: value for var, value in os.environ.items() if var not in INHERITED}
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(done.stdout)["grew_mb"]


def onednn_computes_bf16() -> bool:
    """Whether oneDNN takes bfloat16 matmuls on this CPU (AVX-512 or newer): below it, ATen
    computes them itself, caches no primitive, and takes minutes over these steps."""
    import torch

    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.skipif(
    not onednn_computes_bf16(), reason="oneDNN computes no bfloat16 matmul on this CPU"
)
def test_bf16_matmuls_of_a_new_row_count_each_step_grew_the_primitive_caches_without_bound():
    assert growth("default") > 100  # about 8 MiB per new shape, 120 shapes, unpinned
    assert growth("configured") < 30
