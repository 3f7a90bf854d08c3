"""Reading and writing HF-format Mistral checkpoints for NmoMistralForCausalLM.

Owns the HF <-> align tensor-name map, strict loading (`load_pretrained`, the one
entry point that builds a model from disk, from a config.json its tensors confirm)
and deterministic, atomic saving in the layout transformers' `from_pretrained` reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from align.exit_codes import writing
from align.model.checkpoint_files import companion_files
from align.model.checkpoint_shapes import verified_hf_config
from align.model.hf_config import MistralConfig
from align.model.mistral import NmoMistralForCausalLM
from align.utils.dtypes import TORCH_DTYPES
from align.utils.weights_hash import INDEX_FILE_NAME, SINGLE_FILE_NAME, checkpoint_tensors

SAFETENSORS_METADATA = {"format": "pt"}

_TOP_LEVEL_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_PART_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.o_proj.weight": "attn.o.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_NMO_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_TIED_HF_NAMES = ("lm_head.weight", "model.embed_tokens.weight")


def read_safetensors_state(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint, on CPU, by HF name."""
    names_by_path: dict[Path, list[str]] = {}
    for name, location in checkpoint_tensors(checkpoint_dir).items():
        names_by_path.setdefault(location.path, []).append(name)
    state = {}
    for path, names in names_by_path.items():
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in names:
                state[name] = handle.get_tensor(name)
    return state


def hf_to_nmo(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename HF Mistral tensor names to this package's module names."""
    return _rename(state, _hf_name_to_nmo, "HF Mistral")


def nmo_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename this package's module names to HF Mistral tensor names."""
    return _rename(state, _nmo_name_to_hf, "NmoMistralForCausalLM")


def load_pretrained(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
) -> NmoMistralForCausalLM:
    """Build the model from an HF-format checkpoint directory, strictly, on `device` in `dtype`."""
    target_device = _resolve_device(device)
    target_dtype = _resolve_dtype(dtype, target_device)
    config = dataclasses.replace(verified_hf_config(path), torch_dtype=_dtype_name(target_dtype))
    hf_state = _drop_tied_lm_head(read_safetensors_state(path), config, path)
    with torch.device("meta"):
        model = NmoMistralForCausalLM(config, attn_implementation, attn_device=target_device)
    _check_names(set(hf_state), _expected_hf_names(model), path)
    state = {
        name: tensor.to(device=target_device, dtype=target_dtype)
        for name, tensor in hf_to_nmo(hf_state).items()
    }
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assignment gave lm_head its own Parameter object
    return model


def save_hf_checkpoint(
    model: NmoMistralForCausalLM,
    out_dir: str | Path,
    source_dir: str | Path | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write config.json, weights and `source_dir`'s tokenizer; replace out_dir atomically.

    Weights are split into shards with an index when they exceed `max_shard_bytes`.
    The tokenizer files and the companions that travel with them (special tokens map,
    chat template, sentencepiece model, generation config) are copied from
    `source_dir`, the checkpoint this one derives from.
    """
    return save_hf_state(model.config, model.state_dict(), out_dir, source_dir, max_shard_bytes)


def save_hf_state(
    config: MistralConfig,
    state: dict[str, torch.Tensor],
    out_dir: str | Path,
    source_dir: str | Path | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """`save_hf_checkpoint` from an align-named state dict (e.g. one gathered from shards)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (out_dir.is_symlink() or not out_dir.is_dir()):
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    carried = companion_files(source_dir) if source_dir is not None else []
    hf_state = _hf_state_for_saving(config, state)
    dtype_names = {_dtype_name(tensor.dtype) for tensor in hf_state.values()}
    if len(dtype_names) != 1:
        raise ValueError(f"model mixes parameter dtypes {sorted(dtype_names)}; cast it to one")
    config = dataclasses.replace(config, torch_dtype=dtype_names.pop())
    needed = sum(map(_nbytes, hf_state.values())) + sum(p.stat().st_size for p in carried)
    with writing(out_dir, needed), _atomic_directory(out_dir) as staging:
        _write_json(staging / "config.json", config.to_hf_dict())
        _write_weights(staging, hf_state, max_shard_bytes)
        for source in carried:
            shutil.copyfile(source, staging / source.name)
    return out_dir


def _hf_name_to_nmo(name: str) -> str | None:
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    match = _HF_LAYER.fullmatch(name)
    if match and match[2] in _LAYER_PART_NAMES:
        return f"layers.{match[1]}.{_LAYER_PART_NAMES[match[2]]}"
    return None


_NMO_TOP_LEVEL_NAMES = {nmo: hf for hf, nmo in _TOP_LEVEL_NAMES.items()}
_NMO_LAYER_PART_NAMES = {nmo: hf for hf, nmo in _LAYER_PART_NAMES.items()}


def _nmo_name_to_hf(name: str) -> str | None:
    if name in _NMO_TOP_LEVEL_NAMES:
        return _NMO_TOP_LEVEL_NAMES[name]
    match = _NMO_LAYER.fullmatch(name)
    if match and match[2] in _NMO_LAYER_PART_NAMES:
        return f"model.layers.{match[1]}.{_NMO_LAYER_PART_NAMES[match[2]]}"
    return None


def _rename(
    state: dict[str, torch.Tensor], rename: Callable[[str], str | None], source: str
) -> dict[str, torch.Tensor]:
    renamed = {name: rename(name) for name in state}
    unknown = sorted(name for name, new_name in renamed.items() if new_name is None)
    if unknown:
        raise ValueError(f"unknown {source} tensor names: {unknown}")
    return {renamed[name]: tensor for name, tensor in state.items()}


def _expected_hf_names(model: NmoMistralForCausalLM) -> set[str]:
    names = set(nmo_to_hf(dict.fromkeys(model.state_dict())))
    if model.config.tie_word_embeddings:
        names.discard("lm_head.weight")
    return names


def _drop_tied_lm_head(
    state: dict[str, torch.Tensor], config: MistralConfig, path: str | Path
) -> dict[str, torch.Tensor]:
    """With tied embeddings HF may or may not store lm_head.weight; it must equal the embedding."""
    if not config.tie_word_embeddings or "lm_head.weight" not in state:
        return state
    state = dict(state)
    lm_head = state.pop("lm_head.weight")
    embedding = state.get("model.embed_tokens.weight")
    if embedding is not None and not torch.equal(lm_head, embedding):
        raise ValueError(
            f"{path} ties word embeddings but its lm_head.weight differs from "
            "model.embed_tokens.weight"
        )
    return state


def _check_names(found: set[str], expected: set[str], path: str | Path) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match its config: missing tensors {missing}, "
            f"unexpected tensors {unexpected}"
        )


def _resolve_device(device: torch.device | str) -> torch.device:
    resolved = torch.device(device)
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"device {resolved} is not supported; use cpu or cuda")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {resolved} requested but CUDA is not available here")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise RuntimeError(
            f"device {resolved} requested but only {torch.cuda.device_count()} exist"
        )
    return torch.device("cuda", index)


