"""Memory projections of a training job, term by term, and the preflight's checks (no torch).

`projected_job_rss` sums what the whole job holds in host memory for the optimizer and
precision it really runs: on the CPU the sharded master weights, gradients, optimizer
state and activations; everywhere rank 0's staging copy of the checkpoint during the
load, the data shards and the per-rank runtime. `projected_device_memory` is the
per-GPU peak of a CUDA job: sharded master weights, gradients and optimizer state, the
gathered layers and root in compute dtype, activations at seq_len x micro_batch (with or
without activation checkpointing), the fused loss head's chunk, and the CUDA context.
Both read the checkpoint's config only once its tensors confirm it (a lying config.json
is refused, exit 3); `check_stage_rss` judges a stage's projection against the node
before the stage builds a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.config import ArmConfig, ModelConfig, PreflightConfig, RunConfig
from align.exit_codes import PreflightRefused
from align.model.checkpoint_shapes import verified_hf_config, verify_checkpoint
from align.model.hf_config import MistralConfig, load_hf_config
from align.topology import topology
from align.utils.weights_hash import INDEX_FILE_NAME, SINGLE_FILE_NAME

MIB = 2**20
GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# bitsandbytes' blockwise 8-bit moments: one float32 absmax scale per block of each moment.
ADAMW8BIT_BLOCK = 256
# Positions per chunk of the fused loss head (align.losses.fused.DEFAULT_CHUNK_SIZE).
LOSS_CHUNK = 1024


def parameter_count(config: MistralConfig) -> dict[str, int]:
    """Parameters of one decoder layer, of the root (embedding, final norm, lm_head), in all."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    attn = h * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    layer = attn + 3 * h * i + 2 * h
    root = v * h + (0 if config.tie_word_embeddings else v * h) + h
    return {"layer": layer, "root": root, "total": config.num_hidden_layers * layer + root}


def optimizer_state_bytes(name: str, master_dtype: str) -> float:
    """Bytes of optimizer state per parameter: torch's AdamW keeps two moments in the master
    dtype; bitsandbytes' 8-bit AdamW one byte each plus the per-block absmax scales."""
    if name == "adamw":
        return 2.0 * DTYPE_BYTES[master_dtype]
    if name == "adamw8bit":
        return 2.0 + 2 * 4 / ADAMW8BIT_BLOCK
    raise PreflightRefused(f"no memory model for optimizer {name!r}")


def activation_bytes_per_token_layer(config: MistralConfig, compute_bytes: int) -> int:
    """What autograd keeps of one token in one decoder layer of align.model.mistral.

    Each RMSNorm keeps its float32 input and its normed output; rotary embedding keeps the
    rotated halves of q and k; attention keeps q, k, v, its output and a float32
    log-sum-exp per head; the o projection its (contiguous) input; the SwiGLU MLP its gate
    and up outputs, the activated gate and their product.
    """
    h, i = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    norms = 2 * (4 * h + compute_bytes * h)
    rope = compute_bytes * (q + kv)
    attention = compute_bytes * (2 * q + 2 * kv) + 4 * config.num_attention_heads
    o_input = compute_bytes * q
    mlp = 4 * compute_bytes * i
    return norms + rope + attention + o_input + mlp


def micro_batch_tokens(cfg: ArmConfig) -> tuple[int, int]:
    """(rows, tokens per row) of the widest micro-batch: chosen and rejected rows of
    seq_len, or one prefix-shared row of at most 2 x seq_len per pair."""
    if cfg.batch.share_prompt:
        return cfg.batch.micro_batch, 2 * cfg.data.seq_len
    return 2 * cfg.batch.micro_batch, cfg.data.seq_len


def device_activation_terms(cfg: ArmConfig, config: MistralConfig) -> dict[str, float]:
    """Activations of one micro-batch on the device, in bytes, and the attention mask bias.

    A padded batch gives SDPA a boolean mask that it turns into a compute-dtype bias per
    layer call, and keeps for backward. Activation checkpointing keeps each layer's input
    and recomputes one layer's activations at a time in backward.
    """
    c = DTYPE_BYTES[cfg.model.dtype]
    rows, length = micro_batch_tokens(cfg)
    tokens = rows * length
    per_layer = activation_bytes_per_token_layer(config, c) * tokens
    mask = rows * length * length * c
    layers = config.num_hidden_layers
    if cfg.trainer.activation_checkpointing:
        kept = layers * tokens * config.hidden_size * c + per_layer + mask
    else:
        kept = layers * (per_layer + mask)
    final_hidden = tokens * config.hidden_size * c
    return {"activations": kept + final_hidden}


