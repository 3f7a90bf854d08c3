"""The equivalence gate of the flex attention backend (align.kernels.flex), and its receipts.

`run_gate` compares the backend on seeded random inputs with scaled_dot_product_attention
in float64 under the dense mask of the same rows (align.kernels.segments), over a
pre-registered grid: shared-prompt rows (a prefix and two branches whose positions
restart), packed rows (several such pairs), right-padded rows with a single-token row,
sliding windows, grouped-query heads, widths that end mid-block. It measures the output and, where FlexAttention has a backward (CUDA), dq, dk and dv, each by
max|flex - reference| / max|reference|, and times each shape's compilation. Receipts are
keyed by this package's flex source, torch and the device (a CPU by the vector ISA inductor
compiles for: torch 2.13's CPU flex compiled for AVX2 fails this gate on an AVX-512
machine, out errors about 1), and judged by align.kernels.gate.

CLI: python -m align.kernels.flex_gate [--out PATH] [--device cuda | cpu]
(exit 0 passed, 3 failed; the receipt is written either way). A stage reads the receipt
at $ALIGN_FLEX_RECEIPT (the workflow's results/kernels/flex.json) when that is set, else
the per-device receipt under $ALIGN_KERNEL_RECEIPTS.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from align.constants import GATED_ATTENTION, PAD_SEGMENT, PREFIX_SEGMENT, SEGMENTS_PER_PAIR
from align.exit_codes import run_with_exit_codes
from align.kernels import flex, gate
from align.kernels.gate import AttentionShape, GateSpec
from align.kernels.segments import build_segment_mask
from align.receipts import hash_file

SOURCE = Path(flex.__file__)
RECEIPT_ENV = GATED_ATTENTION[flex.BACKEND][2]
COMMAND = "python -m align.kernels.flex_gate"
CPU = "cpu"
METRIC = (
    "max|flex - reference| / max|reference| per tensor (out; dq, dk, dv where a backward "
    "runs); reference: scaled_dot_product_attention in float64 on the same rounded inputs "
    "under the dense segment mask of the same rows"
)
KEY_COMPONENTS = {
    "flex_source_sha256": "flex source (sha256 of align/kernels/flex.py)",
    "torch_version": "torch version",
    "device_name": "device name",
    "cuda_capability": "CUDA capability (or the CPU's vector ISA)",
}


@dataclass(frozen=True)
class FlexShape(AttentionShape):
    """One pre-registered case. Each row is its segments' lengths: one length is a plain
    row; each three are a pair (prefix, chosen, rejected), so six are a packed row of two;
    the rest is padding."""

    rows: tuple[tuple[int, ...], ...]
    window: int | None
    backward: bool


SHARED_300 = ((120, 90, 80), (100, 30, 20, 60, 50, 40))  # a shared row, a packed row
PADDED_129 = ((129,), (1,), (60,))
# The CPU compiles each shape in about 20 s: three shapes that cover the layouts, in
# float32, forward only (torch's FlexAttention has no CPU backward).
CPU_GRID: tuple[FlexShape, ...] = (
    FlexShape(2, 4, 2, 300, 64, "float32", SHARED_300, 128, False),
    FlexShape(3, 4, 1, 129, 64, "float32", PADDED_129, None, False),
    FlexShape(1, 8, 8, 256, 128, "float32", ((256,),), 64, False),
)
# On CUDA, forward and backward in bfloat16, up to the 7B head shape at 2048 and 4096.
CUDA_GRID: tuple[FlexShape, ...] = (
    FlexShape(2, 8, 2, 300, 64, "bfloat16", SHARED_300, 128, True),
    FlexShape(3, 4, 1, 129, 64, "bfloat16", PADDED_129, None, True),
    FlexShape(
        2,
        32,
        8,
        2048,
        128,
        "bfloat16",
        ((1200, 500, 348), (900, 300, 200, 400, 150, 98)),
        4096,
        True,
    ),
    FlexShape(2, 32, 8, 2048, 128, "bfloat16", ((2048,), (1237,)), 4096, True),
    FlexShape(1, 32, 8, 4096, 128, "bfloat16", ((2500, 900, 696),), 4096, True),
)
# float32: 1-3e-7 measured on the CPU shapes, against a masking error of order 1.
# bfloat16: the triton_fa2 gate's, about 4 roundoffs for the output and 8 for gradients.
THRESHOLDS: dict[str, dict[str, float]] = {
    "float32": {"out": 1e-5},
    "bfloat16": {"out": 1.5e-2, "dq": 3e-2, "dk": 3e-2, "dv": 3e-2},
}


def grid_for(key: dict[str, str]) -> tuple[FlexShape, ...]:
    """The shapes a receipt under `key` must have measured."""
    return CPU_GRID if key["cuda_capability"].startswith(CPU) else CUDA_GRID


SPEC = GateSpec(
    backend=flex.BACKEND,
    command=COMMAND,
    receipt_env=RECEIPT_ENV,
    key_components=KEY_COMPONENTS,
    metric=METRIC,
    thresholds=THRESHOLDS,
    grid_for=grid_for,
)


def device_key(device: torch.device | str) -> dict[str, str]:
    """The receipt key for `device` of this process."""
    device = torch.device(device)
    if device.type == "cpu":
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        name = platform.processor() or platform.machine()
        # What inductor compiles for now (it reads ATEN_CPU_CAPABILITY when it compiles),
        # not what ATen dispatched to when torch was imported.
        capability = f"{CPU}-{pick_vec_isa()}"
    elif device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        capability = "{}.{}".format(*torch.cuda.get_device_capability(device))
    else:
        raise ValueError(
            f"the {flex.BACKEND} backend runs on CUDA or the CPU, got {device} "
            f"(CUDA available: {torch.cuda.is_available()})"
        )
    return {
        "flex_source_sha256": hash_file(SOURCE),
        "torch_version": torch.__version__,
        "device_name": name,
        "cuda_capability": capability,
    }


def proven_for(device: torch.device) -> tuple[frozenset[torch.dtype], frozenset[int]]:
    """The dtypes and head dims the gate proves on a device of `device`'s type."""
    return gate.proven_by(CPU_GRID if device.type == "cpu" else CUDA_GRID)


