"""The resource preflight's RSS projection and the throughput probe's figures (no torch).

`projected_job_rss` sums, per rank, what the stage will hold in host memory for the
optimizer it really runs: sharded weights, gradients and optimizer state, one
gathered layer, rank 0's staging copy of the checkpoint during the load,
activations when training on the CPU, the data shards, and the per-rank runtime.
The probe measures the same run for `probe_steps` micro-steps.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from align.config import ArmConfig
from align.exit_codes import PreflightRefused
from align.model.hf_config import MistralConfig, load_hf_config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Two moments per parameter: float32 for torch's AdamW; for bitsandbytes' 8-bit AdamW one
# byte each plus one float32 absmax scale per 256-value block of each.
OPTIMIZER_STATE_BYTES = {"adamw": 8.0, "adamw8bit": 2.0 + 2 * 4 / 256}
MIB = 2**20


def parameter_count(config: MistralConfig) -> dict[str, int]:
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = config.head_dim or h // config.num_attention_heads
    attn = h * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    layer = attn + 3 * h * i + 2 * h
    embed = v * h
    head = 0 if config.tie_word_embeddings else v * h
    return {"layer": layer, "total": config.num_hidden_layers * layer + embed + head + h}


def projected_job_rss(cfg: ArmConfig, checkpoint: str | Path, shard_bytes: int) -> dict[str, Any]:
    """Projected peak RSS of the whole job (all ranks), broken down by term, in MiB."""
    config = load_hf_config(checkpoint)
    counts = parameter_count(config)
    world = cfg.batch.world_size
    weight_bytes = DTYPE_BYTES[cfg.model.dtype]
    if cfg.optimizer.name not in OPTIMIZER_STATE_BYTES:
        raise PreflightRefused(f"no RSS model for optimizer {cfg.optimizer.name!r}")
    on_cpu = cfg.run.device == "cpu"
    sharded = counts["total"] / world
    per_rank = {
        "weights": sharded * weight_bytes,
        "grads": sharded * weight_bytes,
        "optimizer_state": sharded * OPTIMIZER_STATE_BYTES[cfg.optimizer.name],
        "gathered_layer": 2 * counts["layer"] * weight_bytes,
        "activations": _activations(cfg, config) if on_cpu else 0.0,
        "data_shards": float(shard_bytes),
        "runtime": cfg.preflight.rank_overhead_mb * MIB,
    }
    if not on_cpu:
        # Device-resident terms live in GPU memory; the host keeps staging and runtime only.
        per_rank.update(weights=0.0, grads=0.0, optimizer_state=0.0, gathered_layer=0.0)
    staging = counts["total"] * weight_bytes  # rank 0 reads the full checkpoint once
    terms = {name: world * value / MIB for name, value in per_rank.items()}
    terms["load_staging_rank0"] = staging / MIB
    return {
        "optimizer": cfg.optimizer.name,
        "world_size": world,
        "parameters": counts["total"],
        "terms_mb": terms,
        "total_mb": sum(terms.values()),
    }


def _activations(cfg: ArmConfig, config: MistralConfig) -> float:
    """Saved activations of one micro-batch (chosen + rejected rows), plus its logits."""
    rows = 2 * cfg.batch.micro_batch
    tokens = rows * cfg.data.seq_len
    per_layer = cfg.preflight.activation_factor * tokens * config.hidden_size * 4
    logits = 3 * tokens * config.vocab_size * 4
    return config.num_hidden_layers * per_layer + logits


def host_available_mb() -> float:
    """MemAvailable of /proc/meminfo, or the cgroup limit's headroom when that is smaller."""
    available = None
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    limit_file = Path("/sys/fs/cgroup/memory.max")
    if limit_file.exists() and limit_file.read_text().strip() != "max":
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        available = min(available or 0, int(limit_file.read_text()) - used)
    return (available or 0) / MIB


def check_projection(
    projection: dict[str, Any], fraction: float, available_mb: float | None = None
) -> dict:
    """Refuse (exit 6) a projection over `fraction` of the host's available memory."""
    available = host_available_mb() if available_mb is None else available_mb
    budget = fraction * available
    if projection["total_mb"] > budget:
        terms = ", ".join(f"{k} {v:.0f}" for k, v in projection["terms_mb"].items())
        raise PreflightRefused(
            f"projected job RSS {projection['total_mb']:.0f} MiB for optimizer {projection['optimizer']} exceeds "
            f"{fraction:.0%} of available host memory {available:.0f} MiB ({terms} MiB)"
        )
    return {
        "available_mb": available,
        "budget_mb": budget,
        "headroom_mb": budget - projection["total_mb"],
    }


def probe_figures(
    step_times: list[float],
    tokens_per_s: list[float],
    micro_steps: int,
    horizon_steps: int,
    peak_rss_mb: float,
    peak_device_mb: float,
) -> dict[str, Any]:
    """Median step time and the wall-clock it projects for the whole training run."""
    if not step_times:
        raise ValueError("the probe ran no optimizer step: nothing was measured")
    # The first step pays one-off costs (allocator warm-up, lazy init); it is not typical.
    typical = step_times[1:] or step_times
    median = statistics.median(typical)
    return {
        "steps_measured": len(step_times),
        "micro_steps": micro_steps,
        "step_times": step_times,
        "median_step_s": median,
        "tokens_per_s": statistics.median(tokens_per_s[1:] or tokens_per_s),
        "peak_rss_mb": peak_rss_mb,
        "peak_device_mb": peak_device_mb,
        "horizon_steps": horizon_steps,
        "projected_wall_s": median * horizon_steps,
    }
