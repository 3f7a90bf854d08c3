"""Parallelism applied as functions on a model: FSDP2 sharding, activation checkpointing,
and loading a checkpoint straight into shards (no full replica on any rank but 0's host).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from align.model.checkpoint import DTYPES, hf_to_nmo, read_safetensors_state
from align.model.hf_config import load_hf_config
from align.model.mistral import NmoMistralForCausalLM
from align.utils.dist import DistInfo


def mixed_precision(param_dtype: str, reduce_dtype: str = "float32") -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])


def apply_fsdp(model: NmoMistralForCausalLM, policy: MixedPrecisionPolicy | None = None) -> None:
    """`fully_shard` each decoder layer, then the root (embedding, norm, lm_head)."""
    kwargs = {"mp_policy": policy} if policy is not None else {}
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def apply_activation_checkpointing(model: NmoMistralForCausalLM) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them."""
    for index, layer in enumerate(model.layers):
        model.layers[index] = checkpoint_wrapper(layer, preserve_rng_state=False)


def load_sharded(
    path: str | Path,
    info: DistInfo,
    dtype: str,
    attn_implementation: str,
    activation_checkpointing: bool = False,
) -> NmoMistralForCausalLM:
    """Meta-device init, FSDP2 sharding, then rank 0 reads the weights and broadcasts shards."""
    config = dataclasses.replace(load_hf_config(path), torch_dtype=dtype)
    with torch.device("meta"):
        model = NmoMistralForCausalLM(config, attn_implementation, attn_device=info.device)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model)
    model.to_empty(device=info.device)
    full = {}
    if info.is_main:
        full = {k: v.to(DTYPES[dtype]) for k, v in hf_to_nmo(read_safetensors_state(path)).items()}
        if config.tie_word_embeddings:
            full["lm_head.weight"] = full["embed.weight"]
    set_model_state_dict(
        model,
        full,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
    )
    _log_resident(model, info)
    return model


def gather_full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The consolidated, plain-named state on rank 0's CPU (empty on other ranks)."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _log_resident(model: torch.nn.Module, info: DistInfo) -> None:
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    print(
        f"align: rank {info.rank} holds {local / 2**20:.1f} MiB of parameters after sharding",
        file=sys.stderr,
    )
