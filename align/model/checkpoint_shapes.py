"""A checkpoint's config.json checked against the tensors it really holds, before anything
is built or projected from it.

A hub checkpoint is untrusted: its config.json can claim a 10^12-token vocabulary over a
384 x 256 embedding, and a model built from that claim allocates a petabyte. Every
parameter the config implies (names from the layer count and the tying, shapes from the
sizes and heads) is compared with the safetensors headers, read without loading a
tensor; for a plan whose shards are not downloaded yet, with the index's tensor names
and its total_size. The first disagreement is refused (exit 3) in one line naming the
file, the config key and value, and the tensor's shape. Stdlib only.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path

from align.model.checkpoint_files import GENERATION_CONFIG_FILE
from align.model.hf_config import MistralConfig, load_hf_config
from align.utils.untrusted import CHECKPOINT_GATE, read_json_object
from align.utils.weights_hash import (
    INDEX_EXPECTED,
    INDEX_FILE_NAME,
    SINGLE_FILE_NAME,
    TensorLocation,
    UntrustedFileRefused,
    checkpoint_tensors,
    read_weight_map,
)

CONFIG_FILE = "config.json"
GENERATION_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Bytes per stored parameter a plan may assume: 16-bit (bfloat16, float16) or float32.
PLAN_PARAMETER_BYTES = (2, 4)
# Nine digits at most: a longer number names no layer, and int() of it stays cheap.
_LAYER = re.compile(r"model\.layers\.(\d{1,9})\..+")
_LM_HEAD = "lm_head.weight"

# Each dimension of a parameter: its size, and the config keys (with values) that set it.
Dims = tuple[tuple[int, str], ...]


class ShapeRefused(UntrustedFileRefused):
    """A tensor's shape disagrees with the one config.json implies: refused (exit 3)."""


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """config.json as the checkpoint's tensors confirm it, and those tensors' stored bytes."""

    config: MistralConfig
    stored_bytes: int


def verified_hf_config(checkpoint_dir: str | Path) -> MistralConfig:
    """config.json, once every parameter it implies matches the checkpoint's tensors."""
    return verify_checkpoint(checkpoint_dir).config


def verify_checkpoint(checkpoint_dir: str | Path) -> VerifiedCheckpoint:
    """config.json checked against the safetensors headers (every shard present) or, for a
    plan whose shards are absent, against the index's names and total_size."""
    root = Path(checkpoint_dir)
    config = load_hf_config(root)
    _check_generation_config(root / GENERATION_CONFIG_FILE, config)
    index = root / INDEX_FILE_NAME
    if _absent_shards(root):
        return _verify_plan(root, config, index)
    tensors = checkpoint_tensors(root)
    where = index if index.is_file() else root / SINGLE_FILE_NAME
    _check_names(config, {name: t.path for name, t in tensors.items()}, where, root / CONFIG_FILE)
    _check_shapes(config, tensors, root / CONFIG_FILE)
    stored = sum(t.end - t.begin for t in tensors.values())
    total = _index_total_size(index) if index.is_file() else None
    if total is not None and total != stored:
        raise UntrustedFileRefused(
            CHECKPOINT_GATE,
            index,
            f"metadata.total_size expected {stored} (the bytes its shards' headers declare), "
            f"found {total}",
        )
    return VerifiedCheckpoint(config, stored)


def _check_generation_config(path: Path, config: MistralConfig) -> None:
    """generation_config.json, which an export carries to every reader of the policy, is a
    JSON object whose token ids are ids of this vocabulary."""
    if not path.is_file():
        return
    fields = read_json_object(path, "a JSON object of generation settings")
    for key in GENERATION_TOKEN_KEYS:
        value = fields.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < config.vocab_size
            for i in ids
        ):
            raise UntrustedFileRefused(
                CHECKPOINT_GATE,
                path,
                f"{key} expected a token id or a list of token ids below vocab_size="
                f"{config.vocab_size}, found {value!r:.100}",
            )


def _absent_shards(root: Path) -> list[str]:
    """The shards the index names that are not here (a plan); none for a single file."""
    index = root / INDEX_FILE_NAME
    if (root / SINGLE_FILE_NAME).is_file() or not index.is_file():
        return []
    return sorted(
        name for name in set(read_weight_map(index).values()) if not (root / name).is_file()
    )


def _verify_plan(root: Path, config: MistralConfig, index: Path) -> VerifiedCheckpoint:
    """Names from the index; the absent shards' size from its total_size, which must be the
    implied parameters at 2 or 4 bytes each."""
    weight_map = read_weight_map(index)
    _check_names(config, dict.fromkeys(weight_map, index), index, root / CONFIG_FILE)
    parameters = sum(
        math.prod(size for size, _ in dims)
        for name, dims in expected_shapes(config).items()
        if name in weight_map
    )
    total = _index_total_size(index)
    allowed = [parameters * nbytes for nbytes in PLAN_PARAMETER_BYTES]
    if total not in allowed:
        raise UntrustedFileRefused(
            CHECKPOINT_GATE,
            index,
            f"metadata.total_size expected one of {allowed} (the {parameters} parameters "
            f"{root / CONFIG_FILE} implies at {PLAN_PARAMETER_BYTES} bytes each, since "
            f"shards {_absent_shards(root)} are not here), found {total}",
        )
    return VerifiedCheckpoint(config, total)