def loss_head_bytes(cfg: ArmConfig, config: MistralConfig) -> float:
    """The fused loss's float32 logits chunk; below float32 compute also its float32 copy of
    lm_head and the float32 weight gradient it accumulates, then casts."""
    c = DTYPE_BYTES[cfg.model.dtype]
    head = config.vocab_size * config.hidden_size
    chunk = LOSS_CHUNK * config.vocab_size * 4
    return chunk + (head * (4 + 4 + c) if c < 4 else head * 4)


def projected_device_memory(cfg: ArmConfig, checkpoint: str | Path) -> dict[str, Any]:
    """Projected peak memory of one GPU of the job, by term, in MiB."""
    config = _device_projection_config(Path(checkpoint))
    counts = parameter_count(config)
    m, c, r = (
        DTYPE_BYTES[d] for d in (cfg.model.master_dtype, cfg.model.dtype, cfg.model.reduce_dtype)
    )
    shard = counts["total"] / cfg.batch.world_size
    # FSDP casts a gathered layer's gradients to the reduce dtype before reduce-scatter.
    reduce_copy = r if r != c else 0
    terms = {
        "master_weights": shard * m,
        "gradients": shard * m,
        "optimizer_state": shard
        * optimizer_state_bytes(cfg.optimizer.name, cfg.model.master_dtype),
        # The layer in use and the one FSDP prefetches, in compute dtype.
        "gathered_layers": 2 * counts["layer"] * c,
        "layer_gradients": counts["layer"] * (c + reduce_copy),
        # The root stays gathered from the first forward to the end of backward.
        "gathered_root": counts["root"] * (2 * c + reduce_copy),
        **device_activation_terms(cfg, config),
        "loss_head": loss_head_bytes(cfg, config),
        "cuda_context": cfg.preflight.cuda_context_mb * MIB,
    }
    terms_mb = {name: value / MIB for name, value in terms.items()}
    total = sum(terms_mb.values())
    return {
        "optimizer": cfg.optimizer.name,
        "precision": {
            "compute": cfg.model.dtype,
            "master": cfg.model.master_dtype,
            "reduce": cfg.model.reduce_dtype,
        },
        "world_size": cfg.batch.world_size,
        "activation_checkpointing": cfg.trainer.activation_checkpointing,
        "terms_mb": terms_mb,
        "total_mb": total,
        # What torch's allocator should see (max_memory_allocated): all but the context.
        "allocated_mb": total - terms_mb["cuda_context"],
    }


def _device_projection_config(checkpoint: Path) -> MistralConfig:
    """config.json once the weights (or their index) confirm it; a directory without any
    is `align memory`'s what-if, which nothing can load, so its config.json as written."""
    if (checkpoint / SINGLE_FILE_NAME).is_file() or (checkpoint / INDEX_FILE_NAME).is_file():
        return verified_hf_config(checkpoint)
    return load_hf_config(checkpoint)


def device_memory_mb(preflight: PreflightConfig) -> tuple[float, str]:
    """(per-GPU memory in MiB, where the figure came from): the pre-registered
    device_memory_gb, else the device this rank runs on."""
    if preflight.device_memory_gb:
        return preflight.device_memory_gb * GIB / MIB, "preflight.device_memory_gb"
    import os

    import torch

    if not torch.cuda.is_available():
        raise PreflightRefused(
            "run.device = 'cuda' but no GPU is visible here to read its memory from: "
            "pre-register preflight.device_memory_gb (the per-GPU memory of the target node)"
        )
    index = int(os.environ.get("LOCAL_RANK", "0"))
    # Device properties need no CUDA context, so no rank lands a context on another's GPU.
    total = torch.cuda.get_device_properties(index).total_memory
    return total / MIB, f"torch.cuda device {index} ({torch.cuda.get_device_name(index)})"


