"""Parallelism applied as functions on a model: FSDP2 sharding, activation checkpointing,
and loading a checkpoint straight into shards (no full replica on any rank but 0's host).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from align.log import stage_logger
from align.model.checkpoint import hf_to_nmo, read_safetensors_state
from align.model.checkpoint_shapes import verified_hf_config
from align.model.mistral import NmoMistralForCausalLM
from align.train.precision import Precision, mixed_precision_policy, verify_precision
from align.utils.dist import DistInfo
from align.utils.dtypes import TORCH_DTYPES

NO_CASTS = MixedPrecisionPolicy()

LOG = stage_logger()


def apply_fsdp(model: NmoMistralForCausalLM, policy: MixedPrecisionPolicy = NO_CASTS) -> None:
    """`fully_shard` each decoder layer, then the root (embedding, norm, lm_head)."""
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def apply_activation_checkpointing(model: NmoMistralForCausalLM) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them."""
    for index, layer in enumerate(model.layers):
        model.layers[index] = checkpoint_wrapper(layer, preserve_rng_state=False)


def load_sharded(
    path: str | Path,
    info: DistInfo,
    precision: Precision,
    attn_implementation: str,
    activation_checkpointing: bool = False,
) -> NmoMistralForCausalLM:
    """Meta-device init in the master dtype, FSDP2 sharding with the mixed-precision policy,
    then rank 0 reads the weights and broadcasts shards; the live dtypes are read back and
    checked (`model.precision` holds the record). config.json is refused (exit 3) unless
    the tensors' headers confirm it, before anything is allocated from it."""
    master = TORCH_DTYPES[precision.master]
    config = dataclasses.replace(verified_hf_config(path), torch_dtype=precision.master)
    with torch.device("meta"):
        model = NmoMistralForCausalLM(config, attn_implementation, attn_device=info.device)
    model.to(master)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, mixed_precision_policy(precision))
    model.to_empty(device=info.device)
    full = {}
    if info.is_main:
        full = {k: v.to(master) for k, v in hf_to_nmo(read_safetensors_state(path)).items()}
        if config.tie_word_embeddings:
            full["lm_head.weight"] = full["embed.weight"]
    set_model_state_dict(
        model,
        full,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
    )
    model.precision = verify_precision(model, precision, info.device)
    _log_resident(model, info)
    return model


def gather_full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The consolidated, plain-named state on rank 0's CPU (empty on other ranks)."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _log_resident(model: torch.nn.Module, info: DistInfo) -> None:
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    p = model.precision
    LOG.info(
        f"rank {info.rank} holds {local / 2**20:.1f} MiB of {p['master']} master "
        f"parameters after sharding; computes in {p['compute']}, reduces in {p['reduce']}"
    )
