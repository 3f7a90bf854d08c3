#!/usr/bin/env bash
# One prepared run for a lent GPU machine, from the repo root: the triton_fa2 and flex
# equivalence gates, the attention benchmark (kernels, and a 7B-shaped layer's step in each
# pair layout at T = 2048 and 4096), the selector on CUDA, tests/test_flash_attn.py and
# tests/test_attention_pieces.py on the GPU, and the precision and device-memory checks (bf16 compute over float32 masters, the
# elements one step at lr 5e-7 moves, projected vs measured memory of a full-width
# Mistral-7B step with adamw8bit, the fused loss head's memory at T = 4096, and a CUDA
# rank's host memory against preflight.cuda_rank_overhead_mb). Every step
# runs even when an earlier one failed; the exit status is non-zero when any failed.
# Results land under $OUT (receipt, logs, benchmark table, precision_memory.json).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:?set OUT to the folder the results go to}
PYTHON=${PYTHON:-python3}
# The cluster extra's and the test extra's pins (pyproject.toml).
pin() { grep -oE "\"$1==[^\"]+\"" pyproject.toml | head -1 | tr -d '"' | cut -d= -f3; }
TRITON_PIN=$(pin triton)
PYTEST_PIN=$(pin pytest)
BITSANDBYTES_PIN=$(pin bitsandbytes)
mkdir -p "$OUT/receipts"
# The selector and the tests look for the receipt where the gate writes it.
export ALIGN_KERNEL_RECEIPTS="$OUT/receipts"
unset TRITON_INTERPRET
failed=()

step() {
  local name=$1
  shift
  echo "=== $name"
  "$@" 2>&1 | tee "$OUT/$name.log"
  local status=${PIPESTATUS[0]}
  if ((status == 0)); then
    echo "=== $name: ok"
  else
    echo "=== $name: FAILED (exit $status)"
    failed+=("$name")
  fi
}

setup() {
  # The machine keeps its own torch; only what is missing is installed.
  $PYTHON -c "import align" 2>/dev/null ||
    $PYTHON -m pip install --no-deps --no-build-isolation -e . || return 1
  $PYTHON -c "import triton" 2>/dev/null || $PYTHON -m pip install "triton==$TRITON_PIN" || return 1
  $PYTHON -c "import pytest" 2>/dev/null || $PYTHON -m pip install "pytest==$PYTEST_PIN" || return 1
  $PYTHON -c "import bitsandbytes" 2>/dev/null ||
    $PYTHON -m pip install "bitsandbytes==$BITSANDBYTES_PIN" || return 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  $PYTHON -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name())"
}

selector_on_cuda() {
  $PYTHON - <<'PY'
import torch

from align.model.attention import attention, select_attn_implementation

assert select_attn_implementation("triton_fa2", "cuda") == "triton_fa2"
assert select_attn_implementation("flex", "cuda") == "flex"
q = torch.randn(2, 32, 300, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(2, 8, 300, 128, device="cuda", dtype=torch.bfloat16)
lengths = torch.tensor([300, 123], device="cuda", dtype=torch.int32)
out = attention(q, k, k, lengths, "triton_fa2")
assert out[1, :, 123:].abs().sum().item() == 0
print("select_attn_implementation accepted the triton_fa2 and flex receipts; kernel ran")
PY
}

step setup setup
step equivalence $PYTHON -m align.kernels.equivalence
step flex_equivalence $PYTHON -m align.kernels.flex_gate
step benchmark $PYTHON benchmarks/attention.py --layouts --out "$OUT/attention_benchmark.json"
step selector selector_on_cuda
step pytest $PYTHON -m pytest -q -p no:cacheprovider tests/test_flash_attn.py tests/test_attention_pieces.py
step precision_memory $PYTHON benchmarks/gpu_precision_memory.py --out "$OUT/precision_memory.json"

if ((${#failed[@]})); then
  echo "gpu_check: FAILED steps: ${failed[*]}"
  exit 1
fi
echo "gpu_check: all steps passed"