def check_device_projection(
    projection: dict[str, Any], preflight: PreflightConfig, device_mb: float, source: str
) -> dict[str, Any]:
    """Refuse (exit 6) a per-GPU projection over `device_memory_fraction` of the device."""
    budget = preflight.device_memory_fraction * device_mb
    if projection["total_mb"] > budget:
        terms = ", ".join(f"{k} {v:.0f}" for k, v in projection["terms_mb"].items())
        raise PreflightRefused(
            f"projected device memory {projection['total_mb']:.0f} MiB per GPU for optimizer "
            f"{projection['optimizer']} ({projection['precision']}) exceeds "
            f"{preflight.device_memory_fraction:.0%} of {device_mb:.0f} MiB ({source}): {terms} MiB"
        )
    return {"device_mb": device_mb, "device_source": source, "device_budget_mb": budget}


@dataclass(frozen=True)
class StageLoad:
    """What a stage holds: policies at once (DPO scores the SFT policy beside the trained
    one), whether it trains (gradients, optimizer state), whether rank 0 exports at the end."""

    models: int
    trains: bool
    exports: bool


STAGE_LOADS = {
    "sft": StageLoad(1, True, True),
    "dpo": StageLoad(2, True, True),
    "probe": StageLoad(1, True, False),
    "sft_gate": StageLoad(1, False, False),
    "ref_cache": StageLoad(1, False, False),
    "path_bias": StageLoad(1, False, False),
    "select_arms": StageLoad(1, False, False),
}


@dataclass(frozen=True)
class JobShape:
    """One model-loading job as its memory depends on it."""

    stage: str
    world: int
    nodes: int
    device: str
    model: ModelConfig
    optimizer: str
    rows: int  # rows of one forward
    seq_len: int  # 0: as long as the model's positions (no pre-registered seq_len)
    preflight: PreflightConfig


def job_shape(stage: str, cfg: Any, nodes: int = 1) -> JobShape:
    """The shape of `stage` under its pre-registration (arm, SFT or selection config)."""
    batch = getattr(cfg, "batch", None)
    data = getattr(cfg, "data", None)
    trains = STAGE_LOADS[stage].trains
    if trains:
        rows = 2 * batch.micro_batch
    elif stage == "ref_cache":
        rows = 2 * cfg.ref.batch_size
    else:
        rows = 2 * cfg.eval.batch_size
    world = batch.world_size if batch is not None and stage not in SINGLE_PROCESS else 1
    return JobShape(
        stage=stage,
        world=world,
        nodes=nodes,
        device=cfg.run.device,
        model=cfg.model,
        optimizer=cfg.optimizer.name if trains else "",
        rows=rows,
        seq_len=data.seq_len if data is not None else 0,
        preflight=getattr(cfg, "preflight", PreflightConfig()),
    )


# sft_gate and select_arms score in one process whatever the training topology.
SINGLE_PROCESS = ("sft_gate", "select_arms")


def projected_job_rss(shape: JobShape, checkpoint: str | Path, shard_bytes: int) -> dict[str, Any]:
    """Projected peak RSS of the whole job and of its fullest node, by term, in MiB.

    Steady terms are held by every rank for the whole stage; rank 0 adds, at different
    times, its staging copy of the checkpoint during each load and, for a stage that
    exports, the consolidated state it gathers: the larger of the two counts.
    """
    verified = verify_checkpoint(checkpoint)
    config = verified.config
    counts = parameter_count(config)
    load = STAGE_LOADS[shape.stage]
    master, compute = DTYPE_BYTES[shape.model.master_dtype], DTYPE_BYTES[shape.model.dtype]
    on_cpu = shape.device == "cpu"
    sharded = counts["total"] / shape.world
    per_rank = {
        "weights": load.models * sharded * master if on_cpu else 0.0,
        "grads": sharded * master if on_cpu and load.trains else 0.0,
        "optimizer_state": (
            sharded * optimizer_state_bytes(shape.optimizer, shape.model.master_dtype)
            if on_cpu and load.trains
            else 0.0
        ),
        "gathered_layer": 2 * counts["layer"] * compute if on_cpu else 0.0,
        "activations": _cpu_activations(shape, load, config) if on_cpu else 0.0,
        "data_shards": float(shard_bytes),
        "runtime": rank_overhead_mb(shape.preflight, shape.device) * MIB,
    }
    steady = {name: shape.world * value / MIB for name, value in per_rank.items()}
    # Rank 0 reads the whole checkpoint in its stored dtype, then casts it to the master dtype.
    stored = verified.stored_bytes
    full_master = counts["total"] * master
    transient = {
        "load_staging_rank0": (stored + (full_master if stored != full_master else 0)) / MIB
    }
    if load.exports:
        transient["export_gather_rank0"] = full_master / MIB
    peak_transient = max(transient.values())
    return {
        "stage": shape.stage,
        "optimizer": shape.optimizer or None,
        "world_size": shape.world,
        "nodes": shape.nodes,
        "parameters": counts["total"],
        "terms_mb": {**steady, **transient},
        "total_mb": sum(steady.values()) + peak_transient,
        # Rank 0's node: its share of the steady terms and rank 0's transient.
        "node_mb": sum(steady.values()) / shape.nodes + peak_transient,
    }


