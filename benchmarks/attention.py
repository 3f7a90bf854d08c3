"""Forward+backward time and peak memory of triton_fa2 and flex against SDPA's kernels,
and of a decoder layer's step in each pair layout.

Kernels: 7B attention shapes (32 query heads, 8 K/V heads, head dim 128, bfloat16, causal,
full length), one row per shape and backend, with time and memory as ratios to SDPA flash.
A backend that cannot share K/V heads (enable_gqa) is timed with K/V repeated inside
the timed region, and its row says so.

Layouts (--layouts): one 7B-shaped decoder layer (align's own, with a small vocabulary so
that the layer dominates) trains on prompt-heavy pairs (prompt 5/8 of the pair's length,
chosen 3/8, rejected 1/4; the pairs' lengths T, T/2, T/4, T/4 in turn), collated by
align.data.loader as two right-padded rows [prompt | response] through triton_fa2, flex
and sdpa, as one prefix-shared row [prompt | chosen | rejected] per pair, or packed
several pairs to a row, through flex and sdpa (which runs them as one unpadded stream of
exact attention pieces, align.kernels.pieces). Ratios are to two rows through triton_fa2,
the production path; the goal for shared rows through flex or sdpa is <= 0.7.

Refuses to run without CUDA: CPU or interpreter timings say nothing about the kernels.

usage: python benchmarks/attention.py [--lengths 2048 4096 8192] [--batches 1 2]
       [--layouts [--layout-lengths 2048 4096] [--layout-pairs 4]] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
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


def flex_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """flex under a full-length causal block mask, built once per shape."""
    from align.kernels import flex

    batch, length = q.shape[0], q.shape[2]
    key = (batch, length, q.device)
    if key not in _FLEX_MASKS:
        segments, positions = flex.plain_segments(None, torch.Size(key[:2]), q.device)
        _FLEX_MASKS[key] = flex.build_flex_mask(segments, positions, None)
    return flex.flex_attention_fn(q, k, v, _FLEX_MASKS[key])


_FLEX_MASKS: dict[tuple, object] = {}


def candidates(inputs) -> dict[str, tuple[AttentionFn, str]]:
    """Each backend's function and a note; an SDPA backend without GQA gets repeated K/V."""
    from align.kernels.flash_attn import flash_attention

    backends: dict[str, tuple[AttentionFn, str]] = {
        "triton_fa2": (flash_attention, ""),
        "flex": (flex_causal, "block mask built once"),
    }
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


# Prompt-heavy pairs, in eighths of T: the prompt, the chosen and the rejected response.
PROMPT, CHOSEN, REJECTED = 5, 3, 2
LAYOUT_BASELINE = "two rows, triton_fa2"


def layer_model(attn: str) -> torch.nn.Module:
    """One 7B-shaped decoder layer with a small vocabulary, in bfloat16 on CUDA."""
    from align.model.hf_config import MistralConfig
    from align.model.mistral import NmoMistralForCausalLM

    config = MistralConfig(
        vocab_size=1024,
        hidden_size=Q_HEADS * HEAD_DIM,
        intermediate_size=14336,
        num_hidden_layers=1,
        num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS,
        sliding_window=None,
    )
    torch.manual_seed(0)
    return NmoMistralForCausalLM(config, attn, torch.device("cuda")).to("cuda", torch.bfloat16)


def layout_inputs(batch: int, length: int, layout: str) -> dict[str, torch.Tensor]:
    """`batch` prompt-heavy pairs of lengths T, T/2, T/4, T/4, ... in `layout`, on CUDA."""
    from align.data.loader import collate_pairs
    from align.data.shards import pair_arrays
    from align.data.tokenize import TokenizedPair

    draw = np.random.default_rng(0).integers
    pairs = []
    for index in range(batch):
        scale = length // (1, 2, 4, 4)[index % 4]
        prompt, chosen, rejected = (scale * part // 8 for part in (PROMPT, CHOSEN, REJECTED))
        pairs.append(
            TokenizedPair(
                list(draw(1, 1024, prompt)),
                list(draw(1, 1024, chosen)),
                list(draw(1, 1024, rejected)),
                False,
            )
        )
    arrays = pair_arrays(range(batch), pairs, pad_id=0)
    collated = collate_pairs(arrays, np.arange(batch), layout).to(torch.device("cuda"))
    if layout == "padded":
        return {"input_ids": collated.input_ids, "attention_mask": collated.attention_mask}
    return {
        "input_ids": collated.input_ids,
        "segment_ids": collated.segment_ids,
        "position_ids": collated.position_ids,
    }


def layout_step(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    hidden = model(**inputs, return_hidden=True)
    hidden.float().square().mean().backward()


def benchmark_layouts(batch: int, length: int, warmup: int, iters: int) -> list[dict]:
    cases = {
        LAYOUT_BASELINE: ("triton_fa2", "padded"),
        "two rows, flex": ("flex", "padded"),
        "two rows, sdpa": ("sdpa", "padded"),
        "shared rows, flex": ("flex", "shared"),
        "shared rows, sdpa (stream)": ("sdpa", "shared"),
        "packed rows, flex": ("flex", "packed"),
        "packed rows, sdpa (stream)": ("sdpa", "packed"),
    }
    rows = []
    for name, (attn, layout) in cases.items():
        model, inputs = layer_model(attn), layout_inputs(batch, length, layout)

        def step(model=model, inputs=inputs):
            layout_step(model, inputs)

        for _ in range(warmup):
            step()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        positions = inputs["input_ids"].numel()
        rows.append(
            {
                "batch": batch,
                "length": length,
                "layout": name,
                "positions": positions,
                "ms": statistics.median(times),
            }
        )
        del model
        torch.cuda.empty_cache()
    baseline = next(row for row in rows if row["layout"] == LAYOUT_BASELINE)
    for row in rows:
        row["time_ratio"] = row["ms"] / baseline["ms"]
    return rows


def format_layouts(rows: list[dict]) -> str:
    header = "| pairs | T | layout | positions | ms step | time / two rows triton_fa2 |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        lines.append(
            f"| {row['batch']} | {row['length']} | {row['layout']} | {row['positions']} | "
            f"{row['ms']:.2f} | {row['time_ratio']:.2f} |"
        )
    return "\n".join(lines)


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
    parser.add_argument("--layouts", action="store_true", help="also time the pair layouts")
    parser.add_argument("--layout-lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--layout-pairs", type=int, default=4, help="pairs per layout step")
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
    layouts = []
    if args.layouts:
        for length in args.layout_lengths:
            layouts += benchmark_layouts(args.layout_pairs, length, args.warmup, args.iters)
        print(format_layouts(layouts))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"environment": environment, "rows": rows, "layouts": layouts}
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
