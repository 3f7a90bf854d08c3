"""Mistral-7B-v0.1 as a config-only checkpoint: what a plan needs, and no weights.

`MISTRAL_7B` is the checkpoint's config.json as the hub has it. A config-only
checkpoint holds the small files of a hub download without the weights: config.json,
Mistral v0.1's real tokenizer (its sentencepiece model from the mistral-common
wheel, with no chat template, as the base model has none) and the shard index, whose
weight map names the real tensors in two shards that are not there and whose
metadata records their total size. A dry run plans with it; every stage that would
read weights refuses it (exit 3), naming the missing shards.
"""

from __future__ import annotations

import json
from pathlib import Path

from hub_checkpoint import write_mistral_tokenizer

MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
PARAMETERS = 7_241_732_096
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
LAYER_TENSORS = (
    "input_layernorm",
    "mlp.down_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "post_attention_layernorm",
    "self_attn.k_proj",
    "self_attn.o_proj",
    "self_attn.q_proj",
    "self_attn.v_proj",
)


def weight_map() -> dict[str, str]:
    """Every tensor of Mistral-7B, the first 23 layers and the embedding in the first shard."""
    layers = MISTRAL_7B["num_hidden_layers"]
    names = {"model.embed_tokens.weight": SHARDS[0]}
    for layer in range(layers):
        for tensor in LAYER_TENSORS:
            names[f"model.layers.{layer}.{tensor}.weight"] = SHARDS[0 if layer < 23 else 1]
    names.update({"model.norm.weight": SHARDS[1], "lm_head.weight": SHARDS[1]})
    return names


def write_config_only_checkpoint(out_dir: Path) -> Path:
    """Mistral-7B-v0.1's config, tokenizer and shard index in out_dir; no shard."""
    write_mistral_tokenizer(out_dir, chat_template=None)
    (out_dir / "config.json").write_text(json.dumps(MISTRAL_7B, indent=2))
    # bfloat16: two bytes per parameter, as the hub's index records.
    index = {"metadata": {"total_size": 2 * PARAMETERS}, "weight_map": weight_map()}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out_dir
