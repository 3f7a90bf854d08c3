"""Optimizers named by the config and the warmup + cosine schedule.

`adamw` is torch's AdamW; `adamw8bit` is bitsandbytes' blockwise 8-bit AdamW
(align.train.adamw8bit), refused where bitsandbytes cannot run it on the
parameters' device.

The schedule's horizon is computed from the corpus (epochs x steps per epoch), and
`assert_horizon_consistent` refuses one that disagrees, so the learning rate never
ends at half an epoch.
"""

from __future__ import annotations

import math

import torch

from align.config import BatchConfig, OptimizerConfig
from align.constants import OPTIMIZERS
from align.data.sampler import steps_per_epoch
from align.exit_codes import ConfigError


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer.name {cfg.name!r} cannot be honoured here (available: {', '.join(OPTIMIZERS)})"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name == "adamw8bit":
        # Imported here: bitsandbytes is an optional extra that only this optimizer needs.
        from align.train.adamw8bit import build_adamw8bit

        return build_adamw8bit(
            params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=True,
    )


def training_horizon(num_pairs: int, batch: BatchConfig) -> int:
    """Optimizer steps of the whole run: epochs x floor(pairs / global_batch), at least one per epoch."""
    return batch.epochs * steps_per_epoch(num_pairs, batch.global_batch)


def assert_horizon_consistent(horizon: int, num_pairs: int, batch: BatchConfig) -> None:
    expected = training_horizon(num_pairs, batch)
    if horizon != expected:
        raise ConfigError(
            f"schedule horizon {horizon} steps disagrees with epochs x floor(pairs / global_batch) = "
            f"{batch.epochs} x floor({num_pairs} / {batch.global_batch}) = {expected}"
        )


def lr_factor(step: int, warmup: int, horizon: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at the horizon."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, horizon - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, horizon: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps, horizon, cfg.min_lr_ratio)
    )
