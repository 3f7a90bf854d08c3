"""The small Mistral configurations unit tests build models from."""

from __future__ import annotations

from align.model.hf_config import MistralConfig

# The shape, for make_tiny_model (which takes the vocabulary from the tokenizer).
TINY_SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
TINY_FIELDS = {"vocab_size": 64, **TINY_SIZES, "pad_token_id": 0}


def tiny_mistral_config(**fields) -> MistralConfig:
    """Two grouped-query layers, small enough for exact float32 checks on CPU; `fields`
    replace any of TINY_FIELDS or set another MistralConfig field."""
    return MistralConfig(**{**TINY_FIELDS, **fields})
