"""The equivalence gate of the Triton flash-attention kernel, and its receipts.

`run_gate` compares `flash_attention` on seeded random inputs with PyTorch's
scaled_dot_product_attention in float64 (explicit boolean masks, K/V repeated per
query head) over the pre-registered `EQUIVALENCE_GRID`: the output and dq, dk, dv,
each by relative error max|kernel - reference| / max|reference| against
`THRESHOLDS`. The max-based error is used rather than a norm so that one wrong row
(a block boundary, a padding edge) cannot hide in a long average. A receipt is keyed
by everything the result depends on (kernel source, triton, torch, device) and
sealed by a hash of its contents; `verify_receipt` (align.kernels.gate, shared with flex)
refuses a missing, tampered, stale or failed one, and the attention selector asks it
before "triton_fa2" may run.

On the CPU under Triton's interpreter (TRITON_INTERPRET=1) the same gate runs the small
`INTERPRETER_GRID`; its receipt's key names the interpreter, so it proves nothing for a GPU.

CLI: python -m align.kernels.equivalence [--out PATH] [--device cuda:N | cpu]
(exit 0 passed, 3 failed; the receipt is written either way). A stage reads the receipt
at $ALIGN_KERNEL_RECEIPT (the workflow's results/kernels/triton_fa2.json) when that is
set, else the per-device receipt under $ALIGN_KERNEL_RECEIPTS.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from align.constants import GATED_ATTENTION
from align.exit_codes import run_with_exit_codes
from align.kernels import gate
from align.kernels.gate import AttentionShape, GateSpec
from align.receipts import hash_file

BACKEND = "triton_fa2"
KERNEL_SOURCE = Path(__file__).with_name("flash_attn.py")
RECEIPT_ENV = GATED_ATTENTION[BACKEND][2]
INTERPRETER = "interpreter"
GATE_COMMAND = "python -m align.kernels.equivalence"
METRIC = (
    "max|kernel - reference| / max|reference| per tensor (out, dq, dk, dv); reference: "
    "scaled_dot_product_attention in float64 on the same rounded inputs"
)
TENSORS = ("out", "dq", "dk", "dv")
KEY_COMPONENTS = {
    "kernel_source_sha256": "kernel source (sha256 of align/kernels/flash_attn.py)",
    "triton_version": "triton version",
    "torch_version": "torch version",
    "device_name": "device name",
    "cuda_capability": "CUDA capability",
}


@dataclass(frozen=True)
class GateShape(AttentionShape):
    """One pre-registered case; `seq_lens` None means every row has full length."""

    seq_lens: tuple[int, ...] | None = None
    causal: bool = True


# The GPU kernels block queries by 32..128 and keys by 32..128: lengths 129, 300, 1000
# and 4097 end mid-block; seq_lens include a single-token and an empty row.
EQUIVALENCE_GRID: tuple[GateShape, ...] = (
    GateShape(1, 8, 8, 512, 64, "bfloat16"),
    GateShape(2, 8, 2, 300, 64, "float16", (300, 177)),
    GateShape(3, 4, 1, 129, 64, "bfloat16", (129, 1, 0)),
    GateShape(2, 4, 2, 200, 128, "float16", (200, 64), causal=False),
    GateShape(2, 32, 8, 1000, 128, "bfloat16", (1000, 513)),
    GateShape(2, 32, 8, 2048, 128, "bfloat16"),
    GateShape(2, 32, 8, 2048, 128, "float16", (2048, 1237)),
    GateShape(1, 32, 8, 4097, 128, "bfloat16", (4001,)),
)

# Under the interpreter every program runs in Python (numpy): small shapes that still end
# mid-block and pad a row down to one token, in float16 alone, as numpy has no bfloat16.
INTERPRETER_GRID: tuple[GateShape, ...] = (
    GateShape(1, 2, 1, 40, 64, "float16", (40,)),
    GateShape(2, 2, 2, 33, 64, "float16", (33, 1)),
)

# About 4 unit roundoffs of the input dtype for the output (bf16 2^-8, fp16 2^-11) and 8
# for the gradients, whose 16-bit probability tiles are rounded twice; fp16 runs of this
# kernel under the interpreter measure about 1 roundoff, as does SDPA in fp16.
THRESHOLDS: dict[str, dict[str, float]] = {
    "bfloat16": {"out": 1.5e-2, "dq": 3e-2, "dk": 3e-2, "dv": 3e-2},
    "float16": {"out": 2e-3, "dq": 4e-3, "dk": 4e-3, "dv": 4e-3},
}


def kernel_key(
    device_name: str, cuda_capability: str, kernel_source: Path = KERNEL_SOURCE
) -> dict[str, str]:
    """What a receipt's result depends on, for a device named by the caller."""
    import triton  # triton alone; this package's kernels are decorated only when first run

    return {
        "kernel_source_sha256": hash_file(kernel_source),
        "triton_version": triton.__version__,
        "torch_version": torch.__version__,
        "device_name": device_name,
        "cuda_capability": cuda_capability,
    }


