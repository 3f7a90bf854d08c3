"""A training session, built the same way by every stage: the process group and its
launch checks, the sharded policy, the trainer over this rank's batches, the export.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from align.config import BatchConfig, ModelConfig, OptimizerConfig, RunConfig, TrainerConfig
from align.constants import GATED_ATTENTION
from align.data.loader import BatchSource, PairShard
from align.data.sampler import StepSampler
from align.exit_codes import ConfigError
from align.log import stage_logger
from align.model.checkpoint import save_hf_state
from align.model.hf_config import load_hf_config
from align.paths import RunPaths
from align.train.fsdp import gather_full_state, load_sharded
from align.train.optim import (
    assert_horizon_consistent,
    build_optimizer,
    build_scheduler,
    training_horizon,
)
from align.train.precision import Precision
from align.train.trainer import Trainer
from align.utils.dist import (
    DistInfo,
    assert_cpu_isa,
    assert_distinct_devices,
    assert_launch_topology,
    init_distributed,
)

LOG = stage_logger()


def start_session(run_dir: str | Path, run: RunConfig, batch: BatchConfig | None) -> DistInfo:
    """Join the process group; refuse a launch whose topology or devices are wrong. An
    attention kernel that needs an equivalence receipt reads the one the workflow wrote."""
    paths = RunPaths.of(run.results_dir)
    for backend, (_, _, receipt_env) in GATED_ATTENTION.items():
        os.environ[receipt_env] = str(paths.kernel_receipt(backend))
    info = init_distributed(run_dir, run.device)
    assert_cpu_isa(run.cpu_isa)
    if batch is not None:
        assert_launch_topology(batch, info.world_size)
    info = dataclasses.replace(info, devices=tuple(assert_distinct_devices(info)))
    if info.is_main:
        placed = ", ".join(f"{rank}={device}" for rank, device in enumerate(info.devices))
        LOG.info(f"ranks on devices {placed}")
    torch.manual_seed(batch.seed if batch is not None else 0)
    return info


def load_policy(
    path: str | Path, model_cfg: ModelConfig, info: DistInfo, trainer: TrainerConfig | None = None
):
    return load_sharded(
        path,
        info,
        Precision.of(model_cfg),
        model_cfg.attn_implementation,
        activation_checkpointing=bool(trainer and trainer.activation_checkpointing),
    )


def build_trainer(
    model,
    shard,
    adapter,
    *,
    optim: OptimizerConfig,
    batch: BatchConfig,
    trainer: TrainerConfig,
    run_dir: str | Path,
    stage: str,
    info: DistInfo,
    stage_started: float,
    stop_marker: Path | None = None,
    projected_wall_s: float | None = None,
) -> Trainer:
    check_shard_layout(shard, batch)
    sampler = StepSampler(len(shard), batch, info.rank, info.world_size)
    horizon = training_horizon(len(shard), batch)
    assert_horizon_consistent(len(sampler), len(shard), batch)
    optimizer = build_optimizer(model, optim)
    return Trainer(
        trainer,
        model,
        BatchSource(shard, sampler),
        adapter,
        optimizer,
        build_scheduler(optimizer, optim, horizon),
        run_dir,
        stage,
        info,
        optim.grad_clip,
        stage_started,
        stop_marker,
        projected_wall_s,
    )


def check_shard_layout(shard, batch: BatchConfig) -> None:
    """The shard must collate the layout the pre-registration asks for: the path-bias
    report and the reference-cache key name it, so training on another would lie."""
    layout = getattr(shard, "layout", "padded")
    if batch.layout != "padded" and not isinstance(shard, PairShard):
        raise ConfigError(
            f"batch.layout = {batch.layout!r} needs preference pairs; "
            f"{type(shard).__name__} has none"
        )
    if layout != batch.layout:
        raise ConfigError(
            f"batch.layout = {batch.layout!r} but the training shard {shard.path} was opened "
            f"with layout {layout!r}"
        )


# The hub's shard size: a 7B policy exports as a few files, the tiny default as one.
EXPORT_SHARD_BYTES = 5 * 10**9


def export_policy(
    model, info: DistInfo, source_checkpoint: str | Path, out_dir: str | Path
) -> None:
    """Consolidate the shards on rank 0 and write an HF-format directory.

    The tokenizer, chat template and generation config come from the source checkpoint,
    so the policy loads and generates in transformers as the source did.
    """
    state = gather_full_state(model)
    if info.is_main:
        save_hf_state(
            load_hf_config(source_checkpoint),
            state,
            out_dir,
            source_dir=source_checkpoint,
            max_shard_bytes=EXPORT_SHARD_BYTES,
        )