def _index_total_size(index: Path) -> int | None:
    """The index's metadata.total_size, or None where it records none."""
    metadata = read_json_object(index, INDEX_EXPECTED).get("metadata") or {}
    if not isinstance(metadata, dict):
        raise UntrustedFileRefused(
            CHECKPOINT_GATE, index, f"metadata expected an object, found {type(metadata).__name__}"
        )
    total = metadata.get("total_size")
    # Some writers record the count as a float; an integral one is the same count.
    if isinstance(total, float) and total.is_integer():
        total = int(total)
    if total is not None and not (isinstance(total, int) and not isinstance(total, bool)):
        raise UntrustedFileRefused(
            CHECKPOINT_GATE,
            index,
            f"metadata.total_size expected a byte count, found {total!r:.100}",
        )
    return total


def expected_shapes(config: MistralConfig) -> dict[str, Dims]:
    """Every parameter the config implies, in HF names, lm_head included even when tied."""
    h = (config.hidden_size, f"hidden_size={config.hidden_size}")
    v = (config.vocab_size, f"vocab_size={config.vocab_size}")
    i = (config.intermediate_size, f"intermediate_size={config.intermediate_size}")
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = (heads * d, f"num_attention_heads x head_dim = {heads} x {d}")
    k = (kv * d, f"num_key_value_heads x head_dim = {kv} x {d}")
    shapes: dict[str, Dims] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        shapes.update(
            {
                f"{prefix}input_layernorm.weight": (h,),
                f"{prefix}self_attn.q_proj.weight": (q, h),
                f"{prefix}self_attn.k_proj.weight": (k, h),
                f"{prefix}self_attn.v_proj.weight": (k, h),
                f"{prefix}self_attn.o_proj.weight": (h, q),
                f"{prefix}post_attention_layernorm.weight": (h,),
                f"{prefix}mlp.gate_proj.weight": (i, h),
                f"{prefix}mlp.up_proj.weight": (i, h),
                f"{prefix}mlp.down_proj.weight": (h, i),
            }
        )
    shapes.update({"model.norm.weight": (h,), _LM_HEAD: (v, h)})
    return shapes


def _check_names(
    config: MistralConfig, found: dict[str, Path], where: Path, config_path: Path
) -> None:
    """The layer count first (so a lying count never sizes a loop), then every name.

    `found` maps each tensor name to the file that declares it; `where` names the weights.
    """
    count = config.num_hidden_layers
    layers = {int(match[1]) for name in found if (match := _LAYER.fullmatch(name))}
    # The length first: a lying count of 10^9 must not become a set of 10^9 numbers.
    if len(layers) != count or layers != set(range(count)):
        absent = itertools.islice((i for i in range(count) if i not in layers), 4)
        beyond = sorted(n for n in found if (m := _LAYER.fullmatch(n)) and int(m[1]) >= count)
        raise _names_refused(
            config_path,
            f"num_hidden_layers={count}",
            f"{where}, which hold layers {_layer_list(layers)}",
            [f"model.layers.{i}.*" for i in absent],
            beyond,
        )
    shapes = expected_shapes(config)
    unexpected = sorted(set(found) - set(shapes))
    missing = [name for name in shapes if name not in found]
    if config.tie_word_embeddings and _LM_HEAD in missing:
        missing.remove(_LM_HEAD)
    if missing == [_LM_HEAD] and not unexpected:
        raise _names_refused(config_path, "tie_word_embeddings=false", where, missing, [])
    if missing or unexpected:
        raise _names_refused(
            config_path, f"the Mistral {CONFIG_FILE} describes", where, missing, unexpected
        )


def _names_refused(
    config_path: Path, claim: str, where: Path | str, missing: list[str], unexpected: list[str]
) -> UntrustedFileRefused:
    return UntrustedFileRefused(
        CHECKPOINT_GATE,
        config_path,
        f"{claim} disagrees with the weights in {where}: missing tensors {missing[:8]}, "
        f"unexpected tensors {unexpected[:8]}",
    )


def _check_shapes(
    config: MistralConfig, tensors: dict[str, TensorLocation], config_path: Path
) -> None:
    """Each tensor's header shape against the one config.json implies; the first
    disagreement names the config key that sets the dimension."""
    for name, dims in expected_shapes(config).items():
        if name not in tensors:  # a tied lm_head that the checkpoint does not store
            continue
        found, expected = tensors[name].shape, tuple(size for size, _ in dims)
        if found != expected:
            raise ShapeRefused(
                CHECKPOINT_GATE,
                config_path,
                f"{_disagreeing_key(dims, found)} disagrees with {name} of shape "
                f"{list(found)} in {tensors[name].path} (config.json implies {list(expected)})",
            )


def _disagreeing_key(dims: Dims, found: tuple[int, ...]) -> str:
    for position, (size, key) in enumerate(dims):
        if position >= len(found) or found[position] != size:
            return key
    return f"a {len(dims)}-dimensional parameter"


def _layer_list(layers: set[int]) -> str:
    ordered = sorted(layers)
    if not ordered:
        return "none"
    if ordered == list(range(len(ordered))):
        return f"0..{len(ordered) - 1}"
    return ", ".join(map(str, ordered[:8])) + (", ..." if len(ordered) > 8 else "")
