"""Forward+backward time and peak memory of triton_fa2 against SDPA's flash and efficient kernels.

7B attention shapes (32 query heads, 8 K/V heads, head dim 128, bfloat16, causal, full
length), one row per shape and backend, with time and memory as ratios to SDPA flash.
A backend that cannot share K/V heads (enable_gqa) is timed with K/V repeated inside
the timed region, and its row says so. Refuses to run without CUDA: CPU or interpreter
timings say nothing about the kernel.

usage: python benchmarks/attention.py [--lengths 2048 4096 8192] [--batches 1 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}
BASELINE = "sdpa_flash"
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_fn(backend: SDPBackend, share_kv_heads: bool) -> AttentionFn:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backend):
            if share_kv_heads:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def forward_backward(fn: AttentionFn, q, k, v, grad_out) -> torch.Tensor:
    out = fn(q, k, v)
    torch.autograd.grad(out, (q, k, v), grad_out)
    return out


def time_ms(fn: AttentionFn, inputs, warmup: int, iters: int) -> float:
    """Median of `iters` CUDA-event timings of one forward+backward, after `warmup` runs."""
    for _ in range(warmup):
        forward_backward(fn, *inputs)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        forward_backward(fn, *inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_extra_mib(fn: AttentionFn, inputs) -> float:
    """Peak memory one forward+backward allocates beyond its inputs, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    forward_backward(fn, *inputs)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def causal_tflop(batch: int, length: int) -> float:
    # Forward is two T x T x D matmuls per head, half of them masked; backward is 2.5x that.
    forward = 2 * 2 * batch * Q_HEADS * length * length * HEAD_DIM / 2
    return 3.5 * forward / 1e12


def candidates(inputs) -> dict[str, tuple[AttentionFn, str]]:
    """Each backend's function and a note; an SDPA backend without GQA gets repeated K/V."""
    from align.kernels.flash_attn import flash_attention

    backends: dict[str, tuple[AttentionFn, str]] = {"triton_fa2": (flash_attention, "")}
    for name, backend in SDPA_BACKENDS.items():
        try:
            forward_backward(sdpa_fn(backend, share_kv_heads=True), *inputs)
            backends[name] = (sdpa_fn(backend, share_kv_heads=True), "")
        except RuntimeError:  # this backend has no kernel for shared K/V heads
            backends[name] = (sdpa_fn(backend, share_kv_heads=False), "kv repeated")
    return backends


def benchmark_shape(batch: int, length: int, warmup: int, iters: int) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)

    def draw(heads: int, grad: bool = True) -> torch.Tensor:
        size = (batch, heads, length, HEAD_DIM)
        x = torch.randn(size, generator=generator, device="cuda", dtype=torch.bfloat16)
        return x.requires_grad_(grad)

    inputs = (draw(Q_HEADS), draw(KV_HEADS), draw(KV_HEADS), draw(Q_HEADS, grad=False))
    rows = []
    outputs = {}
    for name, (fn, note) in candidates(inputs).items():
        outputs[name] = forward_backward(fn, *inputs).detach().float()
        ms = time_ms(fn, inputs, warmup, iters)
        rows.append(
            {
                "batch": batch,
                "length": length,
                "backend": name,
                "note": note,
                "ms": ms,
                "tflops": causal_tflop(batch, length) / (ms / 1e3),
                "peak_extra_mib": peak_extra_mib(fn, inputs),
                "max_abs_diff_vs_baseline": None,
            }
        )
    baseline = next(row for row in rows if row["backend"] == BASELINE)
    for row in rows:
        row["time_ratio"] = row["ms"] / baseline["ms"]
        row["memory_ratio"] = row["peak_extra_mib"] / baseline["peak_extra_mib"]
        row["max_abs_diff_vs_baseline"] = (
            (outputs[row["backend"]] - outputs[BASELINE]).abs().max().item()
        )
    return rows


def format_table(rows: list[dict]) -> str:
    header = (
        "| B | T | backend | ms fwd+bwd | TFLOP/s | peak extra MiB | time / flash | "
        "memory / flash | max abs diff vs flash | note |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        lines.append(
            f"| {row['batch']} | {row['length']} | {row['backend']} | {row['ms']:.2f} | "
            f"{row['tflops']:.0f} | {row['peak_extra_mib']:.0f} | {row['time_ratio']:.2f} | "
            f"{row['memory_ratio']:.2f} | {row['max_abs_diff_vs_baseline']:.2e} | {row['note']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, help="also write the rows and environment as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/attention.py needs a CUDA device: it times GPU kernels, and this "
            "machine has none (no CPU fallback is measured)",
            file=sys.stderr,
        )
        return 2
    import triton

    environment = {
        "device": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": f"{Q_HEADS} q heads, {KV_HEADS} kv heads, head dim {HEAD_DIM}, bfloat16, causal",
    }
    print(" | ".join(f"{name}: {value}" for name, value in environment.items()))
    rows = []
    for batch in args.batches:
        for length in args.lengths:
            rows += benchmark_shape(batch, length, args.warmup, args.iters)
            torch.cuda.empty_cache()
    print(format_table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"environment": environment, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
