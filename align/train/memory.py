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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from align.config import ModelConfig, PreflightConfig, RunConfig
from align.constants import STREAMED_ATTENTION
from align.data import deal
from align.data.shards import RowWidths, pair_row_widths, read_shard
from align.exit_codes import PreflightRefused
from align.model.checkpoint_shapes import verified_hf_config, verify_checkpoint
from align.model.hf_config import MistralConfig, load_hf_config
from align.paths import SPLITS
from align.receipts import read_json
from align.topology import topology
from align.utils.weights_hash import INDEX_FILE_NAME, SINGLE_FILE_NAME

MIB = 2**20
GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# bitsandbytes' blockwise 8-bit moments: one float32 absmax scale per block of each moment.
ADAMW8BIT_BLOCK = 256
# Positions per chunk of the fused loss head (align.losses.fused.DEFAULT_CHUNK_SIZE).
LOSS_CHUNK = 1024
# float32 [chunk, vocab] tensors alive at once in the fused head: the logits, and in
# training their gradient beside them.
LOSS_HEAD_COPIES = 2
# Decoder layers a forward holds gathered in the compute dtype: the one it computes, and the
# next twice while FSDP prefetches it (the all-gather's output and the parameters it fills).
# A single rank has nothing to gather: it holds one copy of the layer it computes.
GATHERED_LAYER_COPIES = 3
SINGLE_RANK_LAYER_COPIES = 1


def gathered_layers(world: int, layer_params: int, compute_bytes: int) -> float:
    """Bytes of decoder layers one rank's forward holds beside its shards."""
    copies = GATHERED_LAYER_COPIES if world > 1 else SINGLE_RANK_LAYER_COPIES
    return copies * layer_params * compute_bytes


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


def kept_activation_bytes(config: MistralConfig, shape: JobShape) -> float:
    """Activations one training forward of the shape's rows x row_tokens keeps for
    backward, in bytes.

    A batch gives SDPA a boolean mask (JobShape.mask_positions) that it turns into a
    compute-dtype bias per layer call, and keeps for backward. Activation checkpointing
    keeps each layer's input and recomputes one layer's activations at a time in backward.
    """
    c = DTYPE_BYTES[shape.model.dtype]
    tokens = shape.rows * shape.row_tokens
    per_layer = activation_bytes_per_token_layer(config, c) * tokens
    mask = shape.mask_positions(shape.rows, shape.row_tokens) * c
    layers = config.num_hidden_layers
    if shape.activation_checkpointing:
        kept = layers * tokens * config.hidden_size * c + per_layer + mask
    else:
        kept = layers * (per_layer + mask)
    final_hidden = tokens * config.hidden_size * c
    return kept + final_hidden


def loss_head_bytes(c: int, config: MistralConfig) -> float:
    """The fused loss's float32 logits chunk; below float32 compute also its float32 copy of
    lm_head and the float32 weight gradient it accumulates, then casts."""
    head = config.vocab_size * config.hidden_size
    chunk = LOSS_CHUNK * config.vocab_size * 4
    return chunk + (head * (4 + 4 + c) if c < 4 else head * 4)


def projected_device_memory(
    cfg: Any, checkpoint: str | Path, stage: str = "dpo", seq_len: int = 0
) -> dict[str, Any]:
    """Projected peak memory of one GPU of `stage`'s job under `cfg`, by phase and term."""
    return projected_device_phases(job_shape(stage, cfg, seq_len=seq_len), checkpoint)


