"""Optimizers named by the config and the warmup + cosine schedule.

`adamw` is torch's AdamW; `adamw8bit` is bitsandbytes' blockwise 8-bit AdamW
(align.train.adamw8bit), refused where bitsandbytes cannot run it on the
parameters' device. Both decay what transformers' Trainer decays: every weight but
norm weights and biases (`decays`). Each param group carries its parameters' names,
so `param_groups_record` reads what the live optimizer does off the optimizer itself.
An FSDP model is refused unless every parameter is its sharded DTensor, the tensor
that training updates.

The schedule's horizon is computed from the corpus (epochs x steps per epoch), and
`assert_horizon_consistent` refuses one that disagrees, so the learning rate never
ends at half an epoch.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from align.config import BatchConfig, OptimizerConfig
from align.constants import OPTIMIZERS
from align.data.sampler import steps_per_epoch
from align.exit_codes import AlignError, ConfigError

# transformers 5.24's Trainer.get_decay_parameter_names: a parameter whose lower-cased
# name matches one of these, or that belongs to an nn.LayerNorm, is not decayed.
NO_DECAY_PATTERNS = tuple(
    re.compile(pattern)
    for pattern in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
)


class UnshardedParameters(AlignError):
    """An FSDP model offered the optimizer parameters that are not its sharded DTensors.

    A programming error of the caller, not of the pre-registration, so it ends the stage
    as an internal error (exit 70): no configuration change can fix it.
    """


def decays(name: str, layer_norm_names: frozenset[str] = frozenset()) -> bool:
    """Whether transformers' Trainer would decay the parameter called `name`."""
    lowered = name.lower()
    return name not in layer_norm_names and not any(p.search(lowered) for p in NO_DECAY_PATTERNS)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters as (name, tensor) in a decayed group and an undecayed one,
    transformers' grouping; an empty group is left out."""
    layer_norm_names = frozenset(
        f"{module_name}.{name}" if module_name else name
        for module_name, module in model.named_modules()
        if isinstance(module, nn.LayerNorm)
        for name, _ in module.named_parameters()
    )
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decayed = [(n, p) for n, p in named if decays(n, layer_norm_names)]
    kept = [(n, p) for n, p in named if not decays(n, layer_norm_names)]
    groups = [{"params": decayed, "weight_decay": weight_decay}]
    groups.append({"params": kept, "weight_decay": 0.0})
    return [group for group in groups if group["params"]]


def refuse_unsharded(model: nn.Module) -> None:
    """An FSDP model's parameters must all be DTensors when the optimizer takes them.

    A forward outside autograd (torch.no_grad) leaves the root's gathered parameters
    registered, plain tensors that no step of training updates: an optimizer built then
    would hold them and never train the root (embedding, final norm, lm_head).
    """
    if not any(isinstance(module, FSDPModule) for module in model.modules()):
        return
    plain = [
        n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)
    ]
    if plain:
        raise UnshardedParameters(
            f"the optimizer would hold {len(plain)} parameter(s) of the FSDP model that are "
            f"not its sharded DTensors: {', '.join(plain)}; a forward under torch.no_grad "
            "leaves the root's parameters gathered, so build the optimizer before any "
            "forward (or call the model's reshard() after it)"
        )


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer.name {cfg.name!r} cannot be honoured here (available: {', '.join(OPTIMIZERS)})"
        )
    refuse_unsharded(model)
    groups = parameter_groups(model, cfg.weight_decay)
    if cfg.name == "adamw8bit":
        # Imported here: bitsandbytes is an optional extra that only this optimizer needs.
        from align.train.adamw8bit import build_adamw8bit

        return build_adamw8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        foreach=True,
    )


def param_groups_record(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each live param group's weight decay and parameter names, for the stage receipts."""
    return [
        {"weight_decay": group["weight_decay"], "params": list(group["param_names"])}
        for group in optimizer.param_groups
    ]


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