def require_proven_flex(device: torch.device | str) -> dict[str, Any]:
    """The passed, current receipt for flex on `device`; ValueError otherwise."""
    return gate.required_receipt(SPEC, device_key(device))


def segments_of(shape: FlexShape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """segment_ids and position_ids [B, T] of the shape's rows, as the data loader lays
    them out: each pair's branches follow its prefix, with positions from the prefix's end."""
    segments = torch.full((shape.batch, shape.length), PAD_SEGMENT, dtype=torch.long)
    positions = torch.zeros((shape.batch, shape.length), dtype=torch.long)
    for b, row in enumerate(shape.rows):
        start = 0
        for index, width in enumerate(row):
            role = index % SEGMENTS_PER_PAIR  # 0 the prefix, 1 chosen, 2 rejected
            prefix = row[index - role]
            first = 0 if role == 0 else prefix
            segments[b, start : start + width] = PREFIX_SEGMENT + index
            positions[b, start : start + width] = torch.arange(first, first + width)
            start += width
    return segments.to(device), positions.to(device)


def measure_shape(shape: FlexShape, device: torch.device, seed: int) -> dict[str, Any]:
    """Errors of flex on one shape, against the float64 reference (and, for context,
    SDPA's in the same dtype), with the seconds of its first, compiling call."""
    dtype = getattr(torch, shape.dtype)
    *inputs, grad_out = gate.draw_inputs(shape, device, seed)
    segment_ids, position_ids = segments_of(shape, device)
    dense = build_segment_mask(segment_ids, position_ids, shape.window)
    block = flex.build_flex_mask(segment_ids, position_ids, shape.window)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)

    def run(attention, compute_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        q, k, v = (x.detach().to(compute_dtype).requires_grad_(shape.backward) for x in inputs)
        with torch.set_grad_enabled(shape.backward):
            out = attention(q, k, v)
        if not shape.backward:
            return {"out": out}
        out.backward(grad_out.to(compute_dtype))
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    reference = run(sdpa, torch.float64)
    started = time.perf_counter()
    found = run(lambda q, k, v: flex.flex_attention_fn(q, k, v, block), dtype)
    first_call_s = time.perf_counter() - started
    baseline = run(sdpa, dtype)
    result = gate.shape_result(shape, seed, THRESHOLDS[shape.dtype], found, reference, baseline)
    return {**result, "first_call_s": round(first_call_s, 3)}


def run_gate(
    device: torch.device | str, key: dict[str, str], grid: Sequence[FlexShape] | None = None
) -> dict[str, Any]:
    """Measure every shape of `grid` (the key's grid by default) on `device`."""
    return gate.run_gate(SPEC, device, key, measure_shape, grid)


def main(argv: Sequence[str] | None = None) -> int:
    return gate.main(SPEC, argv, device_key, measure_shape, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    run_with_exit_codes(main, "kernel-equivalence")