def rank_overhead_mb(preflight: PreflightConfig, device: str) -> float:
    """Host memory a rank holds outside the model's tensors, for the device it computes on."""
    return preflight.cuda_rank_overhead_mb if device == "cuda" else preflight.cpu_rank_overhead_mb


def _cpu_activations(shape: JobShape, load: StageLoad, config: MistralConfig) -> float:
    """Activations of one forward's rows on the CPU, plus its logits: every layer's, kept
    for backward, when the stage trains; one layer's at a time when it only scores."""
    tokens = shape.rows * (shape.seq_len or config.max_position_embeddings)
    per_layer = shape.preflight.activation_factor * tokens * config.hidden_size * 4
    logits = 3 * tokens * config.vocab_size * 4
    return (config.num_hidden_layers if load.trains else 1) * per_layer + logits


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


def node_memory(run: RunConfig) -> tuple[float, str]:
    """(MiB, where the figure came from) of the node the job runs on: what the workflow
    passed (a per-partition setting, or Slurm's record of the partition's nodes), else
    this host's available memory, for a job that runs here."""
    if run.node_memory_mb:
        return run.node_memory_mb, run.node_memory_source or "run.node_memory_mb"
    return host_available_mb(), "this host's MemAvailable (or cgroup headroom)"


def check_projection(
    projection: dict[str, Any], fraction: float, available_mb: float, source: str
) -> dict:
    """Refuse (exit 6) a projection whose fullest node exceeds `fraction` of the node's memory."""
    budget = fraction * available_mb
    if projection["node_mb"] > budget:
        terms = ", ".join(f"{k} {v:.0f}" for k, v in projection["terms_mb"].items())
        raise PreflightRefused(
            f"projected RSS {projection['node_mb']:.0f} MiB per node ({projection['nodes']} "
            f"node(s)) for optimizer {projection['optimizer']} exceeds {fraction:.0%} of the "
            f"node's {available_mb:.0f} MiB ({source}); job terms: {terms} MiB"
        )
    return {
        "available_mb": available_mb,
        "node_memory_source": source,
        "budget_mb": budget,
        "headroom_mb": budget - projection["node_mb"],
    }


def check_stage_rss(
    stage: str, cfg: Any, checkpoint: str | Path, shard_bytes: int = 0
) -> dict[str, Any]:
    """The stage's projected RSS (from the checkpoint's verified config and header sizes)
    judged against its node before any model is built: refused (exit 6) when over
    `preflight.host_memory_fraction` of it; the projection with the verdict otherwise."""
    shape = job_shape(stage, cfg, stage_nodes(stage, cfg))
    projection = projected_job_rss(shape, checkpoint, shard_bytes)
    fraction = shape.preflight.host_memory_fraction
    projection.update(check_projection(projection, fraction, *node_memory(cfg.run)))
    return projection


def stage_nodes(stage: str, cfg: Any) -> int:
    """The nodes the stage's ranks span (one for a stage that scores in one process)."""
    batch = getattr(cfg, "batch", None)
    if batch is None or stage in SINGLE_PROCESS:
        return 1
    return topology(batch.world_size, batch.gpus_per_node, cfg.run.gpus_per_node).nodes