def interpreted() -> bool:
    """Whether Triton runs its kernels on the CPU, in its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def grid_for(key: dict[str, str]) -> tuple[GateShape, ...]:
    """The shapes a receipt under `key` must have measured."""
    return INTERPRETER_GRID if key["cuda_capability"] == INTERPRETER else EQUIVALENCE_GRID


def proven_here() -> tuple[frozenset[torch.dtype], frozenset[int]]:
    """The dtypes and head dims the gate proves where kernels run in this process."""
    return gate.proven_by(INTERPRETER_GRID if interpreted() else EQUIVALENCE_GRID)


def device_key(device: torch.device | str) -> dict[str, str]:
    """The receipt key for `device` of this process: a CUDA device, or the CPU under the
    interpreter."""
    device = torch.device(device)
    if device.type == "cpu" and interpreted():
        return kernel_key("cpu (triton interpreter)", INTERPRETER)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            f"the {BACKEND} kernel needs a CUDA device, got {device} "
            f"(CUDA available: {torch.cuda.is_available()}); there is no fallback"
        )
    major, minor = torch.cuda.get_device_capability(device)
    return kernel_key(torch.cuda.get_device_name(device), f"{major}.{minor}")


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    causal: bool = True,
) -> torch.Tensor:
    """SDPA with an explicit mask in q's dtype; padding rows are zero, as the kernel's."""
    length = q.shape[2]
    group = q.shape[1] // k.shape[1]
    positions = torch.arange(length, device=q.device)
    real = positions[None, :] < seq_lens[:, None].to(q.device)
    allowed = real[:, None, None, :]
    if causal:
        allowed = allowed & (positions[None, :] <= positions[:, None])
    row_real = real[:, None, :, None]
    # A padding row attends to every key, so no row is empty (NaN), and is then zeroed.
    mask = allowed | ~row_real
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), attn_mask=mask
    )
    return out * row_real


def _forward_backward(
    attention_fn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    grad_out: torch.Tensor,
    compute_dtype: torch.dtype,
    seq_lens: torch.Tensor,
    causal: bool,
) -> dict[str, torch.Tensor]:
    q, k, v = (x.detach().to(compute_dtype).requires_grad_() for x in inputs)
    out = attention_fn(q, k, v, seq_lens, causal)
    out.backward(grad_out.to(compute_dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def measure_shape(shape: GateShape, device: torch.device, seed: int) -> dict[str, Any]:
    """Errors of the kernel (and, for context, of SDPA in the same dtype) on one shape."""
    from align.kernels.flash_attn import flash_attention  # importing decorates the kernels

    dtype = getattr(torch, shape.dtype)
    *inputs, grad_out = gate.draw_inputs(shape, device, seed)
    lengths = shape.seq_lens or (shape.length,) * shape.batch
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)

    def kernel(q, k, v, lens, causal):
        return flash_attention(q, k, v, seq_lens=lens, causal=causal)

    def run(attention_fn: Callable[..., torch.Tensor], compute_dtype: torch.dtype) -> dict:
        return _forward_backward(
            attention_fn, inputs, grad_out, compute_dtype, seq_lens, shape.causal
        )

    reference = run(reference_attention, torch.float64)
    found, baseline = run(kernel, dtype), run(reference_attention, dtype)
    return gate.shape_result(shape, seed, THRESHOLDS[shape.dtype], found, reference, baseline)


SPEC = GateSpec(
    backend=BACKEND,
    command=GATE_COMMAND,
    receipt_env=RECEIPT_ENV,
    key_components=KEY_COMPONENTS,
    metric=METRIC,
    thresholds=THRESHOLDS,
    grid_for=grid_for,
)


def run_gate(
    device: torch.device | str, key: dict[str, str], grid: Sequence[GateShape] | None = None
) -> dict[str, Any]:
    """Measure every shape of `grid` (the key's grid by default) on `device`."""
    return gate.run_gate(SPEC, device, key, measure_shape, grid)


def receipt_path(key: dict[str, str], directory: Path | None = None) -> Path:
    return gate.receipt_path(SPEC, key, directory)


def seal_receipt(key: dict[str, str], results: list[dict[str, Any]], seconds: float) -> dict:
    return gate.seal_receipt(SPEC, key, results, seconds)


def verify_receipt(path: Path, key: dict[str, str]) -> dict[str, Any]:
    return gate.verify_receipt(SPEC, path, key)


def require_proven_kernel(device: torch.device | str) -> dict[str, Any]:
    """The passed, current receipt for the kernel on `device`; ValueError otherwise."""
    return gate.required_receipt(SPEC, device_key(device))


def main(argv: Sequence[str] | None = None) -> int:
    description = __doc__.split("\n\n")[0]
    return gate.main(SPEC, argv, device_key, measure_shape, description)


if __name__ == "__main__":
    run_with_exit_codes(main, "kernel-equivalence")