def projected_device_phases(shape: JobShape, checkpoint: str | Path) -> dict[str, Any]:
    """Projected peak memory of one GPU of the job, by phase and term, in MiB.

    Every phase holds this rank's shard of the master weights and the CUDA context. Load's
    read-back forward gathers layers and the root; training adds gradients, optimizer
    state, activations and the loss head; export moves one gathered tensor at a time to
    the host; evaluation scores without autograd, beside the SFT policy's shard in DPO.
    `terms_mb` and `allocated_mb` are training's where the stage trains (what the probe
    measures); `total_mb` is the largest phase's, what the device must hold.
    """
    config = _device_projection_config(Path(checkpoint))
    counts = parameter_count(config)
    load = STAGE_LOADS[shape.stage]
    m, c, r = (
        DTYPE_BYTES[shape.model.master_dtype],
        DTYPE_BYTES[shape.model.dtype],
        DTYPE_BYTES[shape.model.reduce_dtype],
    )
    shard = counts["total"] / shape.world
    # FSDP casts a gathered layer's gradients to the reduce dtype before reduce-scatter.
    reduce_copy = r if r != c else 0
    steady = {"master_weights": shard * m, "cuda_context": shape.preflight.cuda_context_mb * MIB}
    layers = gathered_layers(shape.world, counts["layer"], c)
    gathered = {"gathered_layers": layers, "gathered_root": counts["root"] * c}
    phases = {"load": {**steady, **gathered}}
    if load.trains:
        phases["train"] = {
            **steady,
            "gradients": shard * m,
            "optimizer_state": shard
            * optimizer_state_bytes(shape.optimizer, shape.model.master_dtype),
            "gathered_layers": layers,
            "layer_gradients": counts["layer"] * (c + reduce_copy),
            # The root stays gathered from the first forward to the end of backward.
            "gathered_root": counts["root"] * (2 * c + reduce_copy),
            "activations": kept_activation_bytes(config, shape),
            "loss_head": loss_head_bytes(c, config),
        }
    if load.exports:
        largest = config.vocab_size * config.hidden_size * m
        phases["export"] = {**steady, "gathered_tensor": largest}
    if "evaluate" in load.phases:
        policies = 2 if load.second_policy else 1
        scoring = max(
            shape.rank_scoring_bytes(
                lambda rows, tokens: scoring_activation_bytes(config, shape, rows, tokens)
            )
        )
        phases["evaluate"] = {
            **steady,
            "second_policy": shard * m if load.second_policy else 0.0,
            "gathered_layers": layers,
            "gathered_root": policies * counts["root"] * c,
            "activations": scoring,
            "loss_head": loss_head_bytes(c, config),
            "kv_cache": 0.0 if load.trains else kv_cache_bytes(shape, config),
        }
    phases = {
        name: {"terms_mb": {k: v / MIB for k, v in terms.items()}} for name, terms in phases.items()
    }
    for phase in phases.values():
        phase["total_mb"] = sum(phase["terms_mb"].values())
    measured = phases["train"] if load.trains else max(phases.values(), key=lambda p: p["total_mb"])
    return {
        "stage": shape.stage,
        "optimizer": shape.optimizer or None,
        "precision": {
            "compute": shape.model.dtype,
            "master": shape.model.master_dtype,
            "reduce": shape.model.reduce_dtype,
        },
        "world_size": shape.world,
        "activation_checkpointing": shape.activation_checkpointing,
        "phases": phases,
        "terms_mb": measured["terms_mb"],
        "total_mb": max(phase["total_mb"] for phase in phases.values()),
        # What torch's allocator should see (max_memory_allocated): all but the context.
        "allocated_mb": measured["total_mb"] - measured["terms_mb"]["cuda_context"],
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
            "run.device = 'cuda' but CUDA is not available on this host to read the GPU's "
            "memory from: run where the GPUs are, or pre-register preflight.device_memory_gb "
            "(the per-GPU memory of the target node) to project from this one"
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
        phases = projection["phases"]
        phase = max(phases, key=lambda name: phases[name]["total_mb"])
        terms = ", ".join(f"{k} {v:.0f}" for k, v in phases[phase]["terms_mb"].items())
        raise PreflightRefused(
            f"projected device memory {projection['total_mb']:.0f} MiB per GPU in {phase} for "
            f"optimizer {projection['optimizer']} ({projection['precision']}) exceeds "
            f"{preflight.device_memory_fraction:.0%} of {device_mb:.0f} MiB ({source}): {terms} MiB"
        )
    return {"device_mb": device_mb, "device_source": source, "device_budget_mb": budget}


@dataclass(frozen=True)
class StageLoad:
    """What a stage does with its model, phase by phase: whether it trains (gradients,
    optimizer state, activations kept for backward), exports (rank 0 gathers the whole
    state), scores a second policy beside the first when it evaluates (DPO scores the SFT
    policy beside the trained one), loads its policies in turn, each after the last one's
    scoring (selection), generates (a KV cache), and reads rows in-process (the parquet
    reader and tokenizer, or the arms' union eval set, rather than a built shard)."""

    phases: tuple[str, ...]
    second_policy: bool = False
    policies_in_turn: bool = False
    generates: bool = False
    reads_rows: bool = False

    @property
    def trains(self) -> bool:
        return "train" in self.phases

    @property
    def exports(self) -> bool:
        return "export" in self.phases


STAGE_LOADS = {
    "sft": StageLoad(("load", "train", "export", "evaluate"), reads_rows=True),
    # DPO's generation checks run between steps, when gradients and activations are freed:
    # their cache is smaller than what they replace, so it adds no training term.
    "dpo": StageLoad(("load", "train", "export", "evaluate"), second_policy=True, generates=True),
    "probe": StageLoad(("load", "train")),
    "sft_gate": StageLoad(("load", "evaluate"), generates=True, reads_rows=True),
    "ref_cache": StageLoad(("load", "evaluate")),
    "path_bias": StageLoad(("load", "evaluate")),
    "select_arms": StageLoad(
        ("load", "evaluate"), policies_in_turn=True, generates=True, reads_rows=True
    ),
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
    rows: int  # rows of one training forward (a training stage) or one scoring forward
    # Their length: the data's longest row in the stage's layout where the shards are known,
    # else the bound, seq_len (2 x seq_len for prefix-shared pair rows).
    row_tokens: int
    eval_rows: int  # rows of one held-out scoring forward after training, as long
    seq_len: int
    activation_checkpointing: bool
    generation_rows: int  # prompts generated at once
    prompt_tokens: int  # the longest prompt: data.max_prompt_tokens where it is set
    generation_tokens: int  # tokens each of them adds
    preflight: PreflightConfig
    # Each rank's scoring forwards, (rows, width), as the stage deals them from the pair
    # shards it reads; empty where they are not known (rows x row_tokens bounds them).
    scored: tuple[frozenset[tuple[int, int]], ...] = ()
    # Prefix-shared rows through a backend that runs them as one unpadded stream of exact
    # attention pieces (align.kernels.pieces): no dense mask.
    streamed: bool = False

    def mask_positions(self, rows: int, length: int) -> int:
        """Positions of the boolean attention mask one forward of rows x length builds: the
        dense [rows, T, T], or in a stream a rejected response's [r, p + r] per pair, each
        sequence at most seq_len long, with rows bounding the pairs."""
        if not self.streamed:
            return rows * length * length
        side = min(length, self.seq_len)
        return rows * side * side

    def rank_scoring_bytes(self, cost: Callable[[int, int], float]) -> list[float]:
        """Each rank's costliest scoring forward under `cost(rows, tokens)`: of the forwards
        dealt to it where they are known, else of the bound."""
        if self.scored:
            return [max((cost(*f) for f in forwards), default=0.0) for forwards in self.scored]
        rows = self.eval_rows if STAGE_LOADS[self.stage].trains else self.rows
        return [cost(rows, self.row_tokens)] * self.world


def job_shape(
    stage: str,
    cfg: Any,
    nodes: int = 1,
    seq_len: int = 0,
    widths: RowWidths | None = None,
    scored: tuple[frozenset[tuple[int, int]], ...] = (),
) -> JobShape:
    """The shape of `stage` under its pre-registration (arm, SFT or selection config);
    `seq_len` for a config that names none (selection scores the arms' rows); `widths` and
    `scored` read off the pair shards the stage reads, where they exist (`shards_shape`)."""
    batch = getattr(cfg, "batch", None)
    data = getattr(cfg, "data", None)
    if not seq_len and data is None:
        raise ValueError(f"{stage}: its config names no seq_len; pass the rows' length")
    load = STAGE_LOADS[stage]
    seq_len = seq_len or data.seq_len
    pairs = stage not in ("sft", "sft_gate")  # SFT rows are single sequences
    # A shared layout puts each pair in one row of up to twice seq_len; a packed one puts
    # several pairs in a row no wider than its widest pair, so no more rows than pairs.
    trained = batch.layout if batch is not None else "padded"
    shared = (cfg.ref.layout if stage == "ref_cache" else trained) != "padded"
    forward = cfg.ref if stage == "ref_cache" else cfg.model
    per_item, length = (1, 2 * seq_len) if shared else (2 if pairs else 1, seq_len)
    if widths is not None:
        length = min(length, widths.shared if shared else widths.padded)
    eval_rows = per_item * cfg.eval.batch_size
    if load.trains or stage == "path_bias":
        rows = per_item * batch.micro_batch
    elif stage == "ref_cache":
        rows = per_item * cfg.ref.batch_size
    else:
        rows = eval_rows
    world = batch.world_size if batch is not None and stage not in SINGLE_PROCESS else 1
    prompts, new_tokens = generation_of(stage, cfg) if load.generates else (0, 0)
    return JobShape(
        stage=stage,
        world=world,
        nodes=nodes,
        device=cfg.run.device,
        model=cfg.model,
        optimizer=cfg.optimizer.name if load.trains else "",
        rows=rows,
        row_tokens=length,
        eval_rows=eval_rows,
        seq_len=seq_len,
        activation_checkpointing=load.trains and cfg.trainer.activation_checkpointing,
        generation_rows=prompts,
        prompt_tokens=getattr(data, "max_prompt_tokens", None) or seq_len,
        generation_tokens=new_tokens,
        preflight=getattr(cfg, "preflight", PreflightConfig()),
        scored=scored,
        streamed=shared and forward.attn_implementation in STREAMED_ATTENTION,
    )


def shards_shape(
    stage: str, cfg: Any, nodes: int, seq_len: int, shards: Mapping[str, str | Path]
) -> JobShape:
    """`job_shape` with what the pair shards the stage reads tell (`shards` by split for an
    arm's stages): their longest rows, and each rank's scoring forwards."""
    widths = RowWidths.of(shards.values())
    return job_shape(stage, cfg, nodes, seq_len, widths, scoring_forwards(stage, cfg, shards))


def scoring_forwards(
    stage: str, cfg: Any, shards: Mapping[str, str | Path]
) -> tuple[frozenset[tuple[int, int]], ...]:
    """Each rank's scoring forwards, (rows, width), as `stage` deals them from its arm's
    pair shards (align.data.deal): the reference cache scores both splits, the path-bias
    check its sample of train, DPO's evaluation held; empty for any other stage, or while a
    split's shard is missing."""
    if stage not in ("ref_cache", "path_bias", "dpo") or not set(SPLITS) <= shards.keys():
        return ()
    world = cfg.batch.world_size
    if stage == "ref_cache":
        ref, splits = cfg.ref, [read_shard(shards[split]) for split in SPLITS]
        return tuple(
            frozenset().union(*(sliced_forwards(arrays, ref, rank, world) for arrays in splits))
            for rank in range(world)
        )
    layout = cfg.batch.layout
    if stage == "path_bias":
        arrays, size = read_shard(shards["train"]), cfg.batch.micro_batch
        sample = cfg.path_bias
        rows = deal.sample_rows(len(arrays["pair_id"]), sample.sample_pairs, sample.seed)
    else:
        arrays, size = read_shard(shards["held"]), cfg.eval.batch_size
        rows = np.arange(len(arrays["pair_id"]))
    widths = pair_row_widths(arrays, layout)
    pad = rows[deal.padding_rows(len(rows), size)]

    def dealt(rank: int) -> list[deal.Block]:
        return [
            rows[b] if b is not None else None
            for b in deal.rank_blocks(len(rows), size, rank, world)
        ]

    return tuple(
        frozenset(deal.forward_shapes(widths, dealt(rank), pad, layout)) for rank in range(world)
    )


def sliced_forwards(
    arrays: dict[str, np.ndarray], ref: Any, rank: int, world: int
) -> set[tuple[int, int]]:
    """One rank's forwards of the reference cache of one split, every slice pending."""
    n = len(arrays["pair_id"])
    bounds = deal.slice_rows(n, deal.slice_size(ref.slice_pairs, ref.batch_size))
    rounds = deal.slice_rounds(bounds, list(range(len(bounds))), ref.batch_size, rank, world)
    blocks = [block for _, dealt in rounds for block in dealt]
    widths = pair_row_widths(arrays, ref.layout)
    pad = deal.padding_rows(n, ref.batch_size)
    return deal.forward_shapes(widths, blocks, pad, ref.layout)


def selection_seq_len(arm_cfgs: list[Any]) -> int:
    """The longest row selection scores: its eval set holds the arms' held-out rows."""
    return max(arm.data.seq_len for arm in arm_cfgs)


def generation_of(stage: str, cfg: Any) -> tuple[int, int]:
    """(prompts, new tokens) of the stage's greedy generations."""
    if stage == "sft_gate":
        check = cfg.gate.generation_check
    elif stage == "select_arms":
        check = cfg.generation_check
    elif cfg.tripwires.armed("generation"):
        check = cfg.tripwires.generation_check
    else:
        return 0, 0
    return check.prompts, check.max_new_tokens


# sft_gate and select_arms score in one process whatever the training topology.
SINGLE_PROCESS = ("sft_gate", "select_arms")


def projected_job_rss(shape: JobShape, checkpoint: str | Path, shard_bytes: int) -> dict[str, Any]:
    """Projected peak RSS of the whole job and of its fullest node, phase by phase, in MiB.

    Every rank holds the phase's steady terms; rank 0 adds its staging copy of the
    checkpoint while a policy loads and, in export, the consolidated state it gathers.
    The job's peak is its fullest phase's; `terms_mb` is each term at its largest.
    """
    verified = verify_checkpoint(checkpoint)
    phases = {}
    for phase, terms in phase_terms(shape, verified, shard_bytes).items():
        per_job = {name: value / MIB for name, value in terms.items()}
        rank0 = sum(v for name, v in per_job.items() if name.endswith("_rank0"))
        steady = sum(per_job.values()) - rank0
        phases[phase] = {
            "terms_mb": per_job,
            "total_mb": steady + rank0,
            # Rank 0's node: its share of the steady terms and rank 0's own.
            "node_mb": steady / shape.nodes + rank0,
        }
    peak = max(phases, key=lambda name: phases[name]["node_mb"])
    largest: dict[str, float] = {}
    for phase in phases.values():
        for name, value in phase["terms_mb"].items():
            largest[name] = max(largest.get(name, 0.0), value)
    return {
        "stage": shape.stage,
        "optimizer": shape.optimizer or None,
        "world_size": shape.world,
        "nodes": shape.nodes,
        "parameters": parameter_count(verified.config)["total"],
        "phases": phases,
        "peak_phase": peak,
        "terms_mb": largest,
        "total_mb": max(p["total_mb"] for p in phases.values()),
        "node_mb": phases[peak]["node_mb"],
    }


def phase_terms(shape: JobShape, verified, shard_bytes: int) -> dict[str, dict[str, float]]:
    """Bytes of every term of every phase of the stage, summed over the job's ranks."""
    config = verified.config
    counts = parameter_count(config)
    load = STAGE_LOADS[shape.stage]
    master, compute = DTYPE_BYTES[shape.model.master_dtype], DTYPE_BYTES[shape.model.dtype]
    world, on_cpu = shape.world, shape.device == "cpu"
    # A policy's sharded master weights live in host memory only on a CPU rank.
    weights = counts["total"] * master if on_cpu else 0.0
    common = {
        "weights": weights,
        "data_shards": world * float(shard_bytes),
        "runtime": world * rank_overhead_mb(shape.preflight, shape.device) * MIB,
        "row_reader": world * shape.preflight.row_reader_overhead_mb * MIB
        if load.reads_rows
        else 0.0,
        # One launcher per node runs the ranks of a multi-rank stage.
        "launcher": (
            0.0
            if shape.stage in SINGLE_PROCESS
            else shape.nodes * shape.preflight.launcher_overhead_mb * MIB
        ),
    }
    # FSDP keeps the root (embedding, final norm, lm_head) gathered in the compute dtype
    # from a forward to the end of its backward, or, without one, until it is resharded;
    # a forward gathers its layers in turn.
    root_rank = counts["root"] * compute if on_cpu else 0.0
    layers_rank = gathered_layers(world, counts["layer"], compute) if on_cpu else 0.0
    root, layers = world * root_rank, world * layers_rank
    stored, full_master = verified.stored_bytes, counts["total"] * master
    largest_tensor = config.vocab_size * config.hidden_size * master
    loading = load_transient(
        world,
        # Rank 0 reads the checkpoint in its stored dtype and casts it to the master dtype.
        staging=stored + (full_master if stored != full_master else 0),
        # Every other rank receives the broadcast one full tensor at a time.
        receive=largest_tensor if on_cpu else 0.0,
        # The read-back forward's all-gather output beside the unsharded root it fills.
        readback=2 * root_rank + layers_rank,
    )
    # A load after another policy's scoring finds the runtime that scoring grew.
    scored = (
        {"post_scoring": world * shape.preflight.post_scoring_overhead_mb * MIB}
        if load.policies_in_turn
        else {}
    )
    phases = {"load": {**common, **loading, **scored}}
    if load.trains:
        phases["train"] = {
            **common,
            "grads": weights,
            "optimizer_state": (
                counts["total"] * optimizer_state_bytes(shape.optimizer, shape.model.master_dtype)
                if on_cpu
                else 0.0
            ),
            "gathered_layers": layers,
            "gathered_root": root,
            "root_gradients": root,
            "activations": world * cpu_training_activations(shape, config) if on_cpu else 0.0,
        }
    # What the runtime holds once it has trained, in the phases after training.
    trained = {"post_training": world * shape.preflight.post_training_overhead_mb * MIB}
    if load.exports:
        # Backward leaves every parameter resharded; the gather moves one full tensor at a
        # time through every rank (all-gather output and its copy), and rank 0 keeps each.
        phases["export"] = {
            **common,
            **trained,
            "export_transfer": 2 * world * largest_tensor if on_cpu else 0.0,
            "export_gather_rank0": full_master,
        }
    scoring = (
        sum(shape.rank_scoring_bytes(partial(cpu_scoring_activations, shape, config)))
        if on_cpu
        else 0.0
    )
    kv_cache = world * kv_cache_bytes(shape, config) if on_cpu else 0.0
    heap = {
        "scoring_heap": world * shape.preflight.scoring_heap_overhead_mb * MIB if on_cpu else 0.0
    }
    if load.second_policy:
        # The SFT policy loads beside the trained one, then both are scored, and a root
        # gathered for a forward without backward stays gathered.
        phases["evaluate"] = {
            **common,
            **trained,
            "second_policy": weights,
            **larger(
                {"gathered_root": root, **loading},
                {
                    "gathered_root": 2 * root,
                    "gathered_layers": layers,
                    "activations": scoring,
                    **heap,
                },
            ),
        }
    elif "evaluate" in load.phases:
        # Scoring and generation take turns; the larger of them is the phase's peak.
        phases["evaluate"] = {
            **common,
            **(trained if load.trains else {}),
            "gathered_root": root,
            "gathered_layers": layers,
            **larger({"activations": scoring, **heap}, {"kv_cache": kv_cache}),
        }
    return {name: phases[name] for name in load.phases}


def larger(*moments: dict[str, float]) -> dict[str, float]:
    """Of terms that a phase holds at different moments, the moment that holds the most."""
    return max(moments, key=lambda terms: sum(terms.values()))


def load_transient(world: int, staging: float, receive: float, readback: float) -> dict:
    """What loading a policy adds for a while, summed over ranks as each rank's peak: rank
    0's is the larger of its staging copy and the read-back forward, every other rank's the
    larger of the tensor it receives and that forward (each rank meets them at its own time)."""
    return {
        "readback_gather": world * readback,
        "load_staging_rank0": max(0.0, staging - readback),
        "broadcast_receive": (world - 1) * max(0.0, receive - readback),
    }


def rank_overhead_mb(preflight: PreflightConfig, device: str) -> float:
    """Host memory a rank holds outside the model's tensors, for the device it computes on."""
    return preflight.cuda_rank_overhead_mb if device == "cuda" else preflight.cpu_rank_overhead_mb


def cpu_training_activations(shape: JobShape, config: MistralConfig) -> float:
    """What one rank's training forward keeps for backward, and the fused loss head's chunk."""
    kept = kept_activation_bytes(config, shape)
    return kept + LOSS_HEAD_COPIES * LOSS_CHUNK * config.vocab_size * 4


def cpu_scoring_activations(
    shape: JobShape, config: MistralConfig, rows: int, row_tokens: int
) -> float:
    """One rank's scoring forward: the decoder's peak, or, once the layers are done, the
    residual stream and final norm beside the fused loss head's chunk, whichever is larger."""
    c = DTYPE_BYTES[shape.model.dtype]
    head = rows * row_tokens * 3 * config.hidden_size * c + LOSS_CHUNK * config.vocab_size * 4
    return max(scoring_activation_bytes(config, shape, rows, row_tokens), head)


def scoring_activation_bytes(
    config: MistralConfig, shape: JobShape, rows: int, length: int
) -> float:
    """A forward without autograd frees each tensor once the next is computed. Its peak is
    three residual-width tensors (the stream, its normed copy, the branch input) beside the
    wider branch: attention's q, k, v, rotated q and k and output with the mask as a
    compute-dtype bias, or SwiGLU's silu(gate), up and their product; the boolean mask
    stays throughout. With every tensor returned on free (benchmarks/scoring_heap.py), 8
    rows of 1024 tokens peak at 201 MiB at 57.7M parameters and 440 MiB at 258M; modelled
    200 and 440."""
    c = DTYPE_BYTES[shape.model.dtype]
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    mask = shape.mask_positions(rows, length)
    attention = rows * length * (2 * q + 2 * kv + q) * c + mask * c
    swiglu = rows * length * 3 * config.intermediate_size * c
    return rows * length * 3 * config.hidden_size * c + mask + max(attention, swiglu)


def kv_cache_bytes(shape: JobShape, config: MistralConfig) -> float:
    """Keys and values of every layer for each generated prompt at its longest."""
    c = DTYPE_BYTES[shape.model.dtype]
    positions = shape.prompt_tokens + shape.generation_tokens
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * c
    return shape.generation_rows * positions * per_token


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


@dataclass(frozen=True)
class MemoryVerdict:
    """The preflight's projection of the dpo job (`check_stage_rss`), judged against its
    node (and device) and passed, as every reader takes it: the gates before training, and
    the workflow sizing the probe job."""

    total_mb: float
    # The fullest node's share: what a job's memory request is made from.
    node_mb: float
    optimizer: str | None
    # Per-device allocator peak projected under CUDA; None on CPU.
    device_allocated_mb: float | None
    # Every figure as the receipts record it.
    figures: dict[str, Any]

    @classmethod
    def of(cls, figures: Mapping[str, Any]) -> MemoryVerdict:
        device = figures.get("device", {})
        return cls(
            figures["total_mb"],
            figures["node_mb"],
            figures["optimizer"],
            device.get("allocated_mb"),
            dict(figures),
        )

    @classmethod
    def read(cls, path: str | Path) -> MemoryVerdict | None:
        """The preflight receipt at `path`, or None while the preflight has not run."""
        return cls.of(read_json(path)["figures"]) if Path(path).is_file() else None


def check_stage_rss(
    stage: str,
    cfg: Any,
    checkpoint: str | Path,
    shards: Mapping[str, str | Path] | None = None,
    seq_len: int = 0,
) -> dict[str, Any]:
    """The stage's projected RSS (from the checkpoint's verified config and header sizes,
    and the pair `shards` it reads, by split for an arm's stages: their bytes, longest rows
    and each rank's scoring forwards) judged against its node
    before any model is built, and under CUDA each GPU's peak against the device: refused
    (exit 6) when over `preflight.host_memory_fraction` of the node or
    `preflight.device_memory_fraction` of the device; the projection with the verdicts
    otherwise."""
    shards = shards or {}
    shard_bytes = sum(Path(path).stat().st_size for path in shards.values())
    shape = shards_shape(stage, cfg, stage_nodes(stage, cfg), seq_len, shards)
    projection = projected_job_rss(shape, checkpoint, shard_bytes)
    fraction = shape.preflight.host_memory_fraction
    projection.update(check_projection(projection, fraction, *node_memory(cfg.run)))
    if shape.device == "cuda":
        device = projected_device_phases(shape, checkpoint)
        device.update(
            check_device_projection(device, shape.preflight, *device_memory_mb(shape.preflight))
        )
        projection["device"] = device
    return projection


def stage_nodes(stage: str, cfg: Any) -> int:
    """The nodes the stage's ranks span (one for a stage that scores in one process)."""
    batch = getattr(cfg, "batch", None)
    if batch is None or stage in SINGLE_PROCESS:
        return 1
    return topology(batch.world_size, cfg.run.gpus_per_node).nodes