def _resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    resolved = TORCH_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in TORCH_DTYPES.values():
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {tuple(TORCH_DTYPES)}")
    if resolved == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RuntimeError(f"bfloat16 requested but {device} does not support it")
    return resolved


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _hf_state_for_saving(
    config: MistralConfig, nmo_state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    state = nmo_to_hf(dict(nmo_state))
    if config.tie_word_embeddings:
        del state["lm_head.weight"]  # HF re-ties it from the embedding on load
    return {name: state[name].detach().to("cpu").contiguous() for name in sorted(state)}


def _write_weights(
    directory: Path, state: dict[str, torch.Tensor], max_shard_bytes: int | None
) -> None:
    shards = _plan_shards(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(state, directory / SINGLE_FILE_NAME, metadata=SAFETENSORS_METADATA)
        return
    weight_map = {}
    for number, names in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(
            {name: state[name] for name in names},
            directory / file_name,
            metadata=SAFETENSORS_METADATA,
        )
        weight_map.update(dict.fromkeys(names, file_name))
    total_size = sum(_nbytes(tensor) for tensor in state.values())
    _write_json(
        directory / INDEX_FILE_NAME,
        {"metadata": {"total_size": total_size}, "weight_map": weight_map},
    )


def _plan_shards(state: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy split in name order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_bytes is None:
        return [list(state)]
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, tensor in state.items():
        if shards[-1] and shard_bytes + _nbytes(tensor) > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += _nbytes(tensor)
    return shards


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextmanager
def _atomic_directory(out_dir: Path) -> Iterator[Path]:
    """Yield a staging sibling of out_dir; on success it replaces out_dir in one rename."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.staging-{secrets.token_hex(6)}")
    staging.mkdir()
    try:
        yield staging
        _fsync_tree(staging)
        _swap_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _swap_into_place(staging: Path, out_dir: Path) -> None:
    # os.replace cannot overwrite a non-empty directory, so the old one steps aside first.
    if not out_dir.exists():
        os.replace(staging, out_dir)
        return
    retired = out_dir.with_name(f".{out_dir.name}.retired-{secrets.token_hex(6)}")
    os.replace(out_dir, retired)
    try:
        os.replace(staging, out_dir)
    except BaseException:
        os.replace(retired, out_dir)
        raise
    shutil.rmtree(retired)


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.iterdir()):
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
