"""The Mistral architecture hyper-parameters, read from and written to HF config.json.

Stdlib only, so that stages which only inspect a checkpoint never import torch.
Defaults match transformers' `MistralConfig`, so a config.json that omits a field
means the same here as it does there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.constants import DTYPES
from align.utils.untrusted import CHECKPOINT_GATE, UntrustedFileRefused, read_json_object

# Keys HF writes for its own bookkeeping or output plumbing; they do not change the forward pass.
_BOOKKEEPING_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "chunk_size_feed_forward",
        "id2label",
        "initializer_range",
        "label2id",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
        "use_cache",
    }
)
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


@dataclass(frozen=True)
class MistralConfig:
    """Hyper-parameters of a Mistral decoder (the fields of HF's config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    sliding_window: int | None = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = None
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (*_REQUIRED_KEYS, "max_position_embeddings"):
            _require_positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        _require_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.sliding_window is not None:
            _require_positive_int("sliding_window", self.sliding_window)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            token_id = getattr(self, name)
            if token_id is not None and not (_is_int(token_id) and 0 <= token_id < self.vocab_size):
                raise ValueError(f"{name}={token_id!r} is not a token id below vocab_size")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings={self.tie_word_embeddings!r} is not a bool")
        if self.torch_dtype not in DTYPES:
            raise ValueError(f"torch_dtype={self.torch_dtype!r} is not one of {DTYPES}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive number")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> MistralConfig:
        """Build from a parsed HF config.json, refusing anything this model cannot honour."""
        remaining = dict(config)
        _check_architecture(remaining)
        missing = [key for key in _REQUIRED_KEYS if key not in remaining]
        if missing:
            raise ValueError(f"config is missing required keys: {missing}")
        _move_rope_parameters(remaining)
        _move_dtype(remaining)
        for key in _BOOKKEEPING_KEYS:
            remaining.pop(key, None)
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(remaining) - known)
        if unknown:
            raise ValueError(f"config has keys this Mistral model does not support: {unknown}")
        return cls(**remaining)

    def to_hf_dict(self) -> dict[str, Any]:
        """The keyword arguments transformers' MistralConfig accepts (and config.json holds)."""
        fields = dataclasses.asdict(self)
        rope_theta = fields.pop("rope_theta")
        fields["dtype"] = fields.pop("torch_dtype")
        return {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)},
            **fields,
        }


def load_hf_config(checkpoint_dir: str | Path) -> MistralConfig:
    """Read `config.json` from a checkpoint directory; a malformed one is refused (exit 3)
    naming the file, a missing one is a FileNotFoundError."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    fields = read_json_object(path, "a JSON object of a Mistral model's hyper-parameters")
    try:
        return MistralConfig.from_dict(fields)
    except (ValueError, TypeError) as err:
        raise UntrustedFileRefused(CHECKPOINT_GATE, path, str(err)) from None


def _check_architecture(config: dict[str, Any]) -> None:
    model_type = config.pop("model_type", "mistral")
    if model_type != "mistral":
        raise ValueError(f"model_type={model_type!r}: only 'mistral' is supported")
    hidden_act = config.pop("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act={hidden_act!r}: only 'silu' is supported")
    attention_dropout = config.pop("attention_dropout", 0.0)
    if attention_dropout != 0:
        raise ValueError(f"attention_dropout={attention_dropout!r}: only 0.0 is supported")
    if config.pop("is_encoder_decoder", False):
        raise ValueError("is_encoder_decoder is set: Mistral is decoder-only")
    if config.pop("rope_scaling", None) is not None:
        raise ValueError("rope_scaling is set: only default rotary embeddings are supported")


def _move_rope_parameters(config: dict[str, Any]) -> None:
    """Fold transformers 5's `rope_parameters` into the flat `rope_theta` of older configs."""
    rope_parameters = config.pop("rope_parameters", None)
    if rope_parameters is None:
        return
    rope_parameters = dict(rope_parameters)
    rope_type = rope_parameters.pop("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_parameters.rope_type={rope_type!r}: only 'default' is supported")
    if "rope_theta" in rope_parameters:
        theta = rope_parameters.pop("rope_theta")
        if "rope_theta" in config and config["rope_theta"] != theta:
            raise ValueError(
                f"rope_theta={config['rope_theta']!r} disagrees with "
                f"rope_parameters.rope_theta={theta!r}"
            )
        config["rope_theta"] = theta
    if rope_parameters:
        raise ValueError(f"rope_parameters has unsupported keys: {sorted(rope_parameters)}")


def _move_dtype(config: dict[str, Any]) -> None:
    """Accept both `dtype` (transformers 5) and `torch_dtype` (earlier versions)."""
    if config.get("torch_dtype", "") is None:
        del config["torch_dtype"]
    dtype = config.pop("dtype", None)
    if dtype is None:
        return
    if config.get("torch_dtype", dtype) != dtype:
        raise ValueError(f"dtype={dtype!r} disagrees with torch_dtype={config['torch_dtype']!r}")
    config["torch_dtype"] = dtype


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_positive_int(name: str, value: object) -> None:
    if not (_is_int(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a positive integer")
